"""Kernel qualification (``ops/qualify.py``) with the AscendC kernels on their CPU
functional model: the function a server calls before it accepts requests.

* the real kernels qualify, for every fused op a plan can select (LIM, LIM-C8,
  Copy-SFA; one verify row per request and several), and the problem exercised what it
  claims (first fill, hits, misses, evictions);
* the problem's selection is unique: every candidate score of a query token is distinct
  and exact, so the fused and separate top-k must agree element by element (a problem
  with a tie is detected by the same check: negative control);
* a planted faulty kernel -- a mutated kernel source built on the functional model, as
  ``check-kernels``' mutation tests do -- stops startup: one faulty LIM (victim tie order
  reversed) and one faulty Copy-SFA (the rope part gathered from the latent's offset),
  each a :class:`KernelQualificationError` naming the op, the shape, the first differing
  element with both values and the fix; the other op of the plan still qualifies;
* a fused op that raises fails its qualification; ``qualify_kernels: false`` runs
  nothing and says so; a plan without fused ops runs nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch
from kernel_mutations import (
    COPY_SFA_ROPE_OFFSET,
    LIM_VICTIM_ORDER,
    fused_ops_from,
    mutated_library,
    registration_left_as_found,
)

from sglang_ascend_offload.ops import fused, qualify, registry
from sglang_ascend_offload.ops.qualify_problem import STEPS, Problem, ServedShape
from sglang_ascend_offload.sparse_decode.op_selection import select_ops

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the AscendC functional model")

TINY = dict(hot_tokens=256, top_k=128, page_size=64, index_heads=8, heads=4)


@pytest.fixture(autouse=True, scope="module")
def _fused_ops_left_as_found():
    with registration_left_as_found():
        yield


def _plan(shape: ServedShape):
    return select_ops(
        "cpu",
        ops="fused",
        indexer_dtype=shape.indexer_dtype,
        rows_per_request=shape.rows_per_request,
        hot_tokens=shape.hot_tokens,
        top_k=shape.top_k,
    ).check()


# ------------------------------------------------------------------ the real kernels
@pytest.mark.parametrize(
    "shape",
    [
        ServedShape(**TINY),
        ServedShape(**TINY, indexer_dtype="int8"),
        ServedShape(**{**TINY, "hot_tokens": 384, "index_heads": 16, "heads": 16}, rows_per_request=3),
        # plain decode's 2 x top-k for 4 verify rows: the union may overflow (W = min(n x K, Hh) = 256)
        ServedShape(**TINY, rows_per_request=4),
    ],
    ids=["lim-bf16", "lim-c8", "verify-rows-3", "verify-rows-4-at-2k"],
)
def test_the_real_kernels_qualify_on_the_functional_model(shape, caplog):
    plan = _plan(shape)
    with caplog.at_level(logging.INFO, logger="sglang_ascend_offload.ops.qualify"):
        results = qualify.qualify_at_startup(plan, shape)
    labels = ["LIM-C8" if shape.indexer_dtype == "int8" else "LIM", "Copy-SFA"]
    assert [r.label for r in results] == labels
    for r in results:
        assert r.qualified and r.difference is None and r.steps == STEPS and r.seconds > 0, r
        cov = r.coverage
        assert cov["first_fill_rows"] == 1 and cov["hits"] > 0 and cov["misses"] > 0 and cov["evictions"] > 0, cov
        assert "reference" in r.against
    sfa = results[1]
    assert 0 < sfa.max_abs_err <= fused.ATTENTION_ATOL
    text = caplog.text
    assert f"kernel qualification: {', '.join(labels)} qualified in" in text
    assert shape.describe() in text


def _scores(problem: Problem, inp, token: int):
    """float64 scores of one query token over its visible positions (what the indexers
    compute: sum over heads of weight x relu(q . k)), and those positions."""
    s, n = problem.shape, problem.shape.rows_per_request
    req, i = divmod(token, n)
    visible = int(inp.kv_len[req]) - n + i + 1
    pos = torch.arange(visible)
    blocks = problem.block_table[req].long().cpu()[pos // s.page_size]
    keys = problem.key.reshape(-1, s.index_dim).double().cpu()[blocks * s.page_size + pos % s.page_size]
    q = inp.query[token].double().cpu()
    w = inp.weights[token].double().cpu()
    return (torch.relu(keys @ q.T) * w).sum(1), pos


@pytest.mark.parametrize("indexer_dtype", ["bf16", "int8"])
def test_the_problem_has_one_answer(indexer_dtype):
    problem = Problem(ServedShape(**TINY, indexer_dtype=indexer_dtype))
    for step in range(STEPS):
        inp = problem.step(step)
        for token in range(inp.query.shape[0]):
            scores, _ = _scores(problem, inp, token)
            positive = scores[scores > 0]
            assert positive.numel() >= problem.shape.top_k
            assert torch.unique(positive).numel() == positive.numel()  # no ties among candidates
            assert bool((positive == positive.round()).all()) and float(positive.max()) < 2**24  # exact in fp32
    # negative control: two candidates of one token given the same key row tie, and the check sees it
    inp = problem.step(0)
    scores, pos = _scores(problem, inp, 0)
    first, second = pos[scores > 0][:2].tolist()
    flat = problem.key.reshape(-1, problem.shape.index_dim)
    page = problem.shape.page_size
    rows = [int(problem.block_table[0, p // page]) * page + p % page for p in (first, second)]
    flat[rows[1]] = flat[rows[0]]
    scores, _ = _scores(problem, inp, 0)
    positive = scores[scores > 0]
    assert torch.unique(positive).numel() == positive.numel() - 1


def test_the_separate_top_k_is_compared_in_the_contracts_score_order():
    """The reference indexer already returns the contract's order (``in_score_order`` keeps
    it); a separate indexer returning the same set in another order (torch_npu's need not
    sort) is put back in that order, so only a wrong set or a wrong fused order differs."""
    problem = Problem(ServedShape(**TINY))
    inp = problem.step(0)
    topk = registry.select("lightning_indexer", "reference").fn(
        inp.query,
        problem.key,
        inp.weights,
        actual_seq_lengths_query=inp.cu,
        actual_seq_lengths_key=inp.kv_len,
        block_table=problem.block_table,
        sparse_count=problem.shape.top_k,
    )
    assert torch.equal(problem.in_score_order(topk), topk)
    shuffled = topk[:, :, torch.randperm(topk.shape[-1], generator=torch.Generator().manual_seed(3))]
    assert not torch.equal(shuffled, topk) and torch.equal(problem.in_score_order(shuffled), topk)


# ------------------------------------------------------------------ planted faults
def test_a_faulty_lim_stops_startup(tmp_path, caplog):
    shape = ServedShape(**TINY)
    with fused_ops_from(mutated_library(tmp_path, LIM_VICTIM_ORDER)), caplog.at_level(logging.INFO):
        with pytest.raises(qualify.KernelQualificationError) as err:
            qualify.qualify_at_startup(_plan(shape), shape)
    msg = str(err.value)
    assert "fused LIM (lightning_indexer_manage, kernel npu_fused_lightning_indexer_manage)" in msg
    assert shape.describe() in msg and f"of {STEPS}:" in msg
    assert "fused " in msg and ", separate " in msg  # both values of the first differing element
    assert '"fused_lim": false' in msg and "bash ascendc_ops/build.sh --install" in msg
    assert "Copy-SFA" not in msg  # the other op of the plan qualified
    (failed,) = err.value.failures
    diff = failed.difference
    assert diff.tensor in ("sparse_indices", "slots", "slot_token", "miss_slots") and diff.index, diff
    assert diff.fused != diff.separate and diff.count >= 1
    assert "DIFFERS FROM" in caplog.text


def test_a_faulty_copy_sfa_stops_startup(tmp_path):
    shape = ServedShape(**TINY, indexer_dtype="int8")
    with fused_ops_from(mutated_library(tmp_path, COPY_SFA_ROPE_OFFSET)):
        with pytest.raises(qualify.KernelQualificationError) as err:
            qualify.qualify_at_startup(_plan(shape), shape)
    msg = str(err.value)
    assert "fused Copy-SFA (copy_sparse_flash_attention, kernel npu_fused_scatter_copy_sparse_flash_attention)" in msg
    assert "attention output[" in msg and "tolerance 0.02 + 0.02 x |separate|" in msg
    assert '"fused_copy_sfa": false' in msg and "LIM-C8" not in msg
    (failed,) = err.value.failures
    assert failed.difference.step == 0 and failed.difference.count > 1


def test_a_fused_op_that_raises_fails_its_qualification(monkeypatch):
    shape = ServedShape(**TINY)
    plan = _plan(shape)
    real = qualify.registry.select

    def select(op, rung="auto"):
        impl = real(op, rung)
        if op == "copy_sparse_flash_attention" and rung == "fused":

            def broken(*args, **kwargs):
                raise RuntimeError("aclnn error 561103")

            return dataclasses.replace(impl, fn=broken)
        return impl

    monkeypatch.setattr(qualify.registry, "select", select)
    results = qualify.qualify_plan(plan, shape)
    assert [r.qualified for r in results] == [True, False]
    diff = results[1].difference
    assert diff.tensor == "the fused op raised" and "aclnn error 561103" in diff.note


def test_qualify_kernels_false_runs_nothing_and_warns(caplog, monkeypatch):
    shape = ServedShape(**TINY)
    monkeypatch.setattr(qualify, "qualify_plan", lambda *a, **k: pytest.fail("qualification ran"))
    with caplog.at_level(logging.WARNING, logger="sglang_ascend_offload.ops.qualify"):
        assert qualify.qualify_at_startup(_plan(shape), shape, enabled=False) == []
    assert "kernel qualification is off (qualify_kernels: false): the fused LIM, Copy-SFA serve" in caplog.text


def test_a_plan_without_fused_ops_runs_nothing(caplog):
    shape = ServedShape(**TINY)
    plan = select_ops("cpu", ops="reference", hot_tokens=256, top_k=128).check()
    with caplog.at_level(logging.INFO, logger="sglang_ascend_offload.ops.qualify"):
        assert qualify.qualify_at_startup(plan, shape) == [] and qualify.qualify_plan(plan, shape) == []
    assert caplog.text == ""


def test_a_shape_the_problem_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="must hold one row's top-k"):
        ServedShape(hot_tokens=64, top_k=128, rows_per_request=2)
    assert ServedShape(hot_tokens=128, top_k=128, rows_per_request=2).union_width == 128  # the rest overflows
