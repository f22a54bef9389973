"""Let SGLang's memory profile see the smaller device KV of layerwise prefill offload.

SGLang sizes its slot space (``max_total_num_tokens``) from free device memory divided
by the KV bytes per token of *all* cache-bearing layers
(``model_executor/pool_configurator.py::DefaultPoolConfigurator._compute_cell_size``,
which already special-cases SGLang's own NPU sparse KV offload). With layerwise prefill
offload the device holds ``physical`` of ``N`` layer caches, so the per-token device
cost is ``cell * physical / N`` (the indexer follows its main buffer, so the same ratio
applies to it). An AROUND hook on ``_compute_cell_size`` applies that ratio when the
feature is on and the ``ascend_offload`` backend serves the model (a speculative draft
worker's single layer plans as one physical cache, so its size is unchanged, as its
device pool is); the same memory then holds
``N / physical`` times more tokens. ``--max-total-tokens`` still caps the result.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from .... import config as cfg
from ....layerwise_prefill.planner import TensorSpec, plan_buffers, uniform_specs
from ...args import carrier

logger = logging.getLogger(__name__)

__all__ = ["physical_layer_caches", "scaled_cell_size", "cell_size_after"]


def physical_layer_caches(lw: cfg.LayerwisePrefillOffloadConfig, num_layers: int) -> int:
    """How many layer caches the layerwise pool allocates for ``num_layers`` uniform layers."""
    specs = uniform_specs(num_layers, (TensorSpec((1, 1), "bfloat16"),))
    return plan_buffers(specs, lw.shared_buffers, lw.independent_layers).num_physical


def scaled_cell_size(cell: int, lw: cfg.LayerwisePrefillOffloadConfig, num_layers: int) -> int:
    """Per-token device KV bytes with layerwise offload (rounded up)."""
    if num_layers <= 0 or cell <= 0:
        return cell
    return -(-cell * physical_layer_caches(lw, num_layers) // num_layers)


def _applies(kvc: Any) -> Optional[cfg.LayerwisePrefillOffloadConfig]:
    return carrier.section_for_served_pool(kvc, "layerwise_prefill")


def cell_size_after(cell: int, self, kvc, num_layers: int) -> Optional[int]:
    """Per-token device KV bytes with layerwise prefill offload: only the physical layer
    caches (shared buffers + independent layers) take device memory; ``None`` (SGLang's
    ``cell``) when the feature does not serve this pool."""
    lw = _applies(kvc)
    if lw is None:
        return None
    scaled = scaled_cell_size(cell, lw, int(num_layers))
    logger.info(
        "layerwise prefill offload: device KV per token %d B instead of %d B (%d of %d layer caches)",
        scaled,
        cell,
        physical_layer_caches(lw, int(num_layers)),
        num_layers,
    )
    return scaled
