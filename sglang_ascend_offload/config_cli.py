"""``python -m sglang_ascend_offload check-config``: every rule a config breaks, or ``ok``.

Two forms:

* ``--config JSON|@file --deployment JSON|@file``: the deployment-scope rules on the given
  facts (``config.violations``, the function the server's startup runs on the facts it
  reads). The server-scope rules need the launch itself and are listed as undecided.
* ``--launch "python -m sglang.launch_server ARGS"`` (or ``-- ARGS``): the launch
  command decided in this process as the server's launcher decides it, before it would
  start any process (``sglang_plugin/args/launch_command.py``): SGLang's own parser and
  argument resolution, the model's ``config.json``, every deployment and server rule,
  the installed CANN build's SoC and ``_C_ascend`` operators as the server reads them;
  nothing started, no device touched.

Prints ``ok`` and exits 0 when no rule is broken; otherwise prints every violation (rule
id, problem, what to change) and exits 1. Malformed input (unknown keys, wrong types, a
command SGLang's parser refuses) is reported the same way, all problems at once. Rules
that only the running server decides (``rules.DECIDED_AFTER_LAUNCH``: its KV-pool sizing,
the pool's allocation, the kernel qualification, the P/D handshake) are listed as
``undecided`` with what decides each, where they apply: ``ok`` claims only what was
checked.

With ``--model`` / ``--model-config`` (the model's shape, as ``capacity`` reads it; with
``--launch``, the launch's model) and a ``sparse_decode`` section, it also states the hot
buffers the server would allocate: the hot-buffer plan (``sparse_decode/sizing.py``) for
``--requests`` running requests (default 1, the smallest server the startup memory check
plans) and, on a P/D decode, SGLang's ``--disaggregation-decode-extra-slots``
(``--decode-extra-slots``; with ``--launch``, the launch's): a line after ``ok``, or
``"hot_buffer"`` in the JSON (``null`` without a model or with violations).

``--json`` prints one document: ``{"ok": bool, "violations": [{"rule", "problem", "fix"}],
"hot_buffer": {...} | null, "undecided": [{"rule", "requires", "decided_by"}]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .config import ConfigError, Deployment, OffloadConfig, parse_config, parse_deployment, to_dict, validate
from .errors import Violation
from .memory_budget import format_bytes
from .model_specs import PRESETS, ModelShape, load_hf_config, preset
from .rules import DECIDED_AFTER_LAUNCH, RULES, ids_in_scope, violation
from .sparse_decode.sizing import HotBufferPlan, pre_alloc_slots

#: What decides a server-scope rule when check-config is given deployment facts only.
LAUNCH_DECIDES = "the launch command (SGLang's resolved arguments, the model's config.json, this machine's " + (
    "packages): check-config --launch decides it"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help='offload config: JSON or @file, e.g. \'{"sparse_decode": {"hot_tokens": 4096}}\'',
    )
    parser.add_argument(
        "--deployment",
        help='deployment facts: JSON or @file, e.g. \'{"device": "npu", "soc": "A3", "tp": 8}\'',
    )
    parser.add_argument(
        "--launch",
        metavar="COMMAND",
        help="instead of --config / --deployment: the server's launch command, decided as its launcher decides "
        'it (e.g. "python -m sglang.launch_server --model-path M --enable-sparse-decode-offload ..."); or '
        "give its arguments after --",
    )
    parser.add_argument("launch_args", nargs="*", metavar="-- ARGS", help=argparse.SUPPRESS)
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"ok": bool, "violations": [{"rule", "problem", "fix"}], "hot_buffer": {...} | null, '
        '"undecided": [{"rule", "requires", "decided_by"}]}',
    )
    sizing = parser.add_argument_group("hot-buffer sizing (sparse decode offload)")
    sizing.add_argument("--model", help=f"model preset for the hot-buffer plan: {', '.join(sorted(PRESETS))}")
    sizing.add_argument("--model-config", metavar="PATH", help="HuggingFace config.json (or its directory) instead")
    sizing.add_argument("--requests", type=int, default=1, help="running requests to plan for (default 1)")
    sizing.add_argument(
        "--decode-extra-slots",
        type=int,
        default=0,
        help="SGLang's --disaggregation-decode-extra-slots (counted on a deployment with pd_role decode)",
    )


def _model(args: argparse.Namespace) -> Optional[ModelShape]:
    if args.model and args.model_config:
        raise ConfigError([violation("capacity.model", "both --model and --model-config given", "pass one of them")])
    if args.model_config:
        return load_hf_config(args.model_config)
    return preset(args.model) if args.model else None


def _with_model(deployment: Deployment, model: ModelShape) -> Tuple[Deployment, List[Violation]]:
    """The deployment with the model's layers and top-k where it leaves them out; a
    deployment that states other values is a problem."""
    facts = {"num_layers": model.num_layers, "index_topk": model.index_topk}
    problems = [
        violation(
            "check_config.model",
            f"the deployment's {name}={getattr(deployment, name)} but {model.name} has {value}",
            f"drop {name} from the deployment or pass its model",
        )
        for name, value in facts.items()
        if getattr(deployment, name) is not None and getattr(deployment, name) != value
    ]
    missing = {name: value for name, value in facts.items() if getattr(deployment, name) is None}
    return dataclasses.replace(deployment, **missing), problems


def hot_buffer_plan(
    config: OffloadConfig, deployment: Deployment, model: ModelShape, requests: int, decode_extra_slots: int
) -> Optional[HotBufferPlan]:
    """The hot-buffer plan of ``config`` on ``deployment`` serving ``model`` (``None``
    without sparse decode offload)."""
    sd = config.sparse_decode
    if sd is None:
        return None
    return HotBufferPlan.build(
        configured_hot_tokens=sd.hot_tokens,
        top_k=model.index_topk,
        page_size=deployment.page_size,
        verify_rows=deployment.verify_rows,
        layers=model.num_layers,
        row_dim=model.main_kv_dim,
        running_requests=requests,
        pre_alloc_slots=pre_alloc_slots(deployment.pd_role, decode_extra_slots),
    )


def _read(read: Callable[[], Any], problems: List[Violation]) -> Any:
    """``read()``, or ``None`` with its problems added to ``problems``."""
    try:
        return read()
    except ConfigError as exc:
        problems += exc.violations
        return None


def _parse(args: argparse.Namespace):
    """``(config, deployment, model, problems)`` from the flags (``None`` where unreadable)."""
    problems: List[Violation] = []
    config = _read(lambda: parse_config(args.config), problems)
    deployment = _read(lambda: parse_deployment(args.deployment), problems)
    model = _read(lambda: _model(args), problems)
    if args.requests < 1 or args.decode_extra_slots < 0:
        problems.append(
            violation(
                "check_config.count",
                f"--requests {args.requests}, --decode-extra-slots {args.decode_extra_slots}",
                "pass --requests >= 1 and --decode-extra-slots >= 0",
            )
        )
    if model is not None and deployment is not None:
        deployment, found = _with_model(deployment, model)
        problems += found
    return config, deployment, model, problems


def _qualifies(config: OffloadConfig, deployment: Deployment) -> bool:
    """Whether the served engine's plan selects a fused operator the startup qualifies
    (availability aside: a missing one is a refusal of its own)."""
    from .config import residency_shape
    from .sparse_decode.op_selection import select_for_config

    sd = config.sparse_decode
    if sd is None or not sd.qualify_kernels:
        return False
    plan = select_for_config(
        sd,
        deployment.device,
        rows_per_request=deployment.verify_rows,
        tensor_pool=deployment.host_pool_tensor_view,
        available=lambda op: None,
        **residency_shape(sd, deployment),
    )
    return plan.indexer.fused or plan.attention.fused


def after_launch_rules(
    config: OffloadConfig, deployment: Optional[Deployment], *, total_tokens_given: bool, launch: bool
) -> List[str]:
    """The rules of :data:`~.rules.DECIDED_AFTER_LAUNCH` that apply to ``config`` on
    ``deployment``. total_tokens_given: SGLang's token capacity is known (``--max-total-tokens``
    in a launch). launch: the facts were read from a launch (the SoC from the installed
    build, without the device's own name) rather than given."""
    out: List[str] = []
    sd, pd = config.sparse_decode, config.pd_transfer
    if sd is not None:
        out += ["memory.device_budget", "memory.insufficient"]
        if sd.host_pool_tokens is not None and not total_tokens_given:
            out.append("sparse_decode.host_pool_tokens")
        if deployment is not None and _qualifies(config, deployment):
            out.append("sparse_decode.kernel_qualification")
        if launch and deployment is not None and deployment.device == "npu":
            out.append("sparse_decode.soc_unknown")
    if pd is not None and deployment is not None and deployment.pd_role != "colocated":
        out += ["pd_transfer.tp_ratio"] if deployment.peer_tp is None and pd.peer_tp is None else []
        out.append("sglang.pd_parallel")
    if pd is not None and pd.engine == "memfabric" and not pd.store_url:
        out.append("sglang.pd_engine_device")
    return out


def undecided(rule_ids: List[str], server_rules_too: bool) -> List[Dict[str, str]]:
    """``[{"rule", "requires", "decided_by"}]`` for ``rule_ids`` (each once), after every
    server-scope rule when ``server_rules_too`` (check-config given facts, not a launch)."""
    decided_by: Dict[str, str] = {}
    if server_rules_too:
        decided_by.update({r: DECIDED_AFTER_LAUNCH.get(r, LAUNCH_DECIDES) for r in ids_in_scope("server")})
    decided_by.update({r: DECIDED_AFTER_LAUNCH[r] for r in rule_ids})
    return [{"rule": r, "requires": RULES[r].requires, "decided_by": text} for r, text in decided_by.items()]


def _facts_verdict(args: argparse.Namespace):
    """``(problems, hot-buffer plan, undecided)`` of ``--config`` on ``--deployment``."""
    config, deployment, model, problems = _parse(args)
    if config is not None and deployment is not None:
        try:
            validate(config, deployment)
        except ConfigError as exc:
            problems += exc.violations
    plan = None
    if not problems and model is not None:
        plan = hot_buffer_plan(config, deployment, model, args.requests, args.decode_extra_slots)
    open_rules: List[Dict[str, str]] = []
    if config is not None and config != OffloadConfig():
        found = after_launch_rules(config, deployment, total_tokens_given=False, launch=False)
        open_rules = undecided(found, server_rules_too=True)
    return problems, plan, open_rules


def _launch_verdict(args: argparse.Namespace):
    """``(problems, hot-buffer plan, undecided)`` of the launch command (``--launch`` or ``-- ARGS``)."""
    from .sglang_plugin.args.launch_command import decide

    problems: List[Violation] = []
    given = [f for f in ("config", "deployment", "model", "model_config") if getattr(args, f) is not None]
    if given or (args.launch is not None and args.launch_args):
        names = ", ".join("--" + f.replace("_", "-") for f in given) or "--launch with -- ARGS"
        problems.append(
            violation(
                "check_config.launch",
                f"{names} with a launch command: the launch names the config, the deployment and the model",
                "pass the launch command alone (--launch COMMAND, or -- ARGS)",
            )
        )
    if args.requests < 1:
        problems.append(violation("check_config.count", f"--requests {args.requests}", "pass --requests >= 1"))
    verdict = decide(args.launch if args.launch is not None else args.launch_args)
    problems += verdict.violations
    plan = verdict.hot_buffer_plan(args.requests) if not problems else None
    found = after_launch_rules(
        verdict.config, verdict.deployment, total_tokens_given=verdict.max_total_tokens is not None, launch=True
    )
    open_rules = undecided(found + list(verdict.undecided), server_rules_too=False)
    return problems, plan, open_rules


def _print_text(problems: List[Violation], plan: Optional[HotBufferPlan], open_rules: List[Dict[str, str]]) -> None:
    if problems:
        print(str(ConfigError(problems)), file=sys.stderr)
        return
    print("ok")
    if plan is not None:
        print(f"hot buffers and residency tables: {format_bytes(plan.device_bytes)} = {plan.formula()}")
    by_launch = [u["rule"] for u in open_rules if u["decided_by"] == LAUNCH_DECIDES]
    if by_launch:
        print(f"undecided: {len(by_launch)} server rules, decided by {LAUNCH_DECIDES}: {', '.join(by_launch)}")
    for u in open_rules:
        if u["decided_by"] != LAUNCH_DECIDES:
            print(f"undecided: {u['rule']}: decided by {u['decided_by']}")


def main(args: argparse.Namespace) -> int:
    if args.launch is not None or args.launch_args:
        problems, plan, open_rules = _launch_verdict(args)
    elif args.config is None or args.deployment is None:
        print("check-config: pass --config and --deployment, or --launch COMMAND (see --help)", file=sys.stderr)
        return 2
    else:
        problems, plan, open_rules = _facts_verdict(args)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not problems,
                    "violations": [to_dict(v) for v in problems],
                    "hot_buffer": plan.to_dict() if plan is not None else None,
                    "undecided": open_rules,
                }
            )
        )
    else:
        _print_text(problems, plan, open_rules)
    return 0 if not problems else 1
