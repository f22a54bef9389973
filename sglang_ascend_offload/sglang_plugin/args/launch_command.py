"""A launch command's verdict, decided in this process the way the server's launcher
decides it, before any process starts (``check-config --launch``).

:func:`split_command` reads the command: ``python -m sglang.launch_server ARGS``, ``sglang
serve [MODEL] ARGS`` or the bare ``ARGS``, after optional ``NAME=value`` environment
assignments. :func:`decide` then runs what ``python -m sglang.launch_server`` runs up to
the point where it would start the scheduler processes:

1. SGLang's ``load_plugins()``, which registers this plugin's flags and resolution steps
   (``sglang_plugin/install.py``), as in every SGLang process;
2. SGLang's ``prepare_server_args(ARGS)``: its own parser, with the plugin's flags;
3. ``ServerArgs.resolve_once()``: SGLang's argument resolution, which reads the model's
   ``config.json`` and ends with the plugin's validation step (:func:`.resolution.check`):
   the deployment rules on the facts read from the resolved arguments, the server rules
   (:mod:`.rules`, :mod:`.launch_checks`), the installed CANN build's SoC and the
   ``_C_ascend`` operators, read as the server reads them.

The environment assignments apply while it runs; nothing is spawned or allocated. Two
questions the launcher asks the device itself are answered without it
(:func:`without_device`): the NPU's memory capacity, from which SGLang picks its
chunked-prefill and graph batch-size defaults (no rule reads them; answered as
:data:`UNQUERIED_NPU_CAPACITY_MB`, after the same ``import torch_npu`` SGLang's query
does), and the device's SoC name, with which the server cross-checks the installed
build's SoC. Where that cross-check alone can decide the SoC (a build carrying the
operators of several A2/A3 families), ``sparse_decode.soc_unknown`` is not a refusal here
but undecided (:data:`LaunchVerdict.undecided`).

What the running server decides after this point is in
:data:`sglang_ascend_offload.rules.DECIDED_AFTER_LAUNCH`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ... import cann_install, platform
from ... import config as cfg
from ...rules import violation

__all__ = [
    "LaunchVerdict",
    "split_command",
    "decide",
    "without_device",
    "soc_left_to_the_device",
    "UNQUERIED_NPU_CAPACITY_MB",
]

logger = logging.getLogger(__name__)

#: The NPU memory capacity (MiB) SGLang's resolution is told instead of asking the device:
#: an Atlas A2 / A3 die's 64 GiB (it only picks SGLang's chunked-prefill and decode-graph
#: batch-size defaults, which no rule of the plugin reads).
UNQUERIED_NPU_CAPACITY_MB = 64 * 1024
#: Where SGLang 0.5.23 binds its NPU capacity query (``get_npu_memory_capacity``): its
#: definition, and the NPU defaults step that imported it by name.
_NPU_CAPACITY_HOLDERS = ("sglang.srt.utils.common", "sglang.srt.hardware_backend.npu.utils")
_LAUNCHERS = (("-m", "sglang.launch_server"), ("serve",))


@dataclass
class LaunchVerdict:
    """What the launcher decides about one launch command.

    argv: SGLang's arguments. violations: every rule the launch breaks (empty: the
    launcher would start its processes). config: the offload config as published to the
    server's processes when accepted (defaults resolved), else as requested. deployment:
    the facts read from the resolved arguments (``None`` when unreadable). hf_config: the
    model's HF config as SGLang read it (``None`` when unreadable). view: SGLang's
    resolved arguments (``None`` when its parser refused the command). undecided: rule
    ids that only the device could decide here (see the module docstring).
    """

    argv: Tuple[str, ...]
    violations: List[cfg.Violation]
    config: cfg.OffloadConfig = field(default_factory=cfg.OffloadConfig)
    deployment: Optional[cfg.Deployment] = None
    hf_config: Any = None
    view: Any = None
    undecided: Tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def max_total_tokens(self) -> Optional[int]:
        """SGLang's token capacity where the launch gives it (``--max-total-tokens``), else
        ``None``: its KV-pool sizing decides it in the scheduler."""
        from .. import compat

        total = compat.arg(self.view, "max_total_tokens") if self.view is not None else None
        return int(total) if total else None

    def hot_buffer_plan(self, running_requests: int):
        """The hot-buffer plan of this launch for ``running_requests`` requests (the startup
        memory check's, :func:`.launch_checks.smallest_hot_plan`, which plans one), or
        ``None`` without sparse decode offload or the model's facts."""
        from .launch_checks import smallest_hot_plan

        sd = self.config.sparse_decode
        if sd is None or self.deployment is None or self.view is None or self.deployment.index_topk is None:
            return None
        return smallest_hot_plan(sd, self.view, self.hf_config, self.deployment).with_running_requests(running_requests)


def _launch_problem(problem: str) -> cfg.ConfigError:
    return cfg.ConfigError([violation("check_config.launch", problem)], "launch command")


def split_command(command: Union[str, Sequence[str]]) -> Tuple[Dict[str, str], List[str]]:
    """``(environment assignments, SGLang's arguments)`` of a launch command (a shell
    line, or its words); :class:`ConfigError` (``check_config.launch``) when it is not one."""
    try:
        words = shlex.split(command) if isinstance(command, str) else list(command)
    except ValueError as exc:
        raise _launch_problem(f"cannot split the launch command: {exc}") from exc
    env: Dict[str, str] = {}
    while words and "=" in words[0] and not words[0].startswith("-") and words[0].split("=")[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if not words:
        raise _launch_problem("the launch command is empty")
    if words[0].startswith("-"):
        return env, words
    for i in range(len(words)):
        for launcher in _LAUNCHERS:
            if tuple(words[i : i + len(launcher)]) == launcher:
                return env, _serve_args(words[i + len(launcher) :]) if launcher == ("serve",) else words[i + 2 :]
    raise _launch_problem(
        f"{' '.join(words[:3])} ... is not an SGLang launch command: pass python -m sglang.launch_server ARGS, "
        "sglang serve ARGS, or the bare ARGS"
    )


def _serve_args(words: List[str]) -> List[str]:
    """``sglang serve``'s arguments as ``launch_server``'s: a leading positional model path
    becomes ``--model-path``; ``--model-type`` may only name the language-model server."""
    if words and not words[0].startswith("-"):
        words = ["--model-path", *words]
    if "--model-type" in words:
        at = words.index("--model-type")
        kind = words[at + 1] if at + 1 < len(words) else ""
        if kind not in ("auto", "llm"):
            raise _launch_problem(f"--model-type {kind!r}: the plugin serves SGLang's language-model server (llm)")
        del words[at : at + 2]
    return words


@contextlib.contextmanager
def without_device() -> Iterator[None]:
    """Within the block neither SGLang's NPU capacity query nor the SoC cross-check asks
    the device (module docstring). The query still imports ``torch_npu`` first, so a
    machine without it is refused as SGLang refuses it."""
    import importlib

    def capacity_without_device() -> int:
        try:
            import torch_npu  # noqa: F401 - SGLang's query imports it first, and refuses without it
        except ImportError as exc:
            raise ImportError("torch_npu is required when run on npu device.") from exc
        return UNQUERIED_NPU_CAPACITY_MB

    holders = [importlib.import_module(name) for name in _NPU_CAPACITY_HOLDERS]
    saved = [module.get_npu_memory_capacity for module in holders]  # strict: SGLang renamed it
    for module in holders:
        module.get_npu_memory_capacity = capacity_without_device
    try:
        with platform.without_device_queries():
            yield
    finally:
        for module, original in zip(holders, saved):
            module.get_npu_memory_capacity = original


@contextlib.contextmanager
def _environment(assignments: Dict[str, str]) -> Iterator[None]:
    """The launch command's ``NAME=value`` assignments in ``os.environ`` within the block."""
    saved = {name: os.environ.get(name) for name in assignments}
    os.environ.update(assignments)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _plugin_state() -> Iterator[None]:
    """No flags remembered before or after, and the published config as it was: the
    validation step publishes an accepted config in ``os.environ`` for the processes it
    would start; this process starts none."""
    from . import carrier, flags

    before = os.environ.get(carrier.CONFIG_ENV)
    flags.forget()
    try:
        yield
    finally:
        flags.forget()
        os.environ.pop(carrier.CONFIG_ENV, None)
        if before is not None:
            os.environ[carrier.CONFIG_ENV] = before


def _parse(argv: List[str]) -> Tuple[Any, List[cfg.Violation]]:
    """SGLang's ``ServerArgs`` from its own parser (``None`` and the parser's message when
    it refuses). SGLang's parser also configures logging: this process's is kept."""
    from sglang.srt.server_args import prepare_server_args

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return prepare_server_args(argv), []
    except SystemExit:
        message = [line for line in err.getvalue().splitlines() if line.strip()]
        return None, [violation("check_config.launch", message[-1] if message else "SGLang's parser exited")]
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _resolve(server_args: Any) -> List[cfg.Violation]:
    """``ServerArgs.resolve_once()``, the launcher's validation: the plugin's violations,
    or SGLang's own refusal as ``sglang.server_args``."""
    try:
        server_args.resolve_once()
    except cfg.ConfigError as exc:
        return list(exc.violations)
    except Exception as exc:  # noqa: BLE001 - SGLang refuses the launch: reported, as the launcher would fail
        return [violation("sglang.server_args", f"{type(exc).__name__}: {exc}")]
    return []


def _facts(server_args: Any, config: cfg.OffloadConfig) -> Tuple[Optional[cfg.Deployment], Any, Any]:
    """``(deployment facts, HF config, resolved view)`` as the validation step read them
    (each ``None`` where unreadable: the verdict already says why)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view

    from .deployment import deployment_from_server_args
    from .rules.pd_transfer import with_pd_facts

    out: List[Any] = []
    for read in (
        lambda: with_pd_facts(deployment_from_server_args(server_args), config, server_args),
        lambda: model_config_of(server_args).hf_config,
        lambda: resolving_view(server_args),
    ):
        try:
            out.append(read())
        except Exception:  # noqa: BLE001 - unreadable facts are the verdict's to report
            out.append(None)
    return out[0], out[1], out[2]


def soc_left_to_the_device(violations: List[cfg.Violation]) -> Tuple[List[cfg.Violation], Tuple[str, ...]]:
    """``sparse_decode.soc_unknown`` moved to undecided where the server's cross-check with
    the device's SoC name could decide it: the build carries several A2/A3 families."""
    if not any(v.rule == "sparse_decode.soc_unknown" for v in violations):
        return violations, ()
    families = set(cann_install.detect().installed_families)
    if "950" in families or len(families) < 2:
        return violations, ()
    return [v for v in violations if v.rule != "sparse_decode.soc_unknown"], ("sparse_decode.soc_unknown",)


def decide(command: Union[str, Sequence[str]]) -> LaunchVerdict:
    """The launcher's verdict on ``command`` (module docstring), without starting anything."""
    from sglang.srt.plugins import load_plugins

    from . import carrier
    from .resolution import requested_config

    try:
        env, argv = split_command(command)
    except cfg.ConfigError as exc:
        return LaunchVerdict((), list(exc.violations))
    with _environment(env), contextlib.redirect_stdout(sys.stderr), _plugin_state(), without_device():
        load_plugins()
        server_args, problems = _parse(argv)
        if server_args is None:
            return LaunchVerdict(tuple(argv), problems)
        config, _ = requested_config()
        problems += _resolve(server_args)
        published = carrier.published_text()
        if not problems and published is not None:
            config = cfg.parse_config(published)
        deployment, hf_config, view = _facts(server_args, config)
        problems, undecided = soc_left_to_the_device(problems)
    return LaunchVerdict(tuple(argv), problems, config, deployment, hf_config, view, undecided)
