"""``python -m sglang_ascend_offload bench transfer [--json]``: P/D transfer in one run.

Real prefill and decode processes (the multi-process harness of
``transfer/harness.py``), Mooncake over TCP on 127.0.0.1:

1. **throughput**: one request of ``--tokens`` tokens, DeepSeek-V3.2 per-token
   sizes (latent 512 + rope 64 bf16 into the decode host pool, indexer 128 bf16
   into the rank-local cache), ``--layers`` layers over 2 reusable prefill slots;
   engine bytes/s (time inside the engine's batched reads) side by side with a
   plain in-process memcpy of the same chunk sizes, every byte verified;
2. **per-layer protocol overhead**: many layers of a single small block through
   one slot (each layer waits for the previous answer, nothing queues);
   publish -> READ_DONE latency minus the engine read time, per layer;
3. **fault table**: the failure scenarios of the tests (read failure, dropped
   answer, dead decode, decode slower than the deadline, malformed messages...),
   each with outcome, hung, destination_used_after_failure, leaked_slots.

Absolute numbers on a shared CPU machine are noise; the ratios are the result.
Exit status 0 only if every byte verified and no fault scenario hung, leaked a
slot or used a failed destination.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, Dict, List


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument("--engine", choices=["mooncake"], default="mooncake",
                        help="transfer engine (mooncake over TCP; the memfabric engine needs NPU buffers "
                             "and is measured by the npu tests)")
    parser.add_argument("--p-tp", type=int, default=1, help="prefill TP of the throughput run")
    parser.add_argument("--d-tp", type=int, default=1, help="decode TP of the throughput run")
    parser.add_argument("--layers", type=int, default=8, help="layers of the throughput run")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the request")
    parser.add_argument("--block-tokens", type=int, default=128, help="tokens per KV block")
    parser.add_argument("--overhead-layers", type=int, default=64,
                        help="layers of the single-block overhead run")
    parser.add_argument("--layer-timeout", type=float, default=2.0,
                        help="per-layer deadline (s) in the fault scenarios")
    parser.add_argument("--no-faults", action="store_true", help="skip the fault table")


def _sum(reports: Dict[int, Any], key: str) -> float:
    return sum(r["stats"][key] for r in reports.values() if isinstance(r, dict))


def _row(r) -> Dict[str, Any]:
    return {"name": r.name, "outcome": r.outcome, "hung": r.hung,
            "destination_used_after_failure": r.destination_used_after_failure,
            "leaked_slots": r.leaked_slots, "verified": r.verified, "seconds": round(r.seconds, 3)}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    from ..transfer.harness import ScenarioSpec, fault_scenarios, run_scenario
    from ..transfer.topology import PDTopology
    from ..transfer.workers import WorkerPool

    PDTopology(args.p_tp, args.d_tp)  # invalid pairs stop here
    if args.tokens < args.block_tokens or args.layers < 1:
        raise SystemExit("--tokens must be >= --block-tokens and --layers >= 1")
    blocks = args.tokens // args.block_tokens
    throughput = ScenarioSpec(
        name="throughput", p_tp=args.p_tp, d_tp=args.d_tp, num_layers=args.layers, num_slots=2,
        block_tokens=args.block_tokens, main_tensors=(("latent", 512 * 2), ("rope", 64 * 2)),
        indexer_bytes=128 * 2, scale_bytes=0, request_blocks=(blocks,), slot_blocks=blocks,
        pool_blocks=blocks, layer_timeout_s=30.0, handshake_timeout_s=30.0, measure_memcpy=True)
    # one slot: every layer waits for the previous answer, so no batch queues behind another
    overhead = ScenarioSpec(
        name="overhead", num_layers=args.overhead_layers, num_slots=1, block_tokens=1,
        main_tensors=(("latent", 64), ("rope", 8)), indexer_bytes=16, scale_bytes=4,
        request_blocks=(1,), slot_blocks=1, pool_blocks=1, layer_timeout_s=30.0, handshake_timeout_s=30.0)
    faults: List = []
    if not args.no_faults:
        base = ScenarioSpec(name="base", p_tp=2, d_tp=1, layer_timeout_s=args.layer_timeout,
                            handshake_timeout_s=2 * args.layer_timeout, read_retries=1, engine=args.engine)
        faults = fault_scenarios(base)
    size = max(args.p_tp + args.d_tp, 3)
    out: Dict[str, Any] = {"engine": args.engine, "data_protocol": "tcp", "p_tp": args.p_tp, "d_tp": args.d_tp}
    with WorkerPool(size) as pool:
        run_scenario(pool, replace(overhead, name="warmup", num_layers=2), timeout_s=120)
        t = run_scenario(pool, replace(throughput, engine=args.engine), timeout_s=600)
        read_bytes, read_s = _sum(t.decode, "read_bytes"), _sum(t.decode, "read_seconds")
        memcpy = [r["memcpy_bytes_per_s"] for r in t.decode.values()
                  if isinstance(r, dict) and r["memcpy_bytes_per_s"]]
        out["bytes_moved"] = int(read_bytes)
        out["engine_bytes_per_s"] = read_bytes / read_s if read_s > 0 else None
        out["memcpy_bytes_per_s"] = sum(memcpy) / len(memcpy) if memcpy else None
        if out["engine_bytes_per_s"] and out["memcpy_bytes_per_s"]:
            out["engine_vs_memcpy"] = out["engine_bytes_per_s"] / out["memcpy_bytes_per_s"]
        out["verified"] = bool(t.verified and t.outcome == "done")
        out["throughput_outcome"] = t.outcome
        o = run_scenario(pool, replace(overhead, engine=args.engine), timeout_s=300)
        answer = _sum(o.prefill, "answer_seconds") / max(1.0, _sum(o.prefill, "batches"))
        read = _sum(o.decode, "read_seconds") / max(1.0, _sum(o.decode, "reads"))
        out["per_layer_answer_us"] = answer * 1e6
        out["per_layer_read_us"] = read * 1e6
        out["per_layer_overhead_us"] = (answer - read) * 1e6
        out["verified"] = out["verified"] and bool(o.verified and o.outcome == "done")
        out["scenarios"] = [_row(run_scenario(pool, s, timeout_s=120)) for s in faults]
    return out


def _fmt_rate(v) -> str:
    return "n/a" if not v else f"{v / 1e9:.3f} GB/s"


def print_table(res: Dict[str, Any]) -> None:
    print(f"P/D transfer, engine {res['engine']} ({res['data_protocol']}), prefill TP {res['p_tp']} -> "
          f"decode TP {res['d_tp']}")
    print(f"  bytes moved               {res['bytes_moved']:>14,d}   verified: {res['verified']}")
    print(f"  engine reads              {_fmt_rate(res['engine_bytes_per_s']):>14}")
    print(f"  plain memcpy (same sizes) {_fmt_rate(res['memcpy_bytes_per_s']):>14}")
    if res.get("engine_vs_memcpy"):
        print(f"  engine / memcpy           {res['engine_vs_memcpy']:>14.3f}")
    print(f"  per layer: answer {res['per_layer_answer_us']:.0f} us, engine read {res['per_layer_read_us']:.0f} us, "
          f"protocol overhead {res['per_layer_overhead_us']:.0f} us")
    if res["scenarios"]:
        print(f"  {'fault scenario':30s} {'hung':5s} {'used-after-fail':15s} {'leaked':6s} {'s':>6s}  outcome")
        for s in res["scenarios"]:
            print(f"  {s['name']:30s} {str(s['hung']):5s} {str(s['destination_used_after_failure']):15s} "
                  f"{s['leaked_slots']:<6d} {s['seconds']:6.2f}  {s['outcome'][:90]}")


def main(args: argparse.Namespace) -> int:
    res = run(args)
    if args.json:
        json.dump(res, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        print_table(res)
    bad = [s for s in res["scenarios"] if s["hung"] or s["leaked_slots"] or s["destination_used_after_failure"]
           or not s["verified"]]
    return 0 if res["verified"] and not bad else 1
