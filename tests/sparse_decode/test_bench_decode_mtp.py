"""`bench decode --mtp N` on tiny traces: the JSON contract, verification, ratios, bad input."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from sglang_ascend_offload.bench import decode
from sglang_ascend_offload.sparse_decode.trace import SyntheticTraceSpec, save_trace, synthesize

from .test_bench_decode import _run  # the CLI in-process: (rc, stdout, stderr)

TINY = ["--steps", "40", "--layers", "2", "--rows", "3", "--top-k", "16", "--heads", "2"]
ROW_BYTES = (512 + 64) * 2  # bf16 latent + rope
DESIGN_KEYS = {
    "h2d_bytes_per_round",
    "device_hot_bytes_per_request",
    "hit_rate",
    "unique_hit_rate",
    "misses",
    "opt_misses",
    "misses_over_opt",
    "hot_tokens",
    "verified",
    "failures",
    "overflow_rounds",
    "overflow_positions",
    "overflow_h2d_bytes",
    "overflow_per_layer",
}
TOP_KEYS = {
    "per_row",
    "per_request",
    "verified",
    "ratios",
    "mtp",
    "rows_per_request",
    "accept_rate",
    "mean_accept_length",
    "rounds",
    "top_k",
    "layers",
    "requests",
    "trace",
}


def _one_json_document(text: str):
    """The one JSON document ``text`` holds (nothing else but whitespace around it)."""
    doc, end = json.JSONDecoder().raw_decode(text.lstrip())
    assert text.lstrip()[end:].strip() == "", "stdout holds more than one JSON document"
    return doc


@pytest.fixture(scope="module")
def mtp3():
    """``--mtp 3 --json`` on the tiny synthetic trace, run once for the module: (rc, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = decode.main(parser.parse_args(TINY + ["--mtp", "3", "--json"]))
    return rc, out.getvalue(), err.getvalue()


def test_json_is_one_document_with_the_contract_keys(mtp3):
    rc, out, err = mtp3
    assert rc == 0
    r = _one_json_document(out)
    assert TOP_KEYS <= set(r)
    for design in ("per_row", "per_request"):
        assert DESIGN_KEYS <= set(r[design]), design
    assert {"h2d_bytes_per_round", "device_hot_bytes_per_request", "hit_rate_delta"} <= set(r["ratios"])
    assert (r["mtp"], r["rows_per_request"], r["accept_rate"], r["top_k"], r["layers"], r["requests"]) == (
        3,
        4,
        0.8,
        16,
        2,
        3,
    )
    assert r["trace"]["source"] == "synthetic"
    assert r["verified"] is True and r["per_row"]["verified"] is True and r["per_request"]["verified"] is True
    assert r["failures"] == r["per_row"]["failures"] == r["per_request"]["failures"] == []
    assert "per_row: round" in err and "per_request: round" in err  # progress on stderr only


def test_sections_follow_the_designs_and_the_ratios_follow_the_sections(mtp3):
    r = _one_json_document(mtp3[1])
    row, req, ratio = r["per_row"], r["per_request"], r["ratios"]
    n, k, layers, rounds = r["rows_per_request"], r["top_k"], r["layers"], r["rounds"]
    assert 1 <= r["mean_accept_length"] <= n and rounds > 0
    # default sizes: 2 x top-k per verify row and per request (the server's default)
    assert (row["hot_tokens"], req["hot_tokens"]) == (2 * k, 2 * k)
    assert row["device_hot_bytes_per_request"] == n * row["hot_tokens"] * layers * ROW_BYTES
    assert req["device_hot_bytes_per_request"] == req["hot_tokens"] * layers * ROW_BYTES
    for d in (row, req):
        fetched = d["misses"] + d["overflow_positions"]  # every host -> device row
        assert d["h2d_bytes"] == fetched * ROW_BYTES and d["overflow_h2d_bytes"] == d["overflow_positions"] * ROW_BYTES
        assert d["h2d_bytes_per_round"] == pytest.approx(d["h2d_bytes"] / rounds)
        assert d["hits"] + d["misses"] == d["selected"] and d["row_hits"] <= d["row_selected"]
        assert d["hit_rate"] == pytest.approx(d["row_hits"] / d["row_selected"])
        assert d["unique_hit_rate"] == pytest.approx(d["hits"] / d["selected"])
        assert 0 < d["opt_misses"] <= fetched
        assert d["misses_over_opt"] == pytest.approx(fetched / d["opt_misses"])
        assert d["checks"] == rounds * layers
        per_layer = d["overflow_per_layer"]
        assert [x["layer"] for x in per_layer] == list(range(layers))
        assert sum(x["overflow_positions"] for x in per_layer) == d["overflow_positions"]
        assert sum(x["overflow_rounds"] for x in per_layer) == d["overflow_rounds"]
    # a verify row's buffer never overflows; the request's of 2 x top-k does when the union is larger
    assert row["overflow_rounds"] == row["overflow_positions"] == 0
    assert req["overflow_rounds"] > 0 and req["overflow_positions"] >= req["overflow_rounds"]
    # the same verify rows in both designs; per row, every row entry is its own lookup
    assert row["row_selected"] == req["row_selected"] == row["selected"] >= req["selected"]
    assert row["hit_rate"] == row["unique_hit_rate"]
    assert ratio["h2d_bytes_per_round"] == pytest.approx(req["h2d_bytes_per_round"] / row["h2d_bytes_per_round"])
    assert ratio["device_hot_bytes_per_request"] == pytest.approx(
        req["device_hot_bytes_per_request"] / row["device_hot_bytes_per_request"]
    )
    assert ratio["hit_rate_delta"] == pytest.approx(req["hit_rate"] - row["hit_rate"])
    # one shared buffer of a quarter of the slots (plain decode's size) moves less on this trace
    assert ratio["device_hot_bytes_per_request"] == 1 / n
    assert ratio["h2d_bytes_per_round"] < 1
    # the union a request's shared buffer holds: more than one row's top-k, within the n x top-k bound;
    # each position is one lookup of the resident part or one overflow position
    u = r["union_over_top_k"]
    assert u["bound"] == n and 1 < u["p50"] <= u["p99"] <= u["max"] <= n and 1 < u["mean"] <= u["max"]
    union = u["mean"] * k * r["request_rounds"] * layers
    assert union == pytest.approx(req["selected"] + req["overflow_positions"])
    assert len(u["per_layer"]) == layers
    assert sum(x["mean"] for x in u["per_layer"]) / layers == pytest.approx(u["mean"])


def test_trace_file_explicit_sizes_and_table(tmp_path, capsys):
    trace = synthesize(
        SyntheticTraceSpec(
            steps=16, layers=1, rows=2, top_k=8, min_prompt=4, max_prompt=40, min_decode=6, max_decode=10, seed=2
        )
    )
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    argv = [
        "--trace",
        str(path),
        "--heads",
        "2",
        "--mtp",
        "1",
        "--mtp-accept",
        "0.5",
        "--hot-tokens",
        "12",
        "--mtp-hot-tokens",
        "20",
    ]
    rc, out, _ = _run(argv + ["--json"], capsys)
    assert rc == 0
    r = _one_json_document(out)
    assert (r["per_row"]["hot_tokens"], r["per_request"]["hot_tokens"]) == (12, 20)
    assert r["trace"] == {"source": str(path)} and r["accept_rate"] == 0.5 and r["verified"] is True
    rc, out, err = _run(argv, capsys)
    assert rc == 0
    assert "verified: yes" in out and "per_row" in out and "per_request" in out
    for label in ("H2D MiB per round", "device hot MiB per request", "hit rate", "Belady optimum misses"):
        assert label in out, label
    assert "per_row: round" in err


def test_bad_input_lists_every_problem(tmp_path, capsys):
    rc, out, err = _run(
        TINY + ["--mtp", "0", "--mtp-accept", "1.5", "--policy", "score_rank", "--profile-shape", "--json"], capsys
    )
    assert rc == 2 and out == ""
    for needle in (
        "--mtp 0",
        "--mtp-accept 1.5 must be in [0, 1]",
        "--policy score_rank needs the indexer's ranking",
        "--profile-shape and --mtp",
    ):
        assert needle in err, needle
    rc, out, err = _run(
        TINY + ["--mtp", "3", "--mtp-accept", "-0.1", "--hot-tokens", "8", "--mtp-hot-tokens", "8", "--layers", "0"],
        capsys,
    )
    assert rc == 2 and out == ""
    for needle in (
        "--layers must be >= 1",
        "--mtp-accept -0.1",
        "--hot-tokens 8 < the trace's top-k 16",
        "--mtp-hot-tokens 8 < the trace's top-k 16",
    ):
        assert needle in err, needle
    # the speculative flags need --mtp
    rc, _, err = _run(TINY + ["--mtp-accept", "0.5", "--mtp-hot-tokens", "64"], capsys)
    assert rc == 2 and "--mtp-accept needs --mtp" in err and "--mtp-hot-tokens needs --mtp" in err
    # against a recorded trace the sizes are checked with its top-k; a trace too short for a round
    trace = synthesize(
        SyntheticTraceSpec(
            steps=8, layers=1, rows=2, top_k=8, min_prompt=4, max_prompt=20, min_decode=2, max_decode=3, seed=1
        )
    )
    path = tmp_path / "short.npz"
    save_trace(trace, path)
    rc, _, err = _run(["--trace", str(path), "--mtp", "1", "--hot-tokens", "4", "--mtp-hot-tokens", "4"], capsys)
    assert rc == 2 and "--hot-tokens 4 < the trace's top-k 8" in err and "--mtp-hot-tokens 4 < the trace's top-k" in err
    rc, _, err = _run(["--trace", str(path), "--mtp", "5"], capsys)
    assert rc == 2 and "no request with 6 consecutive decode positions" in err
