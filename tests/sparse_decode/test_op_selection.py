"""The fused-operator plan (``sparse_decode/op_selection.py``) on a simulated platform.

The platform is simulated by monkeypatching ``platform.device_kind``; what the AscendC
extension provides by a fake extension module object whose attributes are its kernels.
The engine's step follows the plan it was built with, and nothing else decides.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch

from sglang_ascend_offload import platform
from sglang_ascend_offload.ops import fused, registry
from sglang_ascend_offload.ops.contract import OpImpl
from sglang_ascend_offload.ops.registry import _REGISTRY
from sglang_ascend_offload.sparse_decode import engine as engine_mod
from sglang_ascend_offload.sparse_decode import op_selection
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.op_selection import OpSelectionError, select_ops

from .test_engine_equivalence import CPU_DIMS, run_against_full_kv

ALL_KERNELS = (fused.LIM_KERNEL, fused.LIM_C8_KERNEL, fused.COPY_SFA_KERNEL, fused.REGISTER_HOST_KERNEL)
BUILD = "ascendc_ops/build.sh --install"


def extension(*kernels):
    """A fake ``_C_ascend`` that provides ``kernels``."""
    return SimpleNamespace(**{k: object() for k in kernels})


@pytest.fixture
def on_npu(monkeypatch):
    """This machine seen as an Ascend NPU node (platform detection only)."""
    monkeypatch.setattr(platform, "device_kind", lambda: "npu")


def no_model(monkeypatch):
    """Selecting ``fused`` on this CPU neither builds nor registers the functional-model ops
    (``test_engine_fused_cpu_model.py`` runs them); stand-ins take the rung's place."""
    from sglang_ascend_offload.ops import ascendc_cpu_ops

    monkeypatch.setattr(ascendc_cpu_ops, "ensure_for_choice", lambda choice: None)


@pytest.fixture(autouse=True)
def no_model_build(monkeypatch):
    no_model(monkeypatch)


def without_model(monkeypatch):
    """This CPU as one where the functional-model rung cannot be built."""
    from sglang_ascend_offload.ops import ascendc_cpu_ops

    def refuse(choice):
        if choice == "fused":
            raise RuntimeError("no C++ compiler (g++) to build the functional model")

    monkeypatch.setattr(ascendc_cpu_ops, "ensure_for_choice", refuse)


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(op_selection, "_LOGGED", set())


def test_npu_defaults_select_fused_lim_and_copy_sfa(on_npu):
    plan = select_ops(extension=extension(*ALL_KERNELS))  # platform detected: the simulated NPU
    assert plan.platform == "npu" and plan.problems == ()
    assert plan.indexer.fused and plan.indexer.ops == ("lightning_indexer_manage",)
    assert plan.attention.fused and plan.attention.ops == ("copy_sparse_flash_attention",)
    assert plan.indexer.source == plan.attention.source == "default"
    assert "default on an Ascend NPU" in plan.attention.reason
    assert plan.attention.kernels == (fused.COPY_SFA_KERNEL, fused.REGISTER_HOST_KERNEL)
    c8 = select_ops(indexer_dtype="int8", extension=extension(*ALL_KERNELS)).check()
    assert c8.indexer.ops == ("quant_lightning_indexer_manage",) and c8.indexer.kernels == (fused.LIM_C8_KERNEL,)
    # ops=fused and explicit true select fused as well
    assert select_ops(ops="fused", extension=extension(*ALL_KERNELS)).attention.source == "ops"
    explicit = select_ops(ops="npu", fused_lim=True, fused_copy_sfa=True, extension=extension(*ALL_KERNELS))
    assert explicit.indexer.fused and explicit.attention.fused and explicit.attention.source == "setting"


def test_explicit_false_selects_the_separate_torch_npu_ops_and_logs_it_once(on_npu, fresh_log, caplog):
    plan = select_ops(fused_lim=False, fused_copy_sfa=False, extension=extension(*ALL_KERNELS)).check()
    assert not plan.indexer.fused and plan.indexer.ops == ("lightning_indexer", "residency_manage")
    assert not plan.attention.fused and plan.attention.ops == ("copy_miss_rows", "sparse_mla_attention")
    assert plan.indexer.kernels == plan.attention.kernels == ()
    assert "fused_copy_sfa=false" in plan.attention.reason and "fused_lim=false" in plan.indexer.reason
    c8 = select_ops(fused_lim=False, indexer_dtype="int8", extension=None).indexer
    assert c8.ops == ("quant_lightning_indexer", "residency_manage")
    with caplog.at_level(logging.INFO, logger=op_selection.__name__):
        for _ in range(3):
            op_selection.log_plan(plan)
    said = [r.getMessage() for r in caplog.records if "separate operators" in r.getMessage()]
    assert len(said) == 2, said  # once per stage, however often the plan is logged
    assert any("fused_copy_sfa=false" in m for m in said) and any("fused_lim=false" in m for m in said)


def test_a_missing_extension_is_an_error_naming_every_missing_op_and_the_build(on_npu):
    plan = select_ops(extension=None)
    assert plan.indexer.fused and plan.attention.fused  # still the selection: never a silent fallback
    [problem] = plan.problems
    assert problem.rule == "sglang.fused_unavailable"
    for kernel in (fused.LIM_KERNEL, fused.COPY_SFA_KERNEL, fused.REGISTER_HOST_KERNEL):
        assert kernel in problem.problem
    assert BUILD in problem.fix and '"fused_copy_sfa": false' in problem.fix
    with pytest.raises(OpSelectionError) as info:
        plan.check()
    assert "sglang.fused_unavailable" in str(info.value) and BUILD in str(info.value)
    # the real probe on this machine (no torch_npu, no extension) says the same, and that the
    # extend's separate indexer and attention have no usable npu rung either (the torch
    # reference runs on an NPU only with ops=reference)
    real = select_ops()
    assert [p.rule for p in real.problems] == ["sglang.fused_unavailable"] + ["sglang.ops_unavailable"] * 2
    assert fused.LIM_KERNEL in real.problems[0].problem and fused.COPY_SFA_KERNEL in real.problems[0].problem
    assert "indexer stage (lightning_indexer)" in real.problems[1].problem
    assert "attention stage (sparse_mla_attention)" in real.problems[2].problem
    assert '"ops": "reference"' in real.problems[1].fix


def test_an_extension_lacking_ops_is_an_error_naming_exactly_those(on_npu):
    plan = select_ops(extension=extension(fused.LIM_KERNEL, fused.COPY_SFA_KERNEL))
    [problem] = plan.problems
    assert fused.REGISTER_HOST_KERNEL in problem.problem and "Copy-SFA" in problem.problem
    assert "LIM (" not in problem.problem  # LIM is there
    c8 = select_ops(indexer_dtype="int8", extension=extension(fused.LIM_KERNEL))
    text = c8.problems[0].problem
    assert all(k in text for k in (fused.LIM_C8_KERNEL, fused.COPY_SFA_KERNEL, fused.REGISTER_HOST_KERNEL))
    assert BUILD in c8.problems[0].fix


@pytest.mark.parametrize("setting", [None, False])
def test_cpu_with_ops_reference_is_never_fused(setting):
    for ext in (None, extension(*ALL_KERNELS)):
        plan = select_ops("cpu", ops="reference", fused_lim=setting, fused_copy_sfa=setting, extension=ext).check()
        assert not plan.indexer.fused and not plan.attention.fused
    auto = select_ops("cpu", extension=extension(*ALL_KERNELS)).check()  # no fused default off the NPU
    assert not auto.attention.fused and "off the NPU" in auto.attention.reason
    assert not select_ops("cuda", extension=extension(*ALL_KERNELS)).attention.fused


def test_fused_off_the_npu_only_where_the_platform_has_the_rung(monkeypatch):
    plan = select_ops("cpu", fused_copy_sfa=True, extension=None)
    assert [p.rule for p in plan.problems] == ["sparse_decode.fused_device"]
    assert "no fused rung on cpu" in plan.problems[0].problem
    without_model(monkeypatch)
    real = select_ops("cpu", ops="fused")  # this machine's registry, the functional model not buildable
    assert [p.rule for p in real.problems] == ["sparse_decode.fused_device"]
    assert "no C++ compiler (g++)" in real.problems[0].problem
    assert "g++" in real.problems[0].fix and BUILD in real.problems[0].fix
    built = select_ops("cpu", ops="fused", extension=extension(*ALL_KERNELS)).check()  # the CPU rung exists
    assert built.indexer.fused and built.attention.fused
    assert [p.rule for p in select_ops("cuda", fused_copy_sfa=True, extension=None).problems] == [
        "sparse_decode.fused_device"
    ]


def test_the_engine_layout_and_the_caller_decide_only_defaults():
    ext = extension(*ALL_KERNELS)
    verify = select_ops("npu", rows_per_request=2, extension=ext).check()  # verify rows: fused, up to 14
    assert verify.attention.fused and verify.indexer.fused
    assert select_ops("npu", rows_per_request=14, extension=ext).check().attention.fused
    shared = select_ops("npu", rows_per_request=15, extension=ext).check()
    assert not shared.attention.fused and shared.attention.source == "engine"
    assert "verify rows" in shared.attention.reason and "at most 14" in shared.attention.reason
    assert not shared.indexer.fused and "at most 14" in shared.indexer.reason
    gather = select_ops("npu", tensor_pool=False, extension=ext).check()
    assert not gather.attention.fused and "tensor view" in gather.attention.reason
    for explicit in (dict(fused_copy_sfa=True), dict(ops="fused")):
        plan = select_ops("npu", rows_per_request=15, extension=ext, **explicit)
        assert [p.rule for p in plan.problems] == ["sparse_decode.fused_copy_sfa_engine"]
    served = select_ops("npu", indexer_wired=False, extension=ext).check()
    assert not served.indexer.fused and served.indexer.source == "consumer" and served.attention.fused
    assert not select_ops("npu", ops="fused", indexer_wired=False, extension=ext).check().indexer.fused
    refused = select_ops("npu", fused_lim=True, indexer_wired=False, extension=ext)
    assert [p.rule for p in refused.problems] == ["sglang.fused_not_wired"]


def test_every_problem_rule_is_registered():
    from sglang_ascend_offload.rules import RULES

    plans = [
        select_ops("npu", extension=None),
        select_ops("cpu", ops="fused", extension=None),
        select_ops(
            "npu", fused_copy_sfa=True, rows_per_request=15, fused_lim=True, indexer_wired=False, extension=None
        ),
    ]
    rules = {p.rule for plan in plans for p in plan.problems}
    assert rules == {
        "sglang.fused_unavailable",
        "sparse_decode.fused_device",
        "sparse_decode.fused_copy_sfa_engine",
        "sglang.fused_not_wired",
    }
    assert rules <= set(RULES)
    assert len(plans[2].problems) == 3  # every problem, not the first


# ------------------------------------------------------------------ the engine follows its plan
def _counting_stand_in(monkeypatch):
    """A usable ``fused`` Copy-SFA rung (the reference composition) that counts its calls."""
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(1)
        return fused.copy_sparse_flash_attention(*args, **kwargs)

    monkeypatch.setitem(
        _REGISTRY.impls,
        ("copy_sparse_flash_attention", "fused"),
        OpImpl("copy_sparse_flash_attention", "fused", stand_in, lambda: None),
    )
    ref_copy = registry.implementations("copy_miss_rows")["reference"]  # ops=fused's separate copy
    monkeypatch.setitem(_REGISTRY.impls, ("copy_miss_rows", "fused"), dataclasses.replace(ref_copy, rung="fused"))
    return calls


def _forced(monkeypatch, **settings):
    """Make the engine's plan the one of ``settings`` (on the engine's platform); records the plans."""
    real, plans = op_selection.select_ops, []

    def select(platform_kind, **kw):
        kw.update(settings)
        plans.append(real(platform_kind, **kw))
        return plans[-1]

    monkeypatch.setattr(op_selection, "select_ops", select)
    return plans


def test_the_engine_step_runs_fused_copy_sfa_when_its_plan_says_so(monkeypatch):
    """ops=reference on the engine, a plan that says fused: every layer step is the fused op
    (and still equals attention over the full KV)."""
    registry.ensure_registered()
    calls = _counting_stand_in(monkeypatch)
    plans = _forced(monkeypatch, ops="fused")
    stats = run_against_full_kv("lru", 6, seed=3, ops="reference")
    assert plans and plans[-1].attention.fused
    assert stats.steps == 6 and len(calls) == 6 * CPU_DIMS.layers


def test_the_engine_step_runs_the_separate_ops_when_its_plan_says_so(monkeypatch):
    """ops=fused on the engine with a usable fused rung, a plan that says separate: the
    fused op is never called."""
    registry.ensure_registered()
    calls = _counting_stand_in(monkeypatch)
    plans = _forced(monkeypatch, fused_copy_sfa=False)
    run_against_full_kv("lru", 6, seed=3, ops="fused")
    assert plans and not plans[-1].attention.fused and calls == []


def test_no_other_engine_code_path_chooses_copy_sfa():
    source = inspect.getsource(engine_mod)
    tree = ast.parse(source)
    assigned = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "_copy_sfa_op" for t in node.targets)
    ]
    assert len(assigned) == 1 and "_choose_copy_sfa" in ast.unparse(assigned[0].value)
    chooser = inspect.getsource(SparseDecodeEngine._choose_copy_sfa)
    assert "op_selection.select_ops(" in chooser and "registry.select(" not in chooser
    assert 'select("copy_sparse_flash_attention"' not in source


def _engine(pool, **kw):
    config = dict(layers=1, rows=2, hot_tokens=8, top_k=4, latent_dim=16, rope_dim=8, dtype=torch.float32)
    config.update(kw)
    return SparseDecodeEngine(EngineConfig(**config), pool, device="cpu")


def test_engine_errors_name_the_rule_and_false_is_honoured(monkeypatch):
    pool = HostKVPool.allocate(HostPoolShape(1, 64, 16, 8, torch.float32), "pinned")
    without_model(monkeypatch)
    with pytest.raises(OpSelectionError, match="sparse_decode.fused_device.*g\\+\\+"):
        _engine(pool, ops="reference", fused_copy_sfa=True)  # no fused rung on this CPU
    no_model(monkeypatch)
    _counting_stand_in(monkeypatch)
    assert _engine(pool, ops="fused")._copy_sfa_op is not None
    assert _engine(pool, ops="fused", fused_copy_sfa=False)._copy_sfa_op is None
    assert _engine(pool, ops="auto")._copy_sfa_op is None  # no fused default off the NPU
    assert _engine(pool, ops="fused", hot_tokens=8, rows_per_request=2)._copy_sfa_op is not None  # verify rows
    with pytest.raises(OpSelectionError, match="fused_copy_sfa_engine.*verify rows share"):
        _engine(pool, ops="fused", hot_tokens=60, rows_per_request=15)
    assert _engine(pool, ops="fused", fused_copy_sfa=False, rows_per_request=15, hot_tokens=60).plan.problems == ()


# ------------------------------------------------------------------ host pool rows for the fused path
def test_host_pool_rows_are_rounded_to_4kib_aligned_layer_slices():
    from sglang_ascend_offload import config as cfg

    assert op_selection.host_rows_alignment(576 * 2) == 32  # DeepSeek-V3.2: 512 + 64 bf16 columns
    assert (
        op_selection.fused_host_pool_rows(1000, 1152) == 1024 and op_selection.fused_host_pool_rows(1024, 1152) == 1024
    )
    sd = cfg.SparseDecodeOffloadConfig
    assert op_selection.host_pool_rows(sd(), 1000, 1152, "npu") == 1024  # NPU default: fused Copy-SFA
    assert op_selection.host_pool_rows(sd(ops="fused"), 1000, 1152, "npu") == 1024
    # the separate ops with the fused miss copy (ops=auto's first rung on an NPU) register the layers too
    assert op_selection.host_pool_rows(sd(fused_copy_sfa=False), 1000, 1152, "npu") == 1024
    assert op_selection.host_pool_rows(sd(ops="npu"), 1000, 1152, "npu") == 1000  # torch_npu only: no registration
    assert op_selection.host_pool_rows(sd(), 1000, 1152, "cpu") == 1000  # ops=auto on CPU: separate ops
    assert op_selection.host_pool_rows(sd(ops="fused"), 1000, 1152, "cpu") == 1024  # the functional model's rule
    assert op_selection.host_pool_rows(sd(), 1000, 1152, "npu", rows_per_request=2) == 1024  # verify rows: fused
    assert op_selection.host_pool_rows(sd(), 1000, 1152, "npu", rows_per_request=15) == 1024  # the fused copy
    assert op_selection.host_pool_rows(sd(ops="npu"), 1000, 1152, "npu", rows_per_request=15) == 1000


def test_the_engine_refuses_an_unaligned_pool_for_the_npu_fused_copy_sfa(monkeypatch):
    """What the extension's host code would refuse at the first decode (layer 1's slice)
    is refused when the engine is built."""
    _counting_stand_in(monkeypatch)
    real = op_selection.select_ops

    def as_npu(platform_kind, **kw):  # the separate ops on the reference rung: no torch_npu here
        return real("npu", **dict(kw, ops="reference", fused_copy_sfa=True, extension=extension(*ALL_KERNELS)))

    monkeypatch.setattr(op_selection, "select_ops", as_npu)
    row_bytes = (16 + 8) * 4
    align = op_selection.host_rows_alignment(row_bytes)
    odd = HostKVPool.allocate(HostPoolShape(2, align + 8, 16, 8, torch.float32), "pinned")
    with pytest.raises(ValueError, match=f"multiple of {align} rows"):
        _engine(odd, layers=2)
    aligned = HostKVPool.allocate(
        HostPoolShape(2, op_selection.fused_host_pool_rows(align + 8, row_bytes), 16, 8, torch.float32), "pinned"
    )
    assert _engine(aligned, layers=2).plan.attention.fused


def test_shapes_outside_the_kernels_limits_give_way_or_are_refused():
    """DeepSeek-V3.2 with SGLang's default MTP (4 verify rows, top-k 2048) and a hot buffer
    of 4 x 2048 = 8192 slots (what the old rule asked) is outside the kernels' 4096-slot
    residency step: the NPU defaults give way to the separate operators with that reason,
    and an explicit request is a startup problem; at the default 4096 slots (a union beyond
    them overflows) and with one draft token (2 rows, 4096 slots) both stages are fused."""
    ext = extension(*ALL_KERNELS)
    one_draft = select_ops("npu", rows_per_request=2, hot_tokens=4096, top_k=2048, extension=ext).check()
    assert one_draft.indexer.fused and one_draft.attention.fused
    mtp3 = select_ops("npu", rows_per_request=4, hot_tokens=4096, top_k=2048, extension=ext).check()
    assert mtp3.indexer.fused and mtp3.attention.fused
    mtp = select_ops("npu", rows_per_request=4, hot_tokens=8192, top_k=2048, extension=ext).check()
    assert not mtp.indexer.fused and "hot_tokens 8192" in mtp.indexer.reason
    assert mtp.attention.fused  # Copy-SFA has no hot-buffer limit of its own: it stays fused
    explicit = select_ops("npu", fused_lim=True, rows_per_request=4, hot_tokens=8192, top_k=2048, extension=ext)
    assert [p.rule for p in explicit.problems] == ["sglang.fused_not_wired"]
    odd_k = select_ops("npu", fused_copy_sfa=True, hot_tokens=256, top_k=64, extension=ext)
    assert [p.rule for p in odd_k.problems] == ["sparse_decode.fused_copy_sfa_engine"]
    assert "top-k 64" in odd_k.problems[0].problem
    assert select_ops("npu", hot_tokens=256, top_k=64, extension=ext).check().indexer.fused  # LIM takes K = 64


# ----------------------------------------------------------------- each stage's rung
SEPARATE = {"lightning_indexer", "residency_manage", "copy_miss_rows", "sparse_mla_attention"}


@pytest.mark.parametrize("ops", ["auto", "npu", "fused", "triton"])
def test_on_an_npu_no_stage_runs_the_torch_reference_unless_asked_for(on_npu, ops):
    """Every stage of a decode step on an NPU has a rung, and it is never the reference:
    what an ``ops`` rung lacks runs on the torch_npu rung, named as such."""
    plan = select_ops(ops=ops, policy="lru_k2", extension=extension(*ALL_KERNELS)).check()
    assert {r.op for r in plan.rungs} == SEPARATE
    assert all(r.rung not in (None, "reference") for r in plan.rungs), plan.describe()
    for stage, op, rung, via in plan.decode_stages():
        assert rung != "reference", (stage, op)
    asked = select_ops(ops="reference", policy="lru_k2", extension=extension(*ALL_KERNELS)).check()
    assert {r.rung for r in asked.rungs} == {"reference"}  # ops=reference: the torch reference, as asked


def test_ops_fused_where_the_fused_lim_gives_way_runs_the_torch_npu_indexer(on_npu, fresh_log, caplog):
    """``ops: fused`` with a policy the fused LIM does not implement: the indexer stage is
    separate, and its ``lightning_indexer`` runs on the torch_npu rung -- in the plan, its
    description and the log (it was the dense torch reference, silently)."""
    plan = select_ops(ops="fused", policy="lru_k2", extension=extension(*ALL_KERNELS)).check()
    assert not plan.indexer.fused and plan.attention.fused
    assert plan.rung("lightning_indexer").rung == "npu"
    assert plan.rung("lightning_indexer").reason == "ops=fused has no lightning_indexer: the npu rung runs it"
    assert plan.decode_stages()[:2] == (
        ("indexer", "lightning_indexer", "npu", ""),
        ("residency", "residency_lru_k2", "npu", ""),  # the policy's own step, on the device
    )
    assert plan.rung("residency_manage").rung == "npu"  # the ladder op (lru's; a guarded policy's ghost)
    with caplog.at_level(logging.INFO, logger=op_selection.__name__):
        op_selection.log_plan(plan)
    assert "indexer: lightning_indexer[npu] + residency_lru_k2[npu]" in caplog.text
    assert "policy lru_k2: its torch composition (torch_npu's kernels on the NPU" in caplog.text
    assert "lightning_indexer: ops=fused has no lightning_indexer: the npu rung runs it" in caplog.text


def test_a_stage_without_an_npu_rung_is_a_startup_error_saying_what_to_set(on_npu, monkeypatch):
    """An op with no rung an NPU may run (here the miss copy, its npu and triton rungs taken
    away): the plan refuses it and says what to set; nothing is substituted."""
    registry.ensure_registered()
    monkeypatch.delitem(_REGISTRY.impls, ("copy_miss_rows", "npu"))
    monkeypatch.delitem(_REGISTRY.impls, ("copy_miss_rows", "triton"))
    plan = select_ops(ops="npu", fused_copy_sfa=False, extension=extension(*ALL_KERNELS))
    [problem] = plan.problems
    assert problem.rule == "sglang.ops_unavailable"
    assert "the miss_copy stage (copy_miss_rows) has no usable npu rung" in problem.problem
    assert '"ops": "reference"' in problem.fix
    assert plan.rung("copy_miss_rows").rung is None
    with pytest.raises(OpSelectionError, match="sglang.ops_unavailable"):
        plan.impl("copy_miss_rows")
    with pytest.raises(OpSelectionError, match="miss_copy stage"):
        plan.check()


def test_off_the_npu_a_missing_rung_gives_way_to_the_reference_by_name():
    """On CPU / CUDA the reference is the only other rung of the ops Triton lacks: the plan
    names it (and why), the registry itself substitutes nothing."""
    plan = select_ops("cuda", ops="triton", extension=None)
    attention = plan.rung("sparse_mla_attention")
    assert attention.rung == "reference"
    assert (
        attention.reason
        == "ops=triton has no sparse_mla_attention: the reference rung runs it (no other rung implements it on cuda)"
    )
    assert plan.rung("residency_manage").rung == plan.rung("copy_miss_rows").rung == "triton"
    with pytest.raises(registry.OpUnavailableError, match="has no 'triton' implementation"):
        registry.select("sparse_mla_attention", "triton")
