"""``python -m sglang_ascend_offload env``: what this machine can run.

Reports the device, installed packages that matter, and for every op of the
operator ladder which rungs are usable here (and why not).
"""

from __future__ import annotations

import argparse
import json
import sys

from . import SUPPORTED_SGLANG_VERSION, platform
from .errors import ConfigError
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
        help="pre-flight of an Ascend node: each capability the features need (the kernel qualification of "
        "--config included), pass / fail with the fix / unknown with the reason (exit 1 when any fails or is "
        "unknown)",
    )
    group = parser.add_argument_group("--npu-check options")
    group.add_argument(
        "--allow-unknown",
        action="store_true",
        help="exit 0 when no check fails even if some could not be checked (unknown, each with its reason)",
    )
    group.add_argument(
        "--config",
        help='offload config whose fused ops are qualified: JSON or @file, e.g. \'{"sparse_decode": '
        '{"hot_tokens": 4096}}\' (default: the sparse decode defaults; a config without sparse_decode: none)',
    )
    group.add_argument(
        "--model", default="deepseek-v3.2", help="model preset or path to its config.json (default deepseek-v3.2)"
    )
    group.add_argument("--heads", type=int, default=16, help="attention heads per rank (default 16: 128 at TP 8)")
    group.add_argument("--page-size", type=int, default=128, help="KV page size (default 128)")
    group.add_argument("--verify-rows", type=int, default=1, help="speculative verify rows per request (default 1)")
    parser.add_argument(
        "--npu-api",
        action="store_true",
        help="check every memfabric/memcache/torch_npu/SGLang-NPU call in the source against "
        "the real APIs (exit 1 when any use is unknown)",
    )


def _qualify_request(args):
    """The :class:`~.npu_preflight.QualifyRequest` of ``--config`` / ``--model`` / ``--heads``
    / ``--page-size`` / ``--verify-rows``."""
    import os

    from .config import SparseDecodeOffloadConfig, parse_config
    from .model_specs import load_hf_config, preset
    from .npu_preflight import QualifyRequest

    for name in ("heads", "page_size", "verify_rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    sparse_decode = SparseDecodeOffloadConfig() if args.config is None else parse_config(args.config).sparse_decode
    model = load_hf_config(args.model) if os.path.isfile(args.model) else preset(args.model)
    return QualifyRequest(sparse_decode, model, args.heads, args.page_size, args.verify_rows)


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

        try:
            request = _qualify_request(args)
        except (ConfigError, ValueError, OSError) as exc:
            print(f"env --npu-check: {exc}", file=sys.stderr)
            return 2
        return npu_preflight.main(as_json=args.json, allow_unknown=args.allow_unknown, qualification=request)
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
