"""``python -m sglang_ascend_offload bench kvpp``: KVPP broadcast + prefetch, CPU, real processes.

``--group`` processes join a gloo group (``torch.distributed``) and build the
KVPP storage of ``--layers`` DSA layers (owned bundles + two scratch buffers): per
block of ``--block-tokens`` tokens a layer's bundle is the latent (512), rope (64)
and indexer K (128) rows in bf16 -- DeepSeek-V3.2's layout with smaller blocks and
pool (``--pool-blocks``). For each pool fill level (the fraction of the pool's blocks
the forward's requests read) and each broadcast mode, the same forwards run three
ways, in lockstep on every rank:

* ``broadcast`` only: each layer's broadcast waited for, no compute, no prefetch;
* ``compute`` only: per layer the compute stand-in, no broadcast;
* ``wall``: the real schedule: the first layer prefetched at forward start, each
  layer's wait starts the next layer's broadcast, then the layer computes.

Modes: ``full`` broadcasts every allocated block of the layer (the baseline),
``active`` gathers only the active blocks into a staging buffer, broadcasts it and
scatters it on the receivers. Active blocks are a random sample (same on all ranks).

Compute stand-in (``--compute``): ``sleep`` (default) waits ``--compute-ms`` per layer,
standing in for device compute that leaves the host and the link free, as attention
on an NPU's AI cores does while HCCL moves data; ``matmul`` runs a real CPU matmul of
about that duration, which then competes with gloo for the same cores.

Times are medians over ``--repeats`` rounds (each round runs the three ways back to
back, so load drift on a shared machine hits them alike) of the slowest rank. Reported
per run: ``bytes_per_forward`` (broadcast payload of one forward, all layers),
``wall_s``, ``compute_s``, ``broadcast_s``, ``wall_over_max`` = the median over rounds
of wall / max(compute, broadcast) of the same round (1.0 = perfect overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import List

import torch

RUN_KEYS = (
    "group",
    "layers",
    "mode",
    "pool_blocks",
    "active_blocks",
    "bytes_per_forward",
    "wall_s",
    "compute_s",
    "broadcast_s",
    "wall_over_max",
)


@dataclass(frozen=True)
class KVPPRun:
    """One row of ``bench kvpp`` (times in seconds per forward, medians)."""

    group: int
    layers: int
    mode: str
    pool_blocks: int
    active_blocks: int
    bytes_per_forward: int
    wall_s: float
    compute_s: float
    broadcast_s: float
    wall_over_max: float


def _float_list(text: str) -> List[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError("fill levels must be in (0, 1]")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group", type=int, default=2, help="KVPP group size = processes (default 2)")
    parser.add_argument("--layers", type=int, default=8, help="target layers (default 8)")
    parser.add_argument("--pool-blocks", type=int, default=256, help="KV blocks in the pool (default 256)")
    parser.add_argument("--block-tokens", type=int, default=32, help="tokens per block (default 32)")
    parser.add_argument(
        "--fill",
        type=_float_list,
        default=[0.125, 0.5, 1.0],
        help="fractions of the pool's blocks the forward reads (default 0.125,0.5,1.0)",
    )
    parser.add_argument("--modes", default="full,active", help="broadcast modes (default full,active)")
    parser.add_argument(
        "--compute",
        choices=("sleep", "matmul"),
        default="sleep",
        help="per-layer compute stand-in (default sleep; see the module doc)",
    )
    parser.add_argument("--compute-ms", type=float, default=4.0, help="compute per layer in ms (default 4)")
    parser.add_argument("--repeats", type=int, default=15, help="timed forwards per run (default 15)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def _free_port() -> int:
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port()  # reserved across processes, below the ephemeral range


class _Compute:
    """Per-layer compute stand-in of about ``ms`` milliseconds."""

    def __init__(self, kind: str, ms: float):
        self.kind, self.ms = kind, ms
        if kind == "matmul":
            torch.set_num_threads(1)
            self.a = torch.randn(256, 256)
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.05:
                self.a @ self.a
                n += 1
            self.reps = max(1, round(ms / 1e3 / ((time.perf_counter() - t0) / n)))

    def __call__(self) -> None:
        if self.kind == "sleep":
            time.sleep(self.ms / 1e3)
        else:
            for _ in range(self.reps):
                self.a @ self.a


def _worker(rank: int, args: argparse.Namespace, port: int, q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch.distributed as dist

        from ..kvpp.ownership import assign_owners
        from ..kvpp.plan import bundles_for, mla_bundle, plan_rank
        from ..kvpp.runtime import BroadcastTransport, KVPPScheduler, KVPPStorage

        dist.init_process_group("gloo", rank=rank, world_size=args.group)
        group = dist.new_group(list(range(args.group)))
        own = assign_owners(range(args.layers), args.group)
        plan = plan_rank(rank, own, bundles_for(range(args.layers), mla_bundle(block_size=args.block_tokens)))
        storage = KVPPStorage(plan, args.pool_blocks)
        for layer, buf in storage.persistent.items():
            buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
        transport = BroadcastTransport(storage, group=group)
        prefetching = KVPPScheduler(transport, prefetch=True)
        serial = KVPPScheduler(transport, prefetch=False)
        compute = _Compute(args.compute, args.compute_ms)
        layers = list(range(args.layers))

        def slowest(seconds: float) -> float:
            t = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            return float(t.item())

        def forward(sched, blocks, with_compute: bool) -> float:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            sched.schedule_forward(True, blocks)
            for layer in layers:
                sched.wait_for_layer(layer)
                if with_compute:
                    compute()
            sched.complete_forward()
            return slowest(time.perf_counter() - t0)

        def compute_only() -> float:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in layers:
                compute()
            return slowest(time.perf_counter() - t0)

        rows = []
        gen = torch.Generator().manual_seed(7)  # same active sample on every rank
        for fill in args.fill:
            active = max(1, round(fill * args.pool_blocks))
            sample = torch.sort(torch.randperm(args.pool_blocks, generator=gen)[:active]).values
            for mode in args.modes.split(","):
                blocks = None if mode == "full" else sample
                forward(prefetching, blocks, True)  # warm-up
                before = transport.bytes_broadcast
                forward(serial, blocks, False)
                per_forward = transport.bytes_broadcast - before
                bc, cp, wall, ratio = [], [], [], []
                for _ in range(args.repeats):  # interleaved, so load drift hits all three alike
                    bc.append(forward(serial, blocks, False))
                    cp.append(compute_only())
                    wall.append(forward(prefetching, blocks, True))
                    ratio.append(wall[-1] / max(bc[-1], cp[-1]))
                b, c, w = statistics.median(bc), statistics.median(cp), statistics.median(wall)
                rows.append(
                    KVPPRun(
                        args.group,
                        args.layers,
                        mode,
                        args.pool_blocks,
                        active,
                        per_forward,
                        round(w, 6),
                        round(c, 6),
                        round(b, 6),
                        round(statistics.median(ratio), 4),
                    )
                )
                if rank == 0:
                    print(f"kvpp bench: fill {fill} mode {mode} done", file=sys.stderr, flush=True)
        prefetching.close()
        serial.close()
        if rank == 0:
            q.put(("ok", [asdict(r) for r in rows]))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run(args: argparse.Namespace) -> List[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args, port, q)) for r in range(args.group)]
    for p in procs:
        p.start()
    try:
        status, payload = q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(f"bench kvpp failed: {payload}")
    return payload


def main(args) -> int:
    problems = [
        f"--{n.replace('_', '-')} must be >= {m}"
        for n, m in (("group", 2), ("layers", 1), ("pool_blocks", 1), ("block_tokens", 1), ("repeats", 1))
        if getattr(args, n) < m
    ]
    bad_modes = set(args.modes.split(",")) - {"full", "active"}
    if bad_modes:
        problems.append(f"--modes: unknown {sorted(bad_modes)} (use full,active)")
    if args.compute_ms < 0:
        problems.append("--compute-ms must be >= 0")
    if problems:
        raise SystemExit("bench kvpp: " + "; ".join(problems))
    runs = run(args)
    if args.json:
        print(json.dumps({"runs": runs}, indent=1))
        return 0
    print(
        f"KVPP broadcast + prefetch, CPU gloo: group {args.group}, {args.layers} layers, pool {args.pool_blocks} "
        f"blocks x {args.block_tokens} tokens, compute {args.compute} {args.compute_ms} ms/layer, "
        f"median of {args.repeats} forwards (slowest rank)"
    )
    head = ("mode", "active", "MiB/fwd", "bcast ms/layer", "compute_s", "broadcast_s", "wall_s", "wall/max")
    print("  ".join(f"{h:>14}" for h in head))
    for r in runs:
        cells = (
            r["mode"],
            f"{r['active_blocks']}/{r['pool_blocks']}",
            f"{r['bytes_per_forward'] / 2**20:.2f}",
            f"{1e3 * r['broadcast_s'] / r['layers']:.2f}",
            f"{r['compute_s']:.4f}",
            f"{r['broadcast_s']:.4f}",
            f"{r['wall_s']:.4f}",
            f"{r['wall_over_max']:.2f}",
        )
        print("  ".join(f"{c:>14}" for c in cells))
    return 0
