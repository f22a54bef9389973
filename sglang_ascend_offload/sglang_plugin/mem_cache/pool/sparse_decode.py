"""KV pool for sparse decode offload: main KV in the host pool, indexer on the device.

:class:`HostMainKVPool` keeps SGLang's slot space (the allocator's slots; page 0 is
padding), so the radix / prefix cache works unchanged: a prefix shared by two
requests is one set of slots, stored once in the host pool.

=====================  ========  ==============================================
buffer                 where     shape
=====================  ========  ==============================================
main KV (host pool)    host      ``[layers, slots, kv_lora_rank + rope]`` bf16
                                 (``sparse_decode.host_pool.HostKVPool``)
index K                device    ``[indexer layers, pages + 1, page, 1, index_head_dim]``
                                 (SGLang's NPU MLA layout, as in :class:`~.device.DeviceDSAPool`);
                                 bf16, or with ``indexer_dtype: "int8"`` (LIM-C8) int8
                                 Hadamard-rotated keys plus
index K scales         device    ``[indexer layers, pages + 1, page, 1]`` fp16, one
                                 dequantisation scale per token (int8 only;
                                 ``index_k_scale_buffer``, SGLang's NPU pool attribute)
hot buffers            device    per layer ``[hot_rows, hot_tokens, kv_lora_rank + rope]``
                                 and their residency tables, as the hot-buffer plan says
                                 (``sparse_decode/sizing.py``; ``engine.SparseDecodeEngine``)
=====================  ========  ==============================================

The host pool is one per attention-DP group (``shared_host_pool.allocate_rank_pool``):
its attention-TP rank 0 creates and appends, the other ranks map the same memory (on an
NPU with attention TP > 1: reach rank 0's MemFabric memory through its global address)
and wait for rank 0's appends of a layer before reading it (:meth:`HostMainKVPool.host_rows`
/ :meth:`HostMainKVPool.read_host_rows`, the engine's gate); outside a server
(component tests) the pool is private.

There is no device main KV (``k_buffer`` / ``v_buffer`` are ``None``); code that
asks for it gets an error naming the offload. The decode engine's hot rows are the
``req_to_token`` rows (``req_pool_idx``, stable per request across steps) and one sink row.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

from .... import config as cfg
from .... import platform
from ....sparse_decode.engine import EngineConfig, SparseDecodeEngine
from ....sparse_decode.host_pool import HostPoolShape
from ....sparse_decode.host_rows import is_tensor_backed
from ....sparse_decode.op_selection import host_pool_rows, platform_of, select_for_config
from ....sparse_decode.sizing import HotBufferPlan
from ...args.rules.sparse_decode import host_pool_tokens_violation, slot_space_of
from ..pool_host.shared import EngineGate, allocate_rank_pool
from ..sizing.sparse_decode import memory_allocations, served_hot_plan
from .device import DeviceDSAPool, _scatter_rows

logger = logging.getLogger(__name__)


class HostMainKVPool(DeviceDSAPool):
    """Main KV in a :class:`HostKVPool`, index K on the device (see module doc).

    size / page_size / dtype / layer_num / device / start_layer / end_layer: as in
    SGLang's pools. hot_plan: the resolved hot-buffer plan (``sparse_decode/sizing.py``):
    its ``hot_rows`` (one per ``req_to_token`` row + the sink row) x ``hot_tokens`` are
    what the engine allocates; the pool never sizes them itself. Its ``layers`` and
    ``row_dim`` are this pool's ``layer_num`` and ``kv_lora_rank + qk_rope_head_dim``.

    Invariants the launch validation established (its rules, not re-checked here): a DSA
    model (``index_head_dim`` set: ``sparse_decode.model``, ``sglang.model_config``), a
    bf16 main KV (``sparse_decode.main_kv_dtype``), a power-of-two ``index_head_dim``
    with ``indexer_dtype: "int8"`` (``sparse_decode.indexer_int8_head_dim``). The one
    rule only SGLang's KV-pool sizing can decide, ``host_pool_tokens`` against its slot
    space, is applied here (``sparse_decode.host_pool_tokens``).
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
        hot_plan: HotBufferPlan,
        offload: cfg.SparseDecodeOffloadConfig,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        host_pool_kind: str = "pinned",
    ):
        _check_plan_shape(hot_plan, layer_num, kv_lora_rank + qk_rope_head_dim)
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
        self.k_buffer = None
        self.v_buffer = None
        self.hot_plan = hot_plan
        self.offload = offload
        pages = size // page_size + 1
        self.indexer_dtype = offload.indexer_dtype
        self._allocate_index_cache(layer_num, pages, page_size, index_head_dim, device)
        row_bytes = hot_plan.row_dim * dtype.itemsize
        host_slots = _host_pool_slots(offload, size, page_size, row_bytes, device, hot_plan.verify_rows)
        _require_memory(hot_plan, host_slots, device)
        # One pool per attention-DP group: TP rank 0 allocates and appends, the others map it
        # and wait for its appends before reading (shared_host_pool.py).
        rank_pool = allocate_rank_pool(
            HostPoolShape(
                layers=layer_num, tokens=host_slots, latent_dim=kv_lora_rank, rope_dim=qk_rope_head_dim, dtype=dtype
            ),
            host_pool_kind,
        )
        self.host_pool, self.append_order = rank_pool.pool, rank_pool.order
        self.engine = _build_engine(hot_plan, offload, self.host_pool, device, rank_pool)
        self._finalize_allocation_log(size)
        self._log_allocation(host_slots)

    def _log_allocation(self, host_slots: int) -> None:
        """One log line: the host pool, the hot buffers as planned, the index-K cache, the residency."""
        plan = self.hot_plan
        logger.info(
            "sparse decode offload: host pool %.1f MiB (%d slots x %d layers), hot buffers and residency "
            "tables %.1f MiB (%s), index K %s, residency %s",
            self.host_pool.shape.nbytes / 2**20,
            host_slots,
            plan.layers,
            plan.device_bytes / 2**20,
            plan.formula(),
            self.index_cache_summary(),
            f"adaptive (a request whose context fits its {plan.hot_tokens} slots, or those of idle request "
            "slots it borrows, is served from them directly)"
            if self.offload.residency == "adaptive"
            else "always",
        )

    def _allocate_index_cache(self, layers: int, pages: int, page_size: int, dim: int, device: str) -> None:
        """The device index-K cache ``[layers, pages, page_size, 1, dim]``: bf16, or int8
        (Hadamard-rotated, LIM-C8) with fp16 per-token scales ``[layers, pages, page_size, 1]``."""
        if self.indexer_dtype == "int8":  # a power-of-two dim (sparse_decode.indexer_int8_head_dim)
            self.index_k_buffer = torch.zeros((layers, pages, page_size, 1, dim), dtype=torch.int8, device=device)
            self.index_k_scale_buffer = torch.zeros((layers, pages, page_size, 1), dtype=torch.float16, device=device)
        else:
            self.index_k_buffer = torch.zeros((layers, pages, page_size, 1, dim), dtype=self.store_dtype, device=device)

    def index_cache_summary(self) -> str:
        """One log phrase for the index-K cache: dtype, bytes per token and layer, MiB, device."""
        per_token = self.index_k_buffer[0, 0, 0].nbytes
        total = self.index_k_buffer.nbytes
        if self.index_k_scale_buffer is not None:
            per_token += self.index_k_scale_buffer[0, 0, 0].nbytes
            total += self.index_k_scale_buffer.nbytes
            return (
                f"int8 + fp16 scales (Hadamard-rotated, LIM-C8): {per_token} B per token and layer, "
                f"{total / 2**20:.1f} MiB on {self.device}"
            )
        return f"bf16: {per_token} B per token and layer, {total / 2**20:.1f} MiB on {self.device}"

    # ------------------------------------------------------------------ main KV
    def _no_device_main_kv(self, what: str):
        raise RuntimeError(
            f"{what}: sparse decode offload keeps the main KV in the host pool "
            "(HostMainKVPool.host_pool); there is no device main KV cache"
        )

    def get_key_buffer(self, layer_id: int):
        self._no_device_main_kv("get_key_buffer")

    def get_value_buffer(self, layer_id: int):
        self._no_device_main_kv("get_value_buffer")

    def get_kv_buffer(self, layer_id: int):
        self._no_device_main_kv("get_kv_buffer")

    def get_contiguous_buf_infos(self):
        """P/D destination regions, in SGLang's ``(ptrs, byte lengths, item lengths)`` form.

        Main KV entries are the host pool's layers (one item = one page of rows,
        ``page_size * (latent + rope)`` elements); then the index-K layers (device),
        then, for the int8 cache, their fp16 scales, as in SGLang's NPU MLA pool. The
        ``ascend_offload`` transfer backend builds its layout from :meth:`host_page_blocks`,
        ``index_k_buffer`` and ``index_k_scale_buffer`` directly; SGLang uses these
        numbers for its registration message and bookkeeping.
        """
        mains = [self.host_page_blocks(lid) for lid in self.model_layer_ids]
        index = [self.index_k_buffer[self._get_indexer_slot(lid)] for lid in self.model_layer_ids]
        if self.index_k_scale_buffer is not None:
            index += [self.index_k_scale_buffer[self._get_indexer_slot(lid)] for lid in self.model_layer_ids]
        entries = mains + index
        return ([t.data_ptr() for t in entries], [t.nbytes for t in entries], [t[0].nbytes for t in entries])

    def host_page_blocks(self, layer_id: int) -> torch.Tensor:
        """``[blocks, page_size, latent + rope]`` view of ``layer_id``'s host rows.

        Block ``b`` holds the rows of slots ``b * page_size .. (b + 1) * page_size - 1``,
        i.e. SGLang's page ``b``: a P/D transfer writes a whole page of a layer's main
        KV into the host pool as one contiguous block (no device copy on the way).
        """
        layer_rows = self.host_rows(layer_id)
        blocks = layer_rows.shape[0] // self.page_size
        return layer_rows[: blocks * self.page_size].view(blocks, self.page_size, layer_rows.shape[-1])

    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor]):
        """Append the new tokens' rows ``[T, latent + rope]`` to the host pool at their slots."""
        loc, _, _ = unwrap_write_loc(loc_info)
        if cache_v is None:
            kv_rows = cache_k.reshape(-1, self.kv_lora_rank + self.qk_rope_head_dim)
        else:
            kv_rows = torch.cat(
                (cache_k.reshape(-1, self.kv_lora_rank), cache_v.reshape(-1, self.qk_rope_head_dim)), dim=-1
            )
        self.engine.append(layer.layer_id - self.start_layer, loc, kv_rows.to(self.dtype))  # TP rank 0 only
        if self.append_order is not None:  # rank 0: publish the rows; others: count the append
            self.append_order.appended(layer.layer_id - self.start_layer)

    def host_rows(self, layer_id: int) -> torch.Tensor:
        """``[slots, latent + rope]`` host rows of ``layer_id``; on a TP rank > 0 of a shared
        pool, after TP rank 0 published every append of the layer this rank has seen.
        A pool without a tensor view (NPU, attention TP > 1: the MemFabric group pool)
        has none: use :meth:`read_host_rows`."""
        if not is_tensor_backed(self.host_pool):
            raise RuntimeError(
                f"layer {layer_id}: the MemFabric group host pool (NPU, attention TP > 1) is reached "
                "through global addresses and has no tensor view; this path needs one (decode "
                "graphs, a P/D transfer into the host pool) and is not served with it"
            )
        if self.append_order is not None:
            self.append_order.wait_readable(layer_id - self.start_layer)
        return self.host_pool.layer(layer_id - self.start_layer)

    def read_host_rows(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """``[n, latent + rope]`` host copy of the rows at ``slots`` of ``layer_id`` (any
        host pool; on a TP rank > 0 of a shared pool after TP rank 0's appends)."""
        if self.append_order is not None:
            self.append_order.wait_readable(layer_id - self.start_layer)
        return self.host_pool.read_rows(layer_id - self.start_layer, slots)

    # ------------------------------------------------------------------ retraction (P/D decode)
    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """Retraction backup of the KV at slots ``indices``: the host rows (a host-to-host copy;
        on any device) and the device index K (:class:`~..retraction.RetractedKV`)."""
        from ..retraction import RetractedKV, index_rows, index_scale_rows, slot_tensor

        slots = slot_tensor(indices, "cpu")
        main = [self.read_host_rows(lid, slots).to("cpu") for lid in self.model_layer_ids]
        return RetractedKV(int(slots.numel()), main, index_rows(self, slots), index_scale_rows(self, slots))

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        """Write a :meth:`get_cpu_copy` backup into slots ``indices`` through the host pool's
        append (TP rank 0 writes; every rank counts the append, as for a forward's)."""
        from ..retraction import restore_index_rows, slot_tensor

        slots = slot_tensor(indices, "cpu")
        kv_cache_cpu.check_restore(slots)
        for layer, kv_rows in enumerate(kv_cache_cpu.main):
            self.engine.append(layer, slots, kv_rows.to(self.dtype))
            if self.append_order is not None:
                self.append_order.appended(layer)
        restore_index_rows(self, kv_cache_cpu, slots)
        return None

    def get_kv_size_bytes(self):
        """Device bytes of the index-K cache (and its scales with an int8 indexer)."""
        scales = self.index_k_scale_buffer.nbytes if self.index_k_scale_buffer is not None else 0
        return self.index_k_buffer.nbytes + scales

    def set_index_k_buffer(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor):
        """Store index-K rows ``[T, index_head_dim]`` in the cache's own dtype at ``loc``
        (bf16 keys into a bf16 cache). An int8 cache takes its keys through
        :meth:`store_index_k`, which also writes their scales; a bf16 key here would be
        cast to int8 without rotation or scale, so it is refused."""
        if self.index_k_scale_buffer is not None:
            raise TypeError(
                f"layer {layer_id}: the int8 index-K cache is written by store_index_k (rotate, "
                f"quantise, keys + scales); set_index_k_buffer got {index_k.dtype} rows"
            )
        if self._on_npu:
            return super().set_index_k_buffer(layer_id, loc, index_k)
        _scatter_rows(self.index_k_buffer[self._get_indexer_slot(layer_id)], loc, index_k)

    def write_index_rows(self, layer_id: int, loc: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Write stored int8 index-K rows ``values [n, D]`` and their fp16 ``scales [n]`` at
        ``loc`` as they are (a retraction restore: rows this cache held before)."""
        if self.index_k_scale_buffer is None or values.dtype != torch.int8 or scales.dtype != torch.float16:
            raise TypeError(
                f"layer {layer_id}: write_index_rows takes int8 rows + fp16 scales for the int8 "
                f"index-K cache; got {values.dtype} / {scales.dtype}"
            )
        slot = self._get_indexer_slot(layer_id)
        _scatter_rows(self.index_k_buffer[slot], loc, values)
        _scatter_rows(self.index_k_scale_buffer[slot], loc, scales)

    def store_index_k(self, layer_id: int, loc: torch.Tensor, key: torch.Tensor) -> None:
        """Store the new tokens' index keys ``key [T, index_head_dim]`` (bf16) at slots
        ``loc [T]``: as they are in a bf16 cache; in an int8 cache Hadamard-rotated and
        quantised per token (``ops.hadamard.rotate_and_quantize``: int8 ``[T, D]`` into
        ``index_k_buffer``, fp16 ``[T]`` into ``index_k_scale_buffer``)."""
        if self.index_k_scale_buffer is None:
            return self.set_index_k_buffer(layer_id, loc, key)
        from ....ops.hadamard import rotate_and_quantize

        values, scales = rotate_and_quantize(key.reshape(-1, key.shape[-1]))
        slot = self._get_indexer_slot(layer_id)
        _scatter_rows(self.index_k_buffer[slot], loc, values)
        _scatter_rows(self.index_k_scale_buffer[slot], loc, scales)


def _check_plan_shape(hot_plan: HotBufferPlan, layers: int, row_dim: int) -> None:
    """The hot-buffer plan was made for this pool's shape (a caller's invariant, not a rule)."""
    if (hot_plan.layers, hot_plan.row_dim) != (layers, row_dim):
        raise ValueError(
            f"hot-buffer plan for {hot_plan.layers} layers x {hot_plan.row_dim}-element rows given to a pool of "
            f"{layers} layers x {row_dim}: the plan must be built for this pool (sizing.sparse_decode.served_hot_plan)"
        )


def _host_pool_slots(
    offload: cfg.SparseDecodeOffloadConfig, size: int, page_size: int, row_bytes: int, device: str, verify_rows: int
) -> int:
    """Token slots of the host pool per layer: ``host_pool_tokens`` or SGLang's slot space
    (its ``size`` tokens in pages + one padding page), rounded up where the fused Copy-SFA
    registers each layer's slice (4 KiB-aligned)."""
    found = host_pool_tokens_violation(offload, size, page_size)
    if found is not None:
        raise cfg.ConfigError([found], "sparse decode offload host pool")
    slot_space = slot_space_of(size, page_size)
    host_slots = offload.host_pool_tokens if offload.host_pool_tokens is not None else slot_space
    return host_pool_rows(offload, host_slots, row_bytes, platform_of(device), verify_rows)


def _build_engine(
    hot_plan: HotBufferPlan, offload: cfg.SparseDecodeOffloadConfig, host_pool: Any, device: str, rank_pool: Any
) -> SparseDecodeEngine:
    """The decode engine over ``host_pool`` with the plan's hot rows and slots. Off TP rank 0
    it waits for rank 0's appends through the shared order (``EngineGate``)."""
    gate = EngineGate(rank_pool.order) if rank_pool.order is not None and rank_pool.rank > 0 else None
    # The fused indexer steps the residency contract's state in place: the managers hold
    # that state only (the torch implementation), not the CPU kernel's derived maps.
    fused_lim = select_for_config(
        offload,
        platform_of(device),
        rows_per_request=hot_plan.verify_rows,
        hot_tokens=hot_plan.hot_tokens,
        top_k=hot_plan.top_k,
        available=lambda op: None,
    ).indexer.fused
    return SparseDecodeEngine(
        EngineConfig(
            layers=hot_plan.layers,
            rows=hot_plan.req_slots,  # the engine adds the sink row: hot_plan.hot_rows in all
            hot_tokens=hot_plan.hot_tokens,
            top_k=hot_plan.top_k,
            latent_dim=host_pool.shape.latent_dim,
            rope_dim=host_pool.shape.rope_dim,
            dtype=host_pool.shape.dtype,
            policy=offload.policy,
            ops=offload.ops,
            rows_per_request=hot_plan.verify_rows,
            verify_sample_rate=offload.verify_sample_rate,
            verify_action=offload.verify_action,
            fused_copy_sfa=offload.fused_copy_sfa,
            fused_lim=offload.fused_lim,
            caller_runs_indexer=True,
            manage_impl="torch" if fused_lim else "auto",
            indexer_dtype=offload.indexer_dtype,
            residency=offload.residency,
        ),
        host_pool,
        device=device if not str(device).startswith("cpu") else "cpu",
        tp_rank=rank_pool.rank,
        gate=gate,
    )


def _require_memory(hot_plan: HotBufferPlan, host_slots: int, device: str) -> None:
    """The planned hot buffers and the host pool against the memory available now, before
    either is allocated (the startup check planned the smallest server; here the request
    slots are known). Raises :class:`ConfigError` with the numbers."""
    from .... import memory_budget

    items = memory_allocations(hot_plan, host_slots, "the host pool's slots")
    kind = "cpu" if str(device).startswith("cpu") else str(device).split(":")[0]
    problems = memory_budget.check(items, kind)
    if problems:
        raise cfg.ConfigError(problems, "sparse decode offload memory")


def build_offload_pool(
    configurator: Any,
    offload: cfg.SparseDecodeOffloadConfig,
    *,
    max_total_num_tokens: int,
    is_dsa_model: bool,
    req_to_token_pool: Any,
) -> HostMainKVPool:
    """:class:`HostMainKVPool` for SGLang's configurator and the validated ``offload``
    section (called by the pool hook, ``features.build_pool_around``), with the hot-buffer
    plan of SGLang's request pool ``req_to_token_pool`` (one hot row per request slot)."""
    from .device import pool_args

    if configurator.is_draft_worker:  # the NextN / MTP draft layer: device KV (speculative.py)
        from ...speculative.eagle import build_draft_pool

        return build_draft_pool(configurator, max_total_num_tokens=max_total_num_tokens, is_dsa_model=is_dsa_model)
    hot_plan = served_hot_plan(
        configurator,
        offload,
        running_requests=req_to_token_pool.size,
        pre_alloc_slots=req_to_token_pool.pre_alloc_size,
    )
    req_slots = int(req_to_token_pool.req_to_token.shape[0])
    if hot_plan.req_slots != req_slots:
        raise RuntimeError(
            f"SGLang's request pool has {req_slots} rows, the hot-buffer plan {hot_plan.rows_in_words()} "
            f"counts {hot_plan.req_slots} request slots: SGLang's ReqToTokenPool layout changed"
        )
    kind = "pinned" if platform.device_kind() != "npu" else "memfabric"
    return HostMainKVPool(
        max_total_num_tokens,
        **pool_args(configurator, is_dsa_model=True),
        hot_plan=hot_plan,
        offload=offload,
        start_layer=configurator.layer_info.start_layer,
        end_layer=configurator.layer_info.end_layer,
        host_pool_kind=kind,
    )
