"""size-hot: the one-pass LRU curve, the fast optimum, the command."""

from __future__ import annotations

import json

import pytest

from sglang_ascend_offload.sparse_decode.belady import belady_misses
from sglang_ascend_offload.sparse_decode.replay import simulate_policy
from sglang_ascend_offload.sparse_decode.size_hot import (
    fold_layers,
    lru_stack_curve,
    sampled_sizes,
    size_hot,
    stack_lru_misses,
)
from sglang_ascend_offload.sparse_decode.trace import SyntheticTraceSpec, save_trace, synthesize

SMALL = dict(steps=50, layers=2, rows=3, top_k=12, min_prompt=6, max_prompt=200, min_decode=4, max_decode=30)


@pytest.mark.parametrize("shape,depth", [("locality", 0), ("random", 0), ("scan", 0), ("bursty", 24)])
def test_lru_curve_equals_per_size_replays_at_sampled_sizes(shape, depth):
    """The one-pass curve equals a per-size simulation of the stack order at every
    sampled size, exactly; the engine's LRU (slot-index ties) equals it at hot = top-k
    and beyond the working set, and stays within 2 % in between."""
    t = synthesize(
        SyntheticTraceSpec(shape=shape, seed=5, rank_depth=depth, noise_skew=1.0 if not depth else 0.0, **SMALL)
    )
    curve = lru_stack_curve(t, 96)
    assert all(curve[h] >= curve[h + 1] for h in range(12, 96))  # inclusion: never more misses with more room
    for h in (12, 13, 17, 24, 40, 96):
        assert int(curve[h]) == stack_lru_misses(t, h), h
        engine = simulate_policy(t, "lru", h).misses
        assert abs(engine - int(curve[h])) <= 0.02 * engine, (h, engine, int(curve[h]))
    assert int(curve[12]) == simulate_policy(t, "lru", 12).misses


def test_fast_optimum_equals_the_belady_manager_and_folding_changes_nothing():
    t = synthesize(SyntheticTraceSpec(seed=8, noise_skew=1.0, **SMALL))
    for h in (12, 15, 20, 30):
        opt = simulate_policy(t, "belady", h).misses
        assert belady_misses(t.topk, t.req_ids, h) == opt
        assert simulate_policy(fold_layers(t), "belady", h).misses == opt
        assert simulate_policy(fold_layers(t), "lru_k2", h).misses == simulate_policy(t, "lru_k2", h).misses


def test_size_hot_recommends_the_smallest_size_reaching_the_target():
    t = synthesize(SyntheticTraceSpec(seed=2, rank_depth=24, **SMALL))
    r = size_hot(t, ["score_rank"], max_hot=48, samples=3, target_hit_rate=0.7)
    assert sampled_sizes(12, 48, 3) == [12, 24, 48]
    rates = r.as_dict()["lru_hit_rate"]
    rec = r.recommended
    i = rec["hot_tokens"] - 12
    assert rates[i] >= 0.7 and (i == 0 or rates[i - 1] < 0.7)
    assert rec["device_bytes_per_request"] > 0
    for name in ("lru", "belady", "score_rank"):
        assert set(r.sampled[name]) == {"12", "24", "48"}
    for h in ("24", "48"):
        assert r.sampled["belady"][h] <= min(r.sampled["lru"][h], r.sampled["score_rank"][h])


def test_size_hot_command_json_and_plot(tmp_path, capsys):
    from sglang_ascend_offload import cli

    path = tmp_path / "t.npz"
    save_trace(synthesize(SyntheticTraceSpec(seed=3, rank_depth=16, **SMALL)), path)
    png = tmp_path / "curve.png"
    rc = cli.main(
        [
            "size-hot",
            "--trace",
            str(path),
            "--json",
            "--max-hot",
            "36",
            "--samples",
            "2",
            "--policy",
            "score_rank_guarded",
            "--target-hit-rate",
            "0.5",
            "--plot",
            str(png),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)  # exactly one JSON document
    assert out["hot_tokens"][0] == 12 and out["hot_tokens"][-1] == 36
    assert len(out["lru_misses"]) == 25 and "score_rank_guarded" in out["sampled"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["size-hot", "--trace", str(tmp_path / "no.npz")]) == 2
    assert "cannot read" in capsys.readouterr().err
    # a score-aware policy on a trace without 'ranked': a clear error
    plain = tmp_path / "plain.npz"
    save_trace(synthesize(SyntheticTraceSpec(seed=3, **SMALL)), plain)
    assert cli.main(["size-hot", "--trace", str(plain), "--policy", "score_rank"]) == 2
    assert "ranked" in capsys.readouterr().err


def test_bench_decode_replays_a_trace_with_the_named_policy_and_plots(tmp_path, capsys):
    from sglang_ascend_offload import cli

    path = tmp_path / "t.npz"
    spec = dict(steps=14, layers=2, rows=2, top_k=8, min_prompt=6, max_prompt=60, min_decode=4, max_decode=10)
    save_trace(synthesize(SyntheticTraceSpec(seed=4, rank_depth=24, **spec)), path)
    png = tmp_path / "table.png"
    rc = cli.main(
        [
            "bench",
            "decode",
            "--trace",
            str(path),
            "--policy",
            "score_rank",
            "--json",
            "--plot",
            str(png),
            "--heads",
            "1",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    assert out["policy"] == "score_rank" and out["verified"] and out["rank_depth"] == 24
    assert out["misses"] == out["policies"]["score_rank"]["misses"]
    assert set(out["policies"]) >= {"lru", "score_rank", "score_rank_guarded"} and out["policies_skipped"] == {}
    assert out["policies"]["score_rank"]["misses"] >= out["opt_misses"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    plain = tmp_path / "plain.npz"
    save_trace(synthesize(SyntheticTraceSpec(seed=4, **spec)), plain)
    assert cli.main(["bench", "decode", "--trace", str(plain), "--policy", "score_rank", "--json"]) == 2
    assert "ranked" in capsys.readouterr().err
    assert cli.main(["bench", "decode", "--trace", str(plain), "--json", "--heads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "score_rank" in out["policies_skipped"] and "score_rank" not in out["policies"]
