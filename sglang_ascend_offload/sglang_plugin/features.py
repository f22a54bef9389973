"""The plugin's features, one entry each: where a newcomer finds a feature's whole
SGLang surface, and the table the plugin's code dispatches on.

========================  =================================================================
feature                   SGLang surface
========================  =================================================================
``sparse_decode``         flags ``--enable-sparse-decode-offload`` / ``--sparse-decode-offload-
                          config``; pool :mod:`.mem_cache.pool.sparse_decode`; attention
                          :mod:`.attention.sparse_decode`; sizing
                          :mod:`.mem_cache.sizing.sparse_decode`; host pools
                          :mod:`.mem_cache.pool_host`; metrics :mod:`.observability`;
                          server rules :mod:`.args.rules.sparse_decode`
``layerwise_prefill``     flags ``--enable-layerwise-prefill-offload`` / ``--layerwise-prefill-
                          offload-config``; pool :mod:`.mem_cache.pool.layerwise_prefill`;
                          sizing :mod:`.mem_cache.sizing.layerwise_prefill`; server rules
                          :mod:`.args.rules.layerwise_prefill`
``kvpp``                  flags ``--enable-kvpp`` / ``--kvpp-config``; pool
                          :mod:`.mem_cache.pool.kvpp`; sizing :mod:`.mem_cache.sizing.kvpp`;
                          server rules :mod:`.args.rules.kvpp`
``pd_transfer``           flags ``--enable-pd-transfer`` / ``--pd-transfer-config`` with
                          ``--disaggregation-transfer-backend ascend_offload``; backend
                          :mod:`.disaggregation.ascend_offload`; server rules
                          :mod:`.args.rules.pd_transfer`
========================  =================================================================

The rules every feature's config must meet on a deployment are in ``config.py``
(ids in ``rules.py``); the HookRegistry hooks are all in :data:`.install.HOOKS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from .. import config as cfg
from .args.flags import FEATURES as FLAGS
from .args.flags import FeatureFlags

__all__ = ["Feature", "FEATURES", "by_section", "pool_feature", "build_pool_around"]


@dataclass(frozen=True)
class Feature:
    """One feature of the plugin.

    section: its ``OffloadConfig`` field. flags: its pair of server flags (and config
    class). pool: ``"module:function"`` (relative to this package) that builds the KV
    pool replacing SGLang's when the feature is on, ``None`` when it keeps the pool.
    server_rules: ``"module:function"`` returning its ``server``-scope violations (run by
    ``args.resolution.startup_violations``), ``None`` when it has none of its own. sizing: the module whose
    hooks change SGLang's per-token KV bytes for it, ``None`` when it does not.
    """

    section: str
    flags: FeatureFlags
    pool: Optional[str]
    server_rules: Optional[str]
    sizing: Optional[str]

    @property
    def config_cls(self) -> type:
        return self.flags.section_cls

    def enabled(self, config: cfg.OffloadConfig) -> bool:
        return getattr(config, self.section) is not None

    def pool_builder(self) -> Callable[..., Any]:
        """The function that builds this feature's KV pool (imported on use)."""
        if self.pool is None:
            raise ValueError(f"{self.section} keeps SGLang's KV pool")
        return _resolve(self.pool)


def _resolve(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _flags(section: str) -> FeatureFlags:
    return next(f for f in FLAGS if f.section == section)


FEATURES: Tuple[Feature, ...] = (
    Feature(
        "sparse_decode",
        _flags("sparse_decode"),
        pool="mem_cache.sparse_decode_startup:build_offload_pool",  # the pool, its startup phases, kernel qualification
        server_rules="args.rules.sparse_decode:sparse_decode_violations",
        sizing="mem_cache.sizing.sparse_decode",
    ),
    Feature(
        "layerwise_prefill",
        _flags("layerwise_prefill"),
        pool="mem_cache.pool.layerwise_prefill:build_layerwise_pool",
        server_rules="args.rules.layerwise_prefill:layerwise_violations",
        sizing="mem_cache.sizing.layerwise_prefill",
    ),
    Feature(
        "kvpp",
        _flags("kvpp"),
        pool="mem_cache.pool.kvpp:build_kvpp_pool",
        server_rules="args.rules.kvpp:kvpp_violations",
        sizing="mem_cache.sizing.kvpp",
    ),
    Feature(
        "pd_transfer",
        _flags("pd_transfer"),
        pool=None,
        server_rules="args.rules.pd_transfer:pd_violations",
        sizing=None,
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
