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
    CUDA capability probes (in ``arg_groups/model_hook.py`` and
    ``arg_groups/overrides.py``) answer "no CUDA" instead of raising.
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
from ...rules import violation
from .. import compat
from ..cpu_capability import no_cuda_capability
from ..names import BACKEND_NAME
from . import carrier, flags, launch_checks
from .deployment import deployment_from_server_args, model_kind

logger = logging.getLogger(__name__)


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


def _wants_backend(server_args: Any, view: Any) -> bool:
    """Whether this launch needs the plugin's attention backend: any offload feature on,
    or a DSA model on a CPU (SGLang has no CPU DSA path)."""
    config, _ = requested_config()
    wants = config.sparse_decode is not None or (view.device == "cpu" and _model_is_dsa(server_args))
    wants = wants or config.layerwise_prefill is not None  # the layerwise pool needs our backend
    return wants or config.kvpp is not None  # so does the KVPP pool


def _select_backend(server_args: Any, previous: Callable[[Any], None]) -> None:
    """``handle_cpu_backends``: the plugin's backend where it is wanted and unset, before
    SGLang's CPU defaults (which then keep it)."""
    from sglang.srt.arg_groups.model_override_base import is_attention_backend_not_set, resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    view = resolving_view(server_args)
    if _wants_backend(server_args, view) and is_attention_backend_not_set(view):
        declare_resolution(server_args, "sglang_ascend_offload", attention_backend=BACKEND_NAME)
        logger.info("sglang-ascend-offload: attention backend %s selected", BACKEND_NAME)
    if (
        view.device == "cpu"
        and resolving_view(server_args).attention_backend == BACKEND_NAME
        and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1"
    ):
        raise cfg.ConfigError(
            [
                violation(
                    "sglang.cpu_engine",
                    "--device cpu without SGLANG_USE_CPU_ENGINE=1 (SGLang then does not run its CPU platform)",
                    "export SGLANG_USE_CPU_ENGINE=1 before starting SGLang",
                )
            ],
            "sglang-ascend-offload configuration",
        )
    previous(server_args)


#: The server arguments that name an attention backend (the default and per phase).
BACKEND_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def _select_npu_backend(server_args: Any, previous: Callable[[Any], None]) -> None:
    """``handle_npu_backends``: SGLang's NPU defaults (``set_default_server_args``) declare
    ``ascend`` for the attention, prefill and decode backends, over an explicit
    ``--attention-backend`` too; so on an NPU the plugin declares its backend for all three
    after them, where it is wanted and the launch names no other backend (a launch that
    does is refused by ``sglang.attention_backend``)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    view = resolving_view(server_args)
    chosen = {compat.arg(server_args, name) for name in BACKEND_FIELDS} - {None}  # the launch's own flags
    wants = view.device == "npu" and _wants_backend(server_args, view) and chosen <= {BACKEND_NAME}
    previous(server_args)
    if wants:
        declare_resolution(server_args, "sglang_ascend_offload", **{name: BACKEND_NAME for name in BACKEND_FIELDS})
        logger.info("sglang-ascend-offload: attention backend %s selected (default and per phase)", BACKEND_NAME)


def _model_adjustments(server_args: Any, previous: Callable[[Any], None]) -> None:
    from sglang.srt.arg_groups.model_override_base import resolving_view

    if resolving_view(server_args).device == "cpu":
        with no_cuda_capability():
            previous(server_args)
    else:
        previous(server_args)


# ------------------------------------------------------------------ validation
def startup_violations(
    config: cfg.OffloadConfig, deployment: Optional[cfg.Deployment], server_args: Any, view: Any, hf_config: Any
) -> List[cfg.Violation]:
    """The server's verdict: every rule ``config`` breaks on this launch.

    The deployment-scope rules come from ``config.violations`` on ``deployment`` (the
    facts read from ``view``), the same function ``check-config`` runs, so the two
    verdicts on those rules cannot differ; then the server-scope rules (``rules.py``)
    over ``view`` (SGLang's resolved arguments), ``hf_config`` and this machine.
    ``deployment`` is ``None`` when it could not be read (already reported). The
    server-scope rules live in :mod:`.rules` (one module per feature) and
    :mod:`.launch_checks`.
    """
    from .rules import kvpp, layerwise_prefill, pd_transfer, sparse_decode

    out = [] if deployment is None else cfg.violations(config, deployment)
    out += sparse_decode.sparse_decode_violations(config, view, deployment, hf_config)
    out += layerwise_prefill.layerwise_violations(config, view)
    out += kvpp.kvpp_violations(config, view)
    out += pd_transfer.pd_violations(config, server_args, view)
    out += launch_checks.launch_violations(config, view, hf_config, deployment)
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

    problems += [
        violation(
            "sglang.compat",
            p,
            f"run SGLang {SUPPORTED_SGLANG_VERSION} "
            f"(pip install sglang=={SUPPORTED_SGLANG_VERSION}) or update the plugin's hooks",
        )
        for p in compat.problems()
    ]

    deployment = None
    try:
        deployment = pd_rules.with_pd_facts(deployment_from_server_args(server_args), config, server_args)
    except Exception as exc:  # noqa: BLE001 - reported with the rest
        problems.append(
            violation(
                "sglang.deployment", f"cannot read the deployment: {exc}", "check the model path and server arguments"
            )
        )
    problems += startup_violations(config, deployment, server_args, view, _hf_config(server_args))
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
    register_resolution_hook("handle_npu_backends")(_select_npu_backend)
    register_resolution_hook("handle_model_specific_adjustments")(_model_adjustments)
    register_resolution_hook(compat.VALIDATION_STEP)(_validate)
    _installed = True
