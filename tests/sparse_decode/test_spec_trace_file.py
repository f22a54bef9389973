"""The speculative trace file (``sparse_decode/spec_trace.py``): save / load / validation,
the recorded NextN traces of the trained checkpoint, and ``bench decode --mtp N --trace``
replaying a speculative trace as recorded (its own rounds, no derived acceptance)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sglang_ascend_offload.sparse_decode.spec_trace import (
    SpecTrace,
    is_spec_trace,
    load_spec_trace,
    save_spec_trace,
    speculative_from_trace,
    union_sizes,
    union_sizes_by_layer,
    validate_spec_trace,
)
from sglang_ascend_offload.sparse_decode.trace import SyntheticTraceSpec, TraceError, save_trace, synthesize

from .test_bench_decode import _run  # the CLI in-process: (rc, stdout, stderr)

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


def _small(seed=3, n=3):
    base = synthesize(
        SyntheticTraceSpec(
            steps=30, layers=2, rows=2, top_k=8, min_prompt=10, max_prompt=40, min_decode=12, max_decode=20, seed=seed
        )
    )
    return speculative_from_trace(base, n, 0.6, seed=seed, source="synthetic")


def test_a_saved_speculative_trace_loads_equal(tmp_path):
    spec = _small()
    path = tmp_path / "s.npz"
    save_spec_trace(spec, path, meta='{"x": 1}')
    assert is_spec_trace(path)
    back = load_spec_trace(path)
    for name in ("topk", "committed", "req_ids", "accepted"):
        assert np.array_equal(getattr(back, name), getattr(spec, name)), name
    assert back.rows_per_request == 3 and back.source == '{"x": 1}'


def test_validation_names_what_is_wrong():
    spec = _small()
    assert validate_spec_trace(spec) == []
    live = np.argwhere(spec.req_ids >= 0)[0]
    bad = SpecTrace(spec.topk.copy(), spec.committed, spec.req_ids, spec.accepted, 3)
    bad.topk[live[0], 0, live[1] * 3, 0] = spec.committed[live[0], live[1]] + 1  # row 0 sees < L + 1
    assert any("cannot see" in p for p in validate_spec_trace(bad))
    idle = SpecTrace(spec.topk, spec.committed, spec.req_ids.copy(), spec.accepted, 3)
    idle.req_ids[live[0], live[1]] = -1
    assert validate_spec_trace(idle)
    with pytest.raises(TraceError):
        save_spec_trace(bad, "/tmp/never_written.npz")


def test_a_decode_trace_is_not_a_speculative_one(tmp_path):
    path = tmp_path / "d.npz"
    save_trace(synthesize(SyntheticTraceSpec(steps=8, layers=1, rows=1, top_k=4, min_prompt=8, max_prompt=9)), path)
    assert not is_spec_trace(path)
    with pytest.raises(TraceError, match="committed"):
        load_spec_trace(path)


def test_union_sizes_per_layer_split_the_flat_distribution():
    spec = _small()
    flat = union_sizes(spec)
    per_layer = union_sizes_by_layer(spec)
    assert len(per_layer) == spec.layers and sum(x.size for x in per_layer) == flat.size
    assert sorted(np.concatenate(per_layer).tolist()) == sorted(flat.tolist())


@pytest.mark.parametrize("mtp", [1, 2, 3])
def test_the_recorded_nextn_traces_are_valid_real_rounds(mtp):
    """``scripts/record_nextn_traces.py``'s files: the trained checkpoint served with NextN
    (real drafts, real acceptance), each round's N + 1 verify rows per request."""
    spec = load_spec_trace(TRACES / f"tiny_dsa_trained_nextn{mtp}.npz")
    meta = json.loads(spec.source)
    assert spec.rows_per_request == mtp + 1 == meta["rows_per_request"] and meta["source"] == "sglang"
    assert spec.top_k == meta["top_k"] == 64 and spec.layers == 2
    live = spec.req_ids >= 0
    accepted = spec.accepted[live & (spec.accepted > 0)]
    assert accepted.size > 50 and 1 <= accepted.min() and accepted.max() <= mtp + 1
    assert accepted.mean() > 1.2  # drafts were accepted: the trained NextN layer agrees often
    assert (union_sizes(spec) <= (mtp + 1) * spec.top_k).all()


def test_bench_decode_replays_a_recorded_speculative_trace(tmp_path, capsys):
    spec = _small(n=3)
    path = tmp_path / "s.npz"
    save_spec_trace(spec, path)
    rc, out, err = _run(["--trace", str(path), "--mtp", "2", "--heads", "2", "--mtp-hot-tokens", "8", "--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    assert r["trace"] == {"source": str(path), "speculative": True} and r["verified"] is True
    req = r["per_request"]
    assert req["hot_tokens"] == 8 and req["overflow_rounds"] > 0  # 3 rows x top-k 8 > 8 slots: overflow, exact
    assert r["rounds"] == int((spec.req_ids >= 0).any(axis=1).sum())
    rc, _, err = _run(["--trace", str(path), "--mtp", "1", "--heads", "2"], capsys)
    assert rc == 2 and "pass --mtp 2" in err
    rc, _, err = _run(["--trace", str(path), "--mtp", "2", "--mtp-accept", "0.5"], capsys)
    assert rc == 2 and "--mtp-accept" in err
