"""``bench transfer --served --served-runs N``: the served rows are per-configuration
medians over the runs, ``completed`` the fewest any run completed, and the P/D offload
over device TTFT ratio comes from the medians. (The runs themselves start real servers:
``tests/sglang/e2e/test_bench_serve.py`` exercises the load path.)"""

from __future__ import annotations

import argparse

import pytest

from sglang_ascend_offload.bench import transfer
from sglang_ascend_offload.bench.transfer_served import ServedResult, median_rows, offload_over_device_ttft


def _run(device_ms, offload_ms, done=8, tok=50.0):
    return [
        ServedResult("pd_device_decode", device_ms, device_ms * 2, tok, 8),
        ServedResult("pd_offload_decode", offload_ms, None, tok + 1, done),
    ]


def test_medians_over_runs_and_the_ratio():
    rows = median_rows([_run(440.0, 423.0), _run(431.0, 445.0, done=7), _run(411.0, 395.0)])
    assert [r.name for r in rows] == ["pd_device_decode", "pd_offload_decode"]
    assert rows[0].ttft_ms_p50 == 431.0 and rows[0].ttft_ms_p99 == 862.0
    assert rows[1].ttft_ms_p50 == 423.0 and rows[1].ttft_ms_p99 is None and rows[1].completed == 7
    assert offload_over_device_ttft(rows) == pytest.approx(423.0 / 431.0)
    assert median_rows([_run(10.0, 20.0)])[1].ttft_ms_p50 == 20.0  # one run: its own numbers
    assert offload_over_device_ttft(rows[:1]) is None
    with pytest.raises(ValueError):
        median_rows([])


def test_served_runs_below_one_is_refused():
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    args = parser.parse_args(["--served-runs", "0"])
    with pytest.raises(SystemExit, match="--served-runs"):
        transfer._scenarios(args)
    assert parser.parse_args([]).served_runs == 1
