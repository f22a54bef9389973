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
  which the caller runs);
* every residency policy: a policy other than ``lru`` runs its own step, which the plan
  names ``residency_<policy>`` (its CPU kernel, its Triton kernel, or its torch
  composition), never ``residency_manage`` (the exact-LRU op it does not run).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest
import torch
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


REF_ATTENTION = ("sparse_mla_attention", "reference", "")


def _policy_case(policy, rung, via, copy):
    return {(f"residency_{policy}", rung, via), copy, REF_ATTENTION}


TORCH_COPY = ("copy_miss_rows", "reference", "")
KERNEL_COPY = ("copy_miss_rows", "reference", "cpu kernel")
POLICY_CASES = {
    # policy, ops, manage_impl -> what a layer step runs
    ("lru_k2", "reference", "auto"): _policy_case("lru_k2", "reference", "", TORCH_COPY),
    ("lru_k2_guarded", "reference", "auto"): _policy_case("lru_k2_guarded", "reference", "", TORCH_COPY),
    ("score_rank", "reference", "auto"): _policy_case("score_rank", "reference", "cpu kernel", KERNEL_COPY),
    ("score_rank", "reference", "torch"): _policy_case("score_rank", "reference", "", TORCH_COPY),
    ("score_rank_smooth", "reference", "auto"): _policy_case("score_rank_smooth", "reference", "", TORCH_COPY),
    ("score_rank_guarded", "reference", "auto"): _policy_case(
        "score_rank_guarded", "reference", "cpu kernel", KERNEL_COPY
    ),
    ("score_rank_guarded", "reference", "torch"): _policy_case("score_rank_guarded", "reference", "", TORCH_COPY),
    # Triton: score_rank's own kernel; lru_k2 has none, its torch composition runs (named so)
    ("score_rank", "triton", "auto"): _policy_case("score_rank", "triton", "", ("copy_miss_rows", "triton", "")),
    ("lru_k2", "triton", "auto"): _policy_case("lru_k2", "reference", "", ("copy_miss_rows", "triton", "")),
}


# eager and captured; the Triton interpreter's cases eager only (the captured form runs the same ops)
POLICY_RUNS = [
    pytest.param(case, captured, id="-".join(case) + ("-captured" if captured else "-eager"))
    for case in POLICY_CASES
    for captured in (False, True)
    if not (captured and case[1] == "triton")
]


@pytest.mark.parametrize("case, captured", POLICY_RUNS)
def test_every_policy_runs_the_residency_step_its_plan_names(monkeypatch, case, captured):
    """A policy other than exact LRU never runs ``residency_manage`` as its step: the plan
    names the policy's own step and that is what runs (eager and in the captured form).
    Negative control: the plan before this rule named ``residency_manage`` for every policy,
    which the recorder does not see run here (``test_a_policy_step_is_not_residency_manage``)."""
    policy, ops, manage_impl = case
    if ops == "triton":
        pytest.importorskip("triton")
    from sglang_ascend_offload.sparse_decode.policies import POLICIES

    assert set(POLICIES) == {"lru", "lru_k2", "lru_k2_guarded", "score_rank", "score_rank_smooth", "score_rank_guarded"}
    calls = record_ops(monkeypatch)
    engine, _ = run_steps(ops, manage_impl, SMALL, captured=captured, policy=policy)
    assert planned(engine.plan, ("residency", "miss_copy", "attention")) == POLICY_CASES[case]
    assert_ran_the_plan(engine, calls, SMALL)


def test_a_policy_step_is_not_residency_manage(monkeypatch):
    """Negative control of the recorder for policies: ``lru_k2``'s steps record its own op,
    and nothing records ``residency_manage`` (the plan that named it was wrong); the
    guarded policy's ghost ``residency_manage`` runs inside its step, unrecorded apart."""
    calls = record_ops(monkeypatch)
    run_steps("reference", "auto", SMALL, policy="lru_k2")
    assert ("residency_lru_k2", "reference", "") in calls
    assert not [c for c in calls if c[0] == "residency_manage"]
    calls.clear()
    engine, _ = run_steps("reference", "torch", SMALL, policy="lru_k2_guarded")
    assert engine.plan.rung("residency_manage").rung == "reference"  # the ghost's op, resolved
    assert "its ghost exact LRU through residency_manage[reference]" in engine.plan.residency_stage().reason
    assert not [c for c in calls if c[0] == "residency_manage"]


@pytest.mark.skipif(not HAVE_CXX, reason="needs g++ to build the AscendC functional model")
def test_ops_fused_with_the_separate_attention_runs_the_fused_miss_copy(monkeypatch):
    """``ops: fused`` with ``fused_copy_sfa: false``: the separate miss copy on the fused rung
    (the AscendC miss copy on its functional model), attention on the reference; outputs
    equal the ``ops: reference`` run's bit for bit (only copies differ in who makes them)."""
    from sglang_ascend_offload.ops import ascendc_cpu_ops

    calls = record_ops(monkeypatch)
    try:
        engine, outputs = run_steps("fused", "auto", FUSED, fused_copy_sfa=False)
        assert planned(engine.plan, ("residency", "miss_copy", "attention")) == {
            ("residency_manage", "reference", "cpu kernel"),
            ("copy_miss_rows", "fused", ""),
            ("sparse_mla_attention", "reference", ""),
        }
        assert_ran_the_plan(engine, calls, FUSED)
    finally:
        ascendc_cpu_ops.unregister()
    monkeypatch.undo()
    _, reference = run_steps("reference", "torch", FUSED)
    assert all(torch.equal(a, b) for a, b in zip(outputs, reference)) and len(outputs) == len(reference)
