"""``bench kernels --copy-sfa``: fused Copy-SFA against the separate miss copy + sparse
attention, side by side in one run.

One synthetic decode workload (request churn, locality model; by default top-k 128, hot
256 slots, 16 heads, latent 512 + rope 64: shapes the AscendC kernel serves) is replayed
twice through the sparse decode engine (:func:`~..sparse_decode.replay.replay_trace`,
every layer step verified against attention over the full host KV):

* ``separate``: ``fused_copy_sfa: false``, the miss copy and the sparse attention as two
  operators (the rungs ``ops`` resolves to on this platform);
* ``fused``: ``fused_copy_sfa: true``, one Copy-SFA operator per layer step.

Reported per run: milliseconds of miss copy + attention per layer step (the engine's own
phase timers, which synchronise the device), misses, H2D bytes and whether every step
verified; across the runs: ``separate_over_fused`` (above 1 the fusion wins; the
reference design measured 1.15-1.24x on Ascend A3) and ``same_traffic`` (both runs made
the same residency decisions, so they moved the same rows).

On an NPU the fused operator is the built AscendC extension (``ascendc_ops/build.sh``).
On a CPU it is the same kernel sources run on the functional model of the AscendC API
(``ops=fused``), a correctness path far slower than any hardware: there only the
correctness columns mean anything, and the note says so.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .. import platform

CPU_MODEL_NOTE = (
    "fused Copy-SFA ran on the CPU functional model of the AscendC API: its time is the "
    "model's, not a kernel's; only the correctness columns count"
)
DEVICE_NOTE = "fused Copy-SFA ran as the AscendC extension; separate = the rungs ops=auto resolves to"

# defaults per device kind: more steps on a device, few on the (slow) CPU model
_STEPS = {"device": 32, "cpu": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fused Copy-SFA vs separate operators (--copy-sfa)")
    group.add_argument(
        "--copy-sfa",
        action="store_true",
        help="compare fused Copy-SFA with the separate copy + attention (instead of the Triton kernels)",
    )
    group.add_argument("--heads", type=int, default=16, help="attention heads per query row (default 16)")
    group.add_argument("--layers", type=int, default=2, help="layers of the replayed workload (default 2)")
    group.add_argument("--steps", type=int, help="decode steps of the replayed workload (default 32; CPU 4)")


@dataclass
class CopySfaRun:
    """One replay of the workload: which operators ran and what they cost and moved."""

    run: str  # "separate" | "fused"
    ops: str
    fused_copy_sfa: bool
    layer_steps: int
    copy_ms_per_layer_step: float
    attention_ms_per_layer_step: float
    copy_attention_ms_per_layer_step: float
    misses: int
    h2d_bytes: int
    verified: bool
    failures: List[str] = field(default_factory=list)


@dataclass
class CopySfaResult:
    """Both runs and their comparison."""

    device: str
    fused_backend: str  # "AscendC extension" | "CPU functional model"
    note: str
    shape: Dict[str, Any]
    runs: List[CopySfaRun]
    separate_over_fused: Optional[float]
    same_traffic: bool

    @property
    def all_correct(self) -> bool:
        return self.same_traffic and all(r.verified for r in self.runs)


def input_problems(args: argparse.Namespace) -> List[str]:
    """Every bad ``--copy-sfa`` argument (all of them, not the first)."""
    problems = [
        f"--{name.replace('_', '-')} must be >= 1"
        for name in ("heads", "layers", "steps")
        if getattr(args, name) is not None and getattr(args, name) < 1
    ]
    return problems


def _runs_for(kind: str) -> List[tuple]:
    """``(run name, ops, fused_copy_sfa)`` of the two runs on this platform kind."""
    if kind == "npu":
        return [("separate", "auto", False), ("fused", "auto", True)]
    # off the NPU the fused rung is the functional model, selected with ops=fused; the
    # separate run uses the reference rungs (the specification) on the same inputs
    return [("separate", "reference", False), ("fused", "fused", True)]


def _one_run(trace, name: str, ops: str, fused: bool, hot_tokens: int, heads: int, seed: int) -> CopySfaRun:
    from ..sparse_decode.replay import ReplayOptions, replay_trace

    print(f"bench kernels --copy-sfa: {name} run (ops={ops}, fused_copy_sfa={str(fused).lower()}) ...", file=sys.stderr)
    result = replay_trace(
        trace, ReplayOptions(hot_tokens=hot_tokens, ops=ops, heads=heads, seed=seed, fused_copy_sfa=fused)
    )
    steps = max(1, result.checks)
    sec = result.times.seconds
    copy_ms, attn_ms = 1e3 * sec.get("copy", 0.0) / steps, 1e3 * sec.get("attention", 0.0) / steps
    total = result.stats.total
    return CopySfaRun(
        run=name,
        ops=ops,
        fused_copy_sfa=fused,
        layer_steps=result.checks,
        copy_ms_per_layer_step=copy_ms,
        attention_ms_per_layer_step=attn_ms,
        copy_attention_ms_per_layer_step=copy_ms + attn_ms,
        misses=total.misses,
        h2d_bytes=total.h2d_bytes,
        verified=result.verified,
        failures=list(result.failures),
    )


def run(args: argparse.Namespace) -> CopySfaResult:
    """Both replays of one synthetic workload (shape from ``args``); raises the engine's
    operator-selection error when the fused Copy-SFA cannot run here."""
    from ..sparse_decode.trace import SyntheticTraceSpec, synthesize

    kind = platform.device_kind()
    top_k = args.top_k or 128
    hot = args.hot_tokens or 2 * top_k
    rows = args.rows or 4
    steps = args.steps or _STEPS["cpu" if kind == "cpu" else "device"]
    spec = SyntheticTraceSpec(
        steps=steps,
        layers=args.layers,
        rows=rows,
        top_k=top_k,
        seed=args.seed,
        min_prompt=top_k + 16,
        max_prompt=2 * hot,
        min_decode=2,
        max_decode=max(4, steps // 2),
        mean_idle=1.0,
    )
    trace = synthesize(spec)
    runs = [_one_run(trace, name, ops, fused, hot, args.heads, args.seed) for name, ops, fused in _runs_for(kind)]
    separate, fused = runs
    ratio = (
        separate.copy_attention_ms_per_layer_step / fused.copy_attention_ms_per_layer_step
        if fused.copy_attention_ms_per_layer_step > 0
        else None
    )
    return CopySfaResult(
        device=str(platform.default_device()),
        fused_backend="AscendC extension" if kind == "npu" else "CPU functional model",
        note=DEVICE_NOTE if kind == "npu" else CPU_MODEL_NOTE,
        shape=dict(
            rows=rows,
            top_k=top_k,
            hot_tokens=hot,
            heads=args.heads,
            layers=args.layers,
            steps=steps,
            latent_dim=512,
            rope_dim=64,
            dtype="bfloat16",
        ),
        runs=runs,
        separate_over_fused=ratio,
        same_traffic=(separate.misses, separate.h2d_bytes) == (fused.misses, fused.h2d_bytes),
    )


def print_table(res: CopySfaResult) -> None:
    s = res.shape
    print(
        f"device {res.device}, fused Copy-SFA: {res.fused_backend}; R={s['rows']} K={s['top_k']} "
        f"H={s['hot_tokens']} heads={s['heads']} layers={s['layers']} steps={s['steps']}"
    )
    print(f"note: {res.note}")
    head = (
        f"{'run':<9} {'ops':<9} {'layer steps':>11} {'copy ms':>9} {'attn ms':>9} {'copy+attn ms':>12} "
        f"{'misses':>8} {'H2D bytes':>11}  verified"
    )
    print(head)
    print("-" * len(head))
    for r in res.runs:
        print(
            f"{r.run:<9} {r.ops:<9} {r.layer_steps:>11} {r.copy_ms_per_layer_step:>9.3f} "
            f"{r.attention_ms_per_layer_step:>9.3f} {r.copy_attention_ms_per_layer_step:>12.3f} {r.misses:>8} "
            f"{r.h2d_bytes:>11}  {'yes' if r.verified else 'NO: ' + '; '.join(r.failures[:2])}"
        )
    ratio = "n/a" if res.separate_over_fused is None else f"{res.separate_over_fused:.3f}"
    print(
        f"separate / fused (copy + attention per layer step): {ratio}; same traffic: "
        f"{'yes' if res.same_traffic else 'NO'}"
    )
