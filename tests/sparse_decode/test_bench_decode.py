"""`bench decode` end to end on tiny traces: JSON keys, verification, side-by-side columns."""

from __future__ import annotations

import argparse
import json

import numpy as np

from sglang_ascend_offload.bench import decode
from sglang_ascend_offload.sparse_decode.trace import SyntheticTraceSpec, save_trace, synthesize

TINY = ["--steps", "24", "--layers", "2", "--rows", "3", "--top-k", "16", "--heads", "2"]


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    rc = decode.main(parser.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_has_the_contract_keys_and_consistent_numbers(capsys):
    rc, out, _ = _run(TINY + ["--json", "--hot-tokens", "24", "--policy", "lru"], capsys)
    assert rc == 0
    r = json.loads(out)
    for key in ("selected", "hits", "misses", "hit_rate", "h2d_bytes", "d2h_bytes", "opt_misses", "verified"):
        assert key in r
    assert set(r["baselines"]) >= {"topk_reload", "topk_cache"}
    assert set(r["baselines"]["topk_cache"]) >= {"misses", "h2d_bytes"}
    assert r["verified"] is True and r["checks"] == 24 * 2
    assert r["hits"] + r["misses"] == r["selected"] == r["baselines"]["topk_reload"]["misses"]
    assert r["h2d_bytes"] == r["misses"] * 1152
    assert r["opt_misses"] <= r["misses"] <= r["selected"]
    assert r["opt_misses"] <= r["baselines"]["topk_cache"]["misses"]
    assert r["policies"]["lru"]["misses"] == r["misses"]  # the engine run matches residency-only replay
    assert r["d2h_bytes"] > 0 and r["hit_rate"] > 0
    assert set(r["timing_ms_per_step"]) >= {"manage", "copy", "attention"}


def test_replays_a_trace_file_and_prints_a_table(tmp_path, capsys):
    trace = synthesize(
        SyntheticTraceSpec(
            steps=12, layers=1, rows=2, top_k=8, min_prompt=4, max_prompt=40, min_decode=2, max_decode=6, seed=2
        )
    )
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    rc, out, err = _run(["--trace", str(path), "--heads", "2"], capsys)
    assert rc == 0
    assert "verified: yes" in out and "Belady optimum" in out and "topk_cache" in out
    assert "replay: step 12/12" in err


def test_invalid_trace_file_lists_problems(tmp_path, capsys):
    path = tmp_path / "bad.npz"
    np.savez(path, topk=np.zeros((1, 1, 1, 2), dtype=np.int32))
    rc, _, err = _run(["--trace", str(path)], capsys)
    assert rc == 2 and "missing array 'seq_lens'" in err and "missing array 'req_ids'" in err


def test_hot_smaller_than_topk_is_an_input_error(capsys):
    rc, _, err = _run(TINY + ["--hot-tokens", "0"], capsys)
    assert rc == 2 and "--hot-tokens" in err
    rc, _, err = _run(TINY + ["--hot-tokens", "8"], capsys)
    assert rc == 2 and "--hot-tokens 8 < the trace's top-k 16" in err


def test_recorded_hot_tokens_is_the_default(tmp_path, capsys):
    import dataclasses

    trace = synthesize(
        SyntheticTraceSpec(
            steps=6, layers=1, rows=2, top_k=8, min_prompt=4, max_prompt=30, min_decode=2, max_decode=4, seed=3
        )
    )
    path = tmp_path / "served.npz"
    save_trace(dataclasses.replace(trace, meta=json.dumps({"hot_tokens": 24, "top_k": 8})), path)
    rc, out, _ = _run(["--trace", str(path), "--heads", "2", "--json"], capsys)
    assert rc == 0 and json.loads(out)["hot_tokens"] == 24
    rc, out, _ = _run(["--trace", str(path), "--heads", "2", "--json", "--hot-tokens", "16"], capsys)
    assert rc == 0 and json.loads(out)["hot_tokens"] == 16


PROFILE = [
    "--profile-shape",
    "--rows",
    "3",
    "--top-k",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--profile-context",
    "300",
    "--profile-steps",
    "4",
    "--profile-compile",
    "off",
]


def test_profile_shape_reports_manage_per_layer_with_misses_equal_to_the_contract(capsys):
    """The engine's residency path (the CPU kernel for lru here) and the torch reference
    see the same steps: identical misses and remapped slots; the per-layer keys exist."""
    rc, out, _ = _run(PROFILE + ["--json"], capsys)
    assert rc == 0
    r = json.loads(out)
    assert r["manage_impl"] == "kernel" and r["misses_equal_contract"] is True
    assert r["step_misses"] == r["reference_step_misses"] > 0
    for key in (
        "manage_ms",
        "copy_ms",
        "attention_ms",
        "manage_over_attention",
        "manage_ms_per_layer",
        "manage_cpu_ms_per_layer",
        "reference_manage_ms_per_layer",
    ):
        assert r[key] >= 0
    assert abs(r["manage_ms_per_layer"] * r["layers"] - r["manage_ms"]) < 1e-6 * max(1.0, r["manage_ms"])
    # the median of the timed warm steps, each over every layer
    assert r["manage_timed_steps"] == 4 == len(r["timed_step_misses"])
    assert r["timed_step_misses"][-1] == r["step_misses"]
    assert r["manage_ms_per_layer_min"] <= r["manage_ms_per_layer"] <= r["manage_ms_per_layer_p90"]
    assert r["manage_cpu_ms_per_layer_min"] <= r["manage_cpu_ms_per_layer"]
    rc, out, _ = _run(PROFILE + ["--manage-impl", "torch"], capsys)
    assert rc == 0 and "identical: yes" in out and "torch)" in out


def test_replays_the_recorded_trace_of_the_trained_checkpoint(tmp_path, capsys):
    """The shipped real trace (4 requests of ~2K context on tests/fixtures/tiny_dsa_trained,
    recorded by scripts/record_trained_trace.py) replays verified; its first 48 steps here."""
    import dataclasses
    from pathlib import Path

    from sglang_ascend_offload.sparse_decode.trace import load_trace

    trace = load_trace(Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "tiny_dsa_trained_decode.npz")
    meta = json.loads(trace.meta)
    assert meta["source"] == "sglang" and meta["top_k"] == 64 and trace.ranked is not None
    assert int(trace.seq_lens.max()) >= 2048
    head = dataclasses.replace(
        trace, topk=trace.topk[:48], seq_lens=trace.seq_lens[:48], req_ids=trace.req_ids[:48], ranked=trace.ranked[:48]
    )
    path = tmp_path / "head.npz"
    save_trace(head, path)
    rc, out, _ = _run(["--trace", str(path), "--policy", "score_rank_guarded", "--json"], capsys)
    assert rc == 0
    r = json.loads(out)
    assert r["verified"] is True and r["checks"] == 48 * 2
    assert r["hits"] + r["misses"] == r["selected"]
    assert r["opt_misses"] <= r["misses"] < r["baselines"]["topk_cache"]["misses"]
