"""Small end-to-end check: ``bench decode --ops triton`` on a replayed trace is
verified and moves exactly what ``--ops reference`` moves."""

import json
import os

import pytest

pytest.importorskip("triton")

from sglang_ascend_offload import cli, platform  # noqa: E402

SAME = ("selected", "hits", "misses", "h2d_bytes", "d2h_bytes", "checks", "per_layer")


def test_replayed_trace_same_hits_misses_bytes_on_both_rungs(tmp_path, capsys):
    if platform.device_kind() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on CPU the triton rung needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    trace = str(tmp_path / "trace.npz")
    shape = ["--steps", "6", "--layers", "2", "--rows", "3", "--top-k", "16"]
    assert cli.main(["bench", "decode", "--ops", "reference", *shape, "--save-trace", trace, "--json"]) == 0
    capsys.readouterr()
    results = {}
    for ops in ("reference", "triton"):
        assert cli.main(["bench", "decode", "--trace", trace, "--ops", ops, "--json"]) == 0
        results[ops] = json.loads(capsys.readouterr().out)
    ref, tri = results["reference"], results["triton"]
    assert ref["verified"] is True and tri["verified"] is True
    assert tri["ops"] == "triton" and tri["failures"] == []
    assert ref["hits"] > 0 and ref["misses"] > 0
    for key in SAME:
        assert tri[key] == ref[key], key
