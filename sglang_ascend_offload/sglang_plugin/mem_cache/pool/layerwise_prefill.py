"""KV pool for layerwise prefill offload: N layers' main KV in ``I + min(B, R)`` device buffers.

Layout (``S`` = SGLang's slot space: ``max_total_tokens`` + one padding page; row =
slot, exactly as in :class:`~.device.DeviceDSAPool`):

======================  ==================================================================
physical buffer ``b``   ``[latent [S, Dl], rope [S, Dr], index K [S, Di]]`` (``store_dtype``),
                        planned by ``layerwise_prefill.planner.plan_buffers``: independent
                        layers get one each, the others share ``min(B, R_group)``
``k_buffer[L]``         view ``[S / P, P, 1, Dl]`` of ``L``'s physical buffer (aliased:
                        layers of one buffer see the same memory); ``v_buffer`` /
                        ``index_k_buffer`` likewise
======================  ==================================================================

Every SGLang accessor inherited from SGLang's NPU MLA pool (``get_key_buffer``,
``get_value_buffer``, ``get_kv_buffer``, ``get_index_k_buffer``) calls
``layer_transfer_counter.wait_until(layer)`` first -- SGLang's per-layer hook for
layer-wise KV loading. This pool's counter (:class:`~.device.LayerCounter`) drives the
layerwise pipeline there, and ``set_kv_buffer`` / ``set_index_k_buffer`` do the same
before writing. Per forward:

1. the first access of a forward (a new ``forward_metadata`` of the ``ascend_offload``
   attention backend, read through SGLang's forward context) closes the previous
   forward and plans this one (:class:`~.layerwise_pages.PageBook`: pages to load and
   save per request, from ``req_to_token``, ``seq_lens`` and the query lengths) and
   opens it in the pipeline: the loader thread starts acquiring slots and loading the
   cached rows of the *pipelined* layers (those whose buffer is shared);
2. entering layer ``L`` (its first access) means every earlier layer's attention has
   been issued (the model runs its layers in order): each earlier pipelined layer is
   reported attended (its slot may be reused once it is saved), then
   ``wait_until_ready(L)`` blocks until ``L``'s slot is free and its cached rows are
   loaded;
3. ``set_kv_buffer(L)`` -- the last write of a layer (the indexer writes index K
   first) -- writes the new rows at ``out_cache_loc`` and reports the layer written:
   the saver thread copies the touched pages to the host store;
4. the next forward's first access (or :meth:`LayerwisePrefillPool.finish_forward`)
   ends the forward: remaining layers attended, earlier forwards' save errors raised,
   superseded host objects removed.

Layers with a dedicated buffer (independent layers, or the only layer of its buffer)
never leave the device: no load, no save, no gate -- their buffer *is* a full SGLang
layer cache. So ``I = "all"`` or ``B >= R`` is the plain device pool.

**Prefix reuse.** SGLang's radix cache hands a request the pages of its cached prefix
and computes only the rest. Those pages' rows of every pipelined layer are loaded from
the host store into the layer's buffer before the layer's first access (the page plan
names them; a page the pool never saved is an error, never silently recomputed).

**Decode on a colocated server** (a debug path; production runs this on a P/D
prefill node): a decode step is a forward with one new token per request, so each
pipelined layer loads every request's whole context from the host store, appends the
token, and saves the request's last page again. Results are identical to the device
pool; the cost is the full context per pipelined layer per step.

Requirements (checked at startup by :mod:`...args.rules.layerwise_prefill`): the ``ascend_offload``
attention backend, eager forwards with buffer reuse, no two-batch overlap, no HiCache,
no sparse decode offload in the same server. With speculative decoding (NextN / MTP)
the draft model's layer is numbered after the base layers and planned as an
independent layer: a dedicated device buffer in SGLang's slot space, never loaded or
saved (``speculative.build_draft_pool``). It cannot share a buffer with a base layer,
because the draft runner's forwards (draft extend after every verify, the draft decode
steps) interleave with the target's and would each need a load and save of the shared
buffer; one layer of device KV costs less.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .... import config as cfg
from .... import platform
from ....layerwise_prefill.pipeline import ForwardStats
from ....layerwise_prefill.planner import BufferPlan, LayerKVSpec, TensorSpec, plan_buffers
from ....layerwise_prefill.store import HostKVStore, make_store, object_key
from ... import compat
from .device import DeviceDSAPool, LayerCounter
from .layerwise_pages import BatchRequest, ForwardPages, PageBook
from .layerwise_runtime import ForwardInfo, LayerListener, LayerWritten, SlotPipeline, WrittenNotifier

logger = logging.getLogger(__name__)

__all__ = ["LayerwisePrefillPool", "LayerwisePoolStats", "build_layerwise_pool"]

_STATS_LOG_INTERVAL_S = 60.0


@dataclass
class LayerwisePoolStats:
    """Cumulative numbers of the pool (folded in once a forward's saves finished)."""

    forwards: int = 0
    prefix_rows: int = 0
    new_rows: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_s: float = 0.0
    save_s: float = 0.0
    gate_wait_s: float = 0.0
    ready_wait_s: float = 0.0
    stale_removed: int = 0

    def add(self, s: ForwardStats) -> None:
        self.forwards += 1
        self.prefix_rows += s.prefix_tokens
        self.new_rows += s.new_tokens
        self.bytes_loaded += s.bytes_loaded
        self.bytes_saved += s.bytes_saved
        self.load_s += s.load_s
        self.save_s += s.save_s
        self.gate_wait_s += s.gate_wait_s
        self.ready_wait_s += s.ready_wait_s


@dataclass
class _PoolForward:
    """One forward seen by the pool (scheduler thread only)."""

    key: object  # the backend's forward_metadata object identifying the forward
    info: ForwardInfo
    pages: Optional[ForwardPages]
    entered_pos: int = -1
    ready: Set[int] = field(default_factory=set)
    written: Set[int] = field(default_factory=set)
    attended: Set[int] = field(default_factory=set)


class LayerwisePrefillPool(DeviceDSAPool):
    """Layerwise prefill offload pool (see module doc).

    size / page_size / dtype / kv_lora_rank / qk_rope_head_dim / layer_num / device /
    enable_memory_saver / index_head_dim / start_layer / end_layer: as SGLang's NPU MLA
    pool. offload: the feature config. store: the host KV store (default
    ``make_store(offload)``; only built when some buffer is shared). namespace: host
    key prefix (made unique per pool instance). speculative: the server verifies
    speculative drafts (a continued page may hold rejected candidate rows).

    The launch validation holds ``offload.store_block_tokens`` unset or equal to
    ``page_size`` (rule ``sglang.layerwise_block_tokens``: the pool stores one object per
    KV page); it is not re-checked here.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        index_head_dim: Optional[int],
        *,
        offload: cfg.LayerwisePrefillOffloadConfig,
        store: Optional[HostKVStore] = None,
        namespace: str = "sglang",
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        speculative: bool = False,
    ):
        self._init_without_buffers(
            size,
            page_size,
            dtype,
            kv_lora_rank,
            qk_rope_head_dim,
            layer_num,
            device,
            enable_memory_saver,
            index_head_dim,
            start_layer,
            end_layer,
        )
        self.offload = offload
        self._build_buffers(size, page_size, kv_lora_rank, qk_rope_head_dim, index_head_dim, layer_num, device)
        self.namespace = f"{namespace}/{uuid.uuid4().hex[:12]}"
        self.pagebook = PageBook(page_size, self.namespace, speculative_tails=speculative)
        self._build_pipeline(store, page_size, device)
        self._init_forward_state()
        self._finalize_allocation_log(size)
        logger.info(
            "layerwise prefill offload: %s; pipelined layers %s (host store %s), dedicated %s; "
            "main KV %.1f MiB on %s instead of %.1f MiB",
            self.plan.summary(),
            list(self.pipelined),
            self.store.name if self.store is not None else "-",
            [l for l in self.plan.order if l not in self._pipelined_set],
            self.plan.main_bytes_physical / 2**20,
            device,
            self.plan.main_bytes_logical / 2**20,
        )
        atexit.register(self.close)

    def _build_buffers(self, size, page_size, kv_lora_rank, qk_rope_head_dim, index_head_dim, layer_num, device):
        """The physical layer buffers of the plan, and SGLang's per-layer views onto them
        (``k_buffer`` / ``v_buffer`` / ``index_k_buffer``: ``[pages, page_size, 1, dim]``;
        layers that share a buffer share its storage)."""
        pages = size // page_size + 1
        self.slot_rows = pages * page_size
        self.plan: BufferPlan = plan_buffers(
            self._layer_specs(), self.offload.shared_buffers, self.offload.independent_layers
        )
        self.physical: List[List[torch.Tensor]] = [
            [torch.zeros(t.shape, dtype=self.store_dtype, device=device) for t in pb.spec.tensors]
            for pb in self.plan.buffers
        ]
        shapes = [kv_lora_rank, qk_rope_head_dim] + ([index_head_dim] if index_head_dim else [])

        def views(k: int) -> List[torch.Tensor]:
            return [
                self.physical[self.plan.buffer_of(l)][k].view(pages, page_size, 1, shapes[k]) for l in range(layer_num)
            ]

        self.k_buffer = views(0)
        self.v_buffer = views(1)
        self.index_k_buffer = views(2) if index_head_dim is not None else None
        self.pipelined: Tuple[int, ...] = tuple(
            l for l in self.plan.order if len(self.plan.layers_of(self.plan.buffer_of(l))) > 1
        )
        self._pipelined_set = frozenset(self.pipelined)
        self._pos = {l: i for i, l in enumerate(self.plan.order)}

    def _build_pipeline(self, store: Optional[HostKVStore], page_size: int, device: str) -> None:
        """The host store and the slot pipeline, only where some buffer is shared."""
        self.store: Optional[HostKVStore] = None
        self.pipe: Optional[SlotPipeline] = None
        if not self.pipelined:
            return
        offload = self.offload
        self.store = store if store is not None else make_store(offload, _device_index(device))
        self.pipe = SlotPipeline(
            self.plan,
            self.store,
            block_tokens=page_size,
            prefetch_depth=offload.prefetch_depth,
            wait_timeout_s=offload.wait_timeout_s,
            device=torch.device(device),
            buffers=self.physical,
            lease_ttl_ms=offload.memcache.lease_ttl_ms,
            namespace=self.namespace,
        )
        self.pipe.add_written_listener(self._on_pipeline_written)

    def _init_forward_state(self) -> None:
        """Per-forward bookkeeping, listeners and statistics (empty at start)."""
        self.layer_transfer_counter = LayerCounter(self)
        self._fwd: Optional[_PoolForward] = None
        self._next_forward_id = 0
        self._listeners: List[LayerListener] = []
        self._written_fifo: Deque[Tuple[int, int, ForwardInfo]] = deque()
        self._fifo_lock = threading.Lock()
        self._notifier: Optional[WrittenNotifier] = None
        self._extra_consumers = None
        self._unfolded: List[ForwardStats] = []
        self.stats = LayerwisePoolStats()
        self._last_log = time.monotonic()
        self._closed = False

    # ------------------------------------------------------------------ layout
    def _layer_specs(self) -> List[LayerKVSpec]:
        dt = str(self.store_dtype).replace("torch.", "")
        main = (
            TensorSpec((self.slot_rows, self.kv_lora_rank), dt),
            TensorSpec((self.slot_rows, self.qk_rope_head_dim), dt),
        )
        index = (TensorSpec((self.slot_rows, self.index_head_dim), dt),) if self.index_head_dim else ()
        return [LayerKVSpec(l, main, index) for l in range(self.layer_num)]

    @property
    def physical_buffers(self) -> int:
        return self.plan.num_physical

    def get_kv_size_bytes(self):
        return sum(t.numel() * t.element_size() for buf in self.physical for t in buf)

    @property
    def gates(self):
        """The pipeline's slot gates (P/D answers ``gates.done(slot, layer, consumer, error)``)."""
        if self.pipe is None:
            raise RuntimeError("no layer buffer is shared (shared_buffers >= reusable layers): nothing is gated")
        return self.pipe.gates

    # ------------------------------------------------------------------ hooks for P/D
    def add_layer_listener(self, fn: LayerListener) -> None:
        """``fn(LayerWritten)`` once per layer and forward after its rows are complete
        (see :mod:`.layerwise_runtime`)."""
        self._listeners.append(fn)
        if self._notifier is None:
            self._notifier = WrittenNotifier()

    def set_extra_consumers(self, fn) -> None:
        """``fn(ForwardInfo) -> {local layer: [consumer, ...]}`` or a sequence for every
        pipelined layer (see :mod:`.layerwise_runtime`); ``None`` removes it."""
        self._extra_consumers = fn

    def _extra_for(self, info: ForwardInfo) -> Dict[int, Sequence[str]]:
        if self._extra_consumers is None or not self.pipelined:
            return {}
        got = self._extra_consumers(info) or {}
        if isinstance(got, dict):
            bad = [l for l in got if l not in self._pipelined_set]
            if bad:
                raise ValueError(
                    f"extra consumers for layers {bad}, which have dedicated buffers (no gate); "
                    f"pipelined layers: {list(self.pipelined)}"
                )
            return {l: tuple(c) for l, c in got.items()}
        return {l: tuple(got) for l in self.pipelined}

    def _on_pipeline_written(self, layer: int, slot: int) -> None:
        """Pipeline listener (saver thread): pair the call with the forward it belongs to."""
        with self._fifo_lock:
            while self._written_fifo:
                lay, sl, info = self._written_fifo.popleft()
                if (lay, sl) == (layer, slot):
                    break
            else:
                return
        if self._listeners:
            item = LayerWritten(info, layer, slot, tuple(self.physical[slot]), True)
            for fn in list(self._listeners):
                try:
                    fn(item)
                except Exception:  # noqa: BLE001 - a P/D publish failure must not cost the host save
                    logger.exception("layerwise prefill: layer listener failed for layer %d", layer)

    # ------------------------------------------------------------------ forward tracking
    def _active_metadata(self):
        from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

        if not has_forward_context():
            return None, None
        backend = get_attn_backend()
        # getattr with a default on purpose: this identifies the backend, and another
        # backend (SGLang's own, or none) need not have the attribute at all.
        if getattr(backend, "token_to_kv_pool", None) is not self:
            raise RuntimeError(
                "layerwise prefill pool accessed inside a forward of another attention backend "
                f"({type(backend).__name__}); the pool serves only its own backend"
            )
        return backend.forward_metadata, backend  # ours: set in its __init__

    def _current_forward(self) -> Optional[_PoolForward]:
        md, backend = self._active_metadata()
        if md is None:
            return None
        if self._fwd is not None and self._fwd.key is md:
            return self._fwd
        self.finish_forward()
        self._fwd = self._begin(md, backend)
        return self._fwd

    def _batch_requests(self, md, backend) -> Tuple[BatchRequest, ...]:
        real = md.real_requests  # DP-attention padding rows alias row 0: never planned or saved
        rows = [int(r) for r in md.req_pool_indices[:real].tolist()]
        seqs = [int(s) for s in md.seq_lens_cpu_int[:real].tolist()]
        qs = [int(q) for q in md.q_lens_cpu[:real]]
        if not rows:
            return ()
        P = self.page_size
        table = backend.req_to_token_pool.req_to_token
        cols = torch.arange(0, max(seqs), P, device=table.device)
        idx = torch.tensor(rows, dtype=torch.long, device=table.device)
        pages = torch.div(table[idx][:, cols], P, rounding_mode="floor").cpu().tolist()
        return tuple(
            BatchRequest(r, s - q, s, tuple(pages[i][: -(-s // P)])) for i, (r, s, q) in enumerate(zip(rows, seqs, qs))
        )

    def _begin(self, md, backend) -> _PoolForward:
        reqs = self._batch_requests(md, backend)
        info = ForwardInfo(self._next_forward_id, reqs, self.pipelined)
        self._next_forward_id += 1
        page_plan = None
        if self.pipe is not None and reqs:
            page_plan = self.pagebook.plan(reqs)
            rows = [e.request_rows(self.page_size) for e in page_plan.entries]
            self.pipe.begin_forward_rows(rows, self.pipelined, self._extra_for(info))
        return _PoolForward(md, info, page_plan)

    def enter_layer(self, layer: int) -> None:
        """``layer`` (local id) is about to be read or written (``wait_until`` hook)."""
        fwd = self._current_forward()
        if fwd is None or self.pipe is None or fwd.pages is None:
            return
        pos = self._pos[layer]
        if pos < fwd.entered_pos:
            raise RuntimeError(
                f"layerwise prefill pool: layer {layer} accessed after layer "
                f"{self.plan.order[fwd.entered_pos]} in forward {fwd.info.forward_id}; layers "
                "must run in order (a shared buffer already holds a later layer)"
            )
        if pos > fwd.entered_pos:
            fwd.entered_pos = pos
            for prev in self.pipelined:  # earlier layers' attention has been issued
                if self._pos[prev] >= pos:
                    break
                if prev not in fwd.attended:
                    if prev not in fwd.written:
                        raise RuntimeError(
                            f"layerwise prefill pool: layer {layer} started before layer "
                            f"{prev}'s KV was written (set_kv_buffer)"
                        )
                    self.pipe.on_layer_attended(prev)
                    fwd.attended.add(prev)
        if layer in self._pipelined_set and layer not in fwd.ready:
            self.pipe.wait_until_ready(layer)
            fwd.ready.add(layer)

    def _layer_written(self, layer: int) -> None:
        fwd = self._fwd
        if fwd is None:
            return
        if layer in self._pipelined_set and fwd.pages is not None:
            if layer in fwd.written:
                raise RuntimeError(f"layerwise prefill pool: layer {layer} written twice in one forward")
            with self._fifo_lock:
                self._written_fifo.append((layer, self.plan.buffer_of(layer), fwd.info))
            self.pipe.on_layer_written(layer)
            fwd.written.add(layer)
        elif self._listeners and self._notifier is not None:
            event = platform.new_event()
            event.record(platform.current_stream())
            slot = self.plan.buffer_of(layer)
            self._notifier.submit(
                event, LayerWritten(fwd.info, layer, slot, tuple(self.physical[slot]), False), self._listeners
            )

    def finish_forward(self, wait_saves: bool = False) -> None:
        """End the open forward (done automatically by the next forward's first access).

        Raises the save / consumer errors of earlier forwards (``ForwardError``), and of
        this one too with ``wait_saves``."""
        fwd, self._fwd = self._fwd, None
        if fwd is None or self.pipe is None or fwd.pages is None:
            return
        missing = [l for l in self.pipelined if l not in fwd.written]
        if missing:
            logger.error(
                "layerwise prefill: forward %d ended with layers %s not written; aborting it",
                fwd.info.forward_id,
                missing,
            )
            if self.pipe.has_open_forward:
                self.pipe.abort_forward()
            return
        for layer in self.pipelined:
            if layer not in fwd.attended:
                self.pipe.on_layer_attended(layer)
                fwd.attended.add(layer)
        try:
            self.pipe.drain()  # earlier forwards: every save finished before this one got the slots
            self._fold_stats()
        finally:
            stats = self.pipe.end_forward(wait_saves=False)
            self._unfolded.append(stats)
        self._remove_stale(fwd.pages)
        if wait_saves:
            self.pipe.drain()
            self._fold_stats()
        self._maybe_log()

    def _fold_stats(self) -> None:
        for s in self._unfolded:
            self.stats.add(s)
        self._unfolded = []

    def _remove_stale(self, pages: ForwardPages) -> None:
        if not pages.stale:
            return
        keys = [object_key(b, l) for b in pages.stale for l in self.pipelined]
        self.store.remove(keys)
        self.stats.stale_removed += len(keys)

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """End the open forward, wait for every save and listener (tests, shutdown)."""
        self.finish_forward(wait_saves=True)
        if self.pipe is not None:
            self.pipe.drain(timeout_s)
            self._fold_stats()
        if self._notifier is not None:
            self._notifier.flush(timeout_s or 30.0)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < _STATS_LOG_INTERVAL_S or not self.stats.forwards:
            return
        s, n = self.stats, self.stats.forwards
        logger.info(
            "layerwise-prefill: forwards=%d prefix_rows=%d new_rows=%d loaded=%.1fMiB saved=%.1fMiB "
            "ready_wait_ms/forward=%.2f gate_wait_ms/forward=%.2f",
            n,
            s.prefix_rows,
            s.new_rows,
            s.bytes_loaded / 2**20,
            s.bytes_saved / 2**20,
            1e3 * s.ready_wait_s / n,
            1e3 * s.gate_wait_s / n,
        )
        self._last_log = now

    # ------------------------------------------------------------------ writes
    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor]):
        """Write the new tokens' latent / rope rows at their slots, then report the layer written."""
        local = layer.layer_id - self.start_layer
        self.layer_transfer_counter.wait_until(local)
        super().set_kv_buffer(layer, loc_info, cache_k, cache_v)
        self._layer_written(local)

    def set_index_k_buffer(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor):
        self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return super().set_index_k_buffer(layer_id, loc, index_k)

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        raise NotImplementedError(
            "layerwise prefill offload keeps most layers' KV in the host store; "
            "retraction to CPU copies is not supported by this pool"
        )

    def load_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("layerwise prefill offload: load_cpu_copy is not supported")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.pipe is not None:
                if self._fwd is not None:
                    self.finish_forward()
                self.pipe.close()
        except Exception:  # noqa: BLE001 - shutdown
            logger.exception("layerwise prefill: error while closing the pipeline")
        if self._notifier is not None:
            self._notifier.close()
        if self.store is not None:
            self.store.close()


def _device_index(device: str) -> Optional[int]:
    d = torch.device(device)
    return d.index if d.type != "cpu" else None


def _namespace(offload: cfg.LayerwisePrefillOffloadConfig, model_path: str, tp_rank: int) -> str:
    base = offload.key_namespace or os.path.basename(os.path.normpath(model_path or "model")) or "model"
    return f"{base}/tp{tp_rank}"


def build_layerwise_pool(
    configurator: Any, offload: cfg.LayerwisePrefillOffloadConfig, *, max_total_num_tokens: int, is_dsa_model: bool
) -> LayerwisePrefillPool:
    """:class:`LayerwisePrefillPool` for SGLang's configurator and the validated
    ``offload`` section (called by the pool hook, ``features.build_pool_around``)."""
    from ...speculative.eagle import build_draft_pool, verify_rows_per_request
    from .device import pool_args

    if configurator.is_draft_worker:  # the NextN / MTP layer: its own dedicated buffer (speculative.py)
        return build_draft_pool(
            configurator,
            max_total_num_tokens=max_total_num_tokens,
            is_dsa_model=is_dsa_model,
            feature="layerwise prefill offload",
        )
    from sglang.srt.runtime_context import get_parallel

    mc = configurator.model_config
    # The host store's namespace must differ per TP rank: SGLang's parallel context raises
    # (naming the field) when the rank is not published, never a default of 0.
    tp_rank = int(get_parallel().tp_rank)
    pool = LayerwisePrefillPool(
        max_total_num_tokens,
        **pool_args(configurator, is_dsa_model=is_dsa_model),
        offload=offload,
        namespace=_namespace(
            offload, compat.field(mc, "sglang.srt.configs.model_config.ModelConfig", "model_path"), tp_rank
        ),
        start_layer=configurator.layer_info.start_layer,
        end_layer=configurator.layer_info.end_layer,
        speculative=verify_rows_per_request() > 1,
    )
    if pool.pipelined and _disaggregation_mode() != "prefill":
        logger.warning(
            "layerwise prefill offload on a colocated server: decode steps reload every request's "
            "whole context for each shared layer (%s) from the host store -- correct but slow, a "
            "debug path; run it on a P/D prefill node (--disaggregation-mode prefill)",
            list(pool.pipelined),
        )
    return pool


def _disaggregation_mode() -> str:
    try:
        from sglang.srt.runtime_context import get_server_args

        server_args = get_server_args()
    except Exception:  # noqa: BLE001 - no published server args (tests): only a warning depends on it
        return "null"
    return str(compat.arg_or(server_args, "disaggregation_mode", "null"))
