"""``--device-kv-budget``: a cap on the device bytes of SGLang's KV pool, and CPU servers
that account like a device of that size.

SGLang sizes its KV pool from ``B``, the device memory that ``--mem-fraction-static``
leaves after the weights (``KVCacheConfigurator._profile_available_bytes``). With the
budget given, ``B`` is the smaller of the two (:func:`profile_after`, an AFTER hook):
on an NPU a way to leave HBM to something else; on a CPU the way to give two servers the
same device budget, whatever the machine's free memory is when each starts.

On a CPU host and "device" are one memory, so without the budget a sparse decode
offload server pays its host pool from the same ``B`` (SGLang's full per-token cell).
With the budget the CPU server accounts as a device node would (:func:`cpu_cell_bytes`):

==========================  ===============================================  ==========
pool (ascend_offload)       device bytes per token                           host pool
==========================  ===============================================  ==========
device KV (no offload)      ``layers x (latent + rope + index_head_dim) x 2``  none
sparse decode offload       ``layers x index_head_dim x 2`` (+ hot buffers,    outside B
                            drawn from ``B`` by :mod:`.sparse_decode`);
                            ``indexer_dtype: "int8"``: ``layers x
                            (index_head_dim + 2)`` (int8 keys + an fp16 scale)
==========================  ===============================================  ==========

(bf16 index K, or the int8 + fp16-scale cache of the sparse decode pool: the plugin's
pools keep SGLang's NPU layout; SGLang's own CPU figure assumes an fp8 indexer with
scales, which these pools do not allocate; :func:`index_k_bytes_per_token`.) So
``max_total_num_tokens`` of two such servers compares what the same device memory
holds with and without offload.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ....memory_budget import format_bytes
from ....model_specs import INT8_SCALE_BYTES
from ...args import carrier

logger = logging.getLogger(__name__)

__all__ = ["budget_bytes", "profile_after", "emulates_device", "cpu_cell_bytes", "index_k_bytes_per_token"]

BF16_BYTES = 2


def budget_bytes() -> Optional[int]:
    """The configured budget (``OffloadConfig.device_kv_budget_bytes``), or ``None``."""
    return carrier.active_config().device_kv_budget_bytes


def profile_after(available: int, self: Any, pre_model_load_memory: Any) -> Optional[int]:
    """AFTER ``KVCacheConfigurator._profile_available_bytes``: ``min(SGLang's B, budget)``."""
    cap = budget_bytes()
    if cap is None:
        return None
    if int(available) <= cap:
        logger.info(
            "device KV budget: --mem-fraction-static leaves %s, under --device-kv-budget %s: using it",
            format_bytes(int(available)),
            format_bytes(cap),
        )
        return None
    logger.info(
        "device KV budget: %s (--device-kv-budget; --mem-fraction-static would leave %s)",
        format_bytes(cap),
        format_bytes(int(available)),
    )
    return int(cap)


def emulates_device(kvc: Any) -> bool:
    """A CPU server with the budget: it accounts its KV like a device of that size."""
    return budget_bytes() is not None and str(getattr(kvc, "device", "cpu")).startswith("cpu")


def index_k_bytes_per_token(index_head_dim: int, indexer_dtype: str = "bf16") -> int:
    """Device bytes of one token's index K in one layer: ``index_head_dim x 2`` (bf16), or
    ``index_head_dim + 2`` for the int8 cache (int8 keys + one fp16 dequantisation scale)."""
    if indexer_dtype == "bf16":
        return int(index_head_dim) * BF16_BYTES
    if indexer_dtype == "int8":
        return int(index_head_dim) + INT8_SCALE_BYTES
    raise ValueError(f"indexer dtype {indexer_dtype!r}: expected bf16 or int8")


def cpu_cell_bytes(kvc: Any, num_layers: int, offloaded: bool, indexer_dtype: str = "bf16") -> Optional[int]:
    """Device bytes per token of the plugin's DSA pool on an emulated device (module
    table); ``None`` for a model without an indexer (SGLang's figure stands).

    kvc: SGLang's KV cache configurator (its ``model_config``); num_layers: the pool's
    layers; offloaded: the main KV lives in the sparse decode host pool; indexer_dtype:
    its index-K cache's dtype (``bf16`` / ``int8``; the device KV pool is bf16).
    """
    mc = kvc.model_config
    index_head_dim = getattr(mc.hf_config, "index_head_dim", None)
    if index_head_dim is None:
        return None
    index_bytes = index_k_bytes_per_token(index_head_dim, indexer_dtype)
    row_bytes = (int(mc.kv_lora_rank) + int(mc.qk_rope_head_dim)) * BF16_BYTES
    per_layer = index_bytes if offloaded else row_bytes + index_bytes
    return int(num_layers) * per_layer
