"""``bench kernels --qualify``: the kernel qualification a server runs at startup, on demand.

Every fused op (LIM, LIM-C8, Copy-SFA) runs once on the qualification problem
(``ops/qualify_problem.py``) at one served shape -- by default DeepSeek-V3.2's (top-k 2048,
4096 hot slots, 64 x 128 index heads, page 128, 16 attention heads per rank) -- and is
compared with the separate operators on the same inputs (``ops/qualify.py``). Reported
per op: ``qualified``, ``seconds``, what it was compared with, what the problem exercised,
the worst attention error and, when it fails, the first difference.

On an NPU the fused ops are the built ``_C_ascend`` extension (selected as the server
selects them: ``ops=auto``); on a CPU they are the same kernel sources on the AscendC
functional model (``ops=fused``), whose time is the model's, not a kernel's.

Exit status: 0 when every op qualified, 1 when one failed, 2 when the fused ops cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Tuple

from .. import platform

CPU_NOTE = "the fused ops ran on the AscendC functional model: seconds are the model's, not a kernel's"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kernel qualification (--qualify; also uses --top-k, --hot-tokens, --heads)")
    group.add_argument(
        "--qualify", action="store_true", help="qualify every fused op at one served shape, as server startup does"
    )
    group.add_argument("--index-heads", type=int, default=64, help="indexer query heads (default 64)")
    group.add_argument("--page-size", type=int, default=128, help="index-K cache block size (default 128)")
    group.add_argument("--verify-rows", type=int, default=1, help="verify rows per request (default 1)")
    group.add_argument(
        "--indexer-dtype", choices=("bf16", "int8", "both"), default="both", help="LIM, LIM-C8 or both (default)"
    )


def input_problems(args) -> List[str]:
    return [
        f"--{n.replace('_', '-')} must be >= 1"
        for n in ("index_heads", "page_size", "verify_rows")
        if getattr(args, n) < 1
    ]


def _plans(args, shape_of) -> List[Tuple[object, object]]:
    """``(plan, shape)`` per indexer dtype asked for; Copy-SFA in the first plan only."""
    from ..sparse_decode.op_selection import select_ops

    kind = platform.device_kind()
    out = []
    for i, dtype in enumerate(("bf16", "int8") if args.indexer_dtype == "both" else (args.indexer_dtype,)):
        shape = shape_of(dtype)
        plan = select_ops(
            kind,
            ops="fused" if kind != "npu" else "auto",
            indexer_dtype=dtype,
            rows_per_request=shape.rows_per_request,
            hot_tokens=shape.hot_tokens,
            top_k=shape.top_k,
            fused_lim=True,
            fused_copy_sfa=i == 0,
        ).check()
        out.append((plan, shape))
    return out


def run(args) -> dict:
    """The JSON document: device, what ran the fused ops, the shape, one entry per fused op."""
    from ..ops import qualify
    from ..ops.qualify_problem import ServedShape
    from ..sparse_decode.sizing import resolve_hot_tokens

    top_k = args.top_k or 2048

    def shape_of(dtype: str) -> ServedShape:
        return ServedShape(
            hot_tokens=resolve_hot_tokens(args.hot_tokens, top_k, args.page_size),
            top_k=top_k,
            rows_per_request=args.verify_rows,
            indexer_dtype=dtype,
            page_size=args.page_size,
            index_heads=args.index_heads,
            heads=args.heads,
        )

    entries = []
    for plan, shape in _plans(args, shape_of):
        entries += [r.as_dict() for r in qualify.qualify_plan(plan, shape)]
    kind = platform.device_kind()
    shape = shape_of("bf16").as_dict()
    shape.pop("indexer_dtype")
    return {
        "device": kind,
        "fused_backend": "AscendC extension _C_ascend" if kind == "npu" else "CPU functional model",
        "note": CPU_NOTE if kind != "npu" else "",
        "shape": shape,
        "ops": entries,
        "all_qualified": all(e["qualified"] for e in entries),
    }


def print_table(doc: dict) -> None:
    s = doc["shape"]
    print(
        f"kernel qualification on {doc['device']} ({doc['fused_backend']}): hot_tokens {s['hot_tokens']}, "
        f"top-k {s['top_k']}, {s['rows_per_request']} verify row(s), {s['index_heads']} x {s['index_dim']} index "
        f"heads, page {s['page_size']}, {s['heads']} heads"
    )
    if doc["note"]:
        print(f"note: {doc['note']}")
    head = f"{'op':<9} {'qualified':<9} {'seconds':>8} {'hits':>7} {'misses':>7} {'evicted':>7} {'max err':>8}  against"
    print(head)
    print("-" * len(head))
    for e in doc["ops"]:
        c = e["coverage"]
        print(
            f"{e['label']:<9} {'yes' if e['qualified'] else 'NO':<9} {e['seconds']:>8.3f} {c.get('hits', 0):>7} "
            f"{c.get('misses', 0):>7} {c.get('evictions', 0):>7} {e['max_abs_err']:>8.2g}  {e['against']}"
        )
        d = e["difference"]
        if d:
            where = f"{d['tensor']}{d['index']}" if d["index"] else d["tensor"]
            print(f"    first difference, step {d['step'] + 1}: {where}: fused {d['fused']}, separate {d['separate']}")
            if d["note"]:
                print(f"    {d['note']}")


def main(args) -> int:
    from ..ops.registry import OpUnavailableError
    from ..sparse_decode.op_selection import OpSelectionError

    try:
        doc = run(args)
    except (OpSelectionError, OpUnavailableError, ValueError) as exc:
        print(f"bench kernels --qualify: the fused ops cannot be qualified here: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(doc)
    return 0 if doc["all_qualified"] else 1
