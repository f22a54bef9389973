"""The plugin's command-line flags of ``launch_server`` / ``sglang serve``.

Each feature has an enable flag and a config flag taking inline JSON or ``@file``:

==================================  =================================================
``--enable-sparse-decode-offload``  ``--sparse-decode-offload-config JSON|@file``
``--enable-layerwise-prefill-offload``  ``--layerwise-prefill-offload-config JSON|@file``
==================================  =================================================

(P/D transfer and KVPP add theirs by appending a :class:`FeatureFlags` row to
:data:`FEATURES`.)

How they enter SGLang 0.5.23 (no SGLang file is changed):

* an AROUND hook on ``ServerArgs.add_cli_args`` adds an argument group, so
  ``python -m sglang.launch_server --help`` lists the flags;
* an AROUND hook on ``ServerArgs.from_cli_args`` takes the flag values off the
  argparse namespace (SGLang would drop them) and keeps them as
  :class:`RawFlags` for this process;
* the validation step in :mod:`.resolution` parses them into the typed configs of
  :mod:`sglang_ascend_offload.config`, validates them against the resolved server
  arguments, and publishes the result (:mod:`.carrier`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ... import config as cfg
from ...memory_budget import parse_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeatureFlags:
    """One feature's pair of flags and the config section it fills."""

    section: str  # field name in OffloadConfig
    section_cls: type
    enable_flag: str
    config_flag: str
    help: str

    @property
    def enable_dest(self) -> str:
        return _dest(self.enable_flag)

    @property
    def config_dest(self) -> str:
        return _dest(self.config_flag)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


FEATURES: Tuple[FeatureFlags, ...] = (
    FeatureFlags(
        section="sparse_decode",
        section_cls=cfg.SparseDecodeOffloadConfig,
        enable_flag="--enable-sparse-decode-offload",
        config_flag="--sparse-decode-offload-config",
        help="Sparse decode offload (DSA models): the main KV lives in host memory, "
        "each decode step copies only the top-k rows missing from a device hot buffer.",
    ),
    FeatureFlags(
        section="layerwise_prefill",
        section_cls=cfg.LayerwisePrefillOffloadConfig,
        enable_flag="--enable-layerwise-prefill-offload",
        config_flag="--layerwise-prefill-offload-config",
        help="Layerwise prefill offload: cache-bearing layers share a few device KV "
        "buffers; each layer's KV is saved to a host KV pool.",
    ),
    # P/D transfer backend (sglang_plugin/disaggregation/ascend_offload/);
    # with --disaggregation-transfer-backend ascend_offload
    FeatureFlags(
        section="pd_transfer",
        section_cls=cfg.PDTransferConfig,
        enable_flag="--enable-pd-transfer",
        config_flag="--pd-transfer-config",
        help="P/D transfer of sglang-ascend-offload (with --disaggregation-mode prefill|decode and "
        "--disaggregation-transfer-backend ascend_offload): decode pulls each prefill layer, main KV "
        "into its host pool (sparse decode offload) or device pool, the indexer into its device cache.",
    ),
    FeatureFlags(  # KVPP (sglang_plugin/mem_cache/pool/kvpp.py)
        section="kvpp",
        section_cls=cfg.KVPPConfig,
        enable_flag="--enable-kvpp",
        config_flag="--kvpp-config",
        help="KV layer parallelism (MLA/DSA models, TP >= 2): each layer's KV is kept on one owner rank "
        "of the TP group and broadcast to the others when the layer runs (one layer prefetched ahead).",
    ),
)


@dataclass(frozen=True)
class RawFlags:
    """The flag values as given on the command line (nothing parsed yet).

    enabled: section -> enable flag given; configs: section -> config flag text.
    """

    enabled: Dict[str, bool] = field(default_factory=dict)
    configs: Dict[str, Optional[str]] = field(default_factory=dict)
    device_kv_budget: Optional[str] = None

    @property
    def any_given(self) -> bool:
        return (
            any(self.enabled.values())
            or any(v is not None for v in self.configs.values())
            or self.device_kv_budget is not None
        )


#: Not a feature: a cap on the device memory of the KV pool (OffloadConfig.device_kv_budget_bytes).
DEVICE_KV_BUDGET_FLAG = "--device-kv-budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's argument group to SGLang's parser."""
    group = parser.add_argument_group(
        "sglang-ascend-offload",
        "KV-cache offload for DeepSeek-V3.2-style (DSA) models on Ascend NPUs "
        "(plugin sglang-ascend-offload; docs/sglang_integration.md). Config values "
        "are inline JSON or @path/to/file.json.",
    )
    for feat in FEATURES:
        group.add_argument(feat.enable_flag, dest=feat.enable_dest, action="store_true", default=False, help=feat.help)
        group.add_argument(
            feat.config_flag,
            dest=feat.config_dest,
            type=str,
            default=None,
            metavar="JSON|@FILE",
            help=f"Settings of {feat.enable_flag} (keys of {feat.section_cls.__name__}; "
            "see docs/configuration.md). Requires the enable flag.",
        )
    group.add_argument(
        DEVICE_KV_BUDGET_FLAG,
        dest=_dest(DEVICE_KV_BUDGET_FLAG),
        type=str,
        default=None,
        metavar="SIZE",
        help="The most device memory the KV pool (plus the sparse decode hot buffers) may take, e.g. 512MiB "
        "or 8GiB; the smaller of this and what --mem-fraction-static leaves is used. On a CPU the server "
        "then accounts like a device of that size: the sparse decode host pool is host memory outside it.",
    )


def take_from_namespace(namespace: argparse.Namespace) -> RawFlags:
    """Read the plugin's flag values off an argparse namespace (missing = defaults)."""
    enabled = {f.section: bool(getattr(namespace, f.enable_dest, False)) for f in FEATURES}
    configs = {f.section: getattr(namespace, f.config_dest, None) for f in FEATURES}
    return RawFlags(
        enabled=enabled, configs=configs, device_kv_budget=getattr(namespace, _dest(DEVICE_KV_BUDGET_FLAG), None)
    )


def parse(raw: RawFlags) -> Tuple[cfg.OffloadConfig, List[cfg.Violation]]:
    """Typed config from the flags plus every parse problem (all sections).

    A section whose flags are absent is off. A section whose config has bad keys
    is returned with those keys at their defaults, together with its problems, so
    that validation still reports every other rule (a config returned with problems
    is never run); one that is not a JSON object at all is left off.
    """
    sections: Dict[str, Any] = {}
    problems: List[cfg.Violation] = []
    for feat in FEATURES:
        on = raw.enabled.get(feat.section, False)
        text = raw.configs.get(feat.section)
        if text is not None and not on:
            problems.append(
                cfg.Violation(
                    "flags.config_without_enable",
                    f"{feat.config_flag} given without {feat.enable_flag}",
                    f"add {feat.enable_flag} (or drop {feat.config_flag})",
                )
            )
            continue
        if not on:
            continue
        section, errors = cfg.parse_section_partial(feat.section_cls, text)
        problems += [cfg.Violation(v.rule, f"{feat.config_flag}: {v.problem}", v.fix) for v in errors]
        if section is not None:  # bad keys keep their defaults: every other rule is still checked
            sections[feat.section] = section
    budget = None
    if raw.device_kv_budget is not None:
        try:
            budget = parse_size(raw.device_kv_budget)
        except ValueError as exc:
            problems.append(
                cfg.Violation(
                    "flags.device_kv_budget", f"{DEVICE_KV_BUDGET_FLAG}: {exc}", f"e.g. {DEVICE_KV_BUDGET_FLAG} 512MiB"
                )
            )
        else:
            if budget <= 0:
                problems.append(
                    cfg.Violation(
                        "flags.device_kv_budget",
                        f"{DEVICE_KV_BUDGET_FLAG} {raw.device_kv_budget} is not positive",
                        f"e.g. {DEVICE_KV_BUDGET_FLAG} 512MiB",
                    )
                )
                budget = None
    return cfg.OffloadConfig(**sections, device_kv_budget_bytes=budget), problems


# ------------------------------------------------------------------ per-process state
_pending: Optional[RawFlags] = None


def remember(raw: RawFlags) -> None:
    """Keep the flags seen by ``from_cli_args`` for the validation step."""
    global _pending
    _pending = raw


def pending() -> Optional[RawFlags]:
    """Flags parsed in this process, or ``None`` if no command line was parsed here."""
    return _pending


def forget() -> None:
    global _pending
    _pending = None


# ------------------------------------------------------------------ SGLang's CLI hooks
class UnsupportedSGLangVersion(RuntimeError):
    """The plugin's flags were used with an SGLang release it does not support."""


def add_cli_args_around(original, parser):
    """HookRegistry AROUND ``ServerArgs.add_cli_args``: SGLang's arguments, then the plugin's."""
    original(parser)
    add_arguments(parser)


def from_cli_args_around(original, cls, args):
    """HookRegistry AROUND ``ServerArgs.from_cli_args``: keep the plugin's flag values
    for the validation step (SGLang's ``ServerArgs`` has no field for them)."""
    remember(take_from_namespace(args))
    return original(cls, args)


def refusing_from_cli_args(reason: str):
    """An AROUND hook for ``ServerArgs.from_cli_args`` on an unsupported SGLang: the
    plugin's flags stop startup with ``reason``; without them SGLang runs unchanged."""

    def from_cli_args_refuse(original, cls, args):
        raw = take_from_namespace(args)
        if raw.any_given:
            raise UnsupportedSGLangVersion(
                f"sglang-ascend-offload flags were given, but {reason}. Install sglang==0.5.23 "
                "or drop the --enable-*-offload / --*-offload-config flags."
            )
        return original(cls, args)

    return from_cli_args_refuse
