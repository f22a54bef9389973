"""On an NPU a decode step runs exactly its operator plan, and no stage on the torch
reference (``ops`` other than ``reference``).

The engine on ``npu`` tensors (an NPU runner, or the CPU-backed stand-in:
``SAO_NPU_STANDIN=1 python -m pytest -m npu``) with every ladder implementation wrapped
by ``tests/op_recorder.py``: the ``(op, rung, via)`` that ran in its residency, miss copy
and attention stages equal ``OpPlan.decode_stages()``, none of them ``reference``, eager
and captured; the outputs equal the CPU reference engine's on the same inputs, bit for bit
(the stand-in computes torch_npu's attention with the reference op; on a node the
attention is within the rung's tolerance, ``docs/operators.md``):

* ``ops: npu``: the torch_npu attention and the npu rungs of the residency step and copy
  (eager: its captured form is refused, the torch_npu copy reads host slots back);
* ``ops: auto`` with ``fused_copy_sfa: false``: the separate ops, the miss copy on the
  fused rung (the AscendC miss copy), eager and captured;
* ``ops: fused`` (Copy-SFA on the AscendC extension; the caller runs no fused indexer, so
  the residency step is separate): the npu residency rung, not the reference it used to
  be given.
"""

from __future__ import annotations

import pytest
import torch
from npu_requirements import npu_present, require_npu, require_npu_extension, requires
from op_recorder import planned, record_ops

from .engine_steps import FUSED, NPU, run_steps

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]

STAGES = ("residency", "miss_copy", "attention")


SEPARATE = {
    "npu": (dict(), ("copy_miss_rows", "npu", "")),
    "auto-separate": (dict(fused_copy_sfa=False), ("copy_miss_rows", "fused", "")),
}


@requires(require_npu)
@requires(lambda: require_npu_extension("npu_fused_copy_miss_rows"))
@pytest.mark.parametrize("name, captured", [("npu", False), ("auto-separate", False), ("auto-separate", True)], ids=str)
def test_the_separate_ops_run_their_plan_on_npu_rungs_only(monkeypatch, name, captured):
    settings, copy = SEPARATE[name]
    calls = record_ops(monkeypatch)
    ops = "npu" if name == "npu" else "auto"
    engine, outputs = run_steps(ops, "auto", NPU, captured=captured, device="npu", **settings)
    ran = set(calls)
    assert planned(engine.plan, STAGES) == {("residency_manage", "npu", ""), copy, ("sparse_mla_attention", "npu", "")}
    assert ran == planned(engine.plan, STAGES), engine.plan.describe()
    monkeypatch.undo()
    _, reference = run_steps("reference", "torch", NPU, captured=captured)
    for got, want in zip(outputs, reference):
        assert torch.equal(got, want)


@requires(require_npu)
def test_the_captured_form_of_the_torch_npu_copy_is_refused():
    with pytest.raises(RuntimeError, match="cannot run the separate miss copy on the npu rung"):
        run_steps("npu", "auto", NPU, captured=True, device="npu")


@requires(require_npu)
@requires(lambda: require_npu_extension("npu_fused_scatter_copy_sparse_flash_attention"))
def test_ops_fused_gives_the_residency_step_to_the_npu_rung_not_the_reference(monkeypatch):
    calls = record_ops(monkeypatch)
    engine, _ = run_steps("fused", "auto", FUSED, device="npu")
    want = {("residency_manage", "npu", ""), ("copy_sparse_flash_attention", "fused", "")}
    assert planned(engine.plan, STAGES) == want
    assert engine.plan.rung("residency_manage").reason == "ops=fused has no residency_manage: the npu rung runs it"
    assert set(calls) == want, engine.plan.describe()
    assert not [c for c in calls if c[1] == "reference"]
