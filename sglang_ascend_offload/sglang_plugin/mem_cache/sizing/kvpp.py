"""Let SGLang's memory profile see KVPP's per-rank KV footprint (:mod:`....kvpp.plan`).

SGLang sizes ``max_total_num_tokens`` as available bytes / per-token KV bytes of all
``L`` cache-bearing layers (``DefaultPoolConfigurator._compute_cell_size``). Under KVPP
a rank holds its owned layers' bundles plus two scratch buffers of the largest bundle,
so with SGLang's own per-layer cost ``cell / L`` (uniform DSA layers) the plan's
formula gives::

    per-token bytes = (owned + 2) * cell / L        owned = ceil(L / N), the most any rank owns

The largest share is used on every rank: SGLang takes the minimum free memory over the
ranks, and every TP rank must size the same slot space. An AFTER hook applies it when
KVPP is on and the ``ascend_offload`` backend serves the model (target workers only; a
draft worker keeps its replicated cost). The 2 MiB alignment of the scratch buffers
(at most 2 x 2 MiB) comes out of SGLang's runtime slack. ``--max-total-tokens`` still
caps the result.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from .... import config as cfg
from ....kvpp.plan import SCRATCH_BUFFER_COUNT
from ...args import carrier

logger = logging.getLogger(__name__)

__all__ = ["kvpp_layer_caches", "kvpp_cell_size", "cell_size_after"]


def kvpp_layer_caches(num_layers: int, group: int) -> int:
    """Layer bundles per token on the fullest rank: ``ceil(L / N)`` owned + 2 scratch."""
    return -(-num_layers // group) + SCRATCH_BUFFER_COUNT


def kvpp_cell_size(cell: int, num_layers: int, group: int) -> int:
    """Per-token KV bytes under KVPP (rounded up). More than ``cell`` when
    ``ceil(L / N) + 2 > L`` (few layers): the pool really allocates that much."""
    if num_layers <= 0 or cell <= 0 or group < 2:
        return cell
    return -(-cell * kvpp_layer_caches(num_layers, group) // num_layers)


def _applies(kvc: Any) -> Optional[cfg.KVPPConfig]:
    return carrier.section_for_served_pool(kvc, "kvpp")


def _group_size() -> int:
    from sglang.srt.distributed.parallel_state import get_tp_group

    return int(get_tp_group().world_size)


def cell_size_after(cell: int, self, kvc, num_layers: int) -> Optional[int]:
    """Per-token device KV bytes with KVPP (a rank's owned layers plus two scratch
    layers); ``None`` (SGLang's ``cell``) when KVPP does not serve this pool."""
    if _applies(kvc) is None:
        return None
    group = _group_size()
    scaled = kvpp_cell_size(cell, int(num_layers), group)
    if scaled > cell:
        logger.warning(
            "KVPP with %d layers over %d ranks holds %d owned + 2 scratch layer bundles per rank, more "
            "than the %d of the replicated pool: it lowers the token capacity",
            num_layers,
            group,
            kvpp_layer_caches(int(num_layers), group) - 2,
            num_layers,
        )
    logger.info(
        "KVPP: device KV per token %d B instead of %d B (%d of %d layer bundles per rank, group %d)",
        scaled,
        cell,
        kvpp_layer_caches(int(num_layers), group),
        num_layers,
        group,
    )
    return scaled


# ------------------------------------------------------------------ fixed KV budget (reproducible sizing)
BUDGET_ENV = "SGLANG_ASCEND_OFFLOAD_KV_BUDGET_BYTES"


def fixed_budget_around(original, self, pre_model_load_memory):
    """SGLang's KV byte budget replaced by ``$SGLANG_ASCEND_OFFLOAD_KV_BUDGET_BYTES``.

    On a CPU SGLang sizes the KV pool from the host's free memory, which other
    processes move between two measurements; with a fixed budget the same server
    arguments give the same ``max_total_num_tokens`` (used by the served KVPP test to
    compare capacities). Registered only when the variable is set.
    """
    budget = int(os.environ[BUDGET_ENV])
    logger.info("KV budget fixed by %s: %d bytes (SGLang's free-memory profile is not used)", BUDGET_ENV, budget)
    return budget


def fixed_budget_requested() -> bool:
    """``$SGLANG_ASCEND_OFFLOAD_KV_BUDGET_BYTES`` is set (then :func:`fixed_budget_around`
    is registered); raises ``ValueError`` when it is not a byte count."""
    text = os.environ.get(BUDGET_ENV)
    if not text:
        return False
    if not text.isdigit():
        raise ValueError(f"{BUDGET_ENV}={text!r} is not a byte count; unset it or give an integer")
    return True
