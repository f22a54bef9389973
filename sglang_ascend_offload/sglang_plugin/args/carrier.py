"""Carry the validated offload configuration to every SGLang process.

SGLang 0.5.23 has no way to add fields to ``ServerArgs`` (``from_cli_args`` drops
unknown attributes), and its schedulers, detokenizer and DP controller are
spawned processes. The launcher therefore publishes the *validated* configuration
as JSON in the environment variable :data:`CONFIG_ENV`; spawned processes inherit
the environment and read it back with :func:`active_config`.

The same variable is the way to enable the features without the CLI (for
``sglang.Engine(...)`` in Python): set it to the JSON of an
:class:`~sglang_ascend_offload.config.OffloadConfig` before creating the engine; the
plugin validates it against the server arguments during resolution exactly as it
validates flags.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from ... import config as cfg

CONFIG_ENV = "SGLANG_ASCEND_OFFLOAD_CONFIG"

#: The only places that read the published configuration (:func:`active_config` and the
#: helpers below): each is where SGLang hands control to the plugin, an object SGLang
#: constructs or a hook it calls, so there is no caller to pass the config in. Everything
#: below them (pools, engines, transfer, sizing arithmetic) gets its section as an
#: argument. ``(module under sglang_plugin, function, what SGLang calls)``;
#: ``tests/test_structure.py`` checks that the call sites are exactly these.
ENTRY_POINTS: Tuple[Tuple[str, str, str], ...] = (
    ("attention.dsa_backend", "create_backend", "SGLang's attention backend factory for ascend_offload"),
    ("attention.dsa_backend", "AscendOffloadAttnBackend.__init__", "the backend SGLang constructs per model runner"),
    ("features", "build_pool_around", "the hook around SGLang's KV pool construction"),
    ("mem_cache.sizing.device_kv_budget", "budget_bytes", "the hook after SGLang's memory profiling"),
    ("mem_cache.sizing.sparse_decode", "_served", "the per-token cell-size hook"),
    ("mem_cache.sizing.sparse_decode", "_plugin_main_pool", "the per-token cell-size hook"),
    ("mem_cache.sizing.layerwise_prefill", "_applies", "the per-token cell-size hook"),
    ("mem_cache.sizing.kvpp", "_applies", "the per-token cell-size hook"),
    (
        "disaggregation.ascend_offload.conn",
        "active_pd_config",
        "the P/D KV manager and sender/receiver classes SGLang constructs",
    ),
    (
        "disaggregation.ascend_offload.install",
        "_layerwise_publisher",
        "the scheduler hook wiring layer announcements of a layerwise P/D prefill",
    ),
)

_cache: Tuple[Optional[str], Optional[cfg.OffloadConfig]] = (None, None)


def publish(config: cfg.OffloadConfig) -> str:
    """Store ``config`` (already validated) for this process and its children."""
    text = cfg.to_json(config)
    os.environ[CONFIG_ENV] = text
    return text


def clear() -> None:
    """Forget the published configuration (tests; a launcher with features off)."""
    os.environ.pop(CONFIG_ENV, None)


def published_text() -> Optional[str]:
    return os.environ.get(CONFIG_ENV) or None


def active_config() -> cfg.OffloadConfig:
    """The configuration published by the launcher (every section off if none).

    Parsing is cached per distinct environment value. A malformed value raises
    :class:`~sglang_ascend_offload.config.ConfigError` (it can only come from a user
    setting the variable by hand: the launcher publishes validated JSON only).
    """
    global _cache
    text = published_text()
    if text is None:
        return cfg.OffloadConfig()
    if _cache[0] != text:
        _cache = (text, cfg.parse_config(text))
    assert _cache[1] is not None
    return _cache[1]


def sparse_decode_enabled() -> bool:
    return active_config().sparse_decode is not None


def section_for_served_pool(kvc: Any, section: str) -> Optional[Any]:
    """The active config's ``section`` (``layerwise_prefill`` / ``kvpp``) when SGLang's KV
    cache configurator ``kvc`` is building the plugin's main MLA pool (not a draft
    worker's, and the ``ascend_offload`` backend runs); ``None`` otherwise. Used by the
    per-token sizing hooks, which must leave every other pool as SGLang sizes it."""
    value = getattr(active_config(), section)
    return value if value is not None and serves_plugin_pool(kvc) else None


def serves_plugin_pool(kvc: Any) -> bool:
    """SGLang's KV cache configurator ``kvc`` builds the plugin's main MLA pool: not a
    draft worker's, an MLA model, and the ``ascend_offload`` backend runs."""
    # is_draft_worker / use_mla_backend: configurator fields that stand-ins in tests may omit.
    if getattr(kvc, "is_draft_worker", False) or not getattr(kvc, "use_mla_backend", False):
        return False
    try:
        from sglang.srt.runtime_context import get_exec

        from ..names import BACKEND_NAME

        return get_exec().kernel.attention_backend == BACKEND_NAME
    except Exception:  # noqa: BLE001 - no runtime context: not a served model
        return False
