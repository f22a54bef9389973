"""``env --npu-check``: a full report on any machine; on one without an NPU every
check fails with its fix and the command exits non-zero.

Nothing passes that was not checked: a torch_npu op whose schema could not be compared
(the schema file missing, unreadable or without the op; the installed schema unreadable)
is ``unknown`` with the reason, and ``unknown`` makes the exit status non-zero unless
``--allow-unknown``. The ops are real dispatcher ops registered under ``torch.ops.npu``
for the test (the schemas of ``npu_api/torch_npu_ops.json``), so the same checks that pass
on them (negative control) report each unknown case. The kernel qualification checks
(``qualify.<op>``) run the fused ops on the CPU functional model here; a planted faulty
LIM fails its check with the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from kernel_mutations import LIM_VICTIM_ORDER, fused_ops_from, mutated_library, registration_left_as_found

from sglang_ascend_offload import npu_preflight, platform
from sglang_ascend_offload.ops.qualify_problem import ServedShape
from sglang_ascend_offload.sparse_decode.op_selection import select_ops

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
    assert set(doc["checks"][0]) == {"name", "ok", "status", "detail", "fix", "needed_by"}
    assert doc["unknown"] == [] and all(c["status"] == "fail" for c in doc["checks"])
    assert "does not exist" in doc["checks"][0]["detail"]


SCHEMAS = json.loads(npu_preflight.SCHEMAS_FILE.read_text())["ops"]


@pytest.fixture
def npu_ops(monkeypatch):
    """The torch_npu ops the npu rung calls, registered under ``torch.ops.npu`` with the
    expected schemas (the checks then see an installed torch_npu)."""
    lib = torch.library.Library("npu", "FRAGMENT")
    for op, _ in npu_preflight.TORCH_NPU_OPS:
        lib.define(SCHEMAS[op][0])
    monkeypatch.setattr(npu_preflight, "_torch_npu_reason", lambda: None)
    yield lib
    lib._destroy()


def _op_checks(expected, note):
    return [npu_preflight.check_torch_npu_op(op, need, expected, note) for op, need in npu_preflight.TORCH_NPU_OPS]


def test_a_schema_that_matches_passes_and_one_that_differs_fails(npu_ops):
    expected, note = npu_preflight.expected_schemas()  # the shipped file: lists of overload schemas
    assert set(expected) == {op for op, _ in npu_preflight.TORCH_NPU_OPS}
    assert [c.status for c in _op_checks(expected, note)] == ["pass"] * 3
    changed = expected["npu_lightning_indexer"][0].replace("int sparse_mode=3", "")
    wrong = {**expected, "npu_lightning_indexer": [changed]}
    first = _op_checks(wrong, note)[0]
    assert first.status == "fail" and "schema differs" in first.detail and first.fix


def test_what_could_not_be_compared_is_unknown_with_its_reason(npu_ops, monkeypatch, tmp_path):
    monkeypatch.setattr(npu_preflight, "SCHEMAS_FILE", tmp_path / "absent.json")
    checks = [c for c in npu_preflight.run_checks() if c.name.startswith("torch_npu.npu_")]
    assert [c.status for c in checks] == ["unknown"] * 3
    assert all("absent.json is not in npu_api/" in c.detail and c.fix for c in checks)

    bad = tmp_path / "torch_npu_ops.json"
    bad.write_text("{not json")
    monkeypatch.setattr(npu_preflight, "SCHEMAS_FILE", bad)
    checks = [c for c in npu_preflight.run_checks() if c.name.startswith("torch_npu.npu_")]
    assert [c.status for c in checks] == ["unknown"] * 3 and "is unreadable" in checks[0].detail

    expected, note = {"npu_sparse_flash_attention": SCHEMAS["npu_sparse_flash_attention"]}, "schemas from a file"
    assert [c.status for c in _op_checks(expected, note)] == ["unknown", "unknown", "pass"]
    assert "has no npu_lightning_indexer" in _op_checks(expected, note)[0].detail

    class Unreadable:
        @property
        def default(self):
            raise RuntimeError("no overload")

    real = torch.ops.npu

    class Namespace:
        def __getattr__(self, name):
            return Unreadable() if name == "npu_lightning_indexer" else getattr(real, name)

    monkeypatch.setattr(torch.ops, "npu", Namespace())
    first = npu_preflight.check_torch_npu_op("npu_lightning_indexer", "x", SCHEMAS, "schemas from the file")
    assert first.status == "unknown" and "schema cannot be read" in first.detail


def test_unknown_makes_the_exit_status_non_zero_unless_allowed(npu_ops, monkeypatch, tmp_path, capsys):
    passed = npu_preflight.Check("a", True, "found")
    unknown = npu_preflight.unknown("b", "not compared: why", "the fix")
    failed = npu_preflight.Check("c", False, "missing", "the fix")
    assert npu_preflight.exit_status([passed]) == 0
    assert npu_preflight.exit_status([passed, unknown]) == 1
    assert npu_preflight.exit_status([passed, unknown], allow_unknown=True) == 0
    assert npu_preflight.exit_status([passed, unknown, failed], allow_unknown=True) == 1  # a failure still fails
    with pytest.raises(ValueError):
        npu_preflight.Check("d", True, "x", status="unknown")  # an unknown is never ok
    monkeypatch.setattr(npu_preflight, "SCHEMAS_FILE", tmp_path / "absent.json")
    monkeypatch.setattr(npu_preflight, "run_checks", lambda q=None: [passed, *_op_checks(None, "absent.json gone")])
    assert npu_preflight.main(as_json=True) == 1
    doc = json.loads(capsys.readouterr().out)
    names = [f"torch_npu.{op}" for op, _ in npu_preflight.TORCH_NPU_OPS]
    assert doc["ok"] is False and [u["name"] for u in doc["unknown"]] == names
    assert all("schema not compared: absent.json gone" in u["reason"] for u in doc["unknown"])
    assert npu_preflight.main(as_json=True, allow_unknown=True) == 0
    capsys.readouterr()


def test_schema_comparison(monkeypatch, tmp_path):
    missing = tmp_path / "absent.json"
    monkeypatch.setattr(npu_preflight, "SCHEMAS_FILE", missing)
    assert npu_preflight.expected_schemas() == (None, "absent.json is not in npu_api/")
    path = tmp_path / "torch_npu_ops.json"
    ops = {"npu_a": {"schema": "npu_a(Tensor x) -> Tensor"}, "npu_b": "npu_b() -> ()", "npu_c": ["c() -> ()"]}
    path.write_text(json.dumps({"ops": ops}))
    monkeypatch.setattr(npu_preflight, "SCHEMAS_FILE", path)
    expected, _ = npu_preflight.expected_schemas()
    assert expected == {"npu_a": ["npu_a(Tensor x) -> Tensor"], "npu_b": ["npu_b() -> ()"], "npu_c": ["c() -> ()"]}
    path.write_text(json.dumps({"ops": {"npu_a": 3}}))
    assert npu_preflight.expected_schemas() == (None, "torch_npu_ops.json holds no op schemas")


# ------------------------------------------------------------------ kernel qualification
TINY = dict(hot_tokens=256, top_k=128, page_size=64, index_heads=8, heads=4)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the AscendC functional model")


@pytest.fixture(autouse=True, scope="module")
def _fused_ops_left_as_found():
    with registration_left_as_found():
        yield


def test_qualification_is_not_run_off_the_npu_and_not_asked_without_sparse_decode():
    (check,) = npu_preflight.qualify_checks()
    assert check.name == "qualify" and check.status == "fail" and "not run: no Ascend NPU" in check.detail
    assert "bench kernels --qualify" in check.fix
    assert npu_preflight.qualify_checks(npu_preflight.QualifyRequest(sparse_decode=None)) == []
    shape = npu_preflight.QualifyRequest().shape()  # DeepSeek-V3.2 defaults
    assert (shape.top_k, shape.hot_tokens, shape.index_heads, shape.page_size) == (2048, 4096, 64, 128)


@needs_gxx
def test_each_fused_op_is_a_qualification_check(tmp_path):
    shape = ServedShape(**TINY)
    plan = select_ops("cpu", ops="fused", hot_tokens=256, top_k=128).check()
    checks = npu_preflight.qualification_checks(plan, shape)
    assert [(c.name, c.status) for c in checks] == [("qualify.LIM", "pass"), ("qualify.Copy-SFA", "pass")]
    assert "equals lightning_indexer[reference] + residency_manage[reference]" in checks[0].detail
    with fused_ops_from(mutated_library(tmp_path, LIM_VICTIM_ORDER)):
        checks = npu_preflight.qualification_checks(plan, shape)
    assert [c.status for c in checks] == ["fail", "pass"]
    assert "fused LIM differs from" in checks[0].detail and "first" not in checks[0].fix
    assert '"fused_lim": false' in checks[0].fix and "bash ascendc_ops/build.sh --install" in checks[0].fix
    plan = select_ops("cpu", ops="reference").check()
    (none,) = npu_preflight.qualification_checks(plan, shape)
    assert none.ok and "selects no fused op" in none.detail


def test_the_command_line_names_the_config_and_model_to_qualify(tmp_path, capsys):
    import argparse

    from sglang_ascend_offload import env_cli

    parser = argparse.ArgumentParser()
    env_cli.add_arguments(parser)
    request = env_cli._qualify_request(parser.parse_args(["--npu-check"]))
    assert request.sparse_decode.ops == "auto" and request.model.name == "deepseek-v3.2"
    args = parser.parse_args(["--npu-check", "--config", '{"kvpp": {}}', "--heads", "8"])
    assert env_cli._qualify_request(args).sparse_decode is None  # no sparse decode: nothing to qualify
    args = parser.parse_args(["--npu-check", "--config", '{"sparse_decode": {"indexer_dtype": "int8"}}'])
    assert env_cli._qualify_request(args).shape().indexer_dtype == "int8"
    bad = parser.parse_args(["--npu-check", "--config", '{"sparse_decode": {"qualify_kernels": "yes"}}'])
    assert env_cli.main(bad) == 2 and "qualify_kernels" in capsys.readouterr().err
