"""``tests/npu_requirements.py``: a missing piece fails on an NPU runner, skips elsewhere."""

import npu_requirements as req
import pytest


def test_missing_piece_skips_without_an_npu(monkeypatch):
    monkeypatch.setattr(req, "npu_present", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="fused rung not built: x missing"):
        req.require("x missing", "fused rung not built")


def test_missing_piece_fails_on_an_npu_runner(monkeypatch):
    monkeypatch.setattr(req, "npu_present", lambda: True)
    with pytest.raises(pytest.fail.Exception, match="missing on an NPU runner: memfabric_hybrid is not installed"):
        req.require("memfabric_hybrid is not installed")
    req.require(None)  # nothing missing: nothing happens


def test_requires_keeps_the_test_signature():
    import inspect

    def test_x(tmp_path, heads):
        return heads

    wrapped = req.requires(lambda: None)(test_x)
    assert list(inspect.signature(wrapped).parameters) == ["tmp_path", "heads"]
    assert wrapped(None, 4) == 4
