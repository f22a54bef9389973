"""Prefill publisher for device pools: one worker per decode peer, each request layer by layer.

:class:`PrefillLinks` is the :class:`~.publisher.PrefillPublisher` of a device KV pool:
the prefill TP rank's sender hands a request to :meth:`PrefillLinks.submit`
(:meth:`~PrefillLinks.last_chunk_sent`) once its last chunk is computed (all its pages
are in the pool then). The request goes to
the :class:`PeerLink` of its decode peer (one per decode TP rank that registered with
this prefill rank; identified by its session id and described by the peer's
:class:`~.advert.DecodeAdvert`). A link owns one
:class:`~sglang_ascend_offload.transfer.prefill_side.PrefillSender` (handshake on first
use, at most ``handshake_timeout_s``), its slot gates and, for ``host_rows`` peers,
its packing staging; its thread runs requests one at a time:

    for each layer L:  wait until slot(L) is free (decode answered its previous
    content) -> [pack L's pages into the staging slot] -> publish_layer(L) (the last
    layer names the request finished)

The sender does the rest: deadlines on every answer, READ_FAILED, verdicts. A
request's state is the sender's (``pending`` / ``done`` / ``failed``), or ``failed``
with the local reason when it never reached the sender (no advert, handshake
refused or timed out, invalid topology, too many pages). A link whose handshake
failed stays failed (a restarted decode registers under a new session id).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

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


@dataclass
class _Job:
    room: int
    pages: List[int]
    wait_event: Any = None


@dataclass
class _Unit:
    link: Optional["PeerLink"]
    state: TransferState = TransferState.PENDING
    reason: str = ""
    published: bool = False
    cancelled: bool = False


@dataclass
class LinkStats:
    """Counters of one prefill rank's links (exposed in logs / tests)."""

    handshakes: int = 0
    handshake_failures: int = 0
    requests: int = 0
    layers_published: int = 0
    packed_layers: int = 0
    local_failures: int = 0


class PeerLink:
    """All transfers from this prefill rank to one decode TP rank (see module doc)."""

    def __init__(self, owner: "PrefillLinks", session: str, advert: DecodeAdvert):
        self.owner = owner
        self.session = session
        self.advert = advert
        self.sender: Optional[PrefillSender] = None
        self.error: Optional[str] = None
        self.staging: Optional[layouts.PackedStaging] = None
        pool = owner.pool
        #: the base layers (from ``pool``, packed for ``host_rows`` peers); logical layers
        #: from here on are the draft pool's, always read straight from its pages
        self.base_layers = pool.layer_num
        if advert.layout_kind == "host_rows":
            self.staging = owner.staging_for(self)
            self.num_slots = self.staging.slots + owner.num_layers - self.base_layers
        else:
            self.num_slots = owner.num_layers
        self.gates = SlotGates(self.num_slots)
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"pd-link-{advert.d_rank}")
        self._thread.start()

    def slot_of(self, layer: int) -> int:
        """The gate slot of logical layer ``layer``: a staging slot for a packed base layer,
        else the layer's own (pool pages are never rewritten during the request)."""
        if self.staging is None:
            return layer
        if layer < self.base_layers:
            return self.staging.slot_of(layer)
        return self.staging.slots + layer - self.base_layers

    def packs(self, layer: int) -> bool:
        """Logical layer ``layer`` is packed into the staging before it is published."""
        return self.staging is not None and layer < self.base_layers

    def put(self, job: _Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5.0)
        if self.sender is not None:
            self.sender.close("prefill link closed")

    # ------------------------------------------------------------------ worker thread
    def _connect(self) -> PrefillSender:
        if self.sender is not None:
            return self.sender
        if self.error is not None:
            raise TransferError(self.error)
        owner, a = self.owner, self.advert
        own_draft = owner.num_layers - self.base_layers
        if a.draft_layers != own_draft:
            self.error = (
                f"decode {a.host}:{a.control_port} serves {a.draft_layers} speculative draft layer(s), "
                f"this prefill {own_draft}: run both servers with the same --speculative-algorithm "
                "(and draft model)"
            )
            raise TransferError(self.error)
        tensors = (
            self.staging.tensors() if self.staging is not None else layouts.split_tensors(owner.pool, owner.draft_pool)
        )
        layout = layouts.layout_of(owner.pool, tensors)
        config = dataclasses.replace(owner.config, kv_port=a.kv_port)
        try:
            sender = PrefillSender(
                config,
                p_tp=owner.p_tp,
                d_tp=a.d_tp,
                p_rank=owner.p_rank,
                layout=layout,
                engine=owner.engine,
                gates=self.gates,
                decode_host=a.host,
                decode_dp_rank=a.dp_rank,
            )
        except (TransferError, ValueError) as exc:
            self.error = f"decode {a.host}:{a.control_port}: {exc}"
            raise TransferError(self.error) from exc
        problems = []
        if sender.d_rank != a.d_rank:
            problems.append(
                f"prefill rank {owner.p_rank} of {owner.p_tp} sends to decode rank {sender.d_rank} of "
                f"{a.d_tp}, but SGLang paired it with decode rank {a.d_rank}"
            )
        if sender.port != a.control_port:
            problems.append(f"decode control port {sender.port} != advertised {a.control_port}")
        try:
            if not problems:
                owner.stats.handshakes += 1
                sender.handshake()
        except TransferError as exc:
            problems.append(str(exc))
        if problems:
            owner.stats.handshake_failures += 1
            sender.close("handshake failed")
            self.error = "; ".join(problems)
            raise TransferError(self.error)
        self.sender = sender
        logger.info(
            "P/D link to decode rank %d at %s:%d (%s layout, ratio %d) ready",
            a.d_rank,
            a.host,
            a.control_port,
            a.layout_kind,
            sender.topology.ratio,
        )
        return sender

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - the request fails, the link lives on
                logger.exception("P/D link: request %s failed", job.room)
                self.owner.fail(job.room, f"prefill P/D link error: {exc}")

    def _run(self, job: _Job) -> None:
        owner = self.owner
        if job.wait_event is not None:  # the forward that wrote these pages (overlap scheduling)
            job.wait_event.synchronize()
        if not owner.begin(job.room):
            return  # cancelled before it started
        try:
            sender = self._connect()
        except TransferError as exc:
            owner.fail(job.room, str(exc))
            return
        rid = unit_id(job.room)
        n = len(job.pages)
        try:
            sender.add_request(rid, n)
        except (ValueError, TransferError) as exc:
            owner.fail(job.room, str(exc))
            return
        owner.mark_published(job.room)
        layers = owner.num_layers
        sends_main = sender.topology.sends_main(sender.member)
        timeout = 2 * owner.config.layer_timeout_s + 1.0
        for layer in range(layers):
            if sender.status(rid).state is not TransferState.PENDING or owner.cancelled(job.room):
                break
            slot = self.slot_of(layer)
            try:
                self.gates.wait_free(slot, timeout)
            except GateError:
                pass  # the slot is free; the error belonged to an earlier request
            except GateTimeout as exc:
                sender.abort(rid, f"layer {layer}: {exc}")
                break
            if sender.status(rid).state is not TransferState.PENDING:
                break  # failed while waiting for the slot (e.g. READ_FAILED of an earlier layer)
            packed = self.packs(layer)
            if packed and (sends_main or self.staging.packs_indexer):  # int8 peer: every member packs its keys
                self.staging.pack(layer, job.pages, main=sends_main)
                owner.stats.packed_layers += 1
            main_blocks = range(n) if packed else job.pages
            index_blocks = self.staging.indexer_blocks(job.pages) if packed else list(job.pages)
            try:
                batch = sender.publish_layer(
                    layer,
                    slot,
                    {rid: SourceBlocks(list(main_blocks), index_blocks)},
                    finished=[rid] if layer == layers - 1 else [],
                )
            except Exception as exc:  # noqa: BLE001 - fail the request, keep the link
                sender.abort(rid, f"layer {layer}: publish failed: {exc}")
                break
            if batch is not None:
                owner.stats.layers_published += 1
        if owner.cancelled(job.room):
            sender.abort(rid, "aborted by the prefill scheduler")


class PrefillLinks(PrefillPublisher):
    """Every decode peer of one prefill TP rank (see module doc). Thread-safe.

    config: the P/D config; p_tp / p_rank: this rank's attention TP size and rank;
    pool: its device DSA pool (the plugin's ``DeviceDSAPool``); engine: the started transfer engine
    (the pool is registered here); max_blocks: the most pages one request can have;
    draft_pool: the speculative draft model's device pool (its layers follow the base
    layers, read from its pages for every peer).
    """

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
        super().__init__(
            config,
            p_tp=p_tp,
            p_rank=p_rank,
            pool=pool,
            engine=engine,
            max_blocks=max_blocks,
            staging_slots=staging_slots,
            draft_pool=draft_pool,
        )
        self.stats = LinkStats()
        self._lock = threading.Lock()
        self._links: Dict[str, PeerLink] = {}
        self._adverts: Dict[str, DecodeAdvert] = {}
        self._advert_errors: Dict[str, str] = {}
        self._units: Dict[int, _Unit] = {}
        self._registered: List[int] = []
        self._register(layouts.tensors_regions(layouts.split_tensors(pool, draft_pool)))

    def _register(self, regions) -> None:
        self.engine.register(regions)
        with self._lock:
            self._registered += [addr for addr, _ in regions]

    # ------------------------------------------------------------------ peers
    def note_peer(self, session: str, advert: Optional[DecodeAdvert], error: str = "") -> None:
        """Record a decode peer's advert (or why it has none) from its registration."""
        with self._lock:
            if advert is None:
                self._advert_errors[session] = error or "the decode peer sent no ascend_offload advert"
                self._adverts.pop(session, None)
            else:
                self._advert_errors.pop(session, None)
                old = self._adverts.get(session)
                self._adverts[session] = advert
                if old is not None and old != advert and session in self._links:
                    stale = self._links.pop(session)
                    threading.Thread(target=stale.close, daemon=True).start()

    def staging_for(self, link: PeerLink) -> layouts.PackedStaging:
        staging = layouts.PackedStaging(
            self.pool,
            slots=self.staging_slots,
            max_blocks=self.max_blocks,
            draft_pool=self.draft_pool,
            indexer_dtype=link.advert.indexer_dtype,
        )
        self._register(layouts.whole_regions(staging.buffers()))
        return staging

    def _link(self, session: str) -> PeerLink:
        with self._lock:
            link = self._links.get(session)
            if link is not None:
                return link
            advert = self._adverts.get(session)
            if advert is None:
                raise TransferError(
                    self._advert_errors.get(
                        session,
                        f"decode session {session} never registered an ascend_offload advert (is the "
                        "decode server running --disaggregation-transfer-backend ascend_offload?)",
                    )
                )
        link = PeerLink(self, session, advert)  # outside the lock: may allocate staging
        with self._lock:
            return self._links.setdefault(session, link)

    # ------------------------------------------------------------------ requests
    def submit(self, room: int, sessions: Sequence[str], pages: Sequence[int], wait_event: Any = None) -> None:
        """Queue request ``room`` (all its pages, in order) for its decode peer."""
        pages = [int(p) for p in pages]
        with self._lock:
            if room in self._units:
                return  # already submitted (a repeated last chunk)
            self._units[room] = _Unit(link=None)
            self.stats.requests += 1
        problems = []
        if len(sessions) != 1:
            problems.append(
                f"{len(sessions)} decode ranks target prefill rank {self.p_rank} for this request; "
                "the P/D protocol pairs each prefill rank with one decode rank (p_tp >= d_tp)"
            )
        if not pages:
            problems.append("no pages to send")
        if len(set(pages)) != len(pages):
            problems.append("repeated pages in the request")
        if problems:
            self.fail(room, "; ".join(problems))
            return
        try:
            link = self._link(sessions[0])
        except TransferError as exc:
            self.fail(room, str(exc))
            return
        with self._lock:
            self._units[room].link = link
        link.put(_Job(room=room, pages=pages, wait_event=wait_event))

    def last_chunk_sent(self, room: int, sessions: Sequence[str], pages: Sequence[int], wait_event: Any = None) -> None:
        """:class:`~.publisher.PrefillPublisher`: publish ``room`` now (:meth:`submit`)."""
        self.submit(room, sessions, pages, wait_event=wait_event)

    def begin(self, room: int) -> bool:
        with self._lock:
            u = self._units.get(room)
            return u is not None and not u.cancelled and u.state is TransferState.PENDING

    def mark_published(self, room: int) -> None:
        with self._lock:
            u = self._units.get(room)
            if u is not None:
                u.published = True

    def cancelled(self, room: int) -> bool:
        with self._lock:
            u = self._units.get(room)
            return u is None or u.cancelled

    def fail(self, room: int, reason: str) -> None:
        """Fail ``room`` locally (it never reached, or left, its sender)."""
        with self._lock:
            u = self._units.get(room)
            if u is None or u.state is not TransferState.PENDING:
                return
            u.state, u.reason = TransferState.FAILED, reason
            self.stats.local_failures += 1
            link = u.link
        logger.warning("P/D prefill rank %d: request %s failed: %s", self.p_rank, room, reason)
        if link is not None and link.sender is not None:
            link.sender.abort(unit_id(room), reason)

    def status(self, room: int) -> Optional[RequestStatus]:
        """``None`` until submitted; then the sender's status, or the local failure."""
        with self._lock:
            u = self._units.get(room)
            if u is None:
                return None
            if u.state is TransferState.FAILED:
                return RequestStatus(TransferState.FAILED, u.reason)
            link, published = u.link, u.published
        if not published or link is None or link.sender is None:
            return PENDING
        try:
            return link.sender.status(unit_id(room))
        except KeyError:
            return RequestStatus(TransferState.FAILED, "request unknown to the P/D sender")

    def cancel(self, room: int, reason: str) -> None:
        """The scheduler gave up on ``room`` (abort): stop publishing, fail it."""
        with self._lock:
            u = self._units.get(room)
            if u is not None:
                u.cancelled = True
        self.fail(room, reason)

    def forget(self, room: int) -> None:
        """Drop ``room``'s bookkeeping (a pending one is cancelled first)."""
        with self._lock:
            u = self._units.get(room)
        if u is None:
            return
        if u.state is TransferState.PENDING and (self.status(room) or PENDING).state is TransferState.PENDING:
            self.cancel(room, "released by the prefill scheduler before the transfer finished")
        with self._lock:
            self._units.pop(room, None)
            link = u.link
        if link is not None and link.sender is not None:
            link.sender.forget(unit_id(room))

    def open_units(self) -> List[int]:
        with self._lock:
            return list(self._units)

    def links(self) -> List[PeerLink]:
        with self._lock:
            return list(self._links.values())

    def close(self) -> None:
        """Stop every link (open gates released with an error) and unregister the memory."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
            registered, self._registered = self._registered, []
        for link in links:
            link.close()
        if registered:
            self.engine.unregister(registered)
