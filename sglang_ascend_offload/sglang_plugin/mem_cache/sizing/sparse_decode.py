"""One device budget for sparse decode offload: SGLang's KV pool and the hot buffers.

SGLang sizes its KV pool from a byte budget ``B``: the device memory free after the
weights, less the slack that ``--mem-fraction-static`` leaves for activations and graphs
(``KVCacheConfigurator._resolve_memory_pool_config``: profile, size the token pool from
``B``, derive ``max_running_requests`` from the tokens, finalize). Sparse decode offload
adds, per request slot, a hot buffer of ``layers x hot_tokens x row bytes`` on the device.
Sized as ``max_running_requests x hot_tokens`` outside ``B`` they can take far more than
the machine has (2,049 default rows x 4,096 slots x 2 layers x 1,152 B = 18 GiB on the
tiny fixture) and, on an NPU, the HBM SGLang keeps for activations.

So the plugin resolves the pool config itself when its sparse decode pool is served
(:func:`resolve_pool_config_around`, the same four steps as SGLang with the split in the
middle):

1. ``B`` from SGLang's profile;
2. the requests SGLang would run: ``--max-running-requests`` (per attention-DP worker)
   or SGLang's own default for a pool sized from the whole ``B``;
3. :func:`plan_device_budget`: the token pool keeps what it needs first (the user's
   ``--max-total-tokens``, else one full context), the hot buffers of as many of those
   requests as fit take the rest, and ``max_running_requests`` is capped to them
   (logged, as SGLang logs its own caps); not even one request fitting is a
   :class:`~sglang_ascend_offload.config.ConfigError` with the numbers;
4. SGLang sizes the token pool from ``B`` less the hot buffers and finalizes.

Per-token device bytes (:func:`cell_size_after`): on an NPU the main KV lives in the
host pool, so the device holds only the indexer's K per token and SGLang's MLA cell
(latent + rope + indexer) shrinks to its indexer part (with ``indexer_dtype: "int8"``
the int8 keys + fp16 scales, ``index_head_dim + 2`` bytes per layer); the same budget then holds
``cell / indexer`` times more tokens. On a CPU host and device are one memory and the
host pool is paid from it too, so the cell stays SGLang's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from .... import config as cfg
from ....memory_budget import format_bytes
from ...args import carrier
from ...compat import field
from . import device_kv_budget

POOL_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"

logger = logging.getLogger(__name__)

__all__ = [
    "DeviceBudgetPlan",
    "plan_device_budget",
    "hot_bytes_per_request",
    "resolve_pool_config_around",
    "cell_size_after",
]

RULE = "memory.device_budget"
BF16_BYTES = 2


@dataclass(frozen=True)
class DeviceBudgetPlan:
    """How SGLang's KV byte budget is split between its token pool and the hot buffers.

    budget_bytes: ``B``. hot_bytes_per_request: one request slot's hot buffers over all
    layers. extra_rows: hot buffers beyond the running requests (SGLang's padding request
    row, the engine's sink row, a P/D decode's pre-allocation rows). requested_requests:
    what SGLang would run. max_running_requests: what gets hot buffers (<= requested).
    hot_buffer_bytes: ``(max_running_requests + extra_rows) x hot_bytes_per_request``.
    token_budget_bytes: ``B - hot_buffer_bytes``, what SGLang sizes its token pool from.
    reserved_token_bytes: what the token pool was guaranteed before the hot buffers.
    """

    budget_bytes: int
    hot_bytes_per_request: int
    extra_rows: int
    requested_requests: int
    max_running_requests: int
    hot_buffer_bytes: int
    token_budget_bytes: int
    reserved_token_bytes: int

    @property
    def capped(self) -> bool:
        return self.max_running_requests < self.requested_requests


def hot_bytes_per_request(layers: int, hot_tokens: int, row_dim: int) -> int:
    """Bytes of one request slot's hot buffers: ``layers x hot_tokens x row_dim`` bf16."""
    return int(layers) * int(hot_tokens) * int(row_dim) * BF16_BYTES


def plan_device_budget(
    budget_bytes: int,
    hot_bytes_per_request: int,
    requested_requests: int,
    reserved_token_bytes: int,
    extra_rows: int = 2,
) -> DeviceBudgetPlan:
    """Split ``budget_bytes`` between the token pool and the hot buffers (module docstring).

    The token pool keeps ``reserved_token_bytes`` (capped at the budget); of the rest,
    the hot buffers of ``min(requested, fitting)`` requests plus ``extra_rows``. Raises
    :class:`ConfigError` when not even one request's hot buffers fit.
    """
    if hot_bytes_per_request <= 0 or requested_requests < 1 or extra_rows < 0:
        raise ValueError(
            f"plan_device_budget: hot_bytes_per_request={hot_bytes_per_request}, "
            f"requested_requests={requested_requests}, extra_rows={extra_rows}"
        )
    budget = max(int(budget_bytes), 0)
    reserved = min(max(int(reserved_token_bytes), 0), budget)
    fitting = (budget - reserved) // hot_bytes_per_request - extra_rows
    granted = min(int(requested_requests), int(fitting))
    if granted < 1:
        need = (1 + extra_rows) * hot_bytes_per_request
        raise cfg.ConfigError(
            [
                cfg.Violation(
                    RULE,
                    f"not even one request's hot buffers fit the device KV budget: {format_bytes(budget)} budget "
                    f"- {format_bytes(reserved)} kept for the token pool leaves {format_bytes(budget - reserved)}, "
                    f"and one request needs {format_bytes(need)} ({1 + extra_rows} rows incl. padding x "
                    f"{format_bytes(hot_bytes_per_request)} of hot buffers per row)",
                    "lower hot_tokens, raise --mem-fraction-static, or lower --max-total-tokens",
                )
            ],
            "sparse decode offload device budget",
        )
    hot = (granted + extra_rows) * hot_bytes_per_request
    return DeviceBudgetPlan(
        budget_bytes=budget,
        hot_bytes_per_request=hot_bytes_per_request,
        extra_rows=extra_rows,
        requested_requests=int(requested_requests),
        max_running_requests=granted,
        hot_buffer_bytes=hot,
        token_budget_bytes=budget - hot,
        reserved_token_bytes=reserved,
    )


# ------------------------------------------------------------------ SGLang side
def _served(kvc: Any) -> Optional[cfg.SparseDecodeOffloadConfig]:
    """The sparse decode config when ``kvc`` builds the plugin's offload pool (the pool
    hook builds a layerwise or KVPP pool instead when one of those is configured)."""
    active = carrier.active_config()
    if active.layerwise_prefill is not None or active.kvpp is not None:
        return None
    return carrier.section_for_served_pool(kvc, "sparse_decode")


def _plugin_main_pool(kvc: Any) -> bool:
    """``kvc`` builds the plugin's own main MLA pool (device KV or sparse decode offload;
    the layerwise and KVPP pools size themselves)."""
    active = carrier.active_config()
    if active.layerwise_prefill is not None or active.kvpp is not None:
        return False
    return carrier.serves_plugin_pool(kvc)


def _on_cpu(kvc: Any) -> bool:
    return str(getattr(kvc, "device", "cpu")).startswith("cpu")


def _hot_bytes(kvc: Any, sd: cfg.SparseDecodeOffloadConfig) -> int:
    from ...speculative.eagle import verify_rows_per_request
    from ..pool.sparse_decode import resolved_hot_tokens

    mc = kvc.model_config
    layers = kvc.layer_info.end_layer - kvc.layer_info.start_layer
    hot = resolved_hot_tokens(sd, int(mc.hf_config.index_topk), verify_rows_per_request())
    return hot_bytes_per_request(layers, hot, int(mc.kv_lora_rank) + int(mc.qk_rope_head_dim))


def _extra_rows(kvc: Any) -> int:
    """Hot buffers beyond the running requests: SGLang's request pool has one padding row
    (and, on a P/D decode, its pre-allocation rows); the engine adds one sink row."""
    from sglang.srt.runtime_context import get_disagg

    disagg = get_disagg()
    extra = disagg.disaggregation_decode_extra_slots if disagg.disaggregation_mode == "decode" else 0
    return 1 + int(extra) + 1


def resolve_pool_config_around(original, self, pre_model_load_memory):
    """AROUND ``KVCacheConfigurator._resolve_memory_pool_config``: SGLang's resolution
    with the hot buffers drawn from the same budget (module docstring)."""
    sd = _served(self)
    if sd is None:
        return original(self, pre_model_load_memory)
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_schedule

    budget = self._profile_available_bytes(pre_model_load_memory)
    whole = self.config_from_budget(budget)
    requested = self.resolve_max_num_reqs(whole.max_total_num_tokens)
    pool_configurator = create_memory_pool_configurator(self)
    cell = int(field(pool_configurator, POOL_CONFIGURATOR, "_cell_size"))
    user_tokens = get_schedule().max_total_tokens
    reserved_tokens = int(user_tokens) if user_tokens else int(self.model_config.context_len)
    plan = plan_device_budget(
        budget, _hot_bytes(self, sd), requested, reserved_tokens * cell, extra_rows=_extra_rows(self)
    )
    config = self.config_from_budget(plan.token_budget_bytes)
    config.max_running_requests = min(plan.max_running_requests, self.resolve_max_num_reqs(config.max_total_num_tokens))
    config = pool_configurator.finalize_with_max_running_requests(config)
    config.mem_fraction_static = get_schedule().mem_fraction_static
    message = (
        "sparse decode offload: device KV budget %s = token pool %d tokens x %d B + hot buffers %s "
        "(%d requests + %d rows x %s)"
    )
    values = (
        format_bytes(plan.budget_bytes),
        config.max_total_num_tokens,
        cell,
        format_bytes(plan.hot_buffer_bytes),
        plan.max_running_requests,
        plan.extra_rows,
        format_bytes(plan.hot_bytes_per_request),
    )
    logger.info(message, *values)
    if plan.capped:
        logger.warning(
            "sparse decode offload: max_running_requests capped from %d to %d: the hot buffers of "
            "%d requests (%s) do not fit the device KV budget (%s) next to the token pool; lower "
            "hot_tokens or raise --mem-fraction-static to run more",
            plan.requested_requests,
            plan.max_running_requests,
            plan.requested_requests,
            format_bytes((plan.requested_requests + plan.extra_rows) * plan.hot_bytes_per_request),
            format_bytes(plan.budget_bytes),
        )
    return config


def cell_size_after(cell: int, self, kvc, num_layers: int) -> Optional[int]:
    """AFTER ``DefaultPoolConfigurator._compute_cell_size``: off the CPU the device holds
    the indexer's K per token but not the main KV (it is in the host pool), so the cell is
    SGLang's own indexer cell. A CPU server with ``--device-kv-budget`` accounts like a
    device (:func:`.device_kv_budget.cpu_cell_bytes`), with or without offload."""
    emulated = None
    sd = _served(kvc)
    if device_kv_budget.emulates_device(kvc) and _plugin_main_pool(kvc):
        emulated = device_kv_budget.cpu_cell_bytes(
            kvc, num_layers, offloaded=sd is not None, indexer_dtype=sd.indexer_dtype if sd is not None else "bf16"
        )
    if emulated is not None:
        logger.info(
            "device KV per token %d B on this CPU accounted as a device (--device-kv-budget; SGLang's figure %d B)",
            emulated,
            cell,
        )
        return emulated
    if sd is None or _on_cpu(kvc):
        return None
    indexer = int(self._compute_dsa_indexer_cell_size(kvc=kvc, num_layers=num_layers))
    if not 0 < indexer < int(cell):
        return None  # not the MLA + indexer cell this reasons about: leave SGLang's
    if sd.indexer_dtype == "int8":  # the pool's int8 keys + fp16 scales, not SGLang's bf16 figure
        dim = int(kvc.model_config.hf_config.index_head_dim)
        indexer = int(num_layers) * device_kv_budget.index_k_bytes_per_token(dim, "int8")
    logger.info(
        "sparse decode offload: device KV per token %d B (the %s indexer) instead of %d B (the main KV "
        "is in the host pool)",
        indexer,
        sd.indexer_dtype,
        cell,
    )
    return indexer
