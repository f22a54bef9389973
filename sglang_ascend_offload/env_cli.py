"""``python -m sglang_ascend_offload env``: what this machine can run.

Reports the device, installed packages that matter, and for every op of the
operator ladder which rungs are usable here (and why not).
"""

from __future__ import annotations

import argparse
import json

from . import SUPPORTED_SGLANG_VERSION, platform
from .ops import registry
from .versions import installed_version

_PACKAGES = (
    "torch",
    "torch-npu",
    "triton",
    "triton-ascend",
    "sglang",
    "memfabric-hybrid",
    "memcache-hybrid",
    "mooncake-transfer-engine-non-cuda",
    "msgspec",
    "pyzmq",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--npu-check",
        action="store_true",
        help="pre-flight of an Ascend node: each capability the features need, pass/fail and the fix "
        "(exit 1 when any fails)",
    )
    parser.add_argument(
        "--npu-api",
        action="store_true",
        help="check every memfabric/memcache/torch_npu/SGLang-NPU call in the source against "
        "the real APIs (exit 1 when any use is unknown)",
    )


def collect() -> dict:
    packages = {}
    for name in _PACKAGES:
        packages[name] = installed_version(name)
    ops = {}
    for op in registry.ops():
        ops[op] = {
            rung: (impl.unavailable() or "usable") for rung, impl in sorted(registry.implementations(op).items())
        }
    info = platform.describe()
    info["packages"] = packages
    info["sglang_supported"] = SUPPORTED_SGLANG_VERSION
    info["ops"] = ops
    return info


def main(args: argparse.Namespace) -> int:
    if getattr(args, "npu_check", False):
        from . import npu_preflight  # noqa: PLC0415 - only this flag pays for its imports

        return npu_preflight.main(as_json=args.json)
    if getattr(args, "npu_api", False):
        from .npu_api import report  # noqa: PLC0415 - only this flag pays for its imports

        result = report.collect()
        print(json.dumps(result.as_dict(), indent=2) if args.json else report.format_human(result))
        return 1 if result.unknown else 0
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"device: {info['device_kind']}  soc: {info['soc_name'] or '-'}  torch: {info['torch']}")
    sg = info["packages"].get("sglang")
    note = "" if sg in (None, SUPPORTED_SGLANG_VERSION) else f"  (plugin supports {SUPPORTED_SGLANG_VERSION})"
    print(f"sglang: {sg or 'not installed'}{note}")
    for name, ver in info["packages"].items():
        if name not in ("torch", "sglang"):
            print(f"  {name:36s} {ver or '-'}")
    print("operator ladder:")
    for op, rungs in info["ops"].items():
        print(f"  {op}")
        for rung, state in rungs.items():
            print(f"    {rung:10s} {state}")
    return 0
