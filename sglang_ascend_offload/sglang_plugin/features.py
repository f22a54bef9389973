"""The plugin's features, one entry each: the index of everything a feature is made of,
and the table the plugin's code dispatches on.

Each :class:`Feature` names its flags, its deployment rules in ``config.py``
(``config_rules``), its server rules (``args/rules/``), the pool it builds, its sizing
hooks, every adapter module that belongs to it (``modules``: pool, host pools, attention,
speculative and retraction parts, metrics, startup) and its HookRegistry rows (``hooks``,
which :data:`.install.HOOKS` assembles). ``tests/test_structure.py`` holds the index
complete: an adapter module that uses a feature's core package, pool, engine or config
section and is not listed in that feature's entry fails it. Modules that serve every
feature alike (the flag and config plumbing, the hook tables) are :data:`PLUGIN_WIDE`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from .. import config as cfg
from . import compat
from .args.flags import FEATURES as FLAGS
from .args.flags import FeatureFlags

__all__ = ["Hook", "resolve", "Feature", "FEATURES", "PLUGIN_WIDE", "by_section", "pool_feature", "build_pool_around"]


@dataclass(frozen=True)
class Hook:
    """One HookRegistry registration.

    target: the hooked callable's dotted path (``compat.TARGET_*``). kind: ``AROUND`` /
    ``AFTER`` / ``BEFORE`` / ``REPLACE``. handler: ``"module:name"`` relative to this
    package; with ``build`` it names a factory whose result is registered. why: what the
    plugin needs from it. upstream: the SGLang change that would make the hook unnecessary
    (required: a hook nobody knows how to remove is a hook forever). when:
    ``"module:name"`` of a predicate; the hook is registered only when it returns true.
    """

    target: str
    kind: str
    handler: str
    why: str
    upstream: str = ""
    build: bool = False
    when: Optional[str] = None

    @property
    def private(self) -> bool:
        """The target is private to SGLang (some part of its path starts with ``_``)."""
        return any(part.startswith("_") for part in self.target.split("."))


def resolve(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


@dataclass(frozen=True)
class Feature:
    """One feature of the plugin.

    section: its ``OffloadConfig`` field. flags: its pair of server flags (and config
    class). pool: ``"module:function"`` (relative to this package) that builds the KV
    pool replacing SGLang's when the feature is on, ``None`` when it keeps the pool.
    server_rules: ``"module:function"`` returning its ``server``-scope violations (run by
    ``args.resolution.startup_violations``), ``None`` when it has none of its own. sizing:
    the module whose hooks change SGLang's per-token KV bytes for it, ``None`` when it does
    not. config_rules: the ``config.py`` functions that check its section against a
    deployment (every ``_check_*`` of ``config.py`` belongs to exactly one feature).
    modules: every adapter module of the feature (dotted, relative to this package).
    hooks: its HookRegistry rows.
    """

    section: str
    flags: FeatureFlags
    pool: Optional[str]
    server_rules: Optional[str]
    sizing: Optional[str]
    config_rules: Tuple[str, ...]
    modules: Tuple[str, ...]
    hooks: Tuple[Hook, ...] = ()

    @property
    def config_cls(self) -> type:
        return self.flags.section_cls

    def enabled(self, config: cfg.OffloadConfig) -> bool:
        return getattr(config, self.section) is not None

    def pool_builder(self) -> Callable[..., Any]:
        """The function that builds this feature's KV pool (imported on use)."""
        if self.pool is None:
            raise ValueError(f"{self.section} keeps SGLang's KV pool")
        return resolve(self.pool)


def _flags(section: str) -> FeatureFlags:
    return next(f for f in FLAGS if f.section == section)


#: Adapter modules that serve every feature alike: the flag / config / launch plumbing and
#: the index and hook tables themselves (they dispatch on :data:`FEATURES`).
PLUGIN_WIDE: Tuple[str, ...] = (
    "features",
    "install",
    "compat",
    "entry",
    "names",
    "cpu_capability",
    "args.flags",
    "args.carrier",
    "args.resolution",
    "args.deployment",
    "args.launch_command",
    "mem_cache.pool.device",
    "mem_cache.sizing.device_kv_budget",
    "attention.native_indexer",
)

FEATURES: Tuple[Feature, ...] = (
    Feature(
        "sparse_decode",
        _flags("sparse_decode"),
        pool="mem_cache.sparse_decode_startup:build_offload_pool",  # the pool, its startup phases, kernel qualification
        server_rules="args.rules.sparse_decode:sparse_decode_violations",
        sizing="mem_cache.sizing.sparse_decode",
        config_rules=(
            "_check_sparse_decode",
            "_check_sparse_decode_model",
            "_check_sparse_decode_hot_tokens",
            "_check_sparse_decode_settings",
            "_check_int8_indexer",
            "_check_sparse_decode_speculative",
            "_check_sparse_decode_graphs",
        ),
        modules=(
            "args.rules.sparse_decode",
            "args.launch_checks",
            "attention.sparse_decode",
            "attention.dsa_backend",
            "attention.dsa_metadata",
            "mem_cache.sparse_decode_startup",
            "mem_cache.pool.sparse_decode",
            "mem_cache.pool_host.shared",
            "mem_cache.pool_host.append_order",
            "mem_cache.pool_host.group_rendezvous",
            "mem_cache.pool_host.npu_memfabric",
            "mem_cache.sizing.sparse_decode",
            "mem_cache.sizing.cell",
            "mem_cache.retraction",
            "observability.metrics",
            "observability.export_hooks",
            "observability.trace_recorder",
            "speculative.eagle",
            "speculative.cpu_graph",
        ),
        hooks=(
            Hook(
                compat.TARGET_NPU_INDEXER,
                "AROUND",
                "attention.dsa_backend:forward_npu_around",
                "the NPU indexer forward routes to the backend where it runs the fused LIM / LIM-C8",
                upstream="the same backend-provided indexer forward on the NPU path of the DSA Indexer",
            ),
            Hook(
                compat.TARGET_ON_IDLE,
                "AFTER",
                "observability.export_hooks:flush_after_idle",
                "export the offload counters the decode interval held back",
                upstream="a scheduler metrics-export callback for plugins (on idle)",
            ),
            Hook(
                compat.TARGET_STREAM_OUTPUT,
                "BEFORE",
                "observability.export_hooks:flush_before_stream_output",
                "export the offload counters before a finished request's output is sent",
                upstream="a scheduler metrics-export callback for plugins (before a finished request is streamed)",
            ),
            Hook(
                compat.TARGET_RESOLVE_POOL_CONFIG,
                "AROUND",
                "mem_cache.sizing.sparse_decode:resolve_pool_config_around",
                "sparse decode: hot buffers drawn from SGLang's KV budget",
                upstream="the KV-pool factory registry reserving a pool's fixed (not per-token) device bytes",
            ),
        ),
    ),
    Feature(
        "layerwise_prefill",
        _flags("layerwise_prefill"),
        pool="mem_cache.pool.layerwise_prefill:build_layerwise_pool",
        server_rules="args.rules.layerwise_prefill:layerwise_violations",
        sizing="mem_cache.sizing.layerwise_prefill",
        config_rules=("_check_layerwise", "_check_layerwise_buffers", "_check_layerwise_serving"),
        modules=(
            "args.rules.layerwise_prefill",
            "args.launch_checks",
            "mem_cache.pool.layerwise_prefill",
            "mem_cache.pool.layerwise_pages",
            "mem_cache.pool.layerwise_runtime",
            "mem_cache.sizing.layerwise_prefill",
            "mem_cache.sizing.cell",
            "mem_cache.sizing.sparse_decode",
            "disaggregation.ascend_offload.install",
            "args.rules.pd_transfer",
        ),
    ),
    Feature(
        "kvpp",
        _flags("kvpp"),
        pool="mem_cache.pool.kvpp:build_kvpp_pool",
        server_rules="args.rules.kvpp:kvpp_violations",
        sizing="mem_cache.sizing.kvpp",
        config_rules=("_check_kvpp",),
        modules=(
            "args.rules.kvpp",
            "mem_cache.pool.kvpp",
            "mem_cache.sizing.kvpp",
            "mem_cache.sizing.cell",
            "mem_cache.sizing.sparse_decode",
        ),
        hooks=(
            Hook(
                compat.TARGET_PROFILE_BYTES,
                "AROUND",
                "mem_cache.sizing.kvpp:fixed_budget_around",
                "a fixed KV byte budget for reproducible sizing",
                upstream="a server flag for a fixed KV budget in bytes (SGLang has --max-total-tokens, in tokens)",
                when="mem_cache.sizing.kvpp:fixed_budget_requested",
            ),
        ),
    ),
    Feature(
        "pd_transfer",
        _flags("pd_transfer"),
        pool=None,
        server_rules="args.rules.pd_transfer:pd_violations",
        sizing=None,
        config_rules=("_check_pd", "_check_pd_engine", "_check_pd_decode_tp"),
        modules=(
            "args.rules.pd_transfer",
            "disaggregation.ascend_offload.conn",
            "disaggregation.ascend_offload.idle",
            "disaggregation.ascend_offload.install",
        ),
        hooks=(
            Hook(
                compat.TARGET_GET_KV_CLASS,
                "AROUND",
                "disaggregation.ascend_offload.install:get_kv_class_around",
                "TransferBackend.ASCEND -> the plugin's P/D classes",
                upstream=(
                    "a transfer-backend registry (name -> KV manager / sender / receiver classes) instead of "
                    "the closed TransferBackend enum"
                ),
            ),
            Hook(
                compat.TARGET_CONFIG_STORE,
                "AROUND",
                "disaggregation.ascend_offload.install:config_store_around",
                "the MemFabric config store of the plugin's P/D",
                upstream="the same transfer-backend registry providing the backend's config store",
            ),
            Hook(
                compat.TARGET_PREFILL_MANAGER,
                "AFTER",
                "disaggregation.ascend_offload.install:attach_pool_after_prefill",
                "hand the prefill queue's KV pool to the manager",
                upstream="KVArgs carrying the KV pool object, not only its buffer pointers",
            ),
            Hook(
                compat.TARGET_DECODE_MANAGER,
                "AFTER",
                "disaggregation.ascend_offload.install:attach_pool_after_decode",
                "hand the decode queue's KV pool to the manager",
                upstream="KVArgs carrying the KV pool object, not only its buffer pointers",
            ),
            Hook(
                compat.TARGET_IDLE_SLEEP,
                "AROUND",
                "disaggregation.ascend_offload.idle:maybe_sleep_on_idle_around",
                "--sleep-on-idle on the P/D backend: short sleeps while transfers are in flight, parked otherwise",
                upstream="a transfer-backend 'work in flight' callback consulted by Scheduler.maybe_sleep_on_idle",
            ),
            Hook(
                compat.TARGET_RUN_BATCH,
                "BEFORE",
                "disaggregation.ascend_offload.install:announce_last_chunks_before",
                "layerwise prefill: announce the requests whose last chunk this forward computes",
                upstream=(
                    "a per-forward callback to the transfer backend naming the requests whose last prefill chunk runs"
                ),
            ),
        ),
    ),
)


def by_section(section: str) -> Feature:
    for feature in FEATURES:
        if feature.section == section:
            return feature
    raise KeyError(f"no feature {section!r} (features: {', '.join(f.section for f in FEATURES)})")


def pool_feature(config: cfg.OffloadConfig) -> Optional[Feature]:
    """The one enabled feature that replaces the KV pool, ``None`` for SGLang-shaped
    device pools. The deployment rules refuse two at once (``sglang.layerwise_sparse_decode``,
    ``kvpp.layerwise_prefill``, ``sparse_decode.kvpp``), so a second one is a bug here."""
    found = [f for f in FEATURES if f.pool is not None and f.enabled(config)]
    if len(found) > 1:
        raise RuntimeError(
            f"features {[f.section for f in found]} each replace the KV pool; startup validation "
            "refuses that combination, so this config was not validated"
        )
    return found[0] if found else None


def build_pool_around(original, self, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    """HookRegistry AROUND ``KVCacheConfigurator._build_token_to_kv_pool``: the active
    feature's pool when the ``ascend_offload`` attention backend runs, else the plugin's
    device DSA pool; SGLang's own pool for every other backend."""
    from sglang.srt.runtime_context import get_exec

    from .args import carrier
    from .names import BACKEND_NAME

    if get_exec().kernel.attention_backend != BACKEND_NAME:
        return original(
            self,
            sizes=sizes,
            is_dsa_model=is_dsa_model,
            is_dsv4_model=is_dsv4_model,
            req_to_token_pool=req_to_token_pool,
        )
    if not self.use_mla_backend or is_dsv4_model or self.is_hybrid_swa or self.mambaish_config:
        raise ValueError(
            f"attention backend {BACKEND_NAME} serves MLA / DSA models with a uniform KV layout "
            "(DeepSeek-V3.2 style); choose another backend for this model"
        )
    config = carrier.active_config()  # what the launcher validated and published
    feature = pool_feature(config)
    tokens = sizes.max_total_num_tokens
    if feature is None:
        from .mem_cache.pool.device import build_device_pool

        return build_device_pool(self, max_total_num_tokens=tokens, is_dsa_model=is_dsa_model)
    section = getattr(config, feature.section)
    if feature.section == "sparse_decode":  # its hot buffers have one row per request slot
        return feature.pool_builder()(
            self,
            section,
            max_total_num_tokens=tokens,
            is_dsa_model=is_dsa_model,
            req_to_token_pool=req_to_token_pool,
        )
    return feature.pool_builder()(self, section, max_total_num_tokens=tokens, is_dsa_model=is_dsa_model)
