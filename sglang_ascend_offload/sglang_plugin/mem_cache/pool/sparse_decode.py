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
hot buffers            device    per layer ``[rows, hot_tokens, kv_lora_rank + rope]``
                                 (``sparse_decode.engine.SparseDecodeEngine``)
=====================  ========  ==============================================

The host pool is one per attention-DP group (``shared_host_pool.allocate_rank_pool``):
its attention-TP rank 0 creates and appends, the other ranks map the same memory (on an
NPU with attention TP > 1: reach rank 0's MemFabric memory through its global address)
and wait for rank 0's appends of a layer before reading it (:meth:`HostMainKVPool.host_rows`
/ :meth:`HostMainKVPool.read_host_rows`, the engine's gate); outside a server
(component tests) the pool is private.

There is no device main KV (``k_buffer`` / ``v_buffer`` are ``None``); code that
asks for it gets an error naming the offload. Rows of the decode engine are
``req_to_token`` rows (``req_pool_idx``), stable per request across steps.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

from .... import config as cfg
from .... import platform
from ....sparse_decode.engine import EngineConfig, SparseDecodeEngine
from ....sparse_decode.host_pool import HostPoolShape
from ....sparse_decode.host_rows import is_tensor_backed
from ....sparse_decode.op_selection import host_pool_rows, platform_of, select_for_config
from ...speculative.eagle import verify_rows_per_request
from ..pool_host.shared import EngineGate, allocate_rank_pool
from .device import DeviceDSAPool, _scatter_rows

logger = logging.getLogger(__name__)

# Fault injection (tests): with residency "adaptive", while the file named here exists no
# request is direct: the direct ones are demoted in place at their next step.
FORCE_DEMOTE_ENV = "SGLANG_ASCEND_OFFLOAD_TEST_FORCE_DEMOTE"


class HostMainKVPool(DeviceDSAPool):
    """Main KV in a :class:`HostKVPool`, index K on the device (see module doc).

    size / page_size / dtype / layer_num / device / start_layer / end_layer: as in
    SGLang's pools. rows: decode engine rows (``req_to_token`` rows).
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
        rows: int,
        top_k: int,
        offload: cfg.SparseDecodeOffloadConfig,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        host_pool_kind: str = "pinned",
        rows_per_request: int = 1,
    ):
        if index_head_dim is None:
            raise ValueError("sparse decode offload needs a DSA model (an indexer cache)")
        if dtype != torch.bfloat16:
            raise ValueError(f"sparse decode offload keeps a bf16 main KV; got {dtype} (use --kv-cache-dtype bfloat16)")
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

        pages = size // page_size + 1
        self.indexer_dtype = offload.indexer_dtype
        self._allocate_index_cache(layer_num, pages, page_size, index_head_dim, device)
        slots = pages * page_size
        tokens = offload.host_pool_tokens if offload.host_pool_tokens is not None else slots
        if tokens < slots:
            raise ValueError(
                f"host_pool_tokens={tokens} is smaller than SGLang's slot space ({slots} = "
                f"{size} tokens + one padding page): raise host_pool_tokens or lower "
                "--max-total-tokens"
            )
        # The fused Copy-SFA (NPU) registers each layer's slice: rows per layer 4 KiB-aligned.
        tokens = host_pool_rows(
            offload, tokens, (kv_lora_rank + qk_rope_head_dim) * dtype.itemsize, platform_of(device), rows_per_request
        )
        hot_tokens = resolved_hot_tokens(offload, top_k, rows_per_request)
        _require_memory(layer_num, rows, hot_tokens, tokens, kv_lora_rank + qk_rope_head_dim, device)
        # One pool per attention-DP group: TP rank 0 allocates and appends, the others map it
        # and wait for its appends before reading (shared_host_pool.py).
        rank_pool = allocate_rank_pool(
            HostPoolShape(
                layers=layer_num, tokens=tokens, latent_dim=kv_lora_rank, rope_dim=qk_rope_head_dim, dtype=dtype
            ),
            host_pool_kind,
        )
        self.host_pool, self.append_order = rank_pool.pool, rank_pool.order
        gate = EngineGate(rank_pool.order) if rank_pool.order is not None and rank_pool.rank > 0 else None
        # The fused indexer steps the residency contract's state in place: the managers hold
        # that state only (the torch implementation), not the CPU kernel's derived maps.
        fused_lim = select_for_config(
            offload,
            platform_of(device),
            rows_per_request=rows_per_request,
            hot_tokens=hot_tokens,
            top_k=top_k,
            available=lambda op: None,
        ).indexer.fused
        self.engine = SparseDecodeEngine(
            EngineConfig(
                layers=layer_num,
                rows=rows,
                hot_tokens=hot_tokens,
                top_k=top_k,
                latent_dim=kv_lora_rank,
                rope_dim=qk_rope_head_dim,
                dtype=dtype,
                policy=offload.policy,
                ops=offload.ops,
                rows_per_request=rows_per_request,
                verify_sample_rate=offload.verify_sample_rate,
                verify_action=offload.verify_action,
                fused_copy_sfa=offload.fused_copy_sfa,
                fused_lim=offload.fused_lim,
                caller_runs_indexer=True,
                manage_impl="torch" if fused_lim else "auto",
                indexer_dtype=offload.indexer_dtype,
                residency=offload.residency,
            ),
            self.host_pool,
            device=device if not str(device).startswith("cpu") else "cpu",
            tp_rank=rank_pool.rank,
            gate=gate,
        )
        if self.engine.direct is not None and os.environ.get(FORCE_DEMOTE_ENV):
            flag = os.environ[FORCE_DEMOTE_ENV]
            self.engine.direct.hold = lambda: os.path.exists(flag)
            logger.warning(
                "%s=%s: while that file exists no request is direct (test fault injection)", FORCE_DEMOTE_ENV, flag
            )
        self.offload = offload
        self._finalize_allocation_log(size)
        logger.info(
            "sparse decode offload: host pool %.1f MiB (%d slots x %d layers), hot buffers %.1f MiB "
            "(%d rows x %d slots x %d layers%s), index K %s, residency %s",
            self.host_pool.shape.nbytes / 2**20,
            tokens,
            layer_num,
            self.engine.hot.nbytes / 2**20,
            rows,
            hot_tokens,
            layer_num,
            f"; one per request, shared by its {rows_per_request} verify rows" if rows_per_request > 1 else "",
            self.index_cache_summary(),
            f"adaptive (a request whose context fits its {hot_tokens} slots, or those of idle request slots "
            "it borrows, is served from them directly)"
            if offload.residency == "adaptive"
            else "always",
        )

    def _allocate_index_cache(self, layers: int, pages: int, page_size: int, dim: int, device: str) -> None:
        """The device index-K cache ``[layers, pages, page_size, 1, dim]``: bf16, or int8
        (Hadamard-rotated, LIM-C8) with fp16 per-token scales ``[layers, pages, page_size, 1]``."""
        if self.indexer_dtype == "int8":
            if dim & (dim - 1):
                raise ValueError(
                    f"indexer_dtype int8 needs a power-of-two index_head_dim for the Hadamard "
                    f"rotation; the model has {dim}"
                )
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
        rows = self.host_rows(layer_id)
        blocks = rows.shape[0] // self.page_size
        return rows[: blocks * self.page_size].view(blocks, self.page_size, rows.shape[-1])

    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor]):
        """Append the new tokens' rows ``[T, latent + rope]`` to the host pool at their slots."""
        loc, _, _ = unwrap_write_loc(loc_info)
        if cache_v is None:
            rows = cache_k.reshape(-1, self.kv_lora_rank + self.qk_rope_head_dim)
        else:
            rows = torch.cat(
                (cache_k.reshape(-1, self.kv_lora_rank), cache_v.reshape(-1, self.qk_rope_head_dim)), dim=-1
            )
        self.engine.append(layer.layer_id - self.start_layer, loc, rows.to(self.dtype))  # TP rank 0 only
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
        for layer, rows in enumerate(kv_cache_cpu.main):
            self.engine.append(layer, slots, rows.to(self.dtype))
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


def resolved_hot_tokens(offload: cfg.SparseDecodeOffloadConfig, top_k: int, rows_per_request: int) -> int:
    """Hot slots per layer and request: ``hot_tokens``, or its default for ``top_k`` and
    the verify rows that share a request's buffer."""
    if offload.hot_tokens is not None:
        return int(offload.hot_tokens)
    return cfg.default_hot_tokens(top_k, None, rows_per_request=rows_per_request)


def _require_memory(layers: int, rows: int, hot_tokens: int, tokens: int, row_dim: int, device: str) -> None:
    """The exact hot buffers and host pool against the memory available now, before
    either is allocated (the startup check estimated them from the arguments; here the
    request pool's rows are known). Raises :class:`ConfigError` with the numbers."""
    from .... import memory_budget

    row_bytes = row_dim * 2  # bf16
    items = [
        memory_budget.Allocation(
            "hot buffers",
            "device",
            layers * (rows + 1) * hot_tokens * row_bytes,
            f"{layers} layers x ({rows} rows + 1 padding row) x {hot_tokens} hot_tokens x {row_bytes} B",
            "hot_tokens or --max-running-requests",
        ),
        memory_budget.Allocation(
            "host pool",
            "host",
            layers * tokens * row_bytes,
            f"{layers} layers x {tokens} tokens x {row_bytes} B",
            "host_pool_tokens or --max-total-tokens",
        ),
    ]
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
    rows: int,
) -> HostMainKVPool:
    """:class:`HostMainKVPool` for SGLang's configurator and the validated ``offload``
    section (called by the pool hook, ``features.build_pool_around``)."""
    from .device import pool_args

    if not is_dsa_model:
        raise ValueError("sparse decode offload needs a DSA model (DeepSeek-V3.2 style)")
    mc = configurator.model_config
    if configurator.is_draft_worker:  # the NextN / MTP draft layer: device KV (speculative.py)
        from ...speculative.eagle import build_draft_pool

        return build_draft_pool(configurator, max_total_num_tokens=max_total_num_tokens, is_dsa_model=is_dsa_model)
    kind = "pinned" if platform.device_kind() != "npu" else "memfabric"
    return HostMainKVPool(
        max_total_num_tokens,
        **pool_args(configurator, is_dsa_model=True),
        rows=rows,
        rows_per_request=verify_rows_per_request(),  # MTP verify rows share their request's hot buffer
        top_k=int(mc.hf_config.index_topk),
        offload=offload,
        start_layer=configurator.layer_info.start_layer,
        end_layer=configurator.layer_info.end_layer,
        host_pool_kind=kind,
    )
