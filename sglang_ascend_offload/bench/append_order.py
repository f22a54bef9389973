"""``bench append-order``: what ordering TP rank 0's host-pool appends before the other
ranks' reads costs per decode step on CPU (two independently spawned processes sharing
one pool mapping, ``sglang_plugin.mem_cache.pool_host.shared``).

Per step and layer, rank 0 writes ``--batch`` new rows and rank 1 reads ``--batch`` x
``--misses`` rows of the same layer. Modes, run one after the other on the same pool:

* ``none``: no ordering (rank 1 may read stale rows; the floor);
* ``counter``: the plugin's per-layer published counter under a process-shared
  semaphore (rank 0 publishes after its rows, rank 1 waits before its reads);
* ``gloo_barrier``: a ``torch.distributed`` barrier over a gloo group after rank 0's
  append of each layer (the alternative the design note weighs).

Reported per mode: wall seconds per step of each rank (median of ``--repeats``), and
``ordering_us_per_step`` = rank 1's step time minus that of ``none``; plus the
uncontended cost of one publish and one already-published check (microseconds).
``--json`` prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

MODES = ("none", "counter", "gloo_barrier")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=61, help="layers per step (DeepSeek-V3.2: 61)")
    parser.add_argument("--tokens", type=int, default=65536, help="pool slots")
    parser.add_argument("--batch", type=int, default=8, help="decode rows per step (new rows per layer)")
    parser.add_argument("--misses", type=int, default=64, help="rows rank 1 copies per batch row and layer")
    parser.add_argument("--steps", type=int, default=100, help="steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _worker(rank: int, args: Dict, path: str, session: str, port: int, out: "mp.Queue") -> None:
    import torch
    import torch.distributed as dist

    from ..sglang_plugin.mem_cache.pool_host import shared as shp
    from ..sparse_decode.host_pool import HostPoolShape

    torch.set_num_threads(1)
    shape = HostPoolShape(args["layers"], args["tokens"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # both ranks map the pool the parent created; rank 0 publishes on it
    sp = shp.attach_pool(shape, path, session, rank=max(rank, 1), timeout_s=60)
    order = shp.AppendOrder(sp.pool.mapping, shape.layers, rank=rank, timeout_s=60)
    sp = shp.SharedPool(sp.pool, order, sp.path, sp.session, 0, 2, rank)
    b, m = args["batch"], args["misses"]
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randn((b, shape.row_dim), generator=gen).to(torch.bfloat16)
    reads = torch.randint(0, args["tokens"], (b * m,), generator=gen)
    results: Dict[str, List[float]] = {mode: [] for mode in MODES}
    cursor = 0
    plan = [("none", False)] + [(mode, True) for mode in MODES for _ in range(args["repeats"])]  # a warm-up first
    for mode, measured in plan:
        dist.barrier()
        t0 = time.perf_counter()
        for _step in range(args["steps"]):
            slots = (torch.arange(b) + cursor) % args["tokens"]
            cursor += b
            for layer in range(shape.layers):
                if rank == 0:
                    sp.pool.write_rows(layer, slots, rows)
                    if mode == "counter":
                        sp.order.appended(layer)
                    elif mode == "gloo_barrier":
                        dist.barrier()
                else:
                    if mode == "counter":
                        sp.order.appended(layer)
                        sp.order.wait_readable(layer)
                    elif mode == "gloo_barrier":
                        dist.barrier()
                    sp.pool.layer(layer).index_select(0, reads)
        if measured:
            results[mode].append((time.perf_counter() - t0) / args["steps"])
    # uncontended costs: one publish (rank 0) / one already-published check (rank 1)
    dist.barrier()
    n = 20000
    if rank == 0:
        t0 = time.perf_counter()
        for _ in range(n):
            sp.order.appended(0)
        op_us = (time.perf_counter() - t0) / n * 1e6
        dist.barrier()
    else:
        dist.barrier()  # rank 0's publishes are done: every check finds its count published
        for _ in range(n):
            sp.order.appended(0)
        t0 = time.perf_counter()
        for _ in range(n):
            sp.order.wait_readable(0)
        op_us = (time.perf_counter() - t0) / n * 1e6
    out.put((rank, results, op_us))
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> Dict:
    from ..sglang_plugin.mem_cache.pool_host import shared as shp
    from ..sparse_decode.host_pool import HostPoolShape
    from ..testing.ports import reserve_port

    params = {k: getattr(args, k) for k in ("layers", "tokens", "batch", "misses", "steps", "repeats")}
    shape = HostPoolShape(args.layers, args.tokens)
    with tempfile.TemporaryDirectory(prefix="sao_bench_") as d:
        owner = shp.create_pool(shape, directory=Path(d))
        try:
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            port = reserve_port()
            procs = [
                ctx.Process(target=_worker, args=(r, params, str(owner.path), owner.session, port, out)) for r in (0, 1)
            ]
            for p in procs:
                p.start()
            got = {}
            for _ in procs:
                rank, results, op_us = out.get(timeout=1800)
                got[rank] = (results, op_us)
            for p in procs:
                p.join(timeout=60)
        finally:
            owner.pool.close()
    med = {rank: {mode: statistics.median(v) for mode, v in got[rank][0].items()} for rank in got}
    base = med[1]["none"]
    modes = {
        mode: {
            "rank0_s_per_step": med[0][mode],
            "rank1_s_per_step": med[1][mode],
            "ordering_us_per_step": (med[1][mode] - base) * 1e6,
            "rank1_vs_none": med[1][mode] / base if base else None,
        }
        for mode in MODES
    }
    return {
        "params": params,
        "modes": modes,
        "publish_us": got[0][1],
        "check_us": got[1][1],
        "ordering_ops_us_per_step": (got[0][1] + got[1][1]) * args.layers,
    }


def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    p = report["params"]
    print(
        f"append ordering, {p['layers']} layers, batch {p['batch']}, {p['misses']} reads/row "
        f"(median of {p['repeats']} x {p['steps']} steps)"
    )
    for mode, r in report["modes"].items():
        print(
            f"  {mode:13s} rank0 {r['rank0_s_per_step'] * 1e3:8.3f} ms/step  rank1 "
            f"{r['rank1_s_per_step'] * 1e3:8.3f} ms/step  x{r['rank1_vs_none']:.2f} of none  "
            f"(+{r['ordering_us_per_step']:.0f} us/step)"
        )
    print(
        f"  uncontended: publish {report['publish_us']:.2f} us, check {report['check_us']:.2f} us "
        f"-> {report['ordering_ops_us_per_step']:.0f} us/step over {p['layers']} layers"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(argparse.Namespace(layers=61, tokens=65536, batch=8, misses=64, steps=100, repeats=3, json=False)))
