"""``python -m sglang_ascend_offload check-config --config JSON|@file --deployment JSON|@file``.

Prints ``ok`` and exits 0 when the deployment can run the config; otherwise prints
every violation (rule id, problem, what to change) and exits 1. Malformed input
(unknown keys, wrong types) is reported the same way, all problems at once.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, parse_config, parse_deployment, to_dict, validate


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
        "--json", action="store_true", help='print {"ok": bool, "violations": [{"rule", "problem", "fix"}]}'
    )


def main(args: argparse.Namespace) -> int:
    problems = []
    config = deployment = None
    try:
        config = parse_config(args.config)
    except ConfigError as exc:
        problems += exc.violations
    try:
        deployment = parse_deployment(args.deployment)
    except ConfigError as exc:
        problems += exc.violations
    if config is not None and deployment is not None:
        try:
            validate(config, deployment)
        except ConfigError as exc:
            problems += exc.violations
    if args.json:
        print(json.dumps({"ok": not problems, "violations": [to_dict(v) for v in problems]}))
    elif problems:
        print(str(ConfigError(problems)), file=sys.stderr)
    else:
        print("ok")
    return 0 if not problems else 1
