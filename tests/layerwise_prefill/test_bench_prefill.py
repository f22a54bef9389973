"""`bench prefill --json`: the documented keys, consistent ratios, from one small run."""

import json

import pytest

from sglang_ascend_offload import cli
from sglang_ascend_offload.bench.prefill import RUN_KEYS


def test_bench_prefill_json(capsys):
    rc = cli.main(
        [
            "bench",
            "prefill",
            "--json",
            "--shared-buffers",
            "1,2,4",
            "--layers",
            "5",
            "--dim",
            "32",
            "--prefix-tokens",
            "64",
            "--new-tokens",
            "4",
            "--block-tokens",
            "16",
            "--repeats",
            "1",
        ]
    )
    assert rc == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["shared_buffers"] for r in runs] == [1, 2, 4]
    for r in runs:
        assert set(RUN_KEYS) <= set(r)
        b = r["shared_buffers"]
        assert r["layers"] == 5 and r["physical_buffers"] == 1 + min(b, 4)
        assert r["footprint_ratio"] == pytest.approx(r["physical_buffers"] / 5)
        assert r["wall_s"] > 0 and r["compute_s"] > 0 and r["transfer_s"] > 0
        assert r["wall_over_max"] == pytest.approx(r["wall_s"] / max(r["compute_s"], r["transfer_s"]))
        assert r["wall_over_sum"] == pytest.approx(r["wall_s"] / (r["compute_s"] + r["transfer_s"]))
        # real copies: the whole cached prefix was loaded for every layer
        assert r["bytes_loaded"] == 64 * 32 * 4 * 2 * 5


def test_bench_prefill_table(capsys):
    assert (
        cli.main(
            [
                "bench",
                "prefill",
                "--shared-buffers",
                "2",
                "--layers",
                "3",
                "--dim",
                "16",
                "--prefix-tokens",
                "32",
                "--new-tokens",
                "2",
                "--block-tokens",
                "16",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "wall/max" in out and "wall/sum" in out
