"""``python -m sglang_ascend_offload bench kernels``: Triton vs reference, per kernel.

For one shape (rows, top-k, hot tokens, row width) on the device present, the
command warms a residency state with a few decode steps whose top-k re-selects a
fraction (``--overlap``) of the previous step's positions, then times, side by side
from identical cloned inputs:

* ``residency_manage`` (Triton: 3 launches) vs the torch reference;
* ``copy_miss_rows`` (Triton: 1 launch, reads the host pool through a device
  pointer) vs the reference (``index_select`` on the host + one host->device copy);

and checks that the Triton results are identical to the reference's (outputs and
state bit for bit, hot buffer bit for bit). It exits with 1 when any check fails.

``--copy-sfa`` compares the fused Copy-SFA operator with the separate miss copy + sparse
attention instead (:mod:`.kernels_copy_sfa`); ``--qualify`` runs the kernel qualification a
server runs at startup, one entry per fused op (:mod:`.kernels_qualify`).

On a CPU-only machine the Triton kernels run through the Triton interpreter
(``TRITON_INTERPRET=1`` is switched on for this command when unset): its times are
the interpreter's, far slower than torch, and only the correctness column counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import platform

INTERPRETER_NOTE = (
    "Triton kernels ran in the Triton interpreter on CPU: the times are the interpreter's "
    "(Python/numpy), not a kernel's; only the correctness column counts"
)

# defaults per device kind: production shape on a device, an interpreter-sized one on CPU
_DEFAULTS = {
    "device": dict(rows=32, top_k=2048, dim=576, repeat=5),
    "cpu": dict(rows=4, top_k=64, dim=576, repeat=2),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, help="decode rows R (default 32 on a device, 4 on CPU)")
    parser.add_argument("--top-k", type=int, help="top-k K (default 2048 on a device, 64 on CPU)")
    parser.add_argument("--hot-tokens", type=int, help="hot slots H per row (default 2 x top-k)")
    parser.add_argument("--dim", type=int, help="elements per KV row D (default 576 = 512 latent + 64 rope)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="KV row dtype for the copy"
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=0.75,
        help="fraction of each step's top-k re-selected from the previous step (hit rate driver)",
    )
    parser.add_argument("--warmup-steps", type=int, default=4, help="decode steps that build the timed state")
    parser.add_argument("--repeat", type=int, help="timed calls per kernel (median reported; default 5, CPU 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    from . import kernels_copy_sfa, kernels_qualify

    kernels_copy_sfa.add_arguments(parser)
    kernels_qualify.add_arguments(parser)


@dataclass
class KernelResult:
    """One kernel's side-by-side numbers (milliseconds, median of ``repeat`` calls)."""

    name: str
    triton_launches: int
    reference_ms: float
    triton_ms: float
    reference_over_triton: float
    correct: bool
    detail: str = ""


@dataclass
class BenchResult:
    device: str
    triton_mode: str  # "compiled" | "interpreter"
    note: str
    shape: Dict[str, Any]
    workload: Dict[str, Any]
    kernels: List[KernelResult] = field(default_factory=list)

    @property
    def all_correct(self) -> bool:
        return all(k.correct for k in self.kernels)


# ------------------------------------------------------------------------ workload
def _next_topk(
    gen: torch.Generator, prev: Optional[torch.Tensor], rows: int, k: int, ctx: int, overlap: float
) -> torch.Tensor:
    """int32 ``[rows, k]``: ``overlap * k`` positions kept from ``prev``, the rest fresh
    distinct positions from ``[0, ctx)``, in random order."""
    out = torch.empty((rows, k), dtype=torch.int32)
    keep_n = 0 if prev is None else int(round(overlap * k))
    for r in range(rows):
        keep = (
            prev[r][torch.randperm(k, generator=gen)[:keep_n]].to(torch.int64)
            if keep_n
            else torch.empty(0, dtype=torch.int64)
        )
        pool = torch.randperm(ctx, generator=gen)
        fresh = pool[~torch.isin(pool, keep)][: k - keep.numel()]
        sel = torch.cat([keep, fresh])
        out[r] = sel[torch.randperm(k, generator=gen)].to(torch.int32)
    return out


def _time(fn: Callable[[], Any], setup: Callable[[], Any], repeat: int) -> float:
    """Median wall milliseconds of ``fn(setup())`` over ``repeat`` calls after one warm-up."""
    samples = []
    for i in range(repeat + 1):
        arg = setup()
        platform.synchronize()
        t0 = time.perf_counter()
        fn(arg)
        platform.synchronize()
        if i:
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _ratio(ref_ms: float, tri_ms: float) -> float:
    return ref_ms / tri_ms if tri_ms > 0 else float("inf")


# ------------------------------------------------------------------------ the bench
@dataclass
class _Workload:
    """The timed inputs: a warmed residency ``state`` and the next step's ``topk``."""

    rows: int
    k: int
    hot: int
    dim: int
    repeat: int
    dtype: torch.dtype
    device: torch.device
    ctx: int
    gen: torch.Generator
    state: Any = None
    req: Any = None
    stable: Any = None
    topk: Any = None
    step: int = 0


def _workload(args) -> _Workload:
    """The shape from the arguments (per-device defaults) and a residency state warmed by
    ``--warmup-steps`` reference steps."""
    from ..ops import residency
    from ..ops.contract import ResidencyTable

    defaults = _DEFAULTS["cpu" if platform.device_kind() == "cpu" else "device"]
    k = args.top_k or defaults["top_k"]
    hot = args.hot_tokens or 2 * k
    w = _Workload(
        rows=args.rows or defaults["rows"],
        k=k,
        hot=hot,
        dim=args.dim or defaults["dim"],
        repeat=args.repeat or defaults["repeat"],
        dtype=getattr(torch, args.dtype),
        device=platform.default_device(),
        ctx=4 * hot,
        gen=torch.Generator().manual_seed(args.seed),
    )
    w.state = ResidencyTable.empty(w.rows, hot, device=w.device)
    w.req = torch.arange(w.rows, dtype=torch.int64, device=w.device)
    w.stable = torch.full((w.rows,), w.ctx, dtype=torch.int32, device=w.device)
    topk = None
    for step in range(args.warmup_steps):
        topk = _next_topk(w.gen, topk, w.rows, k, w.ctx, args.overlap)
        residency.residency_manage(
            w.state.slot_token, w.state.slot_stamp, w.state.row_req, topk.to(w.device), w.req, w.stable, step
        )
    w.topk = _next_topk(w.gen, topk, w.rows, k, w.ctx, args.overlap).to(w.device)
    w.step = args.warmup_steps
    return w


def _bench_residency(w: _Workload) -> Tuple[KernelResult, Any]:
    """``residency_manage``: Triton vs reference from the same state; the reference's step."""
    from ..ops import residency
    from ..triton_ops import residency as tri_residency

    outs: Dict[str, Any] = {}

    def manage_with(fn, name):
        def call(table):
            outs[name] = (fn(table.slot_token, table.slot_stamp, table.row_req, w.topk, w.req, w.stable, w.step), table)

        return call

    ref_ms = _time(manage_with(residency.residency_manage, "reference"), w.state.clone, w.repeat)
    tri_ms = _time(manage_with(tri_residency.residency_manage, "triton"), w.state.clone, w.repeat)
    (want, want_state), (got, got_state) = outs["reference"], outs["triton"]
    mismatched = [
        f
        for f in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots")
        if not torch.equal(getattr(want, f), getattr(got, f))
    ]
    mismatched += [
        f
        for f in ("slot_token", "slot_stamp", "row_req")
        if not torch.equal(getattr(want_state, f), getattr(got_state, f))
    ]
    hits, misses = int(want.hit_mask.sum()), int(want.miss_count.sum())
    detail = f"hits {hits}, misses {misses}" + (f"; differs: {', '.join(mismatched)}" if mismatched else "")
    return KernelResult("residency_manage", 3, ref_ms, tri_ms, _ratio(ref_ms, tri_ms), not mismatched, detail), want


def _bench_copy(w: _Workload, want) -> KernelResult:
    """``copy_miss_rows`` of the reference step's misses (host pool pinned where a device
    exists, as in production): Triton vs reference, hot buffers bit for bit."""
    from ..ops import residency
    from ..triton_ops import copy_rows

    host_rows = w.rows * w.ctx
    host = platform.pinned_empty((host_rows, w.dim), w.dtype)
    host.copy_(torch.randn(host_rows, w.dim, generator=w.gen).to(w.dtype))
    token_table = torch.randperm(host_rows, generator=w.gen).to(torch.int32).reshape(w.rows, w.ctx).to(w.device)
    hot_init = torch.zeros((w.rows, w.hot, w.dim), dtype=w.dtype, device=w.device)
    bufs: Dict[str, torch.Tensor] = {}

    def copy_with(fn, name):
        def call(buf):
            fn(host, buf, want.miss_tokens, want.miss_slots, want.miss_count, token_table)
            bufs[name] = buf

        return call

    ref_ms = _time(copy_with(residency.copy_miss_rows, "reference"), hot_init.clone, w.repeat)
    tri_ms = _time(copy_with(copy_rows.copy_miss_rows, "triton"), hot_init.clone, w.repeat)
    words = torch.int16 if w.dtype != torch.float32 else torch.int32
    same = torch.equal(bufs["reference"].view(words), bufs["triton"].view(words))
    misses = int(want.miss_count.sum())
    moved = misses * w.dim * host.element_size()
    detail = f"{misses} rows, {moved} bytes host->device" + ("" if same else "; hot buffers differ")
    return KernelResult("copy_miss_rows", 1, ref_ms, tri_ms, _ratio(ref_ms, tri_ms), same, detail)


def run(args) -> BenchResult:
    """Triton vs reference for ``residency_manage`` and ``copy_miss_rows`` (module docstring)."""
    kind = platform.device_kind()
    w = _workload(args)
    result = BenchResult(
        device=str(w.device),
        triton_mode="interpreter" if kind == "cpu" else "compiled",
        note=INTERPRETER_NOTE if kind == "cpu" else "compiled Triton kernels vs torch reference on the same device",
        shape=dict(rows=w.rows, top_k=w.k, hot_tokens=w.hot, dim=w.dim, dtype=args.dtype),
        workload=dict(overlap=args.overlap, warmup_steps=args.warmup_steps, repeat=w.repeat, seed=args.seed),
    )
    manage, want = _bench_residency(w)
    result.workload.update(hits=int(want.hit_mask.sum()), misses=int(want.miss_count.sum()))
    result.kernels += [manage, _bench_copy(w, want)]
    return result


def _print_table(res: BenchResult) -> None:
    s = res.shape
    print(
        f"device {res.device}, Triton {res.triton_mode}; R={s['rows']} K={s['top_k']} H={s['hot_tokens']} "
        f"D={s['dim']} {s['dtype']}; overlap {res.workload['overlap']}, median of {res.workload['repeat']}"
    )
    print(f"note: {res.note}")
    head = f"{'kernel':<18} {'launches':>8} {'reference ms':>13} {'triton ms':>11} {'ref/triton':>10}  correct  detail"
    print(head)
    print("-" * len(head))
    for kr in res.kernels:
        print(
            f"{kr.name:<18} {kr.triton_launches:>8} {kr.reference_ms:>13.3f} {kr.triton_ms:>11.3f} "
            f"{kr.reference_over_triton:>10.3f}  {'yes' if kr.correct else 'NO':<7}  {kr.detail}"
        )


def _main_copy_sfa(args) -> int:
    """``--copy-sfa``: the fused Copy-SFA vs the separate operators (``kernels_copy_sfa``)."""
    from ..ops.ascendc_model import ShapeUnsupported
    from ..ops.registry import OpUnavailableError
    from ..sparse_decode.op_selection import OpSelectionError
    from . import kernels_copy_sfa

    try:
        res = kernels_copy_sfa.run(args)
    except (OpSelectionError, OpUnavailableError, ShapeUnsupported) as exc:
        print(f"bench kernels --copy-sfa: the fused Copy-SFA cannot run here: {exc}", file=sys.stderr)
        return 2
    if args.json:
        payload = {"copy_sfa": asdict(res), "all_correct": res.all_correct}
        print(json.dumps(payload, indent=2))
    else:
        kernels_copy_sfa.print_table(res)
    return 0 if res.all_correct else 1


def main(args) -> int:
    problems = [
        f"--{n.replace('_', '-')} must be >= 1"
        for n in ("rows", "top_k", "hot_tokens", "dim", "repeat")
        if getattr(args, n) is not None and getattr(args, n) < 1
    ]
    if args.warmup_steps < 0:
        problems.append("--warmup-steps must be >= 0")
    if not 0.0 <= args.overlap <= 1.0:
        problems.append("--overlap must lie in [0, 1]")
    if args.hot_tokens is not None and args.top_k is not None and args.hot_tokens < args.top_k:
        problems.append("--hot-tokens must be >= --top-k")
    if args.copy_sfa:
        from . import kernels_copy_sfa

        problems += kernels_copy_sfa.input_problems(args)
    if args.qualify:
        from . import kernels_qualify

        problems += kernels_qualify.input_problems(args)
        if args.copy_sfa:
            problems.append("--qualify and --copy-sfa are separate runs: pick one")
    if problems:
        print("bench kernels: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.qualify:
        return kernels_qualify.main(args)
    if args.copy_sfa:
        return _main_copy_sfa(args)
    if platform.device_kind() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # must happen before any kernel module is imported; announced in the output
        os.environ["TRITON_INTERPRET"] = "1"
    from ..ops.triton_impls import triton_unavailable

    reason = triton_unavailable()
    if reason is not None:
        print(f"bench kernels: the Triton kernels cannot run here: {reason}", file=sys.stderr)
        return 2
    res = run(args)
    if args.json:
        payload = asdict(res)
        payload["all_correct"] = res.all_correct
        print(json.dumps(payload, indent=2))
    else:
        _print_table(res)
    return 0 if res.all_correct else 1
