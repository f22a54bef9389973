"""``env --npu-check``: a full report on any machine; on one without an NPU every
check fails with its fix and the command exits non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_ascend_offload import npu_preflight, platform

pytestmark = pytest.mark.skipif(platform.device_kind() == "npu", reason="checks the report off Ascend")


def test_every_capability_is_listed_and_fails_with_a_fix_off_ascend():
    checks = npu_preflight.run_checks()
    names = [c.name for c in checks]
    assert names[:2] == ["cann", "torch_npu"]
    assert {f"torch_npu.{op}" for op, _ in npu_preflight.TORCH_NPU_OPS} <= set(names)
    assert {
        "_C_ascend.npu_fused_lightning_indexer_manage",
        "_C_ascend.npu_fused_scatter_copy_sparse_flash_attention",
        "memfabric",
        "memcache",
        "host_register",
    } <= set(names)
    for c in checks:
        assert isinstance(c, npu_preflight.Check)
        assert not c.ok and c.detail and c.fix and c.needed_by, c


def test_json_is_one_document_and_the_exit_code_says_failure():
    env = {**os.environ, "ASCEND_HOME_PATH": "/nonexistent/cann"}
    run = subprocess.run(
        [sys.executable, "-m", "sglang_ascend_offload", "env", "--npu-check", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr
    doc = json.loads(run.stdout)  # exactly one JSON document
    assert doc["ok"] is False and len(doc["checks"]) == len(npu_preflight.run_checks())
    assert set(doc["checks"][0]) == {"name", "ok", "detail", "fix", "needed_by"}
    assert "does not exist" in doc["checks"][0]["detail"]


def test_schema_comparison(monkeypatch, tmp_path):
    missing = tmp_path / "absent.json"
    monkeypatch.setattr(npu_preflight, "SCHEMAS_FILE", missing)
    assert npu_preflight.expected_schemas() == (None, "schema comparison skipped: absent.json is not in npu_api/")
    path = tmp_path / "torch_npu_ops.json"
    path.write_text(json.dumps({"ops": {"npu_a": {"schema": "npu_a(Tensor x) -> Tensor"}, "npu_b": "npu_b() -> ()"}}))
    monkeypatch.setattr(npu_preflight, "SCHEMAS_FILE", path)
    expected, _ = npu_preflight.expected_schemas()
    assert expected == {"npu_a": "npu_a(Tensor x) -> Tensor", "npu_b": "npu_b() -> ()"}
