"""``python -m sglang_ascend_offload size-hot --trace FILE``: choose ``hot_tokens`` from a trace.

Misses and hit rate as a function of the hot-buffer size from top-k to ``--max-hot``
(default 8 x top-k): the LRU curve at every size in one pass (stack distances), the
optimum and ``--policy`` s at sampled sizes, the recommended ``hot_tokens`` for
``--target-hit-rate`` with its device bytes per request (capacity planner), and a PNG
figure with ``--plot``. ``--json`` prints exactly one JSON document on stdout
(progress on stderr). Method and caveats: :mod:`.sparse_decode.size_hot`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .sparse_decode.policies import POLICIES

    parser.add_argument(
        "--trace", metavar="FILE", required=True, help=".npz trace (record_trace, or bench decode --save-trace)"
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=sorted(POLICIES),
        default=None,
        help="also replay this policy at the sampled sizes (repeatable; default none: the LRU "
        "curve, the engine's LRU and the optimum only)",
    )
    parser.add_argument("--max-hot", type=int, help="largest size (default 8 x top-k)")
    parser.add_argument(
        "--samples", type=int, default=4, help="sampled sizes for the replayed policies and the optimum"
    )
    parser.add_argument(
        "--target-hit-rate", type=float, help="recommend the smallest hot_tokens reaching this hit rate"
    )
    parser.add_argument("--model", default="deepseek-v3.2", help="model preset for the device bytes per request")
    parser.add_argument("--no-optimum", action="store_true", help="skip the Belady optimum")
    parser.add_argument("--plot", metavar="FILE.png", help="write the curves as a PNG figure (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def _policies(args, trace) -> List[str]:
    if args.policy is not None:
        return list(dict.fromkeys(args.policy))
    return []


def main(args: argparse.Namespace) -> int:
    from .sparse_decode.policies import RankedInputError
    from .sparse_decode.size_hot import size_hot
    from .sparse_decode.trace import TraceError, load_trace

    if args.samples < 1 or (args.max_hot is not None and args.max_hot < 1):
        print("size-hot: --samples and --max-hot must be >= 1", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace)
        res = size_hot(
            trace,
            _policies(args, trace),
            max_hot=args.max_hot,
            samples=args.samples,
            target_hit_rate=args.target_hit_rate,
            model=args.model,
            optimum=not args.no_optimum,
        )
    except (TraceError, RankedInputError, ValueError, KeyError) as exc:
        print(f"size-hot: {exc}", file=sys.stderr)
        return 2
    out = res.as_dict()
    out["trace"] = args.trace
    if args.plot:
        from .bench.plots import plot_size_hot

        plot_size_hot(out, args.plot)
        print(f"size-hot: wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    _print(out)
    return 0


def _print(r) -> None:
    k = r["top_k"]
    print(
        f"trace {r['trace']}: {r['steps']} steps ({r['active_steps']} with work), {r['layers']} layers, "
        f"{r['rows']} rows ({r['active_rows']} ever active), top-k {k}, rank depth {r['rank_depth']}; "
        f"{r['selected']} selections"
    )
    sampled = r["sampled"]
    names = list(sampled)
    print(f"\n{'hot_tokens':>10}{'LRU curve':>12}{'hit rate':>10}" + "".join(f"{n:>20}" for n in names))
    for h in sorted({int(x) for n in names for x in sampled[n]} | {2 * k} & set(r["hot_tokens"])):
        i = h - k
        row = f"{h:>10}{r['lru_misses'][i]:>12}{r['lru_hit_rate'][i]:>10.4f}"
        for n in names:
            m = sampled[n].get(str(h))
            row += f"{'' if m is None else m:>20}"
        print(row)
    rec = r.get("recommended")
    if rec:
        if rec.get("hot_tokens"):
            print(
                f"\nrecommended hot_tokens for hit rate >= {rec['target_hit_rate']}: {rec['hot_tokens']} "
                f"(LRU hit rate {rec['hit_rate']:.4f}); device bytes per request ({rec['model']}): "
                f"{rec['device_bytes_per_request'] / 2**20:.1f} MiB"
            )
        else:
            print(f"\nno recommendation: {rec['reason']}")
    print(
        "\nwall seconds: "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["seconds"].items())
        + f"; CPU seconds (this process) {r['cpu_seconds']:.1f}"
    )
