"""What a decode step runs is what its operator plan says (``OpPlan.decode_stages``).

Every implementation in the ladder is wrapped by a recorder (``tests/op_recorder.py``:
the registry's entries, the defining modules' functions, the CPU kernels) before the
engine is built; a few decode steps later, the ``(op, rung, via)`` that ran -- the
residency step, the miss copy and attention of every layer step (the indexer is the
caller's: the SGLang backend's, ``tests/sglang/attention/test_ops_ran_equal_plan_served.py``)
-- must be exactly the plan's, for each CPU configuration:

each eager (``run_layer``) and in the captured form a decode graph records
(``captured_layer_step``, what the served graph path calls):

* ``ops: reference`` on the CPU kernels (``manage_impl`` auto: the CPU serving default) and
  on the torch compositions (``manage_impl`` torch);
* ``ops: triton`` (the Triton interpreter): the residency and copy kernels on the triton
  rung, attention on the reference, which the plan names (Triton has no attention);
* ``ops: fused`` on the AscendC kernels' functional model: Copy-SFA for the miss copy and
  attention, the residency step on the reference rung (no fused residency without LIM,
  which the caller runs).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest
from op_recorder import planned, record_ops

from .engine_steps import FUSED, SMALL, run_steps

HAVE_CXX = shutil.which(os.environ.get("CXX", "g++")) is not None


def assert_ran_the_plan(engine, calls, dims):
    ran = Counter(calls)
    want = planned(engine.plan, ("residency", "miss_copy", "attention"))
    assert set(ran) == want, f"ran {sorted(ran)}, the plan says {sorted(want)} ({engine.plan.describe()})"
    layer_steps = dims["steps"] * dims["layers"]
    assert all(n >= layer_steps for n in ran.values()), ran  # every stage, every layer step


@pytest.mark.parametrize(
    "ops, manage_impl, expected",
    [
        (
            "reference",
            "auto",
            {
                ("residency_manage", "reference", "cpu kernel"),
                ("copy_miss_rows", "reference", "cpu kernel"),
                ("sparse_mla_attention", "reference", ""),
            },
        ),
        (
            "reference",
            "torch",
            {
                ("residency_manage", "reference", ""),
                ("copy_miss_rows", "reference", ""),
                ("sparse_mla_attention", "reference", ""),
            },
        ),
        (
            "triton",
            "auto",
            {
                ("residency_manage", "triton", ""),
                ("copy_miss_rows", "triton", ""),
                ("sparse_mla_attention", "reference", ""),
            },
        ),
    ],
)
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_ops_that_ran_are_the_plans(monkeypatch, ops, manage_impl, expected, captured):
    if ops == "triton":
        pytest.importorskip("triton")
    calls = record_ops(monkeypatch)
    engine, _ = run_steps(ops, manage_impl, SMALL, captured=captured)
    assert planned(engine.plan, ("residency", "miss_copy", "attention")) == expected
    assert_ran_the_plan(engine, calls, SMALL)


@pytest.mark.skipif(not HAVE_CXX, reason="needs g++ to build the AscendC functional model")
def test_ops_that_ran_are_the_plans_with_fused_copy_sfa_on_the_functional_model(monkeypatch):
    from sglang_ascend_offload.ops import ascendc_cpu_ops

    calls = record_ops(monkeypatch)
    try:
        engine, _ = run_steps("fused", "auto", FUSED)
        assert planned(engine.plan, ("residency", "miss_copy", "attention")) == {
            ("residency_manage", "reference", "cpu kernel"),
            ("copy_sparse_flash_attention", "fused", ""),
        }
        assert "ops=fused has no residency_manage: the reference rung runs it" in engine.plan.describe()
        assert_ran_the_plan(engine, calls, FUSED)
    finally:
        ascendc_cpu_ops.unregister()
