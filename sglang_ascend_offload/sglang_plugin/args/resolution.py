"""The plugin's steps in SGLang's argument resolution (``ServerArgs.resolve_once``).

SGLang 0.5.23 resolves server arguments in an ordered pipeline
(``arg_groups/pipeline.py``) whose named steps plugins may wrap with
``register_resolution_hook(name)`` (``arg_groups/resolution_hooks.py``). The launcher
resolves once before it spawns any process or allocates any memory, so a step that
raises stops startup there. The plugin wraps:

``handle_cpu_backends`` / ``handle_npu_backends``
    select the ``ascend_offload`` attention backend when sparse decode offload is on,
    and for DSA models on a CPU (SGLang has no CPU DSA path), unless the user chose
    a backend.
``handle_model_specific_adjustments``
    on a CPU, run the step under :func:`~..cpu_capability.no_cuda_capability` so its
    CUDA capability probes (``arg_groups/model_hook.py:341``,
    ``arg_groups/overrides.py:512`` and ``:631``) answer "no CUDA" instead of raising.
``validate_deepep_v2_dispatch_token_budget`` (the last step)
    parse the plugin's flags, build the :class:`~sglang_ascend_offload.config.Deployment`
    from the resolved arguments, check everything, raise one
    :class:`~sglang_ascend_offload.config.ConfigError` listing every problem, or
    publish the validated config for the spawned processes (:mod:`.carrier`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional, Tuple

from ... import config as cfg
from ... import platform
from . import carrier, flags, launch_checks
from .. import compat
from ..cpu_capability import no_cuda_capability
from .deployment import deployment_from_server_args, model_kind
from ..names import BACKEND_NAME

logger = logging.getLogger(__name__)

VALIDATION_STEP = compat.VALIDATION_STEP

# Features whose runtime the SGLang plugin provides. Enabling another feature is
# rejected at startup (a flag that silently did nothing would be worse).
RUNTIME_READY = {"sparse_decode"}
RUNTIME_READY.add("layerwise_prefill")  # layerwise_pool.py
RUNTIME_READY.add("pd_transfer")  # disagg/ (transfer backend ascend_offload)
RUNTIME_READY.add("kvpp")  # kvpp_pool.py


# ------------------------------------------------------------------ backend choice
def _model_is_dsa(server_args: Any) -> bool:
    from sglang.srt.arg_groups.model_override_base import model_config_of

    try:
        hf_config = model_config_of(server_args).hf_config
    except Exception:  # noqa: BLE001 - model path problems are SGLang's to report
        return False
    return model_kind(hf_config) == "dsa"


def requested_config() -> Tuple[cfg.OffloadConfig, List[cfg.Violation]]:
    """The config asked for in this process: flags if any were given, else the
    published environment variable, else everything off. Plus parse problems."""
    raw = flags.pending()
    if raw is not None and raw.any_given:
        return flags.parse(raw)
    text = carrier.published_text()
    if text is None:
        return cfg.OffloadConfig(), []
    try:
        return cfg.parse_config(text), []
    except cfg.ConfigError as exc:
        return cfg.OffloadConfig(), [
            cfg.Violation(v.rule, f"{carrier.CONFIG_ENV}: {v.problem}", v.fix) for v in exc.violations
        ]


def _select_backend(server_args: Any, previous: Callable[[Any], None]) -> None:
    from sglang.srt.arg_groups.model_override_base import is_attention_backend_not_set, resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    view = resolving_view(server_args)
    config, _ = requested_config()
    wants = config.sparse_decode is not None or (view.device == "cpu" and _model_is_dsa(server_args))
    wants = wants or config.layerwise_prefill is not None  # the layerwise pool needs our backend
    wants = wants or config.kvpp is not None  # so does the KVPP pool
    if wants and is_attention_backend_not_set(view):
        declare_resolution(server_args, "sglang_ascend_offload", attention_backend=BACKEND_NAME)
        logger.info("sglang-ascend-offload: attention backend %s selected", BACKEND_NAME)
    if view.device == "cpu" and resolving_view(server_args).attention_backend == BACKEND_NAME \
            and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        raise cfg.ConfigError([cfg.Violation(
            "sglang.cpu_engine", "--device cpu without SGLANG_USE_CPU_ENGINE=1 (SGLang then does not run its "
            "CPU platform)", "export SGLANG_USE_CPU_ENGINE=1 before starting SGLang")],
            "sglang-ascend-offload configuration")
    previous(server_args)


def _model_adjustments(server_args: Any, previous: Callable[[Any], None]) -> None:
    from sglang.srt.arg_groups.model_override_base import resolving_view

    if resolving_view(server_args).device == "cpu":
        with no_cuda_capability():
            previous(server_args)
    else:
        previous(server_args)


# ------------------------------------------------------------------ validation
def plugin_violations(config: cfg.OffloadConfig, view: Any) -> List[cfg.Violation]:
    """Rules about SGLang's own arguments (the engine-agnostic rules live in config.py)."""
    out: List[cfg.Violation] = []
    for section in ("sparse_decode", "layerwise_prefill", "pd_transfer", "kvpp"):
        if getattr(config, section) is not None and section not in RUNTIME_READY:
            out.append(cfg.Violation(
                "sglang.feature_not_wired",
                f"{section} is configured but the SGLang plugin does not run it yet",
                f"remove the {section} settings; see docs/sglang_integration.md for the status",
            ))
    if config.sparse_decode is not None:
        backends = {b for b in (compat.arg(view, "attention_backend"), compat.arg(view, "prefill_attention_backend"),
                                compat.arg(view, "decode_attention_backend")) if b}
        if backends - {BACKEND_NAME}:
            out.append(cfg.Violation(
                "sglang.attention_backend",
                f"attention backend(s) {sorted(backends)} cannot serve sparse decode offload",
                f"drop --attention-backend (the plugin selects {BACKEND_NAME}) or pass "
                f"--attention-backend {BACKEND_NAME}",
            ))
        # cuda_graph_config is None when SGLang has not built it (graphs off): its parts are optional.
        decode_graph = getattr(getattr(compat.arg(view, "cuda_graph_config"), "decode", None), "backend", None)
        graphs_on = not compat.arg(view, "disable_cuda_graph") and decode_graph not in (None, "disabled")
        if compat.arg(view, "device") == "cpu":  # SGLang's CPU engine captures decode graphs only with --enable-torch-compile
            graphs_on = graphs_on and bool(compat.arg(view, "enable_torch_compile"))
        if graphs_on:
            from .deployment import attention_parallel

            _, attn_tp = attention_parallel(lambda name, default=None: compat.arg_or(view, name, default))
            if attn_tp > 1:
                out.append(cfg.Violation(
                    "sglang.sparse_decode_graph",
                    f"decode graphs with sparse decode offload at attention TP {attn_tp}: the ranks of an "
                    "attention-TP group share one host pool whose appends TP rank 0 publishes from the host "
                    "per layer, which a captured decode step cannot do",
                    "run decode eagerly (--disable-cuda-graph, or on a CPU without --enable-torch-compile) or "
                    "use attention TP 1 (attention DP for more ranks)",
                ))
        if graphs_on:
            out += _host_work_under_graphs(config.sparse_decode, decode_graph)
        out += _sparse_decode_runtime_violations(config.sparse_decode, _device_kind(view))
        if compat.arg(view, "enable_hisparse"):
            out.append(cfg.Violation(
                "sglang.hisparse", "--enable-hisparse is on as well",
                "use one sparse-attention offload: drop --enable-hisparse",
            ))
        if os.environ.get("SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD", "0") not in ("", "0", "false", "False"):
            out.append(cfg.Violation(
                "sglang.npu_sparse_kv_offload",
                "SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD is set (SGLang's in-tree NPU offload)",
                "unset SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD",
            ))
    from .rules.layerwise_prefill import layerwise_violations

    out += layerwise_violations(config, view)
    from .rules.kvpp import kvpp_violations

    out += kvpp_violations(config, view)
    return out


# Ops the offload backend resolves through the operator ladder.
OFFLOAD_OPS = ("lightning_indexer", "sparse_mla_attention", "residency_manage", "copy_miss_rows")


def _host_work_under_graphs(sd: cfg.SparseDecodeOffloadConfig, decode_graph: Any) -> List[cfg.Violation]:
    """Rule ``sglang.sparse_decode_graph`` for the features that do host work between layers
    of a decode step, which a captured step cannot do: one violation per feature that is on."""
    eager = "run decode eagerly (--disable-cuda-graph, or on a CPU without --enable-torch-compile)"
    refusals = [
        (bool(sd.record_trace),
         f"record_trace with decode graphs on (backend {decode_graph!r}): the trace recorder reads each "
         "layer's top-k on the host, which a captured decode step cannot do",
         f"drop record_trace, or {eager}"),
        (sd.verify_sample_rate > 0,
         f"verify_sample_rate={sd.verify_sample_rate} with decode graphs on (backend {decode_graph!r}): shadow "
         "verification recomputes a sampled row between layers on the host, which a captured decode step "
         "cannot do",
         f"set verify_sample_rate to 0, or {eager}"),
        (sd.rank_depth > 0,
         f"policy {sd.policy!r} (rank_depth={sd.rank_depth}) with decode graphs on (backend {decode_graph!r}): "
         "the graph decode path selects top-k only and does not hand the indexer's ranking to the residency "
         "manager",
         f"{eager}, or serve lru / lru_k2_guarded with decode graphs"),
    ]
    return [cfg.Violation("sglang.sparse_decode_graph", problem, fix) for on, problem, fix in refusals if on]


def _device_kind(view: Any) -> str:
    """The served device kind, as the deployment reads it: ``--device`` or this machine's."""
    device = compat.arg(view, "device") or platform.device_kind()
    return "cuda" if device in ("gpu", "rocm", "hip") else str(device)


def _sparse_decode_runtime_violations(sd: cfg.SparseDecodeOffloadConfig, device: str) -> List[cfg.Violation]:
    """Settings the SGLang backend cannot honour here (checked before any process starts);
    ``device``: ``npu`` / ``cuda`` / ``cpu``."""
    from ...ops import registry

    out: List[cfg.Violation] = []
    if sd.indexer_dtype != "bf16":
        out.append(cfg.Violation(
            "sglang.indexer_dtype", f"indexer_dtype={sd.indexer_dtype!r}: the SGLang backend keeps a bf16 "
            "index-K cache (LIM-C8 is not wired into it yet)", 'set "indexer_dtype": "bf16"'))
    if sd.fused_lim is True:
        out.append(cfg.Violation(
            "sglang.fused_not_wired", "fused_lim=true: the SGLang backend does not call the fused AscendC "
            "LIM operator yet", 'drop "fused_lim" (ops=npu uses the torch_npu operators)'))
    registry.ensure_registered()
    if cfg.fused_copy_sfa_required(sd, device):
        fused = registry.implementations("copy_sparse_flash_attention").get("fused")
        reason = "no fused rung is registered" if fused is None else fused.unavailable()
        if reason is not None:
            why = "fused_copy_sfa=true" if sd.fused_copy_sfa else \
                f"the fused Copy-SFA operator (the default on an Ascend NPU with ops={sd.ops!r})"
            out.append(cfg.Violation(
                "sglang.fused_unavailable", f"{why} cannot run: {reason}",
                "build and install the AscendC extension (bash scripts/setup_npu_env.sh, or "
                "ascendc_ops/build.sh --install), or set \"fused_copy_sfa\": false to run the separate miss "
                "copy and sparse attention"))
    for op in OFFLOAD_OPS:
        try:
            registry.select(op, sd.ops)
        except (registry.OpUnavailableError, KeyError, ValueError) as exc:
            out.append(cfg.Violation("sglang.ops_unavailable", f"ops={sd.ops!r}: {exc}",
                                     'use "ops": "auto" or install what the message names'))
    return out


def check(server_args: Any) -> Optional[cfg.OffloadConfig]:
    """Validate the requested config against the resolved ``server_args``.

    Raises :class:`ConfigError` with every problem; otherwise publishes the config
    (or clears it when every feature is off) and returns it.
    """
    from sglang.srt.arg_groups.model_override_base import resolving_view

    config, problems = requested_config()
    if config == cfg.OffloadConfig() and not problems:
        carrier.clear()
        return None
    view = resolving_view(server_args)
    from ... import SUPPORTED_SGLANG_VERSION
    from .rules import pd_transfer as pd_rules  # P/D backend facts and rules

    problems += [cfg.Violation("sglang.compat", p, f"run SGLang {SUPPORTED_SGLANG_VERSION} "
                               f"(pip install sglang=={SUPPORTED_SGLANG_VERSION}) or update the plugin's hooks")
                 for p in compat.problems()]

    deployment = None
    try:
        deployment = pd_rules.with_pd_facts(deployment_from_server_args(server_args), config, server_args)
        problems += cfg.violations(config, deployment)
    except Exception as exc:  # noqa: BLE001 - reported with the rest
        problems.append(cfg.Violation("sglang.deployment", f"cannot read the deployment: {exc}",
                                      "check the model path and server arguments"))
    problems += plugin_violations(config, view)
    problems += pd_rules.pd_violations(config, server_args)
    problems += launch_checks.launch_violations(config, view, _hf_config(server_args), deployment)
    if problems:
        raise cfg.ConfigError(problems, "sglang-ascend-offload configuration")
    config, notes = launch_checks.resolve_defaults(config, deployment)
    for note in notes:
        logger.info("sglang-ascend-offload: default %s", note)
    carrier.publish(config)
    logger.info("sglang-ascend-offload: validated configuration %s", cfg.to_json(config))
    return config


def _hf_config(server_args: Any) -> Any:
    from sglang.srt.arg_groups.model_override_base import model_config_of

    try:
        return model_config_of(server_args).hf_config
    except Exception:  # noqa: BLE001 - model path problems are SGLang's (and the deployment rule's) to report
        return None


def _validate(server_args: Any, previous: Callable[[Any], None]) -> None:
    previous(server_args)
    check(server_args)


_installed = False


def install() -> None:
    """Register the resolution steps (once per process)."""
    global _installed
    if _installed:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_cpu_backends")(_select_backend)
    register_resolution_hook("handle_npu_backends")(_select_backend)
    register_resolution_hook("handle_model_specific_adjustments")(_model_adjustments)
    register_resolution_hook(VALIDATION_STEP)(_validate)
    _installed = True
