"""Trace format: round trip, validation that lists every problem, the synthetic model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_ascend_offload.sparse_decode.trace import (
    SyntheticTraceSpec,
    Trace,
    TraceError,
    load_trace,
    save_trace,
    synthesize,
    validate_trace,
)

SMALL = dict(steps=40, layers=2, rows=3, top_k=16, min_prompt=8, max_prompt=64, min_decode=3, max_decode=12)


@pytest.mark.parametrize("shape", ["locality", "random", "scan"])
def test_synthetic_traces_are_valid_and_deterministic(shape, tmp_path):
    spec = SyntheticTraceSpec(shape=shape, seed=3, noise_skew=1.0 if shape == "locality" else 0.0, **SMALL)
    a, b = synthesize(spec), synthesize(spec)
    assert validate_trace(a.topk, a.seq_lens, a.req_ids) == []
    assert np.array_equal(a.topk, b.topk) and np.array_equal(a.req_ids, b.req_ids)
    assert a.topk.shape == (40, 2, 3, 16)
    assert (a.req_ids == -1).any(), "idle rows exist"
    assert len(np.unique(a.req_ids[a.req_ids >= 0])) > 3, "requests churn"
    dense = (a.seq_lens > 0) & (a.seq_lens <= 16)
    if dense.any():  # short contexts select every position, padded with -1
        s, r = np.argwhere(dense)[0]
        assert sorted(a.topk[s, 0, r][a.topk[s, 0, r] >= 0].tolist()) == list(range(a.seq_lens[s, r]))
    path = tmp_path / "t.npz"
    save_trace(a, path)
    c = load_trace(path)
    assert np.array_equal(c.topk, a.topk) and np.array_equal(c.seq_lens, a.seq_lens)
    assert np.array_equal(c.req_ids, a.req_ids) and json.loads(c.meta)["shape"] == shape


def test_locality_model_has_the_documented_structure():
    spec = SyntheticTraceSpec(
        steps=30, layers=1, rows=1, top_k=64, min_prompt=2000, max_prompt=2000, min_decode=100, max_decode=100, seed=1
    )
    t = synthesize(spec)
    for step in range(30):
        sel = set(t.topk[step, 0, 0].tolist())
        n = int(t.seq_lens[step, 0])
        assert {0} <= sel  # the attention sink (64/64 = 1 position)
        assert set(range(n - 8, n)) <= sel  # the recent window (64/8 positions)
    overlap = [len(set(t.topk[s, 0, 0]) & set(t.topk[s + 1, 0, 0])) / 64 for s in range(29)]
    assert 0.4 < float(np.mean(overlap)) < 0.95  # heavy hitters persist, noise does not


def _valid():
    topk = np.full((2, 1, 2, 3), -1, dtype=np.int32)
    topk[:, 0, 0] = [[0, 1, 2], [3, 1, 0]]
    return topk, np.array([[3, 0], [4, 0]], dtype=np.int32), np.array([[5, -1], [5, -1]], dtype=np.int64)


def test_validation_lists_every_problem():
    topk, lens, reqs = _valid()
    assert validate_trace(topk, lens, reqs) == []
    topk[0, 0, 0, 2] = 9  # beyond seq_len
    topk[1, 0, 0, :2] = 1  # repeated position
    topk[1, 0, 1, 0] = 0  # entry in an idle row
    topk[0, 0, 1, 1] = -5  # bad padding
    lens[1, 0] = 2  # shrinks within a request
    reqs[0, 1] = -3
    problems = validate_trace(topk, lens, reqs)
    text = "\n".join(problems)
    for phrase in ("< -1", ">= their row's seq_len", "repeated position", "idle rows", "shrinks", "req_ids < -1"):
        assert phrase in text, phrase
    assert len(problems) >= 6
    assert "step=0, layer=0, row=0, entry=2" in text  # examples say where


def test_validation_of_dtypes_and_shapes():
    topk, lens, reqs = _valid()
    problems = validate_trace(topk.astype(np.int64), lens.astype(np.int64), reqs)
    assert len(problems) == 2 and "int32" in problems[0]
    assert "(steps, rows)" in validate_trace(topk, lens[:, :1], reqs)[0]


def test_load_reports_missing_and_unknown_arrays(tmp_path):
    topk, lens, reqs = _valid()
    path = tmp_path / "bad.npz"
    np.savez(path, topk=topk, extra=np.zeros(2))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert "missing array 'seq_lens'" in msg and "missing array 'req_ids'" in msg and "unknown array 'extra'" in msg
    assert len(err.value.problems) == 3
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="is not an .npz trace"):
        load_trace(tmp_path / "junk.npz")
    (tmp_path / "trace.txt").write_text("step layer row topk\n")  # a text file: named as such, not as pickle
    with pytest.raises(TraceError, match="is not an .npz trace") as err:
        load_trace(tmp_path / "trace.txt")
    assert "pickle" not in str(err.value)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.npz")
    bad = Trace(topk.copy(), lens, reqs)
    bad.topk[0, 0, 0, 0] = 99
    with pytest.raises(TraceError, match="seq_len"):
        save_trace(bad, tmp_path / "x.npz")


def test_bad_spec_is_rejected():
    with pytest.raises(ValueError, match="max_prompt"):
        synthesize(SyntheticTraceSpec(min_prompt=10, max_prompt=5))
