"""Overlapped load / compute / save pipeline over planned physical layer buffers.

Per layer ``L`` of a prefill forward (slot ``b = plan.buffer_of(L)``):

1. *acquire* (loader thread): wait until every consumer of ``b``'s previous content
   finished (:meth:`SlotGates.wait_free`, with a deadline), then
   ``gates.begin(b, L, ["compute", "save", *extra])``;
2. *load*: copy the cached prefix rows of every request from the host store into
   ``b`` (transfer stream + event on a device; the loader thread on CPU);
3. *compute* (caller): :meth:`wait_until_ready` -> attention writes the new rows
   into ``b`` and reads prefix + new rows -> :meth:`on_layer_written` (the write
   is complete: start the save) -> :meth:`on_layer_attended` (nothing will read
   ``b`` for the compute any more: ``done(b, L, "compute")``);
4. *save* (saver thread): after the write event, copy the new rows to the host
   store, then ``done(b, L, "save")``;
5. *prefetch*: the loader runs ahead, acquiring and loading up to
   ``prefetch_depth`` layers beyond the one being computed, while compute goes on.

Extra consumers (P/D: the decode's remote read of the layer, see
``begin_forward(extra_consumers=...)``) answer through ``pipeline.gates.done`` and
are waited for exactly like the save. Written-listeners
(:meth:`add_written_listener`) are called once a layer's KV is complete in its
slot -- the point at which the P/D side may publish "layer ready".

Driving it from a memory pool (per layer): ``get_key_buffer(L)`` ->
:meth:`wait_until_ready` + :meth:`buffer`; ``set_kv_buffer(L)`` writes rows
returned by :meth:`layout` and then :meth:`on_layer_written`; after the
attention of ``L`` has been issued, :meth:`on_layer_attended`. The forward is
opened with :meth:`begin_forward` and closed with :meth:`end_forward`
(:meth:`abort_forward` on failure).

Invariant (tested with random timings): no slot is written for a layer before
every consumer of its previous content has finished.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang_ascend_offload import platform
from sglang_ascend_offload.layerwise_prefill.gates import GateError, GateTimeout, SlotGates
from sglang_ascend_offload.layerwise_prefill.planner import BufferPlan, torch_dtype
from sglang_ascend_offload.layerwise_prefill.store import BlockKey, HostKVStore, block_keys, object_key

logger = logging.getLogger(__name__)

__all__ = [
    "PrefillRequest",
    "RequestRows",
    "ForwardLayout",
    "ForwardStats",
    "ForwardError",
    "LayerwisePrefillPipeline",
    "run_forward",
    "COMPUTE",
    "SAVE",
]

COMPUTE = "compute"
SAVE = "save"


@dataclass(frozen=True)
class PrefillRequest:
    """A request to prefill: ``rid`` and its full token ids (cached prefix included)."""

    rid: str
    token_ids: Tuple[int, ...]


@dataclass(frozen=True)
class RequestRows:
    """Where one request lives in every layer buffer of a forward.

    Rows ``[row0, row0 + prefix_len)`` hold the cached prefix (loaded from the host
    store), rows ``[row0 + prefix_len, row0 + prefix_len + new_len)`` the tokens
    computed in this forward. ``blocks`` are the request's block keys; the first
    ``cached_blocks`` are loaded, the rest saved after compute.
    """

    rid: str
    row0: int
    prefix_len: int
    new_len: int
    blocks: Tuple[BlockKey, ...]
    cached_blocks: int

    @property
    def total_len(self) -> int:
        return self.prefix_len + self.new_len


@dataclass(frozen=True)
class ForwardLayout:
    """Row layout of a forward: requests packed back to back from row 0."""

    requests: Tuple[RequestRows, ...]
    layers: Tuple[int, ...]

    @property
    def total_rows(self) -> int:
        return sum(r.total_len for r in self.requests)


@dataclass
class ForwardStats:
    """Measured during one forward (seconds are sums over the worker threads)."""

    layers: int = 0
    load_s: float = 0.0
    save_s: float = 0.0
    gate_wait_s: float = 0.0  # loader time blocked on slot gates
    ready_wait_s: float = 0.0  # compute time blocked in wait_until_ready
    bytes_loaded: int = 0
    bytes_saved: int = 0
    prefix_tokens: int = 0
    new_tokens: int = 0


class ForwardError(RuntimeError):
    """Errors of a forward's loads, saves or consumers (``errors``: one line each)."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("layerwise prefill forward failed:\n  " + "\n  ".join(self.errors))


class _Forward:
    """Mutable state of one forward (guarded by the pipeline's condition)."""

    def __init__(self, fid: int, layout: ForwardLayout, extra: Dict[int, Tuple[str, ...]]):
        self.fid = fid
        self.layout = layout
        self.extra = extra
        self.pos = {layer: i for i, layer in enumerate(layout.layers)}
        self.ready: Dict[int, bool] = {}
        self.load_event: Dict[int, object] = {}
        self.layer_error: Dict[int, BaseException] = {}
        self.begun: set = set()
        self.written: set = set()
        self.attended: set = set()
        self.saved: set = set()
        self.compute_pos = -1
        self.errors: List[str] = []
        self.stats = ForwardStats(layers=len(layout.layers))
        self.aborted = False
        self.leased: List[str] = []


class LayerwisePrefillPipeline:
    """Physical layer buffers + gates + loader/saver threads for layerwise prefill.

    plan: buffer plan; store: host KV store; block_tokens: token rows per store
    object (SGLang page size or a multiple); prefetch_depth: layers acquired and
    loaded ahead of compute (``None`` = min(B, 8), at least 1); wait_timeout_s:
    deadline of every gate and readiness wait; buffers: the physical buffers
    (``buffers[b][k]`` = tensor ``k`` of buffer ``b`` with the planned shape/dtype),
    allocated on ``device`` when not given.
    """

    def __init__(
        self,
        plan: BufferPlan,
        store: HostKVStore,
        *,
        block_tokens: int,
        prefetch_depth: Optional[int] = None,
        wait_timeout_s: float = 60.0,
        device: Optional[torch.device] = None,
        buffers: Optional[Sequence[Sequence[torch.Tensor]]] = None,
        lease_ttl_ms: int = 60_000,
        namespace: str = "",
    ):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.plan = plan
        self.store = store
        self.block_tokens = block_tokens
        b = plan.shared_buffers or max(1, plan.num_layers)
        self.prefetch_depth = max(1, prefetch_depth if prefetch_depth is not None else min(b, 8))
        self.wait_timeout_s = float(wait_timeout_s)
        self.lease_ttl_ms = lease_ttl_ms
        self.namespace = namespace
        self.device = device or platform.default_device()
        self.buffers = self._make_buffers(buffers)
        self.capacity_rows = min(t.shape[0] for buf in self.buffers for t in buf)
        self.gates = SlotGates(plan.num_physical)
        self._cv = threading.Condition()
        self._fwd: Optional[_Forward] = None
        self._slot_owner: Dict[int, Tuple[_Forward, int]] = {}
        self._release_event: Dict[int, object] = {}
        self._listeners: List[Callable[[int, int], None]] = []
        self._unfinished: List[_Forward] = []
        self._next_fid = 0
        self._load_q: "queue.Queue" = queue.Queue()
        self._save_q: "queue.Queue" = queue.Queue()
        self._load_stream = platform.new_stream()
        self._save_stream = platform.new_stream()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._loader, name="lwp-loader", daemon=True),
            threading.Thread(target=self._saver, name="lwp-saver", daemon=True),
        ]
        for t in self._threads:
            t.start()
        store.register([t for buf in self.buffers for t in buf])

    # ------------------------------------------------------------------ setup
    def _make_buffers(self, given) -> List[List[torch.Tensor]]:
        if given is None:
            return [
                [torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=self.device) for t in pb.spec.tensors]
                for pb in self.plan.buffers
            ]
        bufs = [list(b) for b in given]
        errs = []
        if len(bufs) != self.plan.num_physical:
            errs.append(f"{len(bufs)} buffers given, plan has {self.plan.num_physical}")
        for pb, tensors in zip(self.plan.buffers, bufs):
            want = [(tuple(t.shape), torch_dtype(t.dtype)) for t in pb.spec.tensors]
            got = [(tuple(t.shape), t.dtype) for t in tensors]
            if want != got:
                errs.append(f"buffer {pb.index}: tensors {got} != planned {want}")
            if any(not t.is_contiguous() for t in tensors):
                errs.append(f"buffer {pb.index}: tensors must be contiguous")
        if errs:
            raise ValueError("physical buffers do not match the plan: " + "; ".join(errs))
        return bufs

    def add_written_listener(self, fn: Callable[[int, int], None]) -> None:
        """``fn(layer, slot)`` runs (saver thread) once a layer's KV is complete in its slot."""
        self._listeners.append(fn)

    def buffer(self, layer: int) -> List[torch.Tensor]:
        """The physical buffer tensors that ``layer`` uses (aliased by other layers)."""
        return self.buffers[self.plan.buffer_of(layer)]

    def layout(self) -> ForwardLayout:
        return self._current().layout

    # ------------------------------------------------------------------ prefix
    def _layer_keys(self, blocks: Sequence[BlockKey], layer: int) -> List[str]:
        return [object_key(b, layer) for b in blocks]

    def match_prefix(self, token_ids: Sequence[int], layers: Optional[Sequence[int]] = None) -> int:
        """Tokens of ``token_ids`` whose KV is in the store for every layer (whole blocks),
        leaving at least one token to compute."""
        layers = tuple(layers or self.plan.order)
        blocks = [b for b in block_keys(token_ids, self.block_tokens, self.namespace) if b.tokens == self.block_tokens]
        usable = min(len(blocks), max(0, len(token_ids) - 1) // self.block_tokens)
        if usable == 0:
            return 0
        keys = [object_key(b, layer) for b in blocks[:usable] for layer in layers]
        present = self.store.exists(keys)
        n = 0
        for i in range(usable):
            if all(present[i * len(layers) : (i + 1) * len(layers)]):
                n += 1
            else:
                break
        return n * self.block_tokens

    # ------------------------------------------------------------------ forward API
    def begin_forward(
        self,
        requests: Sequence[PrefillRequest],
        layers: Optional[Sequence[int]] = None,
        extra_consumers: Optional[Dict[int, Sequence[str]]] = None,
    ) -> ForwardLayout:
        """Open a forward: match cached prefixes, lay out rows, start prefetching.

        extra_consumers: layer -> further consumers of that layer's slot content
        (e.g. ``["decode:0"]``); they must call ``gates.done(slot, layer, name)``.
        Only one forward is open at a time; the previous one's saves may still run.
        """
        with self._cv:
            if self._closed:
                raise RuntimeError("pipeline is closed")
            if self._fwd is not None:
                raise RuntimeError(f"forward {self._fwd.fid} is still open; call end_forward first")
        layers = tuple(layers or self.plan.order)
        unknown = [l for l in layers if l not in self.plan.layer_buffer]
        if unknown:
            raise ValueError(f"layers {unknown} are not in the buffer plan")
        rows: List[RequestRows] = []
        row0 = 0
        for req in requests:
            toks = tuple(req.token_ids)
            if not toks:
                raise ValueError(f"request {req.rid}: no tokens")
            prefix = self.match_prefix(toks, layers)
            blocks = tuple(block_keys(toks, self.block_tokens, self.namespace))
            rows.append(RequestRows(req.rid, row0, prefix, len(toks) - prefix, blocks, prefix // self.block_tokens))
            row0 += len(toks)
        if row0 > self.capacity_rows:
            raise ValueError(
                f"forward needs {row0} token rows but the layer buffers hold "
                f"{self.capacity_rows}; split the batch (chunked prefill) or plan "
                "larger buffers"
            )
        return self.open_forward(ForwardLayout(tuple(rows), layers), extra_consumers)

    def open_forward(
        self, layout: ForwardLayout, extra_consumers: Optional[Dict[int, Sequence[str]]] = None
    ) -> ForwardLayout:
        """Open a forward over a caller-made ``layout`` (rows already placed; blocks
        ``[:cached_blocks]`` of each row are loaded, the rest saved): lease the cached
        blocks and start prefetching. :meth:`begin_forward` builds the layout from
        token ids; a memory pool that owns its row placement calls this directly."""
        layers = layout.layers
        unknown = [l for l in layers if l not in self.plan.layer_buffer]
        if unknown or not layers:
            raise ValueError(f"layers {list(layers)}: {unknown or 'none'} not in the buffer plan")
        end = max((r.row0 + b.start + b.tokens for r in layout.requests for b in r.blocks), default=0)
        if end > self.capacity_rows:
            raise ValueError(f"forward rows reach {end} but the layer buffers hold {self.capacity_rows}")
        rows = layout.requests
        extra = {l: tuple(c) for l, c in (extra_consumers or {}).items() if c}
        with self._cv:
            if self._closed:
                raise RuntimeError("pipeline is closed")
            if self._fwd is not None:
                raise RuntimeError(f"forward {self._fwd.fid} is still open; call end_forward first")
            fwd = _Forward(self._next_fid, layout, extra)
            self._next_fid += 1
            fwd.stats.prefix_tokens = sum(r.prefix_len for r in rows)
            fwd.stats.new_tokens = sum(r.new_len for r in rows)
            self._fwd = fwd
        leased = [k for r in rows for l in layers for k in self._layer_keys(r.blocks[: r.cached_blocks], l)]
        if leased:
            self.store.add_lease(leased, self.lease_ttl_ms)
            fwd.leased = leased
        for layer in layers:
            self._load_q.put((fwd, layer))
        return layout

    @property
    def has_open_forward(self) -> bool:
        return self._fwd is not None

    def _current(self) -> _Forward:
        fwd = self._fwd
        if fwd is None:
            raise RuntimeError("no open forward; call begin_forward first")
        return fwd

    def wait_until_ready(self, layer: int, timeout_s: Optional[float] = None) -> None:
        """Block until ``layer``'s slot is acquired and its prefix loaded (deadline:
        ``wait_timeout_s``); on a device the current stream then waits on the load event."""
        fwd = self._current()
        if layer not in fwd.pos:
            raise ValueError(f"layer {layer} is not part of the open forward {list(fwd.layout.layers)}")
        timeout = self.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        with self._cv:
            fwd.compute_pos = max(fwd.compute_pos, fwd.pos[layer])
            self._cv.notify_all()
            while not fwd.ready.get(layer) and layer not in fwd.layer_error:
                left = deadline - time.monotonic()
                if left <= 0:
                    slot = self.plan.buffer_of(layer)
                    raise GateTimeout(
                        f"layer {layer} not ready after {timeout:.3f}s: slot {slot} holds layer "
                        f"{self.gates.layer(slot)} with pending consumers "
                        f"{sorted(self.gates.pending(slot))}"
                    )
                self._cv.wait(left)
            fwd.stats.ready_wait_s += time.perf_counter() - t0
            if layer in fwd.layer_error:
                raise fwd.layer_error[layer]
            event = fwd.load_event.get(layer)
        if event is not None:
            platform.current_stream().wait_event(event)

    def on_layer_written(self, layer: int) -> None:
        """The layer's new KV rows are written (issued on the current stream): save them."""
        fwd = self._current()
        with self._cv:
            if layer in fwd.written or not fwd.ready.get(layer):
                raise RuntimeError(f"on_layer_written({layer}) before wait_until_ready or twice")
            fwd.written.add(layer)
        event = platform.new_event()
        event.record(platform.current_stream())
        self._save_q.put((fwd, layer, event))

    def on_layer_attended(self, layer: int) -> None:
        """Attention of ``layer`` is issued: compute no longer needs the slot.

        Must come before :meth:`wait_until_ready` of the next layer that reuses the
        slot (with ``B = 1`` that is the next shared layer), or that wait times out."""
        fwd = self._current()
        with self._cv:
            if layer in fwd.attended or layer not in fwd.written:
                raise RuntimeError(f"on_layer_attended({layer}) before on_layer_written or twice")
            fwd.attended.add(layer)
        slot = self.plan.buffer_of(layer)
        event = platform.new_event()
        event.record(platform.current_stream())
        self._release_event[slot] = event
        self.gates.done(slot, layer, COMPUTE)

    def end_forward(self, wait_saves: bool = True, timeout_s: Optional[float] = None) -> ForwardStats:
        """Close the forward and release its prefix leases (every load is done by now).

        With ``wait_saves`` wait (deadline) until every layer is saved and raise
        :class:`ForwardError` on any error of this forward; otherwise saves go on in
        the background and :meth:`drain` waits for them and reports their errors.
        A forward with layers not computed is aborted and raises ForwardError.
        """
        fwd = self._current()
        missing = [l for l in fwd.layout.layers if l not in fwd.attended]
        if missing:
            self.abort_forward()
            raise ForwardError([f"end_forward with layers not computed: {missing}"])
        with self._cv:
            self._fwd = None
            self._unfinished.append(fwd)
        self._release_leases(fwd)
        if wait_saves:
            self._wait_saved([fwd], timeout_s)
        return fwd.stats

    def drain(self, timeout_s: Optional[float] = None) -> None:
        """Wait until the saves of every ended forward finished; raise their errors."""
        with self._cv:
            fwds = list(self._unfinished)
        self._wait_saved(fwds, timeout_s)

    def wait_all_free(self, timeout_s: Optional[float] = None) -> None:
        """Wait (one deadline for all) until no slot has pending consumers, e.g. remote
        reads of the last layers, before shutting down or freeing the buffers."""
        timeout = self.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        for slot in range(self.plan.num_physical):
            try:
                self.gates.wait_free(slot, max(0.0, deadline - time.monotonic()))
            except GateError:
                pass  # free; the error was reported to its forward

    def _release_leases(self, fwd: _Forward) -> None:
        if fwd.leased:
            leased, fwd.leased = fwd.leased, []
            self.store.remove_lease(leased)

    def _wait_saved(self, fwds: Sequence[_Forward], timeout_s: Optional[float]) -> None:
        timeout = self.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        errors: List[str] = []
        with self._cv:
            for fwd in fwds:
                while len(fwd.saved) < len(fwd.written):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise GateTimeout(
                            f"forward {fwd.fid}: saves of layers "
                            f"{sorted(fwd.written - fwd.saved)} not finished after "
                            f"{timeout:.3f}s"
                        )
                    self._cv.wait(left)
                errors += fwd.errors
                if fwd in self._unfinished:
                    self._unfinished.remove(fwd)
        if errors:
            raise ForwardError(errors)

    def abort_forward(self) -> None:
        """Give up the open forward: pending loads are skipped; every consumer of a slot
        it acquired that will never run (compute, save, and extra consumers of layers
        never written) is reported done with error ``aborted``, so the slots free up."""
        fwd = self._current()
        with self._cv:
            fwd.aborted = True
            self._fwd = None
            self._cv.notify_all()
            begun = sorted(fwd.begun)
            written = set(fwd.written)
        for layer in begun:
            slot = self.plan.buffer_of(layer)
            if layer not in fwd.attended:
                fwd.attended.add(layer)
                self._safe_done(slot, layer, COMPUTE, "aborted")
            if layer not in written:
                for consumer in (SAVE,) + fwd.extra.get(layer, ()):
                    self._safe_done(slot, layer, consumer, "aborted")
        self._release_leases(fwd)

    def _safe_done(self, slot: int, layer: int, consumer: str, error: Optional[str]) -> None:
        try:
            self.gates.done(slot, layer, consumer, error)
        except ValueError:
            pass  # already reported

    # ------------------------------------------------------------------ workers
    def _views(self, slot: int, row0: int, nrows: int) -> List[torch.Tensor]:
        return [t[row0 : row0 + nrows] for t in self.buffers[slot]]

    def _block_views(self, slot: int, r: RequestRows, blocks: Sequence[BlockKey]) -> List[List[torch.Tensor]]:
        return [self._views(slot, r.row0 + b.start, b.tokens) for b in blocks]

    def _loader(self) -> None:
        while True:
            item = self._load_q.get()
            if item is None:
                return
            fwd, layer = item
            try:
                self._acquire_and_load(fwd, layer)
            except BaseException as exc:  # noqa: BLE001 - delivered to wait_until_ready
                with self._cv:
                    fwd.layer_error[layer] = exc
                    self._cv.notify_all()

    def _acquire_and_load(self, fwd: _Forward, layer: int) -> None:
        with self._cv:  # prefetch throttle: at most prefetch_depth layers ahead of compute
            # (no deadline: this waits for the caller's compute, not for a consumer)
            while fwd.pos[layer] - fwd.compute_pos > self.prefetch_depth and not fwd.aborted and not self._closed:
                self._cv.wait(0.5)
            if fwd.aborted or self._closed:
                return
        deadline = time.monotonic() + self.wait_timeout_s
        slot = self.plan.buffer_of(layer)
        t0 = time.perf_counter()
        left = max(0.0, deadline - time.monotonic())
        try:
            self.gates.wait_free(slot, left)
        except GateError as exc:
            # The slot is free; the failure belongs to the forward that owned the content.
            # Save/compute failures are already recorded there; extra consumers' are not.
            foreign = {c: e for c, e in exc.errors.items() if c not in (COMPUTE, SAVE)}
            owner = self._slot_owner.get(slot)
            if foreign:
                with self._cv:
                    target = owner[0] if owner else fwd
                    target.errors += [
                        f"slot {slot} layer {exc.layer}: consumer {c} failed: {e}" for c, e in sorted(foreign.items())
                    ]
                logger.warning("layerwise prefill: %s", exc)
        gate_s = time.perf_counter() - t0
        with self._cv:
            if fwd.aborted:
                return
            fwd.stats.gate_wait_s += gate_s
            self.gates.begin(slot, layer, (COMPUTE, SAVE) + fwd.extra.get(layer, ()))
            fwd.begun.add(layer)
            self._slot_owner[slot] = (fwd, layer)
        release = self._release_event.get(slot)
        if release is not None:
            release.synchronize()  # previous content's attention has finished on the device
        t1 = time.perf_counter()
        keys: List[str] = []
        dst: List[List[torch.Tensor]] = []
        for r in fwd.layout.requests:
            cached = r.blocks[: r.cached_blocks]
            keys += self._layer_keys(cached, layer)
            dst += self._block_views(slot, r, cached)
        event = None
        if keys:
            with platform.stream_context(self._load_stream):
                self.store.get_into(keys, dst)
                event = platform.new_event()
                event.record(self._load_stream)
        with self._cv:
            fwd.stats.load_s += time.perf_counter() - t1
            fwd.stats.bytes_loaded += sum(t.numel() * t.element_size() for ts in dst for t in ts)
            fwd.load_event[layer] = event
            fwd.ready[layer] = True
            self._cv.notify_all()

    def _saver(self) -> None:
        while True:
            item = self._save_q.get()
            if item is None:
                return
            fwd, layer, event = item
            slot = self.plan.buffer_of(layer)
            error: Optional[str] = None
            t0 = time.perf_counter()
            nbytes = 0
            try:
                event.synchronize()
                for fn in self._listeners:
                    fn(layer, slot)
                keys: List[str] = []
                src: List[List[torch.Tensor]] = []
                for r in fwd.layout.requests:
                    new_blocks = r.blocks[r.cached_blocks :]
                    keys += self._layer_keys(new_blocks, layer)
                    src += self._block_views(slot, r, new_blocks)
                with platform.stream_context(self._save_stream):
                    self.store.put(keys, src)
                nbytes = sum(t.numel() * t.element_size() for ts in src for t in ts)
            except BaseException as exc:  # noqa: BLE001 - reported through the gate and forward
                error = f"layer {layer} save failed: {exc}"
            with self._cv:
                fwd.stats.save_s += time.perf_counter() - t0
                fwd.stats.bytes_saved += nbytes
                if error:
                    fwd.errors.append(error)
            self._safe_done(slot, layer, SAVE, error)
            with self._cv:
                fwd.saved.add(layer)
                self._cv.notify_all()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the worker threads (pending work is finished first)."""
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._load_q.put(None)
        self._save_q.put(None)
        for t in self._threads:
            t.join(timeout=self.wait_timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_forward(
    pipe: LayerwisePrefillPipeline,
    requests: Sequence[PrefillRequest],
    compute_layer: Callable[[int, List[torch.Tensor], ForwardLayout], None],
    layers: Optional[Sequence[int]] = None,
    wait_saves: bool = True,
    extra_consumers: Optional[Dict[int, Sequence[str]]] = None,
    on_begin: Optional[Callable[[ForwardLayout], None]] = None,
) -> ForwardStats:
    """Drive one forward: ``on_begin(layout)``, then for each layer wait ->
    ``compute_layer(layer, buffer, layout)`` (writes the new rows and attends) ->
    written -> attended; then :meth:`~LayerwisePrefillPipeline.end_forward`."""
    layout = pipe.begin_forward(requests, layers, extra_consumers)
    try:
        if on_begin is not None:
            on_begin(layout)
        for layer in layout.layers:
            pipe.wait_until_ready(layer)
            compute_layer(layer, pipe.buffer(layer), layout)
            pipe.on_layer_written(layer)
            pipe.on_layer_attended(layer)
    except BaseException:
        pipe.abort_forward()
        raise
    return pipe.end_forward(wait_saves=wait_saves)
