"""``bench transfer --json`` runs end to end (tiny sizes) and reports the agreed keys."""

import importlib.util
import json

import pytest

from sglang_ascend_offload import cli

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="needs mooncake-transfer-engine-non-cuda"),
    pytest.mark.timeout(180),
]


def test_bench_transfer_json(capfd):
    rc = cli.main(
        [
            "bench",
            "transfer",
            "--json",
            "--layers",
            "2",
            "--tokens",
            "256",
            "--block-tokens",
            "64",
            "--overhead-layers",
            "8",
            "--layer-timeout",
            "0.3",
            "--throughput-runs",
            "1",
        ]
    )
    captured = capfd.readouterr()
    out = json.loads(captured.out)
    assert rc == 0
    for key in (
        "engine_bytes_per_s",
        "memcpy_bytes_per_s",
        "per_layer_overhead_us",
        "verified",
        "scenarios",
        "raw_engine_bytes_per_s",
        "engine_over_raw",
        "per_layer_overhead_us_p50",
        "per_layer_overhead_us_p99",
    ):
        assert key in out
    assert "served" not in out  # only with --served
    # the raw engine replayed exactly the bytes our path moved; the ratio is ours over it
    assert out["raw_engine_bytes_per_s"] > 0 and out["transfer_bytes_per_s"] > 0
    assert out["engine_over_raw_total"] == pytest.approx(out["transfer_bytes_per_s"] / out["raw_engine_bytes_per_s"])
    assert out["engine_over_raw_layers"] == 1 and out["engine_over_raw"] > 0  # 2 layers: one after the first
    # the raw replay started after as long an engine idle as our first read (capped), really waited
    ours_idle, given, seen = out["idle_before_reads_s"]
    assert given == pytest.approx(min(max(ours_idle, 0.0), 3.0)) and seen >= given - 1e-3
    # one sample per layer of the overhead run, percentiles ordered
    assert out["per_layer_overhead_samples"] == 8
    assert out["per_layer_overhead_us_p50"] <= out["per_layer_overhead_us_p99"]
    # the traced rerun of the overhead run: every stage of every layer, on both sides' stamps
    stages = out["control_path_stages_us"]
    assert {
        "prefill_encode",
        "to_decode_wakeup",
        "decode_validate_plan",
        "read",
        "to_prefill_wakeup",
        "prefill_handle",
        "total_minus_read",
    } <= set(stages)
    assert all(v["n"] == 8 and v["p50"] <= v["p99"] for v in stages.values())
    # every worker froze its start-up heap before the timed runs (gc.freeze returns what it froze)
    assert len(out["worker_gc_frozen_objects"]) == 3 and all(n > 0 for n in out["worker_gc_frozen_objects"])
    from sglang_ascend_offload.transfer.channel import spin_us_from_env
    from sglang_ascend_offload.transfer.decode_side import DECODE_SPIN_US
    from sglang_ascend_offload.transfer.prefill_side import PREFILL_SPIN_US

    assert out["control_path_spin_us"] == {
        "prefill": spin_us_from_env(PREFILL_SPIN_US),
        "decode": spin_us_from_env(DECODE_SPIN_US),
    }
    # injected faults log to a file unless -v: nothing of theirs on the terminal
    assert "injected read failure" not in captured.err and "request r0 failed" not in captured.err
    assert out["verified"] is True
    assert out["engine_bytes_per_s"] > 0 and out["memcpy_bytes_per_s"] > 0
    # 2 layers x 4 blocks x 64 tokens x (1024 + 128 + 256) bytes
    assert out["bytes_moved"] == 2 * 4 * 64 * (1024 + 128 + 256)
    names = {s["name"] for s in out["scenarios"]}
    assert {"read_failure", "dropped_answer", "dead_decode", "decode_slower_than_deadline", "malformed_ready"} <= names
    for s in out["scenarios"]:
        assert set(s) >= {"name", "outcome", "hung", "destination_used_after_failure", "leaked_slots"}
        assert s["hung"] is False and s["leaked_slots"] == 0 and s["destination_used_after_failure"] is False
        assert s["outcome"] == "done" if s["name"] == "read_retry_recovers" else s["outcome"].startswith("failed")


def test_fault_table_prints_whole_words():
    from sglang_ascend_offload.testing.pd_harness import clip_words

    reason = "rank 0: prefill rank 1 aborted: layer 1: decode rejected a message: malformed message: " * 4
    clipped = clip_words(reason, 120)
    assert len(clipped) <= 120 and clipped.endswith("...")
    assert reason.startswith(clipped[:-3]) and reason[len(clipped) - 3] == " "  # cut at a word boundary
    assert clip_words("short reason", 120) == "short reason"


def test_overhead_percentiles_match_batches():
    from sglang_ascend_offload.bench.transfer import overhead_samples, percentile

    prefill = {0: {"timings": [(0, 0, 0.0010), (1, 1, 0.0020), (2, 2, 0.0030)]}}
    decode = {1: {"timings": [(0, 0, 0.0004), (2, 2, 0.0010)]}}  # batch 1's read is unknown: skipped
    samples = overhead_samples(prefill, decode)
    assert samples == pytest.approx([0.0006, 0.0020])
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == 2.0
    assert percentile([], 50) is None
