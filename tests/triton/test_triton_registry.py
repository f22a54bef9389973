"""The ``triton`` rung in the operator ladder: registration, signatures, availability."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from sglang_ascend_offload.ops import registry, residency, triton_impls


def _reference_ops():
    registry.ensure_registered()
    return {op: registry.implementations(op)["reference"].fn for op in ("residency_manage", "copy_miss_rows")}


@pytest.mark.parametrize("op", ["residency_manage", "copy_miss_rows"])
def test_triton_rung_has_the_reference_signature(op):
    reference = _reference_ops()[op]
    triton_fn = registry.implementations(op)["triton"].fn
    ref_params = list(inspect.signature(reference).parameters.values())
    tri_params = list(inspect.signature(triton_fn).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ref_params] == [(p.name, p.kind, p.default) for p in tri_params]


def test_importing_the_rung_imports_no_triton():
    code = (
        "import sys; import sglang_ascend_offload.ops.triton_impls, sglang_ascend_offload.triton_ops; "
        "print('triton' in sys.modules)"
    )
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_unavailable_without_interpreter_on_cpu(monkeypatch):
    monkeypatch.setattr(triton_impls.platform, "device_kind", lambda: "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = triton_impls.triton_unavailable()
    assert reason is not None and "TRITON_INTERPRET=1" in reason
    _reference_ops()
    with pytest.raises(registry.OpUnavailableError, match="TRITON_INTERPRET=1"):
        registry.select("residency_manage", "triton")


def test_unavailable_without_triton(monkeypatch):
    real_find_spec = triton_impls.importlib.util.find_spec
    monkeypatch.setattr(
        triton_impls.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else real_find_spec(name, *a),
    )
    reason = triton_impls.triton_unavailable()
    assert reason is not None and "triton is not importable" in reason


def test_selected_rung_runs_and_matches_reference(monkeypatch):
    pytest.importorskip("triton")
    if triton_impls.platform.device_kind() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels run on CPU only through the interpreter (TRITON_INTERPRET=1)")
    refs = _reference_ops()
    manage = registry.select("residency_manage", "triton")
    copy = registry.select("copy_miss_rows", "triton")
    assert manage.rung == "triton" and copy.rung == "triton"

    table = residency.ResidencyTable.empty(2, 6)
    mirror = table.clone()
    topk = torch.tensor([[4, 1, -1], [2, 3, 5]], dtype=torch.int32)
    req = torch.tensor([0, 1])
    stable = torch.tensor([9, 9], dtype=torch.int32)
    got = manage(table.slot_token, table.slot_stamp, table.row_req, topk, req, stable, 0)
    want = refs["residency_manage"](mirror.slot_token, mirror.slot_stamp, mirror.row_req, topk, req, stable, 0)
    assert type(got) is type(want) is residency.ResidencyStep
    assert torch.equal(got.slots, want.slots) and torch.equal(table.slot_stamp, mirror.slot_stamp)

    host = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4).to(torch.bfloat16)
    hot_a = torch.zeros(2, 6, 4, dtype=torch.bfloat16)
    hot_b = hot_a.clone()
    token_table = torch.arange(2 * 10, dtype=torch.int32).reshape(2, 10) % 10
    assert copy(host, hot_a, got.miss_tokens, got.miss_slots, got.miss_count, token_table) is None
    residency.copy_miss_rows(host, hot_b, want.miss_tokens, want.miss_slots, want.miss_count, token_table)
    assert torch.equal(hot_a, hot_b)
