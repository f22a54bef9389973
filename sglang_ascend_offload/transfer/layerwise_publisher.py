"""Prefill publisher over the layerwise prefill offload pool: publish from the layer listener.

:class:`LayerwisePublisher` is the :class:`~.publisher.PrefillPublisher` of the
layerwise prefill pool (``publishes_during_forward``). With layerwise prefill offload a
layer's KV lives in a physical buffer shared with other layers: after the forward only
the last layer of each shared buffer is still in device memory. So the request cannot
be sent after the forward (what :class:`~.prefill_links.PrefillLinks` does for the
device pool). Instead:

1. before the forward that runs a request's **last chunk**, the caller says which
   ``req_to_token`` row carries which bootstrap room and decode session
   (:meth:`LayerwisePublisher.expect`; in a server the BEFORE hook on
   ``Scheduler.run_batch`` in ``sglang_plugin/disaggregation/ascend_offload/install.py`` does, after
   :meth:`~LayerwisePublisher.begin_batch`);
2. when the pool opens that forward it asks :meth:`LayerwisePublisher.consumers_of`
   (``pool.set_extra_consumers``): the request is added to its decode peer's
   :class:`~sglang_ascend_offload.transfer.prefill_side.PrefillSender` and the peer's
   consumer name (``pd_read:<session>``) is added to the slot gate of every pipelined
   layer;
3. once a layer's rows are complete in its buffer (``pool.add_layer_listener``; the
   cached prefix rows were loaded into the same buffer before the layer ran, so the
   buffer holds the request's whole KV of that layer) the sender publishes it with the
   request's SGLang page ids as source blocks, at the layer's (aliased) buffer address;
4. decode's READ_DONE / READ_FAILED / timeout answers the gate
   (:class:`PoolGateRouter`): only then may the pipeline load or write the next layer
   sharing the buffer. A P/D failure fails the request (the sender tells decode), never
   the prefill forward: the gate is answered without an error.

Layers with a dedicated buffer have no gate; their rows are rewritten only after
SGLang frees the request's pages, which happens after the sender reports the request
done (every layer read) or failed.

After the forward SGLang's sender hands the request's pages to the KV manager
(``add_transfer_request``, last chunk): :meth:`LayerwisePublisher.check_sent`
(:meth:`~LayerwisePublisher.last_chunk_sent`) compares
them with the pages published, and fails the request when it was never announced
(a send outside the forward that computed it: the pipelined layers are gone by then)
or when the pages differ. Nothing is ever sent from a buffer that may hold another
layer.

Decode peers of both layouts are served:

* ``split`` (decode pool on the device): one batch per layer for all of the
  forward's requests to that peer, read straight from the shared buffer;
* ``host_rows`` (decode with sparse decode offload; main KV lands in its host pool
  as packed ``[latent | rope]`` rows): the listener packs each request's pages of the
  layer into a staging slot (:class:`~.pool_layouts.PackedStaging`, layer ``L`` -> slot
  ``L % staging_slots``, each slot behind its own gate) and publishes one batch per
  request (main from the staging, indexer from the shared buffer). The shared
  buffer's gate is answered once every request's batch of that layer was answered
  (:class:`StagingGateRouter`). Requests of one forward to one ``host_rows`` peer are
  therefore read one after another within a layer (the staging holds one request).

The pool is duck-typed (the plugin's ``LayerwisePrefillPool``): ``pipelined``,
``gates``, ``layer_num``, ``set_extra_consumers(fn)`` and ``add_layer_listener(fn)``;
``fn`` receives a forward's info (``forward_id``, ``pipelined_layers``, ``requests``
each with ``req_pool_idx`` and ``pages``) and, per written layer, an item with
``forward``, ``layer``, ``slot`` and ``pipelined``
(``sglang_plugin/mem_cache/pool/layerwise_runtime.py``: ``ForwardInfo``, ``LayerWritten``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import config as cfg
from ..layerwise_prefill.gates import GateError, GateTimeout, SlotGates
from . import pool_layouts as layouts
from .advert import DecodeAdvert
from .engine import TransferEngine
from .errors import TransferError
from .prefill_side import PrefillSender, SourceBlocks
from .publisher import PrefillPublisher, unit_id
from .status import PENDING, RequestStatus, TransferState

logger = logging.getLogger(__name__)


def sent_pages_problem(sent: Sequence[int], published: Sequence[int]) -> str:
    """Why SGLang's sent pages of a request cannot be the KV its last forward published
    (``""`` when they can).

    ``sent``: the pages SGLang hands the KV manager over all chunks; ``published``: the
    request's pages in ``req_to_token`` when its last chunk's forward ran, whose KV the
    publisher sent to decode layer by layer during that forward. The two lists may name
    different pages for the same tokens: when another request put the same tokens into the
    radix tree first, the tree's checkpoint of this request (``RadixCache.checkpoint``, after
    an earlier chunk's send or after the last forward) frees this request's duplicate pages
    and rewrites its row with the tree's pages, which hold the KV of the same tokens (seen
    under load in the served P/D test, on prefix pages and on the last chunk's own page). The
    published KV is the forward's own and SGLang's sender moves nothing (``send_kvcache`` is
    a no-op), so only the page count must agree: a different count is another request's or
    another forward's pages."""
    if len(sent) != len(published):
        return f"SGLang sends {len(sent)} pages but {len(published)} pages were published from the forward"
    return ""


CONSUMER_PREFIX = "pd_read:"


class PoolGateRouter:
    """The ``gates`` a :class:`PrefillSender` answers (``begin_gate=False``), routed to the
    layerwise pool's slot gates.

    ``done`` of a pipelined layer releases the pool's gate for that consumer (without
    the error: the sender fails the request itself); a dedicated layer has no gate.
    """

    def __init__(self, pool: Any):
        self.pool = pool
        self.pipelined = frozenset(pool.pipelined)

    def begin(self, slot: int, layer: int, consumers) -> None:
        raise RuntimeError("the layerwise pool opens its slot gates itself (sender needs begin_gate=False)")

    def done(self, slot: int, layer: int, consumer: str, error: Optional[str] = None) -> None:
        if error is not None:
            logger.warning("P/D layerwise: layer %d (buffer %d) for %s failed: %s", layer, slot, consumer, error)
        if layer in self.pipelined:
            self.pool.gates.done(slot, layer, consumer)


class StagingGateRouter:
    """The ``gates`` of a ``host_rows`` peer's sender: its batches name staging slots.

    ``done`` frees the staging slot, and the pool's slot gate of a pipelined layer once
    the last of that layer's batches (:meth:`expect`) was answered. Every published
    batch gets exactly one ``done`` (answer, timeout, close, or at once when it had no
    live request), so the count always reaches zero.
    """

    def __init__(self, pool: Any, slots: int):
        self.pool = pool
        self.pipelined = frozenset(pool.pipelined)
        self.staging_gates = SlotGates(slots)
        self._lock = threading.Lock()
        self._left: Dict[int, List[int]] = {}  # layer -> [answers still due, pool slot]

    def expect(self, layer: int, batches: int, pool_slot: int) -> None:
        if layer in self.pipelined:
            with self._lock:
                self._left[layer] = [batches, pool_slot]

    def begin(self, slot: int, layer: int, consumers) -> None:
        raise RuntimeError("the publisher opens the staging gates itself (sender needs begin_gate=False)")

    def done(self, slot: int, layer: int, consumer: str, error: Optional[str] = None) -> None:
        if error is not None:
            logger.warning("P/D layerwise: layer %d (staging %d) for %s failed: %s", layer, slot, consumer, error)
        self.staging_gates.done(slot, layer, consumer)
        self.done_without_staging(layer, consumer)

    def done_without_staging(self, layer: int, consumer: str) -> None:
        """One of ``layer``'s batches is over without holding a staging slot (never began)."""
        release = None
        with self._lock:
            left = self._left.get(layer)
            if left is not None:
                left[0] -= 1
                if left[0] == 0:
                    release = left[1]
                    del self._left[layer]
        if release is not None:
            self.pool.gates.done(release, layer, consumer)


@dataclass
class _Staging:
    """Packing staging of one ``host_rows`` peer (module doc)."""

    staging: Any  # layouts.PackedStaging
    router: StagingGateRouter
    claim: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # wait_free + begin, atomically


@dataclass(frozen=True)
class _Expected:
    room: int
    session: str


@dataclass
class _Unit:
    """A request published in one forward: its sender, protocol id and source pages."""

    sender: PrefillSender
    rid: str
    pages: Tuple[int, ...]
    layers_left: int
    staging: Optional[_Staging] = None


class LayerwisePublisher(PrefillPublisher):
    """Publishes requests of one prefill TP rank from the layerwise pool (module doc).

    config: the P/D config; p_tp / p_rank: attention TP size and rank; pool: the
    plugin's ``LayerwisePrefillPool``; engine: the started transfer
    engine (the pool's physical buffers are registered here); max_blocks /
    staging_slots: pages per staging slot (default: the pool's) and staging slots of
    each ``host_rows`` peer.
    """

    publishes_during_forward = True

    def __init__(
        self,
        config: cfg.PDTransferConfig,
        *,
        p_tp: int,
        p_rank: int,
        pool: Any,
        engine: TransferEngine,
        max_blocks: Optional[int] = None,
        staging_slots: int = 2,
        draft_pool: Any = None,
    ):
        if draft_pool is not None:
            # the layer listener publishes the base layers during the forward; the draft
            # model's extend runs after it, on a pool this publisher never sees
            raise layouts.LayoutError(
                "P/D prefill with layerwise prefill offload does not publish the "
                "speculative draft (NextN) layer: serve the prefill without "
                "--speculative-algorithm, or without layerwise prefill offload"
            )
        super().__init__(
            config,
            p_tp=p_tp,
            p_rank=p_rank,
            pool=pool,
            engine=engine,
            max_blocks=max_blocks,
            staging_slots=staging_slots,
        )
        self.router = PoolGateRouter(pool)
        self._tensors = layouts.split_tensors(pool, allow_layerwise=True)
        regions = layouts.tensors_regions(self._tensors)
        engine.register(regions)
        self._registered = [addr for addr, _ in regions]
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._adverts: Dict[str, DecodeAdvert] = {}
        self._senders: Dict[str, PrefillSender] = {}
        self._stagings: Dict[int, _Staging] = {}  # id(sender) -> staging of a host_rows peer
        self._sender_errors: Dict[str, str] = {}
        self._expected: Dict[int, _Expected] = {}
        self._forwards: Dict[int, List[_Unit]] = {}
        self._rooms: Dict[int, Tuple[Optional[PrefillSender], RequestStatus]] = {}
        self._published_pages: Dict[int, Tuple[int, ...]] = {}
        pool.set_extra_consumers(self.consumers_of)
        pool.add_layer_listener(self.on_layer_written)

    # ------------------------------------------------------------------ control plane
    def note_peer(self, session: str, advert: Optional[DecodeAdvert], error: str = "") -> None:
        """A decode peer's advert from its registration (see :mod:`.advert`); ``advert=None``
        with ``error``: the registration was invalid, every request to it fails with that."""
        with self._lock:
            if advert is None:
                self._sender_errors[session] = error or f"decode session {session}: invalid registration"
                self._adverts.pop(session, None)
            else:
                self._adverts[session] = advert

    def begin_batch(self) -> None:
        """A new batch is about to run: expectations never picked up by a forward are stale.

        They belong to a batch whose forward never opened the pool; keeping them would
        publish whatever request takes the row next. Their rooms fail."""
        with self._lock:
            stale, self._expected = self._expected, {}
        for exp in stale.values():
            self._fail_local(exp.room, "the forward announced for this request's last chunk never ran")

    def expect(self, row: int, room: int, session: str) -> None:
        """The next forward containing ``req_to_token`` row ``row`` computes bootstrap room
        ``room``'s last chunk; send it to decode ``session``."""
        with self._lock:
            if int(room) in self._rooms:
                return  # announced already (a repeated last chunk): keep the first
            self._expected[int(row)] = _Expected(int(room), session)
            self._rooms[int(room)] = (None, PENDING)

    def check_sent(self, room: int, pages) -> None:
        """SGLang sends ``room``'s last chunk (after the forward): ``pages`` (all of the
        request's pages, in order) must be as many as were published
        (:func:`sent_pages_problem`). Fails the room otherwise."""
        pages = tuple(int(p) for p in pages)
        with self._lock:
            entry = self._rooms.get(room)
            published = self._published_pages.get(room)
        if entry is None:
            self._fail_local(
                room,
                "sent outside the forward that computed its last chunk (optimistic prefill "
                "or a requeued request): with layerwise prefill offload the shared layer "
                "buffers no longer hold its KV; run prefill with --optimistic-prefill-attempts 0",
            )
            return
        if published is None:
            return
        problem = sent_pages_problem(pages, published)
        if problem:
            self.cancel(room, problem)

    def last_chunk_sent(self, room: int, sessions: Sequence[str], pages: Sequence[int], wait_event: Any = None) -> None:
        """:class:`~.publisher.PrefillPublisher`: ``room`` was published during its forward;
        check the pages (:meth:`check_sent`)."""
        self.check_sent(room, pages)

    def cancel(self, room: int, reason: str) -> None:
        """The scheduler gave up on ``room``: fail it (the sender tells decode; the request's
        remaining layers are then skipped and their gates answered at once)."""
        with self._lock:
            entry = self._rooms.get(room)
        if entry is None:
            return
        sender, local = entry
        if sender is None:
            if local.state is TransferState.PENDING:
                self._fail_local(room, reason)
            return
        sender.abort(unit_id(room), reason)

    def forget(self, room: int) -> None:
        """Drop ``room``'s bookkeeping (SGLang released the request; a pending one is
        cancelled first). An expectation not yet picked up by a forward is withdrawn."""
        with self._lock:
            entry = self._rooms.pop(room, None)
            self._published_pages.pop(room, None)
            for row, exp in list(self._expected.items()):
                if exp.room == room:
                    del self._expected[row]
        if entry is not None and entry[0] is not None:
            entry[0].forget(unit_id(room))

    def status(self, room: int) -> Optional[RequestStatus]:
        """``None`` if unknown; the local failure, or the sender's status."""
        with self._lock:
            entry = self._rooms.get(room)
        if entry is None:
            return None
        sender, local = entry
        if sender is None or local.state is TransferState.FAILED:
            return local
        try:
            return sender.status(unit_id(room))
        except KeyError:
            return RequestStatus(TransferState.FAILED, "request unknown to the P/D sender")

    # ------------------------------------------------------------------ pool hooks
    def consumers_of(self, info: Any) -> Dict[int, List[str]]:
        """Extra gate consumers of ``info`` (scheduler thread, when the forward opens)."""
        units: List[_Unit] = []
        for req in info.requests:
            with self._lock:
                exp = self._expected.pop(req.req_pool_idx, None)
            if exp is None:
                continue
            rid = unit_id(exp.room)
            try:
                sender = self._sender(exp.session)
                sender.add_request(rid, len(req.pages))
            except (TransferError, ValueError) as exc:
                self._fail_local(exp.room, str(exc))
                continue
            pages = tuple(int(p) for p in req.pages)
            with self._lock:
                self._rooms[exp.room] = (sender, PENDING)
                self._published_pages[exp.room] = pages
            with self._lock:
                staging = self._stagings.get(id(sender))
            units.append(_Unit(sender, rid, pages, self.pool.layer_num, staging))
        if not units:
            return {}
        with self._lock:
            self._forwards[info.forward_id] = units
        names = sorted({u.sender.consumer for u in units})
        return {layer: list(names) for layer in info.pipelined_layers}

    def on_layer_written(self, item: Any) -> None:
        """Publish ``item.layer`` of the forward's requests (saver / notifier thread)."""
        with self._lock:
            units = list(self._forwards.get(item.forward.forward_id, ()))
        by_sender: Dict[int, List[_Unit]] = {}
        for u in units:
            by_sender.setdefault(id(u.sender), []).append(u)
        for group in by_sender.values():
            if group[0].staging is not None:
                self._publish_packed(item, group)
                continue
            sender = group[0].sender
            with self._publish_lock:  # "finished" must match the sender's published count
                for u in group:
                    u.layers_left -= 1
                sources = {u.rid: SourceBlocks(u.pages, u.pages) for u in group}
                finished = [u.rid for u in group if u.layers_left == 0]
                try:
                    sender.publish_layer(item.layer, item.slot, sources, finished=finished)
                except Exception as exc:  # noqa: BLE001 - fail the requests, free the slot
                    for u in group:
                        sender.abort(u.rid, f"layer {item.layer}: publish failed: {exc}")
                    if item.pipelined:
                        try:
                            self.router.done(item.slot, item.layer, sender.consumer)
                        except ValueError:
                            pass  # already answered
        if units and all(u.layers_left == 0 for u in units):
            with self._lock:
                self._forwards.pop(item.forward.forward_id, None)

    def _publish_packed(self, item: Any, group: List[_Unit]) -> None:
        """``host_rows`` peer: per request, wait for the layer's staging slot, pack, publish."""
        st = group[0].staging
        sender = group[0].sender
        slot = st.staging.slot_of(item.layer)
        gates = st.router.staging_gates
        wait_s = 2 * self.config.layer_timeout_s + 1.0
        st.router.expect(item.layer, len(group), item.slot)
        for u in group:
            with self._publish_lock:
                u.layers_left -= 1
                finished = [u.rid] if u.layers_left == 0 else []
            try:
                with st.claim:  # the saver and notifier threads may both want this slot
                    try:
                        gates.wait_free(slot, wait_s)
                    except GateError:
                        pass  # free; the error belonged to an earlier batch (its request failed already)
                    gates.begin(slot, item.layer, [sender.consumer])
            except (GateTimeout, ValueError) as exc:
                sender.abort(u.rid, f"layer {item.layer}: staging slot {slot} not free: {exc}")
                st.router.done_without_staging(item.layer, sender.consumer)
                continue
            try:
                # only the contributor that sends the main KV needs it packed (member 0); an int8
                # peer's indexer is packed by every contributor (each sends its share of it)
                sends_main = sender.topology.sends_main(sender.member)
                if (sends_main or st.staging.packs_indexer) and sender.status(u.rid).state is TransferState.PENDING:
                    st.staging.pack(item.layer, u.pages, main=sends_main)
                sender.publish_layer(
                    item.layer,
                    slot,
                    {u.rid: SourceBlocks(range(len(u.pages)), st.staging.indexer_blocks(u.pages))},
                    finished=finished,
                )
            except Exception as exc:  # noqa: BLE001 - fail the request, answer its gates
                sender.abort(u.rid, f"layer {item.layer}: publish failed: {exc}")
                try:
                    st.router.done(slot, item.layer, sender.consumer)
                except ValueError:
                    pass  # already answered

    # ------------------------------------------------------------------ helpers
    def _fail_local(self, room: int, reason: str) -> None:
        logger.warning("P/D layerwise prefill rank %d: request %s failed: %s", self.p_rank, room, reason)
        with self._lock:
            self._rooms[room] = (None, RequestStatus(TransferState.FAILED, reason))

    def _sender(self, session: str) -> PrefillSender:
        with self._lock:
            sender = self._senders.get(session)
            if sender is not None:
                return sender
            if session in self._sender_errors:
                raise TransferError(self._sender_errors[session])
            advert = self._adverts.get(session)
        if advert is None:
            raise TransferError(f"decode session {session} never registered an ascend_offload advert")
        staging = None
        tensors, router = self._tensors, self.router
        if advert.layout_kind == "host_rows":
            packed = layouts.PackedStaging(
                self.pool,
                slots=self.staging_slots,
                max_blocks=self.max_blocks,
                allow_layerwise=True,
                indexer_dtype=advert.indexer_dtype,
            )
            regions = layouts.whole_regions(packed.buffers())
            self.engine.register(regions)
            with self._lock:
                self._registered.extend(addr for addr, _ in regions)
            staging = _Staging(packed, StagingGateRouter(self.pool, packed.slots))
            tensors, router = packed.tensors(), staging.router
        elif advert.layout_kind != "split":
            raise TransferError(f"decode layout {advert.layout_kind!r} is not served by layerwise prefill offload")
        layout = layouts.layout_of(self.pool, tensors)
        config = dataclasses.replace(self.config, kv_port=advert.kv_port)
        sender = PrefillSender(
            config,
            p_tp=self.p_tp,
            d_tp=advert.d_tp,
            p_rank=self.p_rank,
            layout=layout,
            engine=self.engine,
            gates=router,
            decode_host=advert.host,
            decode_dp_rank=advert.dp_rank,
            consumer=CONSUMER_PREFIX + session,
            begin_gate=False,
        )
        try:
            sender.handshake()
        except TransferError as exc:
            sender.close("handshake failed")
            with self._lock:
                self._sender_errors[session] = str(exc)
            raise
        with self._lock:
            self._senders[session] = sender
            if staging is not None:
                self._stagings[id(sender)] = staging
        logger.info(
            "P/D layerwise publisher: link to decode rank %d at %s:%d (%s layout, ratio %d) ready; "
            "layers %s are published from shared buffers, gated by decode's reads",
            advert.d_rank,
            advert.host,
            advert.control_port,
            advert.layout_kind,
            sender.topology.ratio,
            list(self.pool.pipelined),
        )
        return sender

    def close(self) -> None:
        """Close every sender (open gates answered), detach from the pool, unregister."""
        self.pool.set_extra_consumers(None)
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
            registered, self._registered = self._registered, []
        for s in senders:
            s.close("layerwise P/D publisher closed")
        if registered:
            self.engine.unregister(registered)
