"""``python -m sglang_ascend_offload bench transfer [--json]``: P/D transfer in one run.

Real prefill and decode processes (the multi-process harness of
``testing/pd_harness.py``), Mooncake over TCP on 127.0.0.1:

1. **throughput**: one request of ``--tokens`` tokens, DeepSeek-V3.2 per-token
   sizes (latent 512 + rope 64 bf16 into the decode host pool, indexer 128 bf16
   into the rank-local cache), ``--layers`` layers, one prefill slot per layer
   unless ``--throughput-slots``, every byte verified. Side by side, in the same run:

   * ``transfer_bytes_per_s``: our P/D path, bytes over the decode rank's span
     from the start of its first engine read to the end of its last (protocol,
     validation and every gap between layers included);
   * ``engine_bytes_per_s``: bytes over the time inside those engine reads only;
   * ``raw_engine_bytes_per_s``: the bare engine (Mooncake's own
     ``batch_transfer_sync_read``) issuing exactly the same chunk lists on the same
     registered buffers in the same processes, one call per layer as ours, no
     control plane, right after ours and after as long an engine idle as ours had
     (``idle_before_reads_s``: Mooncake's TCP connections read 2-3x slower after a few
     hundred ms of idle, so a replay on warm connections would flatter the engine);
     ``engine_over_raw``: per layer after the first,
     raw time over ours (read + idle gap before it), median over every layer of the
     ``--throughput-runs`` runs; ``engine_over_raw_total``: whole-run
     ``transfer_bytes_per_s / raw_engine_bytes_per_s`` of the reported run (the one
     with the median whole-run ratio);
   * ``memcpy_bytes_per_s``: a plain in-process memcpy of the same chunk sizes;
2. **per-layer protocol overhead**: ``--overhead-layers`` layers of a single small
   block through one slot (each layer waits for the previous answer, nothing
   queues); per layer, publish -> READ_DONE latency on prefill minus decode's engine
   read time for that layer: mean (``per_layer_overhead_us``), p50 and p99; then the
   same run once more with stage stamps on (``SGLANG_ASCEND_OFFLOAD_PD_TRACE``, see
   :mod:`sglang_ascend_offload.transfer.stages`): ``control_path_stages_us`` gives
   p50 / p99 of every step of the path (encode, send, the receiver's wake-up,
   decode, validation, bookkeeping...), so the untraced run above stays the
   reported number; ``control_path_spin_us``: the receive spin each side ran with
   (``--spin-us`` sets both, for A/B runs; 0 = off). After warm-up every worker
   collects once and freezes its start-up heap (``gc.freeze``,
   ``worker_gc_frozen_objects``): a full collection over a worker's ~170k objects
   otherwise lands inside some run as one layer of hundreds of ms;
3. **fault table**: the failure scenarios of the tests (read failure, dropped
   answer, dead decode, decode slower than the deadline, malformed messages...),
   each with outcome, hung, destination_used_after_failure, leaked_slots. The
   injected faults' logs go to a temporary file unless ``-v``;
4. ``--served``: real SGLang servers on the tiny DSA fixture behind the router
   (see :mod:`sglang_ascend_offload.bench.transfer_served`): TTFT p50 / p99 and output
   tokens/s of colocated serving and of each P/D pairing under the same load.

Absolute numbers on a shared CPU machine are noise; the ratios are the result.
Exit status 0 only if every byte verified and no fault scenario hung, leaked a
slot or used a failed destination.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import textwrap
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Tuple


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument(
        "-v",
        "--verbose",
        dest="transfer_verbose",
        action="store_true",
        help="show the worker processes' logs (injected faults log every failure they cause)",
    )
    parser.add_argument(
        "--engine",
        choices=["mooncake"],
        default="mooncake",
        help="transfer engine (mooncake over TCP; the memfabric engine needs NPU buffers "
        "and is measured by the npu tests)",
    )
    parser.add_argument("--p-tp", type=int, default=1, help="prefill TP of the throughput run")
    parser.add_argument("--d-tp", type=int, default=1, help="decode TP of the throughput run")
    parser.add_argument("--layers", type=int, default=8, help="layers of the throughput run")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the request")
    parser.add_argument("--block-tokens", type=int, default=128, help="tokens per KV block")
    parser.add_argument(
        "--throughput-slots",
        type=int,
        default=0,
        help="prefill slots of the throughput run (0 = one per layer: every layer is written "
        "before the first publish, so the harness's host-memcpy stand-in for the forward does "
        "not compete with the engine for the CPU while it is timed; 2 = slot reuse as in "
        "layerwise prefill)",
    )
    parser.add_argument(
        "--throughput-runs",
        type=int,
        default=5,
        help="throughput runs (ours, then the raw replay, each time); the run with the median ratio is reported",
    )
    parser.add_argument(
        "--overhead-layers",
        type=int,
        default=256,
        help="layers of the single-block overhead run (samples of the percentiles)",
    )
    parser.add_argument(
        "--layer-timeout", type=float, default=2.0, help="per-layer deadline (s) in the fault scenarios"
    )
    parser.add_argument("--no-faults", action="store_true", help="skip the fault table")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="receive spin of both control endpoints in microseconds (0 = off; default: each "
        "side's own, see transfer/channel.py); for A/B runs of the control-path overhead",
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="also serve the tiny DSA fixture (router + prefill/decode servers on CPU) and "
        "compare TTFT with colocated serving (minutes)",
    )
    parser.add_argument("--served-requests", type=int, default=8, help="requests per served configuration")
    parser.add_argument("--served-concurrency", type=int, default=2, help="requests in flight at once")
    parser.add_argument("--served-input-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--served-output-len", type=int, default=16, help="output tokens per request")
    parser.add_argument(
        "--served-runs",
        type=int,
        default=1,
        help="start and load every served configuration this many times; the served rows are "
        "the medians, each run's rows are in served_runs",
    )


def _sum(reports: Dict[int, Any], key: str) -> float:
    return sum(r["stats"][key] for r in reports.values() if isinstance(r, dict))


def _row(r) -> Dict[str, Any]:
    return {
        "name": r.name,
        "outcome": r.outcome,
        "hung": r.hung,
        "destination_used_after_failure": r.destination_used_after_failure,
        "leaked_slots": r.leaked_slots,
        "verified": r.verified,
        "seconds": round(r.seconds, 3),
    }


def percentile(values: List[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(q / 100.0 * len(xs)) - 1)]


def overhead_samples(prefill: Dict[int, Any], decode: Dict[int, Any]) -> List[float]:
    """Per answered batch: prefill's publish -> READ_DONE seconds minus decode's read seconds.

    Matched by batch id (the overhead run has one prefill and one decode rank).
    """
    answers = {b: s for r in prefill.values() if isinstance(r, dict) for b, _, s in r["timings"]}
    reads = {b: s for r in decode.values() if isinstance(r, dict) for b, _, s in r["timings"]}
    return [answers[b] - reads[b] for b in sorted(answers) if b in reads]


def set_worker_env(name: str, value: Optional[str]) -> None:
    """Run in a worker: set (or with None remove) one environment variable there."""
    import os

    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def freeze_worker_gc() -> int:
    """Run in a worker after warm-up: collect once, then ``gc.freeze()``; returns the frozen objects.

    A worker holds ~170k objects after its imports; a generation-2 collection over
    them took 340-420 ms on the loaded 2-core machine and, whenever it fell inside
    the overhead run, became one layer's "protocol overhead" (seen as means of
    1-6 ms with p50 ~100 us). Long-lived serving processes freeze their start-up
    heap for the same reason (SGLang's ``/freeze_gc``); objects made afterwards
    are collected as usual.
    """
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _pool_env(pool, name: str, value: Optional[str]) -> None:
    from ..testing.workers import run_tasks

    run_tasks(
        pool, {i: (__name__, "set_worker_env", dict(name=name, value=value)) for i in range(pool.size)}, timeout_s=60
    )


def _throughput_run(t) -> tuple:
    """The throughput keys of one throughput scenario result, and the result."""
    out: Dict[str, Any] = {}
    read_bytes, read_s = _sum(t.decode, "read_bytes"), _sum(t.decode, "read_seconds")
    decode_ok = [r for r in t.decode.values() if isinstance(r, dict)]
    memcpy = [r["memcpy_bytes_per_s"] for r in decode_ok if r["memcpy_bytes_per_s"]]
    out["bytes_moved"] = int(read_bytes)
    out["engine_bytes_per_s"] = read_bytes / read_s if read_s > 0 else None
    out["memcpy_bytes_per_s"] = sum(memcpy) / len(memcpy) if memcpy else None
    if out["engine_bytes_per_s"] and out["memcpy_bytes_per_s"]:
        out["engine_vs_memcpy"] = out["engine_bytes_per_s"] / out["memcpy_bytes_per_s"]
    spans = [r["read_span"] for r in decode_ok if r["read_span"]]
    out["transfer_bytes_per_s"] = read_bytes / max(spans) if spans else None
    raw_s = [r["raw_seconds"] for r in decode_ok if r["raw_seconds"]]
    raw_b = sum(r["raw_bytes"] or 0 for r in decode_ok)
    out["raw_engine_bytes_per_s"] = raw_b / max(raw_s) if raw_s else None
    out["engine_over_raw"] = (
        out["transfer_bytes_per_s"] / out["raw_engine_bytes_per_s"]
        if out["transfer_bytes_per_s"] and out["raw_engine_bytes_per_s"]
        else None
    )
    idles = [r.get("idle_before_reads_s") for r in decode_ok if r.get("idle_before_reads_s")]
    # (before our first read, given to the raw replay, the raw replay really had)
    out["idle_before_reads_s"] = list(idles[0]) if idles else None
    gaps = [g * 1e6 for r in decode_ok for g in r["read_gaps"]]
    out["read_gap_us_p50"] = percentile(gaps, 50)  # decode idle between two engine reads
    out["read_gap_us_max"] = max(gaps) if gaps else None
    ranges = [n for r in decode_ok for n in r["read_ranges"]]
    out["ranges_per_layer_read"] = sum(ranges) / len(ranges) if ranges else None
    return out, t


@dataclass(frozen=True)
class _Scenarios:
    """The scenarios of one ``bench transfer`` run (``testing.pd_harness.ScenarioSpec``)."""

    throughput: Any  # one request of --tokens tokens, DeepSeek-V3.2 per-token sizes
    overhead: Any  # one small block per layer through one slot
    faults: List[Any]  # the fault table (empty with --no-faults)


def _scenarios(args: argparse.Namespace) -> _Scenarios:
    """Check the sizes of ``args`` (``SystemExit`` with what is wrong) and build the scenarios."""
    from ..testing.pd_harness import ScenarioSpec, fault_scenarios
    from ..transfer.topology import PDTopology

    PDTopology(args.p_tp, args.d_tp)  # invalid pairs stop here
    if args.tokens < args.block_tokens or args.layers < 1:
        raise SystemExit("--tokens must be >= --block-tokens and --layers >= 1")
    blocks = args.tokens // args.block_tokens
    if args.throughput_slots < 0:
        raise SystemExit("--throughput-slots must be >= 0")
    if args.served_runs < 1:
        raise SystemExit("--served-runs must be >= 1")
    args.throughput_slots = args.throughput_slots or args.layers
    throughput = ScenarioSpec(
        name="throughput",
        p_tp=args.p_tp,
        d_tp=args.d_tp,
        num_layers=args.layers,
        num_slots=args.throughput_slots,
        block_tokens=args.block_tokens,
        main_tensors=(("latent", 512 * 2), ("rope", 64 * 2)),
        indexer_bytes=128 * 2,
        scale_bytes=0,
        request_blocks=(blocks,),
        slot_blocks=blocks,
        pool_blocks=blocks,
        layer_timeout_s=30.0,
        handshake_timeout_s=30.0,
        measure_memcpy=True,
        measure_raw=True,
    )
    # one slot: every layer waits for the previous answer, so no batch queues behind another
    overhead = ScenarioSpec(
        name="overhead",
        num_layers=args.overhead_layers,
        num_slots=1,
        block_tokens=1,
        main_tensors=(("latent", 64), ("rope", 8)),
        indexer_bytes=16,
        scale_bytes=4,
        request_blocks=(1,),
        slot_blocks=1,
        pool_blocks=1,
        layer_timeout_s=30.0,
        handshake_timeout_s=30.0,
    )
    faults: List = []
    if not args.no_faults:
        base = ScenarioSpec(
            name="base",
            p_tp=2,
            d_tp=1,
            layer_timeout_s=args.layer_timeout,
            handshake_timeout_s=2 * args.layer_timeout,
            read_retries=1,
            engine=args.engine,
        )
        faults = fault_scenarios(base)
    return _Scenarios(throughput, overhead, faults)


def _spin(args: argparse.Namespace) -> Tuple[Optional[str], Dict[str, Any]]:
    """The receive spin given to the workers (None: their inherited environment decides) and
    the spin each side runs with, in microseconds."""
    from ..transfer.channel import spin_us_from_env
    from ..transfer.decode_side import DECODE_SPIN_US
    from ..transfer.prefill_side import PREFILL_SPIN_US

    if args.spin_us is not None and not 0 <= args.spin_us <= 1e6:
        raise SystemExit("--spin-us must be between 0 and 1000000")
    spin = None if args.spin_us is None else str(args.spin_us)
    if spin is None:  # the workers inherit this process's environment
        return spin, {"prefill": spin_us_from_env(PREFILL_SPIN_US), "decode": spin_us_from_env(DECODE_SPIN_US)}
    return spin, {"prefill": args.spin_us, "decode": args.spin_us}


def _warm_workers(pool, sc: _Scenarios) -> List[Optional[int]]:
    """Start every worker's engines before anything is timed, then freeze each worker's heap;
    returns the objects each froze (None where the worker failed)."""
    from ..testing.pd_harness import run_scenario
    from ..testing.workers import run_tasks

    run_scenario(pool, replace(sc.overhead, name="warmup", num_layers=2), timeout_s=120)
    if sc.faults:  # every worker's engines started before any deadline is timed
        run_scenario(pool, replace(sc.overhead, name="warmup_faults", p_tp=2, d_tp=1, num_layers=2), timeout_s=120)
    frozen = run_tasks(pool, {i: (__name__, "freeze_worker_gc", {}) for i in range(pool.size)}, timeout_s=120)
    return [frozen[i] if isinstance(frozen[i], int) else None for i in range(pool.size)]


def _throughput_keys(pool, throughput, args: argparse.Namespace) -> Dict[str, Any]:
    """``--throughput-runs`` throughput runs: the keys of the run with the median whole-run
    ours/raw ratio, and the per-layer ratio over every run."""
    from ..testing.pd_harness import run_scenario

    out: Dict[str, Any] = {}
    runs = [
        _throughput_run(run_scenario(pool, replace(throughput, engine=args.engine), timeout_s=600))
        for _ in range(max(1, args.throughput_runs))
    ]
    # the run with the median ours/raw ratio (each run times ours and the raw replay back to back)
    ranked = sorted(runs, key=lambda r: (r[0].get("engine_over_raw") is None, r[0].get("engine_over_raw") or 0))
    keys, t = ranked[(len(ranked) - 1) // 2] if all(r[0].get("engine_over_raw") for r in runs) else ranked[-1]
    out.update(keys)
    out["engine_over_raw_runs"] = [r[0].get("engine_over_raw") for r in runs]
    out["engine_over_raw_total"] = out["engine_over_raw"]
    # robust to the other jobs' load spikes: per layer (after the first), the raw engine's
    # time for that layer's reads over ours (read + idle gap before it), median of every
    # layer of every run
    ratios = [
        raw / ours
        for _, t_run in runs
        for r in t_run.decode.values()
        if isinstance(r, dict)
        for ours, raw in zip(r["layer_seconds"], r["raw_layer_seconds"])
        if ours > 0
    ]
    out["engine_over_raw_layers"] = len(ratios)
    if ratios:
        out["engine_over_raw"] = percentile(ratios, 50)
    out["verified"] = all(r[1].verified and r[1].outcome == "done" for r in runs)
    out["throughput_outcome"] = t.outcome
    return out


def _overhead_keys(pool, overhead, args: argparse.Namespace) -> Tuple[Dict[str, Any], bool]:
    """The per-layer protocol overhead run (untraced): its keys, and whether it verified."""
    from ..testing.pd_harness import run_scenario

    out: Dict[str, Any] = {}
    o = run_scenario(pool, replace(overhead, engine=args.engine), timeout_s=300)
    answer = _sum(o.prefill, "answer_seconds") / max(1.0, _sum(o.prefill, "batches"))
    read = _sum(o.decode, "read_seconds") / max(1.0, _sum(o.decode, "reads"))
    out["per_layer_answer_us"] = answer * 1e6
    out["per_layer_read_us"] = read * 1e6
    out["per_layer_overhead_us"] = (answer - read) * 1e6
    samples = [x * 1e6 for x in overhead_samples(o.prefill, o.decode)]
    out["per_layer_overhead_samples"] = len(samples)
    out["per_layer_overhead_us_p50"] = percentile(samples, 50)
    out["per_layer_overhead_us_p99"] = percentile(samples, 99)
    return out, bool(o.verified and o.outcome == "done")


def _traced_stages(pool, overhead, args: argparse.Namespace) -> Tuple[Dict[str, Any], bool]:
    """The overhead run again with stage stamps on (a separate run: the reported numbers carry
    no tracing): p50 / p99 of every control-path stage, and whether it verified."""
    from ..testing.pd_harness import run_scenario
    from ..transfer.stages import TRACE_ENV, stage_breakdown

    _pool_env(pool, TRACE_ENV, "1")
    try:
        o = run_scenario(pool, replace(overhead, engine=args.engine), timeout_s=300)
    finally:
        _pool_env(pool, TRACE_ENV, None)
    stamps = [
        {b: rec for r in side.values() if isinstance(r, dict) and r.get("stages") for b, rec in r["stages"].items()}
        for side in (o.prefill, o.decode)
    ]
    return stage_breakdown(*stamps), bool(o.verified and o.outcome == "done")


def run(args: argparse.Namespace, log_dir: Optional[str] = None) -> Dict[str, Any]:
    from ..testing.pd_harness import run_scenario
    from ..testing.workers import WorkerPool
    from ..transfer.channel import SPIN_ENV

    sc = _scenarios(args)
    size = max(args.p_tp + args.d_tp, 3)
    out: Dict[str, Any] = {"engine": args.engine, "data_protocol": "tcp", "p_tp": args.p_tp, "d_tp": args.d_tp}
    spin, out["control_path_spin_us"] = _spin(args)
    with WorkerPool(size, log_dir=log_dir) as pool:
        if spin is not None:
            _pool_env(pool, SPIN_ENV, spin)
        out["worker_gc_frozen_objects"] = _warm_workers(pool, sc)
        out.update(_throughput_keys(pool, sc.throughput, args))
        overhead, verified = _overhead_keys(pool, sc.overhead, args)
        out.update(overhead)
        out["verified"] = out["verified"] and verified
        out["control_path_stages_us"], verified = _traced_stages(pool, sc.overhead, args)
        out["verified"] = out["verified"] and verified
        out["scenarios"] = [_row(run_scenario(pool, s, timeout_s=120)) for s in sc.faults]
    if args.served:
        from .transfer_served import ServedLoad, median_rows, offload_over_device_ttft, run_served

        load = ServedLoad(
            requests=args.served_requests,
            concurrency=args.served_concurrency,
            input_len=args.served_input_len,
            output_len=args.served_output_len,
        )
        runs = [run_served(load) for _ in range(args.served_runs)]
        rows = median_rows(runs)
        out["served"] = [asdict(r) for r in rows]
        out["served_runs"] = [[asdict(r) for r in run] for run in runs]
        out["pd_offload_over_device_ttft_p50"] = offload_over_device_ttft(rows)
    return out


def _fmt_rate(v) -> str:
    return "n/a" if not v else f"{v / 1e9:.3f} GB/s"


def _fmt(v, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_table(res: Dict[str, Any]) -> None:
    print(
        f"P/D transfer, engine {res['engine']} ({res['data_protocol']}), prefill TP {res['p_tp']} -> "
        f"decode TP {res['d_tp']}"
    )
    print(f"  bytes moved                 {res['bytes_moved']:>14,d}   verified: {res['verified']}")
    print(f"  P/D transfer (read span)    {_fmt_rate(res.get('transfer_bytes_per_s')):>14}")
    print(f"  raw engine, same chunks     {_fmt_rate(res.get('raw_engine_bytes_per_s')):>14}")
    print(f"  P/D / raw engine            {_fmt(res.get('engine_over_raw'), '.3f'):>14}")
    print(f"  time inside engine reads    {_fmt_rate(res['engine_bytes_per_s']):>14}")
    print(f"  plain memcpy (same sizes)   {_fmt_rate(res['memcpy_bytes_per_s']):>14}")
    if res.get("engine_vs_memcpy"):
        print(f"  engine / memcpy             {res['engine_vs_memcpy']:>14.3f}")
    print(
        f"  per layer: answer {res['per_layer_answer_us']:.0f} us, engine read {res['per_layer_read_us']:.0f} us, "
        f"protocol overhead mean {res['per_layer_overhead_us']:.0f} us, "
        f"p50 {_fmt(res.get('per_layer_overhead_us_p50'))} us, p99 {_fmt(res.get('per_layer_overhead_us_p99'))} us "
        f"({res.get('per_layer_overhead_samples', 0)} layers)"
    )
    stages = res.get("control_path_stages_us") or {}
    if stages:
        spin = res.get("control_path_spin_us") or {}
        print(
            f"  control path by stage (traced run; receive spin prefill {spin.get('prefill')} us, "
            f"decode {spin.get('decode')} us):"
        )
        for name, v in stages.items():
            print(f"    {name:24s} p50 {_fmt(v['p50'], '.1f'):>8} us  p99 {_fmt(v['p99'], '.1f'):>8} us")
    if res["scenarios"]:
        width = 30
        print(f"  {'fault scenario':{width}s} {'hung':5s} {'used-after-fail':15s} {'leaked':6s} {'s':>6s}  outcome")
        for s in res["scenarios"]:
            lines = textwrap.wrap(s["outcome"], 72, break_long_words=False, break_on_hyphens=False) or [""]
            print(
                f"  {s['name']:{width}s} {str(s['hung']):5s} {str(s['destination_used_after_failure']):15s} "
                f"{s['leaked_slots']:<6d} {s['seconds']:6.2f}  {lines[0]}"
            )
            for more in lines[1:]:
                print(f"  {'':{width + 38}s}  {more}")
    for r in res.get("served", []):
        print(
            f"  served {r['name']:28s} TTFT p50 {_fmt(r['ttft_ms_p50'], '.1f')} ms, "
            f"p99 {_fmt(r['ttft_ms_p99'], '.1f')} ms, {_fmt(r['output_tokens_per_s'], '.1f')} output tok/s, "
            f"{r['completed']} completed"
        )
    if len(res.get("served_runs", [])) > 1:
        print(f"  served rows: medians of {len(res['served_runs'])} runs")
    if res.get("pd_offload_over_device_ttft_p50") is not None:
        print(f"  P/D offload decode / device decode TTFT p50: {res['pd_offload_over_device_ttft_p50']:.3f}")


def _verbose(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "verbose", False) or getattr(args, "transfer_verbose", False))


def main(args: argparse.Namespace) -> int:
    log_dir = None if _verbose(args) else tempfile.mkdtemp(prefix="pd_bench_transfer_logs_")
    res = run(args, log_dir=log_dir)
    if args.json:
        json.dump(res, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        print_table(res)
    bad = [
        s
        for s in res["scenarios"]
        if s["hung"] or s["leaked_slots"] or s["destination_used_after_failure"] or not s["verified"]
    ]
    served_bad = [r for r in res.get("served", []) if not r["completed"]]
    ok = res["verified"] and not bad and not served_bad
    if log_dir is not None:
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"worker logs (injected faults, engine messages): {log_dir}", file=sys.stderr)
    return 0 if ok else 1
