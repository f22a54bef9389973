"""``python -m sglang_ascend_offload bench decode``: replay a top-k trace, side by side.

One run reports, for the same trace and hot-buffer size:

* **this engine** (the chosen policy), replayed with random KV content through the
  real engine; after every layer step it checks that each resident slot holds its
  host row and that attention output ``torch.equal`` s the full-KV reference;
* **topk_reload**: no hot buffer, every selected row copied every step;
* **topk_cache**: a device cache of exactly ``top_k`` rows per row (SGLang's in-tree
  design; every policy is the same at that size);
* **opt**: Belady's optimum for the same capacity (the lower bound on misses);
* every available policy's misses at the same capacity (residency only).

``--mtp N`` (speculative verify, ``N`` draft tokens) instead turns the trace into rounds
of ``N + 1`` verify rows per request (or replays a recorded speculative trace, ``--trace``
of a NextN server's ``record_trace``) and replays two designs side by side, both
verified the same way: **per_row** (one engine row and hot buffer of ``--hot-tokens``
per verify row) and **per_request** (one per request, shared by its rows through the
union of their top-k, ``--mtp-hot-tokens`` slots; a round whose union exceeds them is
served from the overflow area), with H2D bytes per round, device hot bytes per request,
hit rates, overflow counts and Belady's optimum of each, and the distribution of the
union over top-k (``union_over_top_k``, also per layer).

Without ``--trace`` a synthetic trace is generated (``--shape``; the model is in
``docs/sparse_decode.md``). ``--profile-shape`` instead times warm decode steps at
production shape (rows 32, top-k 2048, hot 4096, 61 layers by default, ~128K-token
contexts with ``--profile-context``): residency management on the engine's path (the
CPU kernel for ``lru`` on CPU, ``manage_ms_per_layer``: the median over
``--profile-repeats`` steps, each cycling over every layer's state) next to the torch reference
(the contract) with their miss counts compared, miss copy, the reference sparse
attention, and one layer's whole step on the reference rung eager vs
``torch.compile`` d (``--profile-compile``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..ops import contract
from ..sparse_decode import op_selection

_SHAPES = ("locality", "random", "scan", "bursty")
_PROFILE_HOST_ROWS = 1 << 18  # host rows of the profile's copy timing (a 288 MiB bf16 pool)
_MTP_ACCEPT = 0.8  # default per-draft acceptance of --mtp rounds


def _default_policy() -> str:
    from ..config import SparseDecodeOffloadConfig

    return SparseDecodeOffloadConfig().policy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..sparse_decode.policies import POLICIES

    parser.add_argument("--trace", metavar="FILE", help=".npz trace, a speculative one with --mtp (default: synthetic)")
    parser.add_argument(
        "--hot-tokens",
        type=int,
        help="hot slots per layer and row (default: the value a recorded trace was served with, else 2 x top-k)",
    )
    parser.add_argument("--ops", default="auto", choices=contract.CHOICES, help="operator ladder rung")
    parser.add_argument(
        "--policy", choices=sorted(POLICIES), help="residency policy of the engine run (default: the config default)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    syn = parser.add_argument_group("synthetic trace (without --trace)")
    syn.add_argument("--steps", type=int, default=160, help="decode steps")
    syn.add_argument("--layers", type=int, default=4, help="layers")
    syn.add_argument("--rows", type=int, default=8, help="decode rows")
    syn.add_argument("--top-k", type=int, default=128, help="top-k per row")
    syn.add_argument("--shape", choices=_SHAPES, default="locality", help="trace shape")
    syn.add_argument(
        "--noise-skew",
        type=float,
        default=1.5,
        help="skew of the noise positions' persistent weights (0 = uniform noise)",
    )
    syn.add_argument(
        "--rank-depth",
        type=int,
        default=0,
        help="latent-score model with a 'ranked' array of this depth (>= top-k; 0 = the selection "
        "model without ranking; required by score_rank* policies and --shape bursty)",
    )
    syn.add_argument("--seed", type=int, default=0, help="trace and KV content seed")
    syn.add_argument("--save-trace", metavar="FILE", help="also write the synthetic trace to FILE (.npz)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads per query row")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the side-by-side table as a figure (matplotlib)")
    mtp = parser.add_argument_group("speculative verify rows (--mtp): per-row vs per-request residency")
    mtp.add_argument(
        "--mtp",
        type=int,
        metavar="N",
        help="MTP with N draft tokens: rounds of N + 1 verify rows per request derived from the trace (or "
        "those of a recorded speculative trace); replays one hot buffer per verify row (per_row, --hot-tokens "
        "each) and one per request (per_request, --mtp-hot-tokens) side by side",
    )
    mtp.add_argument(
        "--mtp-accept",
        type=float,
        metavar="P",
        help=f"per-draft acceptance probability of the rounds (default {_MTP_ACCEPT}; seeded by --seed)",
    )
    mtp.add_argument(
        "--mtp-hot-tokens",
        type=int,
        metavar="H",
        help="hot slots per layer and request of the per_request design (>= top-k; default 2 x top-k, "
        "the server's: rounds whose union exceeds it are served from the overflow area)",
    )
    prof = parser.add_argument_group("production-shape timing (--profile-shape)")
    prof.add_argument(
        "--profile-shape",
        action="store_true",
        help="time warm steps' residency management vs sparse attention at production shape "
        "(overrides the synthetic defaults: rows 32, top-k 2048, hot 4096, 61 layers, 16 heads)",
    )
    prof.add_argument(
        "--profile-steps",
        type=int,
        default=4,
        help="warm-up steps before the timed ones (the hot buffers are full after 3)",
    )
    prof.add_argument(
        "--profile-repeats",
        type=int,
        default=4,
        help="timed warm steps, each over every layer's state in turn (cache-cold state, as in a "
        "model); manage times are their median, with min and p90",
    )
    prof.add_argument(
        "--profile-context",
        type=int,
        default=131072,
        help="longest prompt of the profile's synthetic trace (tokens; prompts are 1/4 .. 1 of it)",
    )
    prof.add_argument(
        "--manage-impl",
        choices=("auto", "kernel", "torch"),
        default="auto",
        help="residency implementation timed as the engine's (auto: the CPU kernel for lru on CPU)",
    )
    prof.add_argument(
        "--profile-compile",
        choices=("on", "off"),
        default="on",
        help="also time one layer step of the reference rung compiled with torch.compile",
    )


# ------------------------------------------------------------------------ helpers
def _progress(enabled: bool, label: str = "replay: step"):
    """Progress on stderr: a rewritten line on a terminal, a line per 10 % otherwise."""
    tty = sys.stderr.isatty()
    state = {"last": 0.0, "tenth": 0}

    def report(done: int, total: int) -> None:
        if not enabled:
            return
        if tty:
            now = time.monotonic()
            if now - state["last"] > 0.5 or done == total:
                state["last"] = now
                print(f"\r  {label} {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)
        elif done * 10 // total > state["tenth"]:
            state["tenth"] = done * 10 // total
            print(f"  {label} {done}/{total}", file=sys.stderr, flush=True)

    return report


def _load_or_synthesize(args):
    from ..sparse_decode.trace import SyntheticTraceSpec, load_trace, save_trace, synthesize

    if args.trace:
        return load_trace(args.trace), {"source": args.trace}
    spec = SyntheticTraceSpec(
        steps=args.steps,
        layers=args.layers,
        rows=args.rows,
        top_k=args.top_k,
        shape=args.shape,
        seed=args.seed,
        noise_skew=args.noise_skew,
        rank_depth=args.rank_depth,
    )
    trace = synthesize(spec)
    if args.save_trace:
        save_trace(trace, args.save_trace)
    return trace, {"source": "synthetic", **asdict(spec)}


def _input_problems(args) -> List[str]:
    problems = []
    for name in ("steps", "layers", "rows", "top_k", "heads", "profile_steps", "profile_repeats", "profile_context"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.hot_tokens is not None and args.hot_tokens < 1:
        problems.append("--hot-tokens must be >= 1")
    if args.noise_skew < 0:
        problems.append("--noise-skew must be >= 0")
    if args.rank_depth < 0:
        problems.append("--rank-depth must be >= 0")
    if getattr(args, "mtp", None) is None:
        for name in ("mtp_accept", "mtp_hot_tokens"):
            if getattr(args, name, None) is not None:
                problems.append(f"--{name.replace('_', '-')} needs --mtp")
    return problems


# ------------------------------------------------------------------------ replay mode
def _recorded_hot_tokens(trace) -> Optional[int]:
    """``hot_tokens`` a server recorded the trace with (its ``meta`` JSON), if any."""
    try:
        value = json.loads(trace.meta).get("hot_tokens") if trace.meta else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def run_replay(args) -> Dict[str, Any]:
    from ..sparse_decode.host_pool import HostPoolShape
    from ..sparse_decode.policies import POLICIES, needs_ranked
    from ..sparse_decode.replay import ReplayOptions, check_ranked, replay_trace, simulate_policy

    trace, source = _load_or_synthesize(args)
    k = trace.top_k
    hot = args.hot_tokens if args.hot_tokens is not None else _recorded_hot_tokens(trace) or 2 * k
    if hot < k:
        raise ValueError(f"--hot-tokens {hot} < the trace's top-k {k}: a row's selection must fit")
    policy = args.policy or _default_policy()
    check_ranked(trace, policy)
    if not args.json:
        print(
            f"trace: {trace.steps} steps x {trace.layers} layers x {trace.rows} rows, top-k {k}; "
            f"hot_tokens {hot}; policy {policy}; ops {args.ops}",
            file=sys.stderr,
        )
    result = replay_trace(
        trace,
        ReplayOptions(hot_tokens=hot, policy=policy, ops=args.ops, heads=args.heads, seed=args.seed),
        progress=_progress(not args.json),
    )
    total = result.stats.total
    row_bytes = HostPoolShape(1, 1).row_bytes
    selected = total.selected
    runnable = [name for name in POLICIES if trace.ranked is not None or not needs_ranked(name)]
    skipped = {name: "needs the trace's 'ranked' array" for name in POLICIES if name not in runnable}
    # residency-only columns: LRU on the CPU kernel (bit-identical to the contract), the
    # optimum by the per-row heap simulation (equal to BeladyManager; both tested)
    from ..sparse_decode.belady import belady_misses
    from ..sparse_decode.replay import SimResult, compact_trace

    sims = {name: simulate_policy(trace, name, hot, manage_impl="auto") for name in runnable}
    small = compact_trace(trace)
    opt = SimResult("belady", hot, [belady_misses(small.topk, small.req_ids, hot)])
    cache = simulate_policy(trace, "lru", k, manage_impl="auto")
    steps = max(1, trace.steps)
    times = result.times.seconds
    out: Dict[str, Any] = {
        "selected": selected,
        "hits": total.hits,
        "misses": total.misses,
        "hit_rate": total.hit_rate,
        "h2d_bytes": total.h2d_bytes,
        "d2h_bytes": total.d2h_bytes,
        "opt_misses": opt.misses,
        "misses_over_opt": total.misses / opt.misses if opt.misses else None,
        "verified": result.verified,
        "baselines": {
            "topk_reload": {"misses": selected, "h2d_bytes": selected * row_bytes},
            "topk_cache": {"misses": cache.misses, "h2d_bytes": cache.misses * row_bytes},
        },
        "h2d_vs_topk_reload": total.h2d_bytes / (selected * row_bytes) if selected else None,
        "h2d_vs_topk_cache": total.h2d_bytes / (cache.misses * row_bytes) if cache.misses else None,
        "policy": policy,
        "ops": args.ops,
        "hot_tokens": hot,
        "top_k": k,
        "steps": trace.steps,
        "layers": trace.layers,
        "rows": trace.rows,
        "row_bytes": row_bytes,
        "policies": {
            name: {
                "misses": s.misses,
                "misses_over_opt": s.misses / opt.misses if opt.misses else None,
                "misses_over_lru": s.misses / sims["lru"].misses if sims["lru"].misses else None,
            }
            for name, s in sims.items()
        },
        "policies_skipped": skipped,
        "rank_depth": trace.rank_depth,
        "per_layer": [c.as_dict() for c in result.stats.per_layer],
        "checks": result.checks,
        "failures": result.failures,
        "timing_ms_per_step": {phase: 1e3 * sec / steps for phase, sec in times.items()},
        "prefill_bytes": result.prefill_bytes,
        "host_tokens": result.host_tokens,
        "wall_s": result.wall_s,
        "trace": source,
    }
    if sims[policy].misses != total.misses:
        out["failures"].append(f"engine misses {total.misses} != residency-only replay {sims[policy].misses}")
        out["verified"] = False
    return out


def _ratio(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _print_replay(r: Dict[str, Any]) -> None:
    mib = 1 / 2**20
    print(
        f"\nsparse decode replay: {r['steps']} steps x {r['layers']} layers x {r['rows']} rows, "
        f"top-k {r['top_k']}, hot_tokens {r['hot_tokens']}, policy {r['policy']}, ops {r['ops']}"
    )
    print(
        f"verified: {'yes' if r['verified'] else 'NO'} ({r['checks']} layer steps: resident rows == host rows, "
        "attention == full-KV reference)"
    )
    for f in r["failures"]:
        print(f"  FAILED: {f}")
    rows = [
        ("this engine", r["misses"], r["h2d_bytes"], r["hit_rate"]),
        (
            "topk_cache (hot = top-k)",
            r["baselines"]["topk_cache"]["misses"],
            r["baselines"]["topk_cache"]["h2d_bytes"],
            1 - r["baselines"]["topk_cache"]["misses"] / max(1, r["selected"]),
        ),
        (
            "topk_reload (no hot buffer)",
            r["baselines"]["topk_reload"]["misses"],
            r["baselines"]["topk_reload"]["h2d_bytes"],
            0.0,
        ),
        (
            "Belady optimum",
            r["opt_misses"],
            r["opt_misses"] * r["row_bytes"],
            1 - r["opt_misses"] / max(1, r["selected"]),
        ),
    ]
    print(f"\n{'strategy':<30}{'misses':>12}{'H2D MiB':>12}{'hit rate':>10}{'vs engine':>11}")
    for name, misses, nbytes, hr in rows:
        ratio = misses / r["misses"] if r["misses"] else float("nan")
        print(f"{name:<30}{misses:>12}{nbytes * mib:>12.1f}{hr:>10.3f}{ratio:>10.2f}x")
    print(
        f"\nselected {r['selected']}, D2H (new-token appends) {r['d2h_bytes'] * mib:.2f} MiB, "
        f"misses / optimum {_ratio(r['misses_over_opt'])}"
    )
    print(f"\n{'policy (same capacity)':<30}{'misses':>12}{'/ optimum':>11}{'/ lru':>9}")
    for name, p in r["policies"].items():
        print(f"{name:<30}{p['misses']:>12}{_ratio(p['misses_over_opt']):>11}{_ratio(p['misses_over_lru']):>9}")
    t = r["timing_ms_per_step"]
    print(
        "\nper step (ms, this CPU): " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()) + f"; wall {r['wall_s']:.1f} s"
    )


# ------------------------------------------------------------------------ MTP mode
@dataclass
class MtpDesignResult:
    """One residency design's numbers in ``bench decode --mtp``.

    Bytes count bf16 rows of ``row_bytes`` (latent + rope); ``hit_rate`` is the share of
    the verify rows' own top-k entries that were resident (``row_hits / row_selected``,
    comparable across designs), ``unique_hit_rate`` the share of lookups that hit (per
    request, a position several rows select is one lookup). ``misses_over_opt`` compares
    every fetch (misses + overflow positions) with Belady's misses at the same capacity
    (with overflow too: ``belady.belady_misses``). ``h2d_bytes`` counts every
    host -> device row: the residency's misses and the overflow area's copies
    (``overflow_h2d_bytes``; ``overflow_rounds`` requests' rounds overflowed by
    ``overflow_positions`` positions, per layer in ``overflow_per_layer``).
    """

    design: str
    hot_tokens: int
    engine_rows: int
    h2d_bytes: int
    h2d_bytes_per_round: Optional[float]
    device_hot_bytes_per_request: int
    hit_rate: float
    unique_hit_rate: float
    selected: int
    hits: int
    misses: int
    row_selected: int
    row_hits: int
    opt_misses: int
    misses_over_opt: Optional[float]
    verified: bool
    checks: int
    failures: List[str]
    wall_s: float
    overflow_rounds: int = 0
    overflow_positions: int = 0
    overflow_h2d_bytes: int = 0
    overflow_per_layer: Optional[List[Dict[str, int]]] = None


def _mtp_rows(args) -> int:
    """Verify rows per request: ``--mtp`` drafts + the last accepted token."""
    return int(args.mtp) + 1


def _mtp_hot_tokens(args, top_k: int) -> Dict[str, int]:
    """Hot slots per layer and engine row of each design: per verify row (``--hot-tokens``,
    default 2 x top-k) and per request (``--mtp-hot-tokens``, default the server's, 2 x top-k)."""
    from ..sparse_decode.sizing import default_hot_tokens

    per_row = args.hot_tokens if args.hot_tokens is not None else default_hot_tokens(top_k, None)
    per_request = args.mtp_hot_tokens if args.mtp_hot_tokens is not None else default_hot_tokens(top_k, None)
    return {"per_row": per_row, "per_request": per_request}


def _mtp_static_problems(args) -> List[str]:
    """Every problem of the ``--mtp`` flags that does not need the trace's top-k."""
    from ..sparse_decode.policies import POLICIES, needs_ranked

    problems = []
    if args.mtp < 1:
        problems.append(f"--mtp {args.mtp}: the draft tokens must be >= 1")
    accept = args.mtp_accept if args.mtp_accept is not None else _MTP_ACCEPT
    if not 0.0 <= accept <= 1.0:
        problems.append(f"--mtp-accept {accept:g} must be in [0, 1]")
    policy = args.policy or _default_policy()
    if needs_ranked(policy):
        usable = ", ".join(sorted(p for p in POLICIES if not needs_ranked(p)))
        problems.append(
            f"--policy {policy} needs the indexer's ranking; speculative rounds carry top-k only (use one of {usable})"
        )
    if args.mtp_hot_tokens is not None and args.mtp_hot_tokens < 1:
        problems.append("--mtp-hot-tokens must be >= 1")
    if args.profile_shape:
        problems.append("--profile-shape and --mtp are separate modes: pass one")
    if args.plot:
        problems.append("--plot draws the non-speculative table: drop it with --mtp")
    return problems


def _mtp_topk_problems(args, top_k: int) -> List[str]:
    """Problems of the hot-buffer sizes against the trace's ``top_k`` (both designs must fit a round)."""
    if args.mtp < 1 or top_k < 1:
        return []
    hot = _mtp_hot_tokens(args, top_k)
    problems = []
    if args.hot_tokens is not None and 1 <= hot["per_row"] < top_k:
        problems.append(
            f"--hot-tokens {hot['per_row']} < the trace's top-k {top_k}: a verify row's selection "
            "must fit its buffer (per_row design)"
        )
    if args.mtp_hot_tokens is not None and 1 <= hot["per_request"] < top_k:
        problems.append(
            f"--mtp-hot-tokens {hot['per_request']} < the trace's top-k {top_k}: every verify row's "
            "selection must fit its request's buffer (per_request design)"
        )
    return problems


def _mtp_trace(args):
    """``(SpecTrace, trace source dict)`` from the base trace (``--trace`` or synthetic), or
    a recorded speculative trace (``--trace``); ValueError listing the hot-buffer problems
    against a recorded trace's top-k."""
    from ..sparse_decode.spec_trace import is_spec_trace, load_spec_trace, speculative_from_trace

    if args.trace and is_spec_trace(args.trace):
        spec = load_spec_trace(args.trace)
        if spec.rows_per_request != _mtp_rows(args):
            raise ValueError(
                f"{args.trace} holds rounds of {spec.rows_per_request} verify rows (MTP "
                f"{spec.rows_per_request - 1}); pass --mtp {spec.rows_per_request - 1}"
            )
        for name in ("mtp_accept",):
            if getattr(args, name) is not None:
                raise ValueError("--mtp-accept derives rounds from a decode trace; a speculative trace has its own")
        problems = _mtp_topk_problems(args, spec.top_k)
        if problems:
            raise ValueError("; ".join(problems))
        return spec, {"source": args.trace, "speculative": True}
    base, source = _load_or_synthesize(args)
    problems = _mtp_topk_problems(args, base.top_k) if args.trace else []
    if problems:
        raise ValueError("; ".join(problems))
    accept = args.mtp_accept if args.mtp_accept is not None else _MTP_ACCEPT
    spec = speculative_from_trace(base, _mtp_rows(args), accept, seed=args.seed, source=source["source"])
    if spec.rounds == 0:
        raise ValueError(
            f"the trace has no request with {spec.rows_per_request} consecutive decode positions: "
            "no verify round to replay (a longer trace, or a smaller --mtp)"
        )
    return spec, source


def _mtp_device_hot_bytes(design: str, hot_tokens: int, n: int, layers: int, row_bytes: int) -> int:
    """Device hot-buffer bytes one request holds: ``n`` buffers of ``hot_tokens`` rows per
    layer (per_row) or one (per_request)."""
    buffers = n if design == "per_row" else 1
    return buffers * hot_tokens * layers * row_bytes


def _mtp_design(spec, design: str, hot_tokens: int, args, policy: str, row_bytes: int) -> MtpDesignResult:
    """Replay ``spec`` (a :class:`~..sparse_decode.spec_trace.SpecTrace`) in ``design``, verified,
    and its Belady optimum at the same capacity."""
    from ..sparse_decode.spec_replay import opt_misses, replay_speculative

    res = replay_speculative(
        spec,
        design,
        hot_tokens,
        policy=policy,
        ops=args.ops,
        heads=args.heads,
        seed=args.seed,
        verify=True,
        progress=_progress(True, f"{design}: round"),
    )
    total = res.stats.total
    opt = opt_misses(spec, design, hot_tokens)
    n = spec.rows_per_request
    h2d = total.h2d_bytes + total.overflow_h2d_bytes
    return MtpDesignResult(
        design=design,
        hot_tokens=hot_tokens,
        engine_rows=spec.requests * (n if design == "per_row" else 1),
        h2d_bytes=h2d,
        h2d_bytes_per_round=h2d / res.rounds if res.rounds else None,
        device_hot_bytes_per_request=_mtp_device_hot_bytes(design, hot_tokens, n, spec.layers, row_bytes),
        hit_rate=total.row_hit_rate,
        unique_hit_rate=total.hit_rate,
        selected=total.selected,
        hits=total.hits,
        misses=total.misses,
        row_selected=total.row_selected,
        row_hits=total.row_hits,
        opt_misses=opt,
        misses_over_opt=(total.misses + total.overflow_positions) / opt if opt else None,
        verified=res.verified,
        checks=res.checks,
        failures=list(res.failures),
        wall_s=res.wall_s,
        overflow_rounds=total.overflow_rounds,
        overflow_positions=total.overflow_positions,
        overflow_h2d_bytes=total.overflow_h2d_bytes,
        overflow_per_layer=[
            {"layer": i, "overflow_rounds": c.overflow_rounds, "overflow_positions": c.overflow_positions}
            for i, c in enumerate(res.stats.per_layer)
        ],
    )


def _over(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _mtp_ratios(row: MtpDesignResult, req: MtpDesignResult) -> Dict[str, Optional[float]]:
    """per_request / per_row of the byte counts and misses; hit-rate difference."""
    return {
        "h2d_bytes_per_round": _over(req.h2d_bytes_per_round, row.h2d_bytes_per_round),
        "device_hot_bytes_per_request": _over(req.device_hot_bytes_per_request, row.device_hot_bytes_per_request),
        "misses": _over(req.misses, row.misses),
        "hit_rate_delta": req.hit_rate - row.hit_rate,
    }


def _mtp_cross_failures(row: MtpDesignResult, req: MtpDesignResult) -> List[str]:
    """Checks across the designs: both replays saw the same rows' entries, and the
    per-row design has one lookup per row entry."""
    out = []
    if row.row_selected != req.row_selected:
        out.append(f"the designs' verify rows selected different entries ({row.row_selected} vs {req.row_selected})")
    if row.selected != row.row_selected:
        out.append(f"per_row lookups {row.selected} != its rows' entries {row.row_selected}")
    if req.selected > req.row_selected:
        out.append(f"per_request lookups {req.selected} > its rows' entries {req.row_selected}")
    return out


def run_mtp(args) -> Dict[str, Any]:
    """``bench decode --mtp N``: the per_row and per_request designs over one speculative trace."""
    from ..sparse_decode.host_pool import HostPoolShape

    spec, source = _mtp_trace(args)
    n, k = spec.rows_per_request, spec.top_k
    hot = _mtp_hot_tokens(args, k)
    policy = args.policy or _default_policy()
    row_bytes = HostPoolShape(1, 1).row_bytes
    live = spec.req_ids >= 0
    accept = args.mtp_accept if args.mtp_accept is not None else _MTP_ACCEPT
    print(
        f"speculative trace: {spec.rounds} rounds x {spec.layers} layers x {spec.requests} requests x {n} "
        f"verify rows, top-k {k}; hot_tokens {hot['per_row']} per row, {hot['per_request']} per request; "
        f"policy {policy}; ops {args.ops}",
        file=sys.stderr,
        flush=True,
    )
    results = {d: _mtp_design(spec, d, hot[d], args, policy, row_bytes) for d in ("per_row", "per_request")}
    row, req = results["per_row"], results["per_request"]
    cross = _mtp_cross_failures(row, req)
    return {
        "per_row": asdict(row),
        "per_request": asdict(req),
        "verified": row.verified and req.verified and not cross,
        "failures": cross,
        "ratios": _mtp_ratios(row, req),
        "mtp": int(args.mtp),
        "rows_per_request": n,
        "accept_rate": accept,
        "mean_accept_length": float(spec.accepted[live].mean()) if live.any() else 0.0,
        "rounds": int(np.count_nonzero(live.any(axis=1))),
        "request_rounds": int(live.sum()),
        "top_k": k,
        "layers": spec.layers,
        "requests": spec.requests,
        "policy": policy,
        "ops": args.ops,
        "heads": args.heads,
        "seed": args.seed,
        "row_bytes": row_bytes,
        "trace": source,
        "wall_s": row.wall_s + req.wall_s,
        "union_over_top_k": _union_stats(spec),
    }


def _union_stats(spec) -> Dict[str, Optional[float]]:
    """Distribution of the union of a request's verify rows' top-k over top-k (what the
    per-request buffer must hold; ``rows_per_request`` is its bound)."""
    from ..sparse_decode.spec_trace import union_sizes, union_sizes_by_layer

    out = _distribution(union_sizes(spec) / float(spec.top_k))
    out["bound"] = float(spec.rows_per_request)
    out["per_layer"] = [_distribution(s / float(spec.top_k)) for s in union_sizes_by_layer(spec)]
    return out


def _distribution(sizes: np.ndarray) -> Dict[str, Optional[float]]:
    """mean, p50, p99, max of ``sizes`` (``None`` each when empty)."""
    if sizes.size == 0:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    return {
        "mean": float(sizes.mean()),
        "p50": float(np.percentile(sizes, 50)),
        "p99": float(np.percentile(sizes, 99)),
        "max": float(sizes.max()),
    }


def _scaled(x: Optional[float], factor: float) -> Optional[float]:
    return None if x is None else x * factor


def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _print_mtp(r: Dict[str, Any]) -> None:
    mib = 1 / 2**20
    row, req, ratio = r["per_row"], r["per_request"], r["ratios"]
    print(
        f"\nspeculative verify replay, MTP {r['mtp']} ({r['rows_per_request']} verify rows per request): "
        f"{r['rounds']} rounds x {r['layers']} layers x {r['requests']} requests, top-k {r['top_k']}, accept "
        f"{r['accept_rate']:g} per draft (mean accept length {r['mean_accept_length']:.2f}), policy {r['policy']}, "
        f"ops {r['ops']}"
    )
    print(
        f"verified: {'yes' if r['verified'] else 'NO'} (per_row {row['checks']}, per_request {req['checks']} "
        "layer steps: resident rows == host rows, attention == full-KV reference)"
    )
    for f in row["failures"] + req["failures"] + r["failures"]:
        print(f"  FAILED: {f}")
    lines = [
        ("hot_tokens (per engine row)", f"{row['hot_tokens']}", f"{req['hot_tokens']}", ""),
        (
            "device hot MiB per request",
            f"{row['device_hot_bytes_per_request'] * mib:.2f}",
            f"{req['device_hot_bytes_per_request'] * mib:.2f}",
            _fmt(ratio["device_hot_bytes_per_request"], ".3f"),
        ),
        (
            "H2D MiB per round",
            _fmt(_scaled(row["h2d_bytes_per_round"], mib), ".3f"),
            _fmt(_scaled(req["h2d_bytes_per_round"], mib), ".3f"),
            _fmt(ratio["h2d_bytes_per_round"], ".3f"),
        ),
        (
            "hit rate (rows' top-k resident)",
            f"{row['hit_rate']:.3f}",
            f"{req['hit_rate']:.3f}",
            f"{ratio['hit_rate_delta']:+.3f}",
        ),
        ("unique hit rate (lookups)", f"{row['unique_hit_rate']:.3f}", f"{req['unique_hit_rate']:.3f}", ""),
        ("misses", f"{row['misses']}", f"{req['misses']}", _fmt(ratio["misses"], ".3f")),
        ("Belady optimum misses", f"{row['opt_misses']}", f"{req['opt_misses']}", ""),
        ("misses / optimum", _fmt(row["misses_over_opt"], ".3f"), _fmt(req["misses_over_opt"], ".3f"), ""),
        ("overflow rounds (request x layer)", f"{row['overflow_rounds']}", f"{req['overflow_rounds']}", ""),
        ("overflow positions", f"{row['overflow_positions']}", f"{req['overflow_positions']}", ""),
    ]
    print(f"\n{'':<34}{'per_row':>12}{'per_request':>14}{'per_request/per_row':>22}")
    for name, a, b, c in lines:
        print(f"{name:<34}{a:>12}{b:>14}{c:>22}")
    u = r["union_over_top_k"]
    if u["mean"] is not None:
        print(
            f"\nunion of a request's verify rows' top-k / top-k (what one shared buffer holds): mean {u['mean']:.2f}, "
            f"p50 {u['p50']:.2f}, p99 {u['p99']:.2f}, max {u['max']:.2f} (bound {u['bound']:g})"
        )
        for layer, d in enumerate(u["per_layer"]):
            if d["mean"] is not None:
                stats = ", ".join(f"{key} {d[key]:.2f}" for key in ("mean", "p50", "p99", "max"))
                print(f"  layer {layer}: {stats}")
        for layer, d in enumerate(u["per_layer"]):
            if d["mean"] is not None:
                stats = ", ".join(f"{key} {d[key]:.2f}" for key in ("mean", "p50", "p99", "max"))
                print(f"  layer {layer}: {stats}")
    print(f"\nlast column: per_request / per_row (hit rate: per_request - per_row); replay wall {r['wall_s']:.1f} s")


def main_mtp(args: argparse.Namespace) -> int:
    """``bench decode --mtp N``: exit 0 verified, 1 a check failed, 2 bad input (every problem listed)."""
    problems = _input_problems(args) + _mtp_static_problems(args)
    if not args.trace:
        problems += _mtp_topk_problems(args, args.top_k)
    if problems:
        print("bench decode: " + "; ".join(problems), file=sys.stderr)
        return 2
    from ..sparse_decode.trace import TraceError

    try:
        result = run_mtp(args)
    except (TraceError, ValueError) as exc:
        print(f"bench decode: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        _print_mtp(result)
    return 0 if result["verified"] else 1


# ------------------------------------------------------------------- profile mode
@dataclass(frozen=True)
class _ProfileShape:
    """What ``--profile-shape`` times: the replay's small defaults give way to production
    shape (rows 32, top-k 2048, 61 layers, 16 heads, hot = 2 x top-k)."""

    rows: int
    top_k: int
    layers: int
    heads: int
    hot: int  # hot-buffer slots per row
    policy: str
    repeats: int  # timed warm steps
    steps: int  # synthesized steps: --profile-steps warm-up steps, then the timed ones
    context: int  # longest prompt (tokens); the shortest is a quarter of it
    depth: int  # rank depth of the synthesized trace (0: no ranking)


def _profile_shape(args) -> _ProfileShape:
    from ..sparse_decode.policies import needs_ranked

    k = args.top_k if args.top_k != 128 else 2048
    hot = args.hot_tokens if args.hot_tokens is not None else 2 * k
    policy = args.policy or _default_policy()
    return _ProfileShape(
        rows=args.rows if args.rows != 8 else 32,
        top_k=k,
        layers=args.layers if args.layers != 4 else 61,
        heads=args.heads if args.heads != 8 else 16,
        hot=hot,
        policy=policy,
        repeats=args.profile_repeats,
        steps=args.profile_steps + args.profile_repeats,
        context=max(args.profile_context, 4 * k),
        depth=args.rank_depth or (2 * hot if needs_ranked(policy) else 0),
    )


@dataclass
class _ProfileTrace:
    """The synthesized trace as the residency managers take it."""

    req: torch.Tensor  # [steps, rows] int64 request id of each row
    lens: torch.Tensor  # [steps, rows] int32 sequence length of each row
    topk: torch.Tensor  # [steps, layers, rows, top_k] selected positions (-1: none)
    ranked: Optional[torch.Tensor]  # the trace's ranking for score policies (None: none recorded)


def _profile_trace(shape: _ProfileShape, args) -> _ProfileTrace:
    from ..sparse_decode.trace import SyntheticTraceSpec, synthesize

    spec = SyntheticTraceSpec(
        steps=shape.steps,
        layers=shape.layers,
        rows=shape.rows,
        top_k=shape.top_k,
        seed=args.seed,
        min_prompt=shape.context // 4,
        max_prompt=shape.context,
        min_decode=shape.steps + 1,
        max_decode=shape.steps + 1,
        noise_skew=args.noise_skew,
        rank_depth=shape.depth,
    )
    trace = synthesize(spec)
    return _ProfileTrace(
        torch.from_numpy(trace.req_ids.astype(np.int64)),
        torch.from_numpy(trace.seq_lens.astype(np.int32)),
        torch.from_numpy(trace.topk),
        torch.from_numpy(trace.ranked) if trace.ranked is not None else None,
    )


def _step_runner(trace: _ProfileTrace, layers: int, batch_rows: torch.Tensor):
    """``one_step(managers, t)``: step ``t`` of the trace through every layer's manager."""
    req, lens, topk, ranked = trace.req, trace.lens, trace.topk, trace.ranked

    def one_step(mgrs, t):
        """Results, wall seconds and this thread's CPU seconds of one step over all layers
        (the CPU time is what the step costs on a machine others also use)."""
        out = []
        t0, c0 = time.perf_counter(), time.thread_time()
        for layer in range(layers):
            if mgrs[layer].needs_ranked:
                mgrs[layer].set_ranked(ranked[t, layer])
            out.append(mgrs[layer].step_rows(batch_rows, topk[t, layer].contiguous(), req[t], lens[t], t))
        return out, time.perf_counter() - t0, time.thread_time() - c0

    return one_step


@dataclass
class _ManageTiming:
    """Residency management over the timed steps, the engine's path beside the torch reference."""

    wall: List[float]  # per timed step: wall seconds per layer-call, engine's path
    cpu: List[float]  # per timed step: this thread's CPU seconds per layer-call, engine's path
    ref_wall: List[float]  # the same for the torch reference
    ref_cpu: List[float]
    misses_all: List[int]  # per timed step: misses over every layer, engine's path
    ref_misses_all: List[int]  # the same for the torch reference
    same: bool  # slots, miss counts and per-step misses identical to the reference
    results: List[Any]  # the engine's results of the last timed step, one per layer


def _time_manage(one_step, managers, reference, warm_steps: int, steps: int, layers: int) -> _ManageTiming:
    """Time the steps after ``warm_steps``: each the engine's path over every layer's state in
    turn (a layer's state is cold when its turn comes, as in a model), then the reference on
    the same step; per step the wall and CPU time per layer-call."""
    wall, cpu, ref_wall, ref_cpu = [], [], [], []
    same, misses_all, ref_misses_all = True, [], []
    for t in range(warm_steps, steps):
        results, manage_s, manage_cpu_s = one_step(managers, t)
        ref_results, ref_manage_s, ref_manage_cpu_s = one_step(reference, t)
        wall.append(manage_s / layers)
        cpu.append(manage_cpu_s / layers)
        ref_wall.append(ref_manage_s / layers)
        ref_cpu.append(ref_manage_cpu_s / layers)
        misses_all.append(int(sum(int(r.miss_count.sum()) for r in results)))
        ref_misses_all.append(int(sum(int(r.miss_count.sum()) for r in ref_results)))
        same = same and all(
            torch.equal(a.slots, b.slots) and torch.equal(a.miss_count, b.miss_count)
            for a, b in zip(results, ref_results)
        )
    same = same and misses_all == ref_misses_all
    return _ManageTiming(wall, cpu, ref_wall, ref_cpu, misses_all, ref_misses_all, same, results)


def _time_copy_and_attention(
    shape: _ProfileShape, lens_t: torch.Tensor, results, row_dim: int, copy_op, attention
) -> Tuple[float, float]:
    """Seconds of every layer's miss copy and sparse attention for ``results`` (one step).

    One layer's worth of buffers, reused for every layer: content does not change cost.
    The token table maps every position to one of ``_PROFILE_HOST_ROWS`` host rows
    (distinct within a row's selection): a bounded host pool, the same copy pattern.
    """
    from ..sparse_decode.hot_buffer import HotBuffers

    rows, hot, heads = shape.rows, shape.hot, shape.heads
    max_ctx = int(lens_t.max())
    host = torch.randn((min(_PROFILE_HOST_ROWS, rows * max_ctx), row_dim)).to(torch.bfloat16)
    token_table = (torch.arange(rows * max_ctx, dtype=torch.int64) % host.shape[0]).to(torch.int32).view(rows, -1)
    hot_buf = HotBuffers(1, rows, hot, row_dim)
    query = torch.randn((rows, heads, 512)).to(torch.bfloat16)
    query_rope = torch.randn((rows, heads, 64)).to(torch.bfloat16)
    latent, rope = hot_buf.split_flat(0, 512)
    copy_s = attn_s = 0.0
    for layer, res in enumerate(results):
        c0 = time.perf_counter()
        copy_op(host, hot_buf.layer(0), res.miss_tokens, res.miss_slots, res.miss_count, token_table)
        c1 = time.perf_counter()
        attention(
            query,
            latent[: rows * hot],
            None,
            hot_buf.flat_indices(res.slots),
            1 / 24.0,
            query_rope=query_rope,
            key_rope=rope[: rows * hot],
            layout_query="TND",
            layout_kv="flat",
        )
        c2 = time.perf_counter()
        copy_s += c1 - c0
        attn_s += c2 - c1
    return copy_s, attn_s


def _profile_keys(
    shape: _ProfileShape,
    args,
    kernel: bool,
    m: _ManageTiming,
    copy_s: float,
    attn_s: float,
    topk_t: torch.Tensor,
    lens_t: torch.Tensor,
) -> Dict[str, Any]:
    """The JSON keys of the residency, copy and attention timings."""
    layers = shape.layers
    misses, ref_misses = m.misses_all[-1], m.ref_misses_all[-1]
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {
        "rows": shape.rows,
        "top_k": shape.top_k,
        "hot_tokens": shape.hot,
        "layers": layers,
        "heads": shape.heads,
        "policy": shape.policy,
        "ops": args.ops,
        "torch_threads": torch.get_num_threads(),
        "step_misses": misses,
        "step_selected": int((topk_t >= 0).sum()),
        "manage_ms": 1e3 * med(m.wall) * layers,
        "copy_ms": 1e3 * copy_s,
        "attention_ms": 1e3 * attn_s,
        "manage_over_attention": med(m.wall) * layers / attn_s if attn_s else None,
        "manage_ms_per_layer": 1e3 * med(m.wall),
        "manage_ms_per_layer_min": 1e3 * min(m.wall),
        "manage_ms_per_layer_p90": 1e3 * float(np.percentile(m.wall, 90)),
        "manage_cpu_ms_per_layer": 1e3 * med(m.cpu),
        "manage_cpu_ms_per_layer_min": 1e3 * min(m.cpu),
        "manage_timed_steps": shape.repeats,
        "manage_impl": "kernel" if kernel else "torch",
        "reference_manage_ms_per_layer": 1e3 * med(m.ref_wall),
        "reference_manage_cpu_ms_per_layer": 1e3 * med(m.ref_cpu),
        "timed_step_misses": m.misses_all,
        "reference_step_misses": ref_misses,
        "misses_equal_contract": bool(m.same and misses == ref_misses),
        "context_max": int(lens_t.max()),
        "rank_depth": shape.depth,
    }


def run_profile(args) -> Dict[str, Any]:
    """Time steady-state steps at production shape (see module docstring)."""
    from ..sparse_decode.policies import make_manager, uses_cpu_kernel

    shape = _profile_shape(args)
    rows, k, layers, hot, policy = shape.rows, shape.top_k, shape.layers, shape.hot, shape.policy
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    log(
        f"profile: rows {rows}, top-k {k}, hot {hot}, layers {layers}, heads {shape.heads}, policy {policy}, "
        f"contexts {shape.context // 4}..{shape.context}; synthesising {shape.steps} steps ..."
    )
    trace = _profile_trace(shape, args)
    # the separate ops on the rungs the operator plan names for --ops (op_selection / op_rungs)
    plan = op_selection.select_ops(
        ops=args.ops, fused_lim=False, fused_copy_sfa=False, policy=policy, manage_impl=args.manage_impl
    )
    manage_op, copy_op, attention = (
        plan.impl(op) for op in ("residency_manage", "copy_miss_rows", "sparse_mla_attention")
    )
    stages = [plan.residency_stage() if r.stage == "residency" else r for r in plan.rungs]  # the policy's step
    log("rungs: " + ", ".join(r.label() for r in stages if r.stage != "indexer"))
    max_pos = int(trace.lens.max()) + 1
    batch_rows = torch.arange(rows, dtype=torch.int64)
    kernel = uses_cpu_kernel(policy, args.manage_impl, None, manage_op)
    managers = [
        make_manager(policy, rows, hot, None, manage_op, manage_impl=args.manage_impl, max_positions=max_pos)
        for _ in range(layers)
    ]
    reference = [make_manager(policy, rows, hot, None, manage_op, manage_impl="torch") for _ in range(layers)]
    one_step = _step_runner(trace, layers, batch_rows)

    log(f"warming residency tables ({'CPU kernel' if kernel else 'torch'} and the torch reference) ...")
    for t in range(args.profile_steps):
        one_step(managers, t)
        one_step(reference, t)
    log(f"timing {shape.repeats} warm steps x {layers} layers ...")
    timing = _time_manage(one_step, managers, reference, args.profile_steps, shape.steps, layers)
    t = shape.steps - 1
    row_dim = 512 + 64
    log(f"timing miss copies and attention of {layers} layers ...")
    copy_s, attn_s = _time_copy_and_attention(shape, trace.lens[t], timing.results, row_dim, copy_op, attention)
    out = _profile_keys(shape, args, kernel, timing, copy_s, attn_s, trace.topk[t], trace.lens[t])
    out.update(_profile_score_kernels(log, trace.ranked, one_step, shape.steps, rows, hot, layers))
    if args.profile_compile == "on":
        out.update(
            _profile_compiled(
                args,
                log,
                reference[layers - 1],
                batch_rows,
                trace.topk[t, layers - 1],
                trace.req[t],
                trace.lens[t],
                t,
                row_dim,
                shape.heads,
            )
        )
    return out


def _profile_score_kernels(log, ranked, one_step, steps, rows, hot, layers) -> Dict[str, Any]:
    """``score_rank`` / ``score_rank_guarded`` on their CPU kernel over the same trace, warmed
    and timed like the engine's manager (ms per layer, wall and CPU); ``None`` when the
    trace has no ranking (give ``--rank-depth``, or profile a score policy)."""
    from ..sparse_decode.policies import make_manager

    out: Dict[str, Any] = {
        f"{p}_manage{c}_ms_per_layer": None for p in ("score_rank", "score_rank_guarded") for c in ("", "_cpu")
    }
    if ranked is None:
        return out
    for policy in ("score_rank", "score_rank_guarded"):
        log(f"timing {policy} on its CPU kernel ...")
        mgrs = [make_manager(policy, rows, hot, None, manage_impl="kernel") for _ in range(layers)]
        for t in range(steps - 1):
            one_step(mgrs, t)
        _, wall_s, cpu_s = one_step(mgrs, steps - 1)
        out[f"{policy}_manage_ms_per_layer"] = 1e3 * wall_s / layers
        out[f"{policy}_manage_cpu_ms_per_layer"] = 1e3 * cpu_s / layers
    return out


def _profile_compiled(args, log, warm_manager, rows, topk, req_ids, stable_len, step, row_dim, heads) -> Dict[str, Any]:
    """One layer's whole step (residency, copy, remap, attention) on the reference rung,
    eager vs ``torch.compile(fullgraph=True)``, from the same warm state (ms)."""
    import copy as _copy

    from ..sparse_decode.engine import decode_layer_step

    r, hot = warm_manager.table.slot_token.shape
    max_ctx = int(stable_len.max()) + 1
    host = torch.randn((min(_PROFILE_HOST_ROWS, r * max_ctx), row_dim)).to(torch.bfloat16)
    table = (torch.arange(r * max_ctx, dtype=torch.int64) % host.shape[0]).to(torch.int32).view(r, max_ctx)
    query = torch.randn((r, heads, 512)).to(torch.bfloat16)
    query_rope = torch.randn((r, heads, 64)).to(torch.bfloat16)
    step_t = torch.tensor(step, dtype=torch.int64)

    def timed(fn, manager, repeats=3):
        best = float("inf")
        for _ in range(repeats):
            m = _copy.deepcopy(manager)
            hot_buf = torch.zeros((r, hot, row_dim), dtype=torch.bfloat16)
            t0 = time.perf_counter()
            fn(
                m,
                rows,
                topk.contiguous(),
                req_ids,
                stable_len,
                step_t,
                host,
                hot_buf,
                table,
                query,
                query_rope,
                1 / 24.0,
                512,
            )
            best = min(best, time.perf_counter() - t0)
        return best

    eager_s = timed(decode_layer_step, warm_manager)
    log("compiling one layer step of the reference rung (torch.compile, fullgraph) ...")
    compiled = torch.compile(decode_layer_step, fullgraph=True, dynamic=False)
    c0 = time.perf_counter()
    timed(compiled, warm_manager, repeats=1)
    compile_s = time.perf_counter() - c0
    compiled_s = timed(compiled, warm_manager)
    return {
        "reference_step_eager_ms_per_layer": 1e3 * eager_s,
        "reference_step_compiled_ms_per_layer": 1e3 * compiled_s,
        "reference_compile_s": compile_s,
    }


def _print_profile(r: Dict[str, Any]) -> None:
    print(
        f"\none decode step at rows {r['rows']}, top-k {r['top_k']}, hot {r['hot_tokens']}, "
        f"{r['layers']} layers, {r['heads']} heads, contexts up to {r['context_max']}, policy {r['policy']}, "
        f"ops {r['ops']} ({r['torch_threads']} torch threads)"
    )
    print(
        f"  selected {r['step_selected']}, misses {r['step_misses']} "
        f"(torch reference: {r['reference_step_misses']}, identical: {'yes' if r['misses_equal_contract'] else 'NO'})"
    )
    print(
        f"  {'residency management':<34}{r['manage_ms']:>10.1f} ms  ({r['manage_ms_per_layer']:.3f} ms/layer, "
        f"CPU time {r['manage_cpu_ms_per_layer']:.3f} ms/layer; median of {r['manage_timed_steps']} steps x "
        f"{r['layers']} layers, min {r['manage_ms_per_layer_min']:.3f}, p90 {r['manage_ms_per_layer_p90']:.3f} "
        f"ms/layer; {r['manage_impl']})"
    )
    print(
        f"  {'  torch reference (the contract)':<34}{r['reference_manage_ms_per_layer'] * r['layers']:>10.1f} ms  "
        f"({r['reference_manage_ms_per_layer']:.3f} ms/layer, CPU time "
        f"{r['reference_manage_cpu_ms_per_layer']:.3f} ms/layer)"
    )
    if r.get("score_rank_manage_ms_per_layer") is not None:
        score_rank_ms = r["score_rank_manage_ms_per_layer"] * r["layers"]
        print(
            f"  {'  score_rank / guarded, CPU kernel':<34}{score_rank_ms:>10.1f} ms  "
            f"({r['score_rank_manage_ms_per_layer']:.3f} / {r['score_rank_guarded_manage_ms_per_layer']:.3f} ms/layer)"
        )
    print(f"  {'miss copy host->device':<34}{r['copy_ms']:>10.1f} ms")
    print(f"  {'sparse attention (reference)':<34}{r['attention_ms']:>10.1f} ms")
    print(f"  management / attention = {r['manage_over_attention']:.3f}")
    if "reference_step_compiled_ms_per_layer" in r:
        print(
            f"  one layer step, reference rung: eager {r['reference_step_eager_ms_per_layer']:.1f} ms, "
            f"torch.compile {r['reference_step_compiled_ms_per_layer']:.1f} ms "
            f"(compiled in {r['reference_compile_s']:.0f} s)"
        )


def main(args: argparse.Namespace) -> int:
    if getattr(args, "mtp", None) is not None:
        return main_mtp(args)
    problems = _input_problems(args)
    if problems:
        print("bench decode: " + "; ".join(problems), file=sys.stderr)
        return 2
    from ..sparse_decode.trace import TraceError

    try:
        result = run_profile(args) if args.profile_shape else run_replay(args)
    except (TraceError, ValueError) as exc:
        print(f"bench decode: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "plot", None) and not args.profile_shape:
        from .plots import plot_decode_table

        plot_decode_table(result, args.plot)
        print(f"bench decode: wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    elif args.profile_shape:
        _print_profile(result)
    else:
        _print_replay(result)
    if not args.profile_shape and not result["verified"]:
        return 1
    return 0
