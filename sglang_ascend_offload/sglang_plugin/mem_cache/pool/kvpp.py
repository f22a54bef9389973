"""KVPP token-to-KV pool for SGLang's MLA/DSA layout: each layer's KV on one owner rank.

Layout on KVPP rank ``r`` of a group of ``N`` (SGLang's TP group), ``S`` = slot rows
(``max_total_tokens`` + one padding page, as in :class:`~.device.DeviceDSAPool`), a
*block* = one KV page of ``P`` rows:

===========================  ==================================================================
persistent bundle of layer   flat ``uint8`` ``[latent S x Dl][rope S x Dr][index K S x Di]``
``L`` (owned by ``r``)       (store dtype), components contiguous, each holding all blocks
scratch ``0`` / ``1``        two flat ``uint8`` buffers of the largest bundle, 2 MiB aligned;
                             target layer ``L`` not owned by ``r`` uses scratch ``L % 2``
``k_buffer[L]``              view ``[S / P, P, 1, Dl]`` of ``L``'s bundle (persistent or its
                             scratch); ``v_buffer`` / ``index_k_buffer`` likewise
===========================  ==================================================================

Owners are contiguous balanced ranges (:func:`~sglang_ascend_offload.kvpp.ownership.assign_owners`).
SGLang's allocator, radix cache, chunked prefill and slot indices are unchanged: a
slot means the same row in every layer, wherever that layer lives. Draft (NextN / MTP)
workers get their own plain :class:`~.device.DeviceDSAPool` (replicated on every rank).

Per forward (detected, as in the layerwise pool, by a new ``forward_metadata`` of the
``ascend_offload`` backend):

1. *history* = some real request has cached tokens (``seq_len - q_len > 0``: a decode
   step, a later prefill chunk, a radix-cache hit). Without history (a first prefill,
   SGLang's warm-up request, idle / dummy forwards with no metadata) nothing is
   broadcast: attention reads only rows this forward writes.
2. With history, the blocks the forward reads are the pages of every real request's
   cached positions (``req_to_token[row, :seq_len - q_len] // P``, unique). The
   first target layer's broadcast starts at once (on a worker thread, over a
   dedicated group with the TP group's ranks: gloo on CPU, the device backend
   elsewhere).
3. The first access of layer ``L`` (SGLang's ``layer_transfer_counter.wait_until``,
   called by every accessor; the indexer's ``set_index_k_buffer`` comes first) waits
   for ``L``'s broadcast and starts ``L + 1``'s.
4. The new rows are written after that wait: the owner writes them into its
   persistent bundle (it keeps the updated KV), the others into the scratch copy they
   compute with (overwritten by a later layer).

``broadcast: "full"`` sends whole bundles (every allocated block) instead.

Requirements (checked at startup by ``config.py`` ``kvpp.*`` and :mod:`...args.rules.kvpp`):
the ``ascend_offload`` backend, TP >= 2, no DP attention / PP / TBO / HiCache, not on
P/D nodes, eager or piecewise graphs.
"""

from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from .... import config as cfg
from ....kvpp.ownership import assign_owners
from ....kvpp.plan import ComponentSpec, KVPPPlan, plan_rank
from ....kvpp.runtime import BroadcastTransport, KVPPScheduler, KVPPStorage
from .device import DeviceDSAPool, LayerCounter

logger = logging.getLogger(__name__)

_STATS_LOG_INTERVAL_S = 30.0

__all__ = ["KVPPPool", "KVPPGroup", "KVPPStats", "build_kvpp_pool", "kvpp_components"]


@dataclass(frozen=True)
class KVPPGroup:
    """This rank's KVPP group: ``rank`` in ``0..size-1``, the global ranks of the
    members (index = KVPP rank), and the process group broadcasts run on (``None`` =
    the default group)."""

    rank: int
    size: int
    global_ranks: Tuple[int, ...]
    process_group: Any = None


@dataclass
class KVPPStats:
    """Cumulative numbers of the pool."""

    forwards: int = 0
    forwards_with_history: int = 0
    active_blocks: int = 0  # summed over forwards with history
    broadcasts: int = 0
    bytes_broadcast: int = 0
    bytes_received: int = 0
    history_flags: List[bool] = field(default_factory=list)  # last forwards (debug / tests)


def kvpp_components(
    page_size: int, kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: Optional[int], itemsize: int
) -> Tuple[ComponentSpec, ...]:
    """One layer's bundle per block (= KV page): latent, rope, indexer K (bytes)."""
    comps = [
        ComponentSpec("kv_latent", page_size * kv_lora_rank * itemsize),
        ComponentSpec("kv_rope", page_size * qk_rope_head_dim * itemsize),
    ]
    if index_head_dim:
        comps.append(ComponentSpec("index_k", page_size * index_head_dim * itemsize))
    return tuple(comps)


class KVPPPool(DeviceDSAPool):
    """KVPP pool (see module doc). Constructor arguments as SGLang's NPU MLA pool, plus
    ``kvpp`` (the feature config) and ``group`` (this rank's KVPP group)."""

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
        kvpp: cfg.KVPPConfig,
        group: KVPPGroup,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
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
        self.kvpp = kvpp
        self.group = group
        pages = size // page_size + 1
        self.num_blocks = pages
        self.slot_rows = pages * page_size
        itemsize = torch.tensor([], dtype=self.store_dtype).element_size()
        comps = kvpp_components(page_size, kv_lora_rank, qk_rope_head_dim, index_head_dim, itemsize)
        ownership = assign_owners(range(layer_num), group.size)
        self.plan: KVPPPlan = plan_rank(
            group.rank, ownership, {l: comps for l in range(layer_num)}, alignment=kvpp.scratch_alignment_bytes
        )
        self.storage = KVPPStorage(self.plan, pages, torch.device(device))
        self.transport = BroadcastTransport(
            self.storage, group=group.process_group, group_ranks=list(group.global_ranks)
        )
        self.scheduler = KVPPScheduler(self.transport, layers=list(range(layer_num)), prefetch=kvpp.prefetch)

        def views(name: str, width: int) -> List[torch.Tensor]:
            return [
                self.storage.component(l, name, self.store_dtype, (pages, page_size, 1, width))
                for l in range(layer_num)
            ]

        self.k_buffer = views("kv_latent", kv_lora_rank)
        self.v_buffer = views("kv_rope", qk_rope_head_dim)
        self.index_k_buffer = views("index_k", index_head_dim) if index_head_dim is not None else None
        self.layer_transfer_counter = LayerCounter(self)
        self.owned_layers = ownership.owned_by(group.rank)
        self.stats = KVPPStats()
        self._fwd_key = None
        self._entered = -1
        self._closed = False
        self._last_log = time.monotonic()
        logger.info(
            "KVPP rank %d/%d: owns layers %s of %d; allocated %d bytes (persistent %d, scratch 2 x %d); "
            "broadcast=%s prefetch=%s; slot rows %d",
            group.rank,
            group.size,
            list(self.owned_layers),
            layer_num,
            self.allocated_bytes,
            sum(t.numel() for t in self.storage.persistent.values()),
            self.storage.scratch[0].numel(),
            kvpp.broadcast,
            kvpp.prefetch,
            self.slot_rows,
        )
        atexit.register(self.close)

    # ------------------------------------------------------------------ sizes
    @property
    def allocated_bytes(self) -> int:
        """Bytes of every tensor storage this pool allocated (measured, deduplicated)."""
        seen, total = set(), 0
        for t in list(self.storage.persistent.values()) + list(self.storage.scratch):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def get_kv_size_bytes(self):
        return self.allocated_bytes

    # ------------------------------------------------------------------ forwards
    def _active_metadata(self):
        from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

        if not has_forward_context():
            return None, None
        backend = get_attn_backend()
        if getattr(backend, "token_to_kv_pool", None) is not self:
            raise RuntimeError(
                "KVPP pool accessed inside a forward of another attention backend "
                f"({type(backend).__name__}); the pool serves only its own backend"
            )
        return getattr(backend, "forward_metadata", None), backend

    def history_blocks(self, md, req_to_token: torch.Tensor) -> Optional[torch.Tensor]:
        """Sorted unique page ids of every real request's cached positions (int64, CPU),
        or ``None`` when no request has cached tokens (no history)."""
        real = md.real_requests
        rows = [int(r) for r in md.req_pool_indices[:real].tolist()]
        seqs = [int(s) for s in md.seq_lens_cpu_int[:real].tolist()]
        cached = [s - int(q) for s, q in zip(seqs, md.q_lens_cpu[:real])]
        parts = [req_to_token[row, :c] for row, c in zip(rows, cached) if c > 0]
        if not parts:
            return None
        slots = torch.cat(parts).to(device="cpu", dtype=torch.long)
        return torch.unique(torch.div(slots, self.page_size, rounding_mode="floor"))

    def _begin(self, md, backend) -> None:
        self.scheduler.complete_forward()
        self._entered = -1
        blocks = self.history_blocks(md, backend.req_to_token_pool.req_to_token)
        has_history = blocks is not None
        s = self.stats
        s.forwards += 1
        s.history_flags = (s.history_flags + [has_history])[-64:]
        if has_history:
            s.forwards_with_history += 1
            s.active_blocks += int(blocks.numel())
        self.scheduler.schedule_forward(has_history, None if self.kvpp.broadcast == "full" else blocks)
        n = s.forwards_with_history
        self._maybe_log(first=has_history and n & (n - 1) == 0)  # 1st, 2nd, 4th, 8th ... forward with history

    def _maybe_log(self, first: bool = False) -> None:
        now = time.monotonic()
        if not first and now - self._last_log < _STATS_LOG_INTERVAL_S:
            return
        self._last_log = now
        s, t = self.stats, self.transport
        logger.info(
            "KVPP rank %d stats: forwards=%d with_history=%d active_pages=%d of %d broadcasts=%d "
            "broadcast_bytes=%d received_bytes=%d",
            self.group.rank,
            s.forwards,
            s.forwards_with_history,
            s.active_blocks,
            self.num_blocks,
            t.broadcasts,
            t.bytes_broadcast,
            t.bytes_received,
        )

    def enter_layer(self, layer: int) -> None:
        """``layer`` (local id) is about to be read or written (``wait_until`` hook)."""
        md, backend = self._active_metadata()
        if md is None:
            return
        if md is not self._fwd_key:
            self._begin(md, backend)
            self._fwd_key = md
        if layer == self._entered:
            return
        if layer < self._entered:
            raise RuntimeError(
                f"KVPP pool: layer {layer} accessed after layer {self._entered} in one forward; "
                "layers must run in order (its scratch buffer may already hold a later layer)"
            )
        for skipped in range(self._entered + 1, layer + 1):  # keep the broadcast order on every rank
            self.scheduler.wait_for_layer(skipped)
        self._entered = layer
        t = self.transport
        self.stats.broadcasts, self.stats.bytes_broadcast, self.stats.bytes_received = (
            t.broadcasts,
            t.bytes_broadcast,
            t.bytes_received,
        )

    # ------------------------------------------------------------------ writes
    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor]):
        self.layer_transfer_counter.wait_until(layer.layer_id - self.start_layer)
        return super().set_kv_buffer(layer, loc_info, cache_k, cache_v)

    def set_index_k_buffer(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor):
        self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return super().set_index_k_buffer(layer_id, loc, index_k)

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        raise NotImplementedError(
            "KVPP keeps each layer on its owner rank; retraction to CPU copies is not supported by this pool"
        )

    def load_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("KVPP: load_cpu_copy is not supported")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._maybe_log(first=True)
            self.scheduler.close()
        except Exception:  # noqa: BLE001 - shutdown
            logger.exception("KVPP: error while closing the prefetch scheduler")


# ------------------------------------------------------------------ SGLang wiring
def tp_kvpp_group(device: str) -> KVPPGroup:
    """The KVPP group of this rank: SGLang's TP group, with a dedicated process group of
    the same ranks for the broadcasts (gloo on CPU, the default backend elsewhere), so
    the prefetch thread never interleaves with SGLang's own TP collectives."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    ranks = tuple(int(r) for r in tp.ranks)
    backend = "gloo" if torch.device(device).type == "cpu" else None
    pg = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
    return KVPPGroup(rank=int(tp.rank_in_group), size=len(ranks), global_ranks=ranks, process_group=pg)


def build_kvpp_pool(
    configurator: Any,
    kvpp: cfg.KVPPConfig,
    *,
    max_total_num_tokens: int,
    is_dsa_model: bool,
    group: Optional[KVPPGroup] = None,
) -> DeviceDSAPool:
    """:class:`KVPPPool` for SGLang's configurator (the pool hook); a draft worker's pool
    is a plain :class:`~.device.DeviceDSAPool` (draft layers are replicated)."""
    from .device import build_device_pool, pool_args

    if configurator.is_draft_worker:
        logger.info("KVPP: draft worker pool replicated on this rank (not partitioned)")
        return build_device_pool(configurator, max_total_num_tokens=max_total_num_tokens, is_dsa_model=is_dsa_model)
    args = pool_args(configurator, is_dsa_model=is_dsa_model)
    if group is None:
        group = tp_kvpp_group(args["device"])
    if group.size < 2:
        raise ValueError(f"KVPP needs a TP group of >= 2 ranks, this one has {group.size}")
    return KVPPPool(
        max_total_num_tokens,
        **args,
        kvpp=kvpp,
        group=group,
        start_layer=configurator.layer_info.start_layer,
        end_layer=configurator.layer_info.end_layer,
    )
