"""``python -m sglang_ascend_offload check-config --config JSON|@file --deployment JSON|@file``.

Prints ``ok`` and exits 0 when the deployment can run the config; otherwise prints
every violation (rule id, problem, what to change) and exits 1. Malformed input
(unknown keys, wrong types) is reported the same way, all problems at once.

With ``--model`` / ``--model-config`` (the model's shape, as ``capacity`` reads it) and a
``sparse_decode`` section, it also states the hot buffers the server would allocate: the
hot-buffer plan (``sparse_decode/sizing.py``) for ``--requests`` running requests (default
1, the smallest server the startup memory check plans) and, on a P/D decode, SGLang's
``--disaggregation-decode-extra-slots`` (``--decode-extra-slots``): a line after ``ok``,
or ``"hot_buffer"`` in the JSON (``null`` without a model or with violations).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable, List, Optional, Tuple

from .config import ConfigError, Deployment, OffloadConfig, parse_config, parse_deployment, to_dict, validate
from .errors import Violation
from .memory_budget import format_bytes
from .model_specs import PRESETS, ModelShape, load_hf_config, preset
from .rules import violation
from .sparse_decode.sizing import HotBufferPlan, pre_alloc_slots


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        help='offload config: JSON or @file, e.g. \'{"sparse_decode": {"hot_tokens": 4096}}\'',
    )
    parser.add_argument(
        "--deployment",
        required=True,
        help='deployment facts: JSON or @file, e.g. \'{"device": "npu", "soc": "A3", "tp": 8}\'',
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"ok": bool, "violations": [{"rule", "problem", "fix"}], "hot_buffer": {...} | null}',
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


def main(args: argparse.Namespace) -> int:
    config, deployment, model, problems = _parse(args)
    if config is not None and deployment is not None:
        try:
            validate(config, deployment)
        except ConfigError as exc:
            problems += exc.violations
    plan = None
    if not problems and model is not None:
        plan = hot_buffer_plan(config, deployment, model, args.requests, args.decode_extra_slots)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not problems,
                    "violations": [to_dict(v) for v in problems],
                    "hot_buffer": plan.to_dict() if plan is not None else None,
                }
            )
        )
    elif problems:
        print(str(ConfigError(problems)), file=sys.stderr)
    else:
        print("ok")
        if plan is not None:
            print(f"hot buffers and residency tables: {format_bytes(plan.device_bytes)} = {plan.formula()}")
    return 0 if not problems else 1
