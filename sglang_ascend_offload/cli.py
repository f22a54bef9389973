"""``python -m sglang_ascend_offload <command>``.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only wires them up, importing a module only when
its command runs (so ``--help`` is fast and no command pays for another's imports).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import List, Optional

# command name -> (module, one-line help)
COMMANDS = {
    "capacity": ("sglang_ascend_offload.capacity_cli", "KV capacity per mode for a model and a machine"),
    "check-config": ("sglang_ascend_offload.config_cli", "validate an offload config against a deployment"),
    "check-kernels": (
        "sglang_ascend_offload.kernel_check.cli",
        "AscendC kernels on CPU: compile check against the AscendC headers + functional model",
    ),
    "demo": (
        "sglang_ascend_offload.demo",
        "serve the trained tiny checkpoint with offload, send one request, show the answer and the offload",
    ),
    "env": ("sglang_ascend_offload.env_cli", "what this machine can run (device, packages, op rungs)"),
    "size-hot": (
        "sglang_ascend_offload.size_hot_cli",
        "misses vs hot_tokens from a trace: curves, plot, recommended size",
    ),
}
BENCH_COMMANDS = {
    "append-order": (
        "sglang_ascend_offload.bench.append_order",
        "TP-shared host pool: cost of ordering rank 0's appends before the other ranks' reads",
    ),
    "decode": ("sglang_ascend_offload.bench.decode", "replay a top-k trace through the sparse decode engine"),
    "kvpp": ("sglang_ascend_offload.bench.kvpp", "KVPP broadcast + prefetch over gloo: full-layer vs active-block"),
    "kernels": ("sglang_ascend_offload.bench.kernels", "Triton vs reference, per residency/copy kernel"),
    "prefill": ("sglang_ascend_offload.bench.prefill", "layerwise prefill pipeline: footprint and overlap"),
    "serve": (
        "sglang_ascend_offload.bench.serve",
        "served tok/s and latency: offload on/off x eager/graph x speculation, side by side",
    ),
    "soak": (
        "sglang_ascend_offload.bench.soak",
        "served offload under churn for minutes: memory growth, leaks, failures",
    ),
    "transfer": ("sglang_ascend_offload.bench.transfer", "P/D transfer engine throughput, overhead and faults"),
}


def _add(sub, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    mod = importlib.import_module(module)
    mod.add_arguments(p)
    p.set_defaults(_module=module)


def build_parser(argv: List[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_ascend_offload")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Import only the module of the command being run; list the rest by name.
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if wanted in (None, name):
            _add(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks (side-by-side ratios in one run)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_wanted = argv[argv.index("bench") + 1] if "bench" in argv and argv.index("bench") + 1 < len(argv) else None
    for name, (module, help_text) in BENCH_COMMANDS.items():
        if wanted == "bench" and bench_wanted in (None, name, "-h", "--help"):
            _add(bench_sub, name, module, help_text)
        else:
            bench_sub.add_parser(name, help=help_text)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(module).main(args) or 0)
    except FileNotFoundError as exc:
        if type(exc).__name__ != "FixtureMissing":  # the CPU benchmarks' models (testing/servers.py)
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
