"""One device budget for sparse decode offload: SGLang's KV pool and the hot buffers.

SGLang sizes its KV pool from a byte budget ``B``: the device memory free after the
weights, less the slack that ``--mem-fraction-static`` leaves for activations and graphs
(``KVCacheConfigurator._resolve_memory_pool_config``: profile, size the token pool from
``B``, derive ``max_running_requests`` from the tokens, finalize). Sparse decode offload
adds, per request slot, a hot row on the device: ``layers x hot_tokens`` slots of hot
buffer and residency table, plus the fixed rows (padding slot, sink row, a P/D decode's
pre-allocation slots), all counted by the hot-buffer plan (``sparse_decode/sizing.py``).
Sized as ``max_running_requests x hot_tokens`` outside ``B`` they can take far more than
the machine has (2,050 hot rows for SGLang's default 2,048 requests x 4,096 slots x 2
layers x 1,164 B = 18 GiB on the tiny fixture) and, on an NPU, the HBM SGLang keeps for
activations.

So the plugin resolves the pool config itself when its sparse decode pool is served
(:func:`resolve_pool_config_around`, the same four steps as SGLang with the split in the
middle):

1. ``B`` from SGLang's profile;
2. the requests SGLang would run: ``--max-running-requests`` (per attention-DP worker)
   or SGLang's own default for a pool sized from the whole ``B``;
3. :func:`plan_device_budget`: the token pool keeps what it needs first (the user's
   ``--max-total-tokens``, else one full context), the hot rows of as many of those
   requests as fit (:func:`served_hot_plan`, the plan the pool then allocates) and the
   fixed rows take the rest, and ``max_running_requests`` is capped to them
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
from typing import Any, List, Optional

from .... import config as cfg
from .... import memory_budget
from ....memory_budget import format_bytes
from ....sparse_decode.sizing import HotBufferPlan, pre_alloc_slots
from ...args import carrier
from ...compat import field
from . import device_kv_budget

POOL_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"

logger = logging.getLogger(__name__)

__all__ = [
    "DeviceBudgetPlan",
    "plan_device_budget",
    "served_hot_plan",
    "memory_allocations",
    "resolve_pool_config_around",
    "cell_size_after",
]

RULE = "memory.device_budget"


@dataclass(frozen=True)
class DeviceBudgetPlan:
    """How SGLang's KV byte budget is split between its token pool and the hot buffers.

    budget_bytes: ``B``. requested_requests: what SGLang would run. hot: the hot-buffer
    plan of the requests that get hot rows (``hot.running_requests <= requested``; its
    ``device_bytes``: their hot rows and the fixed ones, hot buffers and residency
    tables). token_budget_bytes: ``B - hot.device_bytes``, what SGLang sizes its token
    pool from. reserved_token_bytes: what the token pool was guaranteed before the hot buffers.
    """

    budget_bytes: int
    requested_requests: int
    hot: HotBufferPlan
    token_budget_bytes: int
    reserved_token_bytes: int

    @property
    def max_running_requests(self) -> int:
        return self.hot.running_requests

    @property
    def capped(self) -> bool:
        return self.max_running_requests < self.requested_requests


def plan_device_budget(budget_bytes: int, wanted: HotBufferPlan, reserved_token_bytes: int) -> DeviceBudgetPlan:
    """Split ``budget_bytes`` between the token pool and the hot buffers (module docstring).

    ``wanted``: the hot-buffer plan of the requests SGLang would run. The token pool keeps
    ``reserved_token_bytes`` (capped at the budget); of the rest, the hot rows of
    ``min(requested, fitting)`` requests and the plan's fixed rows. Raises
    :class:`ConfigError` when not even one request's hot rows fit.
    """
    budget = max(int(budget_bytes), 0)
    reserved = min(max(int(reserved_token_bytes), 0), budget)
    granted = min(wanted.running_requests, wanted.running_requests_fitting(budget - reserved))
    if granted < 1:
        one = wanted.with_running_requests(1)
        raise cfg.ConfigError(
            [
                cfg.Violation(
                    RULE,
                    f"not even one request's hot buffers fit the device KV budget: {format_bytes(budget)} budget "
                    f"- {format_bytes(reserved)} kept for the token pool leaves {format_bytes(budget - reserved)}, "
                    f"and one request needs {format_bytes(one.device_bytes)} ({one.rows_in_words()} x "
                    f"{format_bytes(one.device_bytes_per_row)} of hot buffers and residency tables per row)",
                    "lower hot_tokens, raise --mem-fraction-static, or lower --max-total-tokens",
                )
            ],
            "sparse decode offload device budget",
        )
    hot = wanted.with_running_requests(granted)
    return DeviceBudgetPlan(
        budget_bytes=budget,
        requested_requests=wanted.running_requests,
        hot=hot,
        token_budget_bytes=budget - hot.device_bytes,
        reserved_token_bytes=reserved,
    )


def memory_allocations(
    hot_plan: HotBufferPlan, host_tokens: Optional[int], host_tokens_source: str
) -> List[memory_budget.Allocation]:
    """The hot buffers with their residency tables (device) and the host pool (host) of
    ``hot_plan``, for the memory check at launch (the smallest server) and in the pool."""
    items = [
        memory_budget.Allocation(
            "hot buffers",
            "device",
            hot_plan.device_bytes,
            hot_plan.formula(),
            "hot_tokens or --max-running-requests",
        )
    ]
    if host_tokens is not None:
        items.append(
            memory_budget.Allocation(
                "host pool",
                "host",
                int(host_tokens) * hot_plan.host_bytes_per_token,
                f"{hot_plan.layers} layers x {host_tokens} tokens ({host_tokens_source}) x "
                f"{hot_plan.host_bytes_per_token // hot_plan.layers} B",
                "host_pool_tokens or --max-total-tokens",
            )
        )
    return items


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


def served_hot_plan(
    kvc: Any, sd: cfg.SparseDecodeOffloadConfig, *, running_requests: int, pre_alloc_slots: int
) -> HotBufferPlan:
    """The hot-buffer plan of the offload pool SGLang's configurator ``kvc`` builds: the
    section's ``hot_tokens``, the model's top-k and main-KV row, the pool's layers, this
    server's verify rows and page size, for ``running_requests`` and the P/D
    ``pre_alloc_slots``. The device-budget split and the pool both build it here."""
    from sglang.srt.runtime_context import get_schedule

    from ...speculative.eagle import verify_rows_per_request

    mc = kvc.model_config
    return HotBufferPlan.build(
        configured_hot_tokens=sd.hot_tokens,
        top_k=int(mc.hf_config.index_topk),
        page_size=get_schedule().page_size,
        verify_rows=verify_rows_per_request(),
        layers=kvc.layer_info.num_effective_layers,
        row_dim=int(mc.kv_lora_rank) + int(mc.qk_rope_head_dim),
        running_requests=running_requests,
        pre_alloc_slots=pre_alloc_slots,
    )


def _served_pre_alloc_slots() -> int:
    from sglang.srt.runtime_context import get_disagg

    disagg = get_disagg()
    return pre_alloc_slots(disagg.disaggregation_mode, disagg.disaggregation_decode_extra_slots)


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
    wanted = served_hot_plan(self, sd, running_requests=requested, pre_alloc_slots=_served_pre_alloc_slots())
    plan = plan_device_budget(budget, wanted, reserved_tokens * cell)
    config = self.config_from_budget(plan.token_budget_bytes)
    config.max_running_requests = min(plan.max_running_requests, self.resolve_max_num_reqs(config.max_total_num_tokens))
    config = pool_configurator.finalize_with_max_running_requests(config)
    config.mem_fraction_static = get_schedule().mem_fraction_static
    _log_split(plan, config.max_total_num_tokens, cell)
    return config


def _log_split(plan: DeviceBudgetPlan, tokens: int, cell: int) -> None:
    logger.info(
        "sparse decode offload: device KV budget %s = token pool %d tokens x %d B + hot buffers and residency "
        "tables %s (%s x %s)",
        format_bytes(plan.budget_bytes),
        tokens,
        cell,
        format_bytes(plan.hot.device_bytes),
        plan.hot.rows_in_words(),
        format_bytes(plan.hot.device_bytes_per_row),
    )
    if plan.capped:
        wanted = plan.hot.with_running_requests(plan.requested_requests)
        logger.warning(
            "sparse decode offload: max_running_requests capped from %d to %d: the hot buffers of "
            "%d requests (%s) do not fit the device KV budget (%s) next to the token pool; lower "
            "hot_tokens or raise --mem-fraction-static to run more",
            plan.requested_requests,
            plan.max_running_requests,
            plan.requested_requests,
            format_bytes(wanted.device_bytes),
            format_bytes(plan.budget_bytes),
        )


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
