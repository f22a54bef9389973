"""``python -m sglang_ascend_offload bench prefill``: layerwise prefill pipeline, CPU.

For each shared-buffer count B it plans the buffers (``I = [0]``), fills the
local host KV store with a cached prefix (setup, not timed), then times prefill
forwards of requests that extend that prefix: per layer the pipeline loads the
prefix rows from the host store (real copies), the tiny attention model computes
the new tokens (real matmuls + attention over prefix + new), and the new rows are
saved back (real copies) while the next layers load and compute.

Reported per B, all from the same forwards: main-KV footprint ratio, wall time,
total compute time, total transfer time (loads + saves, summed over the worker
threads), wall / max(compute, transfer) (1.0 = perfect overlap) and
wall / (compute + transfer) (1.0 = no overlap at all).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch

from sglang_ascend_offload.layerwise_prefill.pipeline import LayerwisePrefillPipeline, PrefillRequest, run_forward
from sglang_ascend_offload.layerwise_prefill.planner import plan_buffers
from sglang_ascend_offload.layerwise_prefill.store import block_keys, object_key
from sglang_ascend_offload.layerwise_prefill.store_local import LocalHostKVStore
from sglang_ascend_offload.testing.tiny_attention_model import TinyAttentionModel

RUN_KEYS = (
    "shared_buffers",
    "layers",
    "physical_buffers",
    "footprint_ratio",
    "wall_s",
    "compute_s",
    "transfer_s",
    "wall_over_max",
    "wall_over_sum",
)


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shared-buffers", type=_int_list, default=[1, 2, 4], help="comma-separated B values (default 1,2,4)"
    )
    parser.add_argument("--layers", type=int, default=12, help="cache-bearing layers (default 12)")
    parser.add_argument("--dim", type=int, default=576, help="K and V width per token (default 576)")
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="cached prefix loaded per layer (default 4096)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens computed per forward (default 8)")
    parser.add_argument("--block-tokens", type=int, default=256, help="tokens per host store object")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per B (default 3)")
    parser.add_argument("--prefetch-depth", type=int, default=None, help="default min(B, 8)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for compute (default 1: the other core copies)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _fill_prefix(store: LocalHostKVStore, tokens, layers: int, dim: int, block_tokens: int) -> None:
    """Put random K/V blocks of the prefix into the store for every layer (setup)."""
    g = torch.Generator().manual_seed(0)
    for blk in block_keys(tokens, block_tokens):
        if blk.tokens < block_tokens:
            continue
        for layer in range(layers):
            kv = [torch.randn(blk.tokens, dim, generator=g) * 0.1 for _ in range(2)]
            store.put([object_key(blk, layer)], [kv])


def run_one(b: int, args) -> Dict[str, float]:
    model = TinyAttentionModel(args.layers, dim=args.dim, seed=1)
    rows = args.prefix_tokens + args.new_tokens
    plan = plan_buffers(model.specs(rows), b, [0])
    store = LocalHostKVStore()
    prefix = tuple((i * 7919) % 50_000 for i in range(args.prefix_tokens))
    _fill_prefix(store, prefix, args.layers, args.dim, args.block_tokens)
    compute_s = 0.0

    def compute(layer, buf, layout):
        nonlocal compute_s
        t0 = time.perf_counter()
        model.compute_layer(layer, buf, layout)
        compute_s += time.perf_counter() - t0

    wall = transfer = 0.0
    loaded = saved = 0
    with LayerwisePrefillPipeline(
        plan, store, block_tokens=args.block_tokens, prefetch_depth=args.prefetch_depth
    ) as pipe:
        for rep in range(args.repeats + 1):  # the first forward warms up and is not counted
            new = tuple(50_000 + rep * args.new_tokens + i for i in range(args.new_tokens))
            req = PrefillRequest(f"r{rep}", prefix + new)
            if rep == 1:
                compute_s = 0.0
            t0 = time.perf_counter()
            stats = run_forward(pipe, [req], compute, on_begin=lambda lay, req=req: model.start([req], lay))
            if rep == 0:
                continue
            if stats.prefix_tokens != args.prefix_tokens - args.prefix_tokens % args.block_tokens:
                raise RuntimeError(f"expected the cached prefix to be reused, got {stats.prefix_tokens}")
            wall += time.perf_counter() - t0
            transfer += stats.load_s + stats.save_s
            loaded += stats.bytes_loaded
            saved += stats.bytes_saved
    store.close()
    return {
        "shared_buffers": b,
        "layers": args.layers,
        "physical_buffers": plan.num_physical,
        "footprint_ratio": plan.footprint_ratio,
        "wall_s": wall,
        "compute_s": compute_s,
        "transfer_s": transfer,
        "wall_over_max": wall / max(compute_s, transfer),
        "wall_over_sum": wall / (compute_s + transfer),
        "bytes_loaded": loaded,
        "bytes_saved": saved,
        "repeats": args.repeats,
    }


def main(args) -> int:
    for name in ("layers", "dim", "prefix_tokens", "new_tokens", "block_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    runs = [run_one(b, args) for b in args.shared_buffers]
    if args.json:
        print(json.dumps({"runs": runs}, indent=1))
        return 0
    print(
        f"layerwise prefill, CPU: {args.layers} layers, K/V width {args.dim}, prefix "
        f"{args.prefix_tokens} tok loaded + {args.new_tokens} new tok per forward, "
        f"{args.repeats} forwards per row, I=[0]"
    )
    head = ("B", "phys", "footprint", "wall_s", "compute_s", "transfer_s", "wall/max", "wall/sum")
    print("  ".join(f"{h:>10}" for h in head))
    for r in runs:
        cells = (
            r["shared_buffers"],
            r["physical_buffers"],
            f"{r['footprint_ratio']:.3f}",
            f"{r['wall_s']:.3f}",
            f"{r['compute_s']:.3f}",
            f"{r['transfer_s']:.3f}",
            f"{r['wall_over_max']:.2f}",
            f"{r['wall_over_sum']:.2f}",
        )
        print("  ".join(f"{c:>10}" for c in cells))
    return 0
