"""KV pools of the ``ascend_offload`` attention backend.

:class:`DeviceDSAPool` is SGLang's NPU MLA pool layout
(``hardware_backend/npu/memory_pool_npu.py::NPUMLATokenToKVPool``) with writes that
run on any device, so the same backend serves DSA models on an NPU and on a CPU:

* ``k_buffer``       [layers, pages + 1, page_size, 1, kv_lora_rank]   latent (bf16)
* ``v_buffer``       [layers, pages + 1, page_size, 1, qk_rope_head_dim]  rope (bf16)
* ``index_k_buffer`` [indexer layers, pages + 1, page_size, 1, index_head_dim] (bf16)

Flat slot ``s`` (SGLang's allocator slot, page 0 is the padding page) is row ``s``
of ``buffer[layer].view(-1, D)``, so block tables are
``req_to_token[req, ::page_size] // page_size`` as on the NPU (PA_BSND layout).

The sparse-decode-offload pool (main KV in the host pool) is
:class:`~.sparse_decode.HostMainKVPool`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from sglang.srt.hardware_backend.npu.memory_pool_npu import NPUMLATokenToKVPool
from sglang.srt.mem_cache.memory_pool import KVCache, unwrap_write_loc

logger = logging.getLogger(__name__)


def _scatter_rows(buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """``buffer.view(-1, D)[loc] = rows`` (bit-exact; rows cast to the buffer dtype)."""
    width = buffer.shape[-1]
    flat = buffer.view(-1, width)
    flat[loc.to(device=flat.device, dtype=torch.long)] = rows.reshape(-1, width).to(
        device=flat.device, dtype=flat.dtype
    )


class LayerCounter:
    """SGLang's ``layer_transfer_counter`` protocol (``wait_until(local_layer)``, called by
    every accessor before a layer's buffer is read or written), served by a pool's
    ``enter_layer``: the layerwise prefill pool waits there for the layer's load, the
    KVPP pool for the layer's broadcast."""

    def __init__(self, pool: Any):
        self._pool = pool

    def wait_until(self, threshold: int) -> None:
        self._pool.enter_layer(threshold)


class DeviceDSAPool(NPUMLATokenToKVPool):
    """NPU-layout MLA/DSA pool whose writes are plain torch off the NPU.

    On an NPU the parent's ``torch_npu.npu_scatter_nd_update_`` writes are kept.
    Packed fp8 storage and the FIA NZ layout are NPU-only and rejected elsewhere.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_npu = str(self.device).startswith("npu")
        if not self._on_npu and (self.dsa_kv_cache_store_fp8 or self.use_fia_nz):
            raise ValueError(
                "packed fp8 DSA KV storage and the FIA NZ layout need an Ascend NPU; "
                "use --kv-cache-dtype bfloat16 and unset SGLANG_USE_FIA_NZ"
            )

    def _init_without_buffers(
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
        start_layer: Optional[int],
        end_layer: Optional[int],
    ) -> None:
        """Set every attribute SGLang reads on an NPU MLA/DSA pool, allocating nothing.

        For subclasses that place the main KV themselves (host pool, shared layer
        buffers) and so must not run the parent's allocating ``__init__``.
        """
        KVCache.__init__(
            self,
            size=size,
            page_size=page_size,
            dtype=dtype,
            layer_num=layer_num,
            device=device,
            enable_memory_saver=enable_memory_saver,
            start_layer=start_layer,
            end_layer=end_layer,
        )
        self._on_npu = str(device).startswith("npu")
        self.use_fia_nz = False
        self.dsa_kv_cache_store_fp8 = False
        self.enable_sparsity_driven_kv_offload = False
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank
        self.kr_cache_dim = qk_rope_head_dim
        self.index_head_dim = index_head_dim
        self.model_layer_ids = tuple(range(self.start_layer, self.start_layer + layer_num))
        self.indexer_layer_ids = self.model_layer_ids if index_head_dim is not None else ()
        self.num_indexer_layers = len(self.indexer_layer_ids)
        self.indexer_layer_id_to_slot = {lid: i for i, lid in enumerate(self.indexer_layer_ids)}
        self.index_page_size = page_size
        self.index_size = size
        self.index_page_padding = 1
        self.kv_page_padding = 1
        self.dcp_size, self.dcp_rank = 1, 0
        self.is_draft_worker = False
        self.custom_mem_pool = None
        self.index_k_scale_buffer = None
        self.indexer_hadamard_128 = None

    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor]):
        """Store latent ``cache_k`` [T, (1,) kv_lora_rank] and rope ``cache_v`` [T, (1,) rope]
        (or ``cache_k`` [T, (1,) kv_lora_rank + rope] with ``cache_v=None``) at ``loc``."""
        if self._on_npu:
            return super().set_kv_buffer(layer, loc_info, cache_k, cache_v)
        loc, _, _ = unwrap_write_loc(loc_info)
        if cache_v is None:
            cache_k, cache_v = cache_k.reshape(-1, self.kv_lora_rank + self.qk_rope_head_dim).split(
                [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
            )
        layer_index = layer.layer_id - self.start_layer
        _scatter_rows(self.k_buffer[layer_index], loc, cache_k)
        _scatter_rows(self.v_buffer[layer_index], loc, cache_v)

    def set_index_k_buffer(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor):
        """Store indexer keys ``index_k`` [T, index_head_dim] at ``loc``."""
        if self._on_npu:
            return super().set_index_k_buffer(layer_id, loc, index_k)
        _scatter_rows(self.index_k_buffer[self._get_indexer_slot(layer_id)], loc, index_k)

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """Retraction backup of the KV at slots ``indices`` (P/D decode,
        ``--disaggregation-decode-retraction-backup cpu_tensor``): SGLang's own NPU copy on an
        NPU, a :class:`~..retraction.RetractedKV` elsewhere."""
        if self._on_npu:
            return super().get_cpu_copy(indices, mamba_indices, req_pool_index)
        from ..retraction import RetractedKV, gather_rows, index_rows, slot_tensor

        slots = slot_tensor(indices, self.device)
        main = [
            torch.cat((gather_rows(self.k_buffer[i], slots), gather_rows(self.v_buffer[i], slots)), dim=-1)
            for i in range(self.layer_num)
        ]
        return RetractedKV(int(slots.numel()), main, index_rows(self, slots))

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        """Write a :meth:`get_cpu_copy` backup into slots ``indices`` (the resumed request's)."""
        if self._on_npu:
            return super().load_cpu_copy(kv_cache_cpu, indices, mamba_indices, req_pool_index)
        from ..retraction import restore_index_rows, slot_tensor

        slots = slot_tensor(indices, self.device)
        kv_cache_cpu.check_restore(slots)
        for i, rows in enumerate(kv_cache_cpu.main):
            latent, rope = rows.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            _scatter_rows(self.k_buffer[i], slots, latent)
            _scatter_rows(self.v_buffer[i], slots, rope)
        restore_index_rows(self, kv_cache_cpu, slots)
        return None


def pool_args(configurator: Any, *, is_dsa_model: bool) -> dict:
    """The constructor arguments every plugin pool takes from SGLang's configurator
    (page size, dtype, MLA dims, layers, device, memory saver, indexer dim)."""
    from sglang.srt.runtime_context import get_exec, get_schedule

    mc = configurator.model_config
    return dict(
        page_size=get_schedule().page_size,
        dtype=configurator.kv_cache_dtype,
        kv_lora_rank=mc.kv_lora_rank,
        qk_rope_head_dim=mc.qk_rope_head_dim,
        layer_num=configurator.layer_info.num_effective_layers,
        device=configurator.device,
        enable_memory_saver=get_exec().features.enable_memory_saver,
        index_head_dim=mc.index_head_dim if is_dsa_model else None,
    )


def build_device_pool(configurator: Any, *, max_total_num_tokens: int, is_dsa_model: bool) -> DeviceDSAPool:
    """:class:`DeviceDSAPool` with the parameters SGLang gives its NPU MLA pool
    (``KVCacheConfigurator._build_ascend_mla_kv_pool``)."""
    args = pool_args(configurator, is_dsa_model=is_dsa_model)
    return DeviceDSAPool(
        max_total_num_tokens,
        index_size=max_total_num_tokens,
        index_page_size=args["page_size"],
        is_draft_worker=configurator.is_draft_worker,
        start_layer=configurator.layer_info.start_layer,
        end_layer=configurator.layer_info.end_layer,
        **args,
    )
