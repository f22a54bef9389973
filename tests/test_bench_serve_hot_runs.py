"""``bench serve``'s ``_hotH`` runs: two hot-buffer sizes side by side, with the overflow
counts read from each server's summary line (issue 50: the verify rows' shared buffer
at plain decode's size against the worst-case size)."""

from __future__ import annotations

import argparse
import json

import pytest

from sglang_ascend_offload.bench import serve


def _args(**kw):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" if v is not True else f"--{k}" for k, v in kw.items()])


def test_a_hot_suffix_sets_the_runs_hot_tokens_over_the_offload_config():
    specs = serve.parse_runs("no_offload_eager_spec,offload_eager_spec,offload_eager_spec_hot256_mrr2", 4)
    assert [s.hot_tokens for s in specs] == [None, None, 256]
    assert specs[2].max_running_requests == 2 and specs[2].speculative and specs[2].offload
    args = _args(trained=True)
    assert "hot_tokens" not in json.loads(serve.offload_config(args, specs[1]))  # the server's default
    cfg = json.loads(serve.offload_config(args, specs[2]))
    assert cfg["hot_tokens"] == 256 and cfg["metrics_log_interval_s"] == 1.0  # over the trained config
    assert json.loads(serve.offload_config(_args(offload_config='{"hot_tokens": 64}'), specs[2]))["hot_tokens"] == 256


def test_a_hot_suffix_needs_an_offload_run():
    with pytest.raises(ValueError, match="_hotH"):
        serve.parse_runs("no_offload_spec_hot256", 4)


def test_runs_of_two_hot_sizes_are_not_compared_as_max_running_requests_ratios():
    specs = serve.parse_runs("offload_spec_mrr2,offload_spec_hot256_mrr4", 4)
    results = {s.name: serve.RunResult(s.name, True, False, True, s.max_running_requests, 1) for s in specs}
    assert serve.mrr_ratios(specs, results, {s.name: None for s in specs}) == []


def test_the_summary_line_gives_the_overflow_counts(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "x sparse-decode-offload: steps=3 hit_rate=0.500 hits=1 misses=1\n"
        "y sparse-decode-offload: steps=9 hit_rate=0.400 overflow_rounds=12 overflow_positions=340 "
        "overflow_h2d=0.37MiB\n"
    )
    summary = serve._summary(log)
    assert (summary["overflow_rounds"], summary["overflow_positions"]) == ("12", "340")
