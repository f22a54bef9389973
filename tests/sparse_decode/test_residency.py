"""Residency manager: the reference equals the contract; invariants for every policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ascend_offload.ops import registry
from sglang_ascend_offload.ops.contract import ResidencyTable
from sglang_ascend_offload.ops.residency import residency_manage
from sglang_ascend_offload.sparse_decode.policies import (
    DEFAULT_POLICY,
    POLICIES,
    GuardedManager,
    LRUManager,
    make_manager,
)

from .contract_model import RowModel, model_step

HYP = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw):
    """A few rows over a few steps: request churn, idle rows, speculative suffixes."""
    rows = draw(st.integers(1, 3))
    k = draw(st.integers(1, 5))
    hot = k + draw(st.integers(0, 4))
    universe = draw(st.integers(k, 14))
    steps = draw(st.integers(1, 24))
    reqs = [draw(st.sampled_from([-1, 0, 1])) for _ in range(rows)]
    out = []
    for _ in range(steps):
        topk = np.full((rows, k), -1, dtype=np.int32)
        stable = np.zeros(rows, dtype=np.int32)
        for r in range(rows):
            if draw(st.integers(0, 7)) == 0:
                reqs[r] = draw(st.sampled_from([-1, 0, 1, 2, 3]))
            stable[r] = draw(st.integers(0, universe))
            if reqs[r] == -1:
                continue
            pos = draw(st.lists(st.integers(0, universe - 1), unique=True, max_size=k))
            row = pos + [-1] * (k - len(pos))
            topk[r] = draw(st.permutations(row))
        out.append((topk, np.array(reqs, dtype=np.int64), stable))
    return hot, out


def _tensors(topk, req, stable):
    return torch.from_numpy(topk), torch.from_numpy(req), torch.from_numpy(stable)


@HYP
@given(scenarios())
def test_reference_equals_the_contract_model(scn):
    """State and every output of residency_manage == a literal loop-by-loop model."""
    hot, steps = scn
    rows, k = steps[0][0].shape
    table = ResidencyTable.empty(rows, hot)
    models = [RowModel(hot) for _ in range(rows)]
    for step, (topk, req, stable) in enumerate(steps):
        out = residency_manage(table.slot_token, table.slot_stamp, table.row_req, *_tensors(topk, req, stable), step)
        for r in range(rows):
            hit, slots, mt, ms = model_step(models[r], topk[r].tolist(), int(req[r]), int(stable[r]), step)
            assert out.hit_mask[r].tolist() == hit
            assert out.slots[r].tolist() == slots
            assert out.miss_tokens[r].tolist() == mt
            assert out.miss_slots[r].tolist() == ms
            assert int(out.miss_count[r]) == sum(1 for x in mt if x != -1)
            assert table.slot_token[r].tolist() == models[r].token
            assert table.slot_stamp[r].tolist() == models[r].stamp
            assert int(table.row_req[r]) == models[r].req
        assert out.slots.dtype == out.miss_tokens.dtype == out.miss_slots.dtype == out.miss_count.dtype == torch.int32
        assert out.hit_mask.dtype == torch.bool


def test_registered_reference_op_is_the_contract_function():
    registry.ensure_registered()
    registry.ensure_registered()  # idempotent
    assert registry.select("residency_manage", "reference").fn is residency_manage
    from sglang_ascend_offload.ops.residency import copy_miss_rows

    assert registry.select("copy_miss_rows", "reference").fn is copy_miss_rows


def _check_invariants(table_before, table, topk, req, stable, out):
    rows, k = topk.shape
    for r in range(rows):
        toks = [t for t in table.slot_token[r].tolist() if t >= 0]
        assert len(toks) == len(set(toks)), "a position is held by two slots"
        valid = [(j, int(p)) for j, p in enumerate(topk[r].tolist()) if p != -1 and req[r] != -1]
        for j, pos in valid:  # every selected position is resident where the remap says
            assert int(table.slot_token[r, out.slots[r, j]]) == pos
        for j in range(k):
            if topk[r, j] == -1 or req[r] == -1:
                assert int(out.slots[r, j]) == -1 and not bool(out.hit_mask[r, j])
        hit_slots = {int(out.slots[r, j]) for j in range(k) if out.hit_mask[r, j]}
        n = int(out.miss_count[r])
        victims = out.miss_slots[r, :n].tolist()
        assert not hit_slots & set(victims), "a slot hit in this step was evicted"
        assert len(set(victims)) == len(victims)
        assert n == len(valid) - len(hit_slots)
        for j, pos in valid:  # speculative positions never hit
            if pos >= stable[r]:
                assert not bool(out.hit_mask[r, j])
        if req[r] != table_before.row_req[r]:  # reset on request change: nothing carried over
            assert not bool(out.hit_mask[r].any())
            kept = set(table.slot_token[r].tolist()) - {-1}
            assert kept == {pos for _, pos in valid}
        for j, pos in valid:  # hits really were resident before the step
            if out.hit_mask[r, j]:
                assert pos in table_before.slot_token[r].tolist()


@pytest.mark.parametrize("policy", sorted(p for p in POLICIES if not POLICIES[p].needs_ranked))
@HYP
@given(scn=scenarios())
def test_invariants_hold_for_every_policy(policy, scn):
    """(The score-aware policies, which also need a ranking, in test_score_rank.py.)"""
    hot, steps = scn
    rows, _ = steps[0][0].shape
    mgr = make_manager(policy, rows, hot)
    for step, (topk, req, stable) in enumerate(steps):
        before = mgr.table.clone()
        out = mgr.step(*_tensors(topk, req, stable), step)
        _check_invariants(before, mgr.table, topk, req, stable, out)


def _misses_per_request(mgr, steps):
    """Cumulative misses per (row, request segment) after every step."""
    totals, seen = [], {}
    rows = steps[0][0].shape[0]
    seg = [0] * rows
    last = [None] * rows
    for step, (topk, req, stable) in enumerate(steps):
        out = mgr.step(*_tensors(topk, req, stable), step)
        snap = {}
        for r in range(rows):
            if last[r] != int(req[r]):
                seg[r] += 1
                last[r] = int(req[r])
            key = (r, seg[r])
            seen[key] = seen.get(key, 0) + int(out.miss_count[r])
            snap[key] = seen[key]
        totals.append(snap)
    return totals


@pytest.mark.parametrize("policy", sorted({DEFAULT_POLICY, "lru_k2_guarded"}))
@HYP
@given(scn=scenarios())
def test_policy_bounded_by_lru(policy, scn):
    """The default and the guarded policy never exceed exact LRU's misses beyond their budget.

    Per request and at every step: ``misses <= lru + seed + lru >> slack_shift``
    (``policies.GuardedManager``). For the LRU default the bound is equality.
    """
    hot, steps = scn
    rows, _ = steps[0][0].shape
    lru = _misses_per_request(LRUManager(rows, hot), steps)
    mgr = make_manager(policy, rows, hot)
    ours = _misses_per_request(mgr, steps)
    seed = getattr(mgr, "seed", 0)
    shift = getattr(mgr, "slack_shift", None)
    for lru_snap, our_snap in zip(lru, ours):
        for key, m_lru in lru_snap.items():
            slack = seed + (m_lru >> shift if shift is not None else 0)
            assert our_snap[key] <= m_lru + slack


@HYP
@given(scenarios())
def test_guard_without_budget_never_misses_more_than_lru(scn):
    """With no budget the guard pins the policy to LRU's misses, at every step."""
    hot, steps = scn
    rows, _ = steps[0][0].shape
    lru = _misses_per_request(LRUManager(rows, hot), steps)
    guarded = _misses_per_request(GuardedManager(rows, hot, seed=0, slack_shift=None), steps)
    assert guarded == lru


def _run_single_row(mgr, seq, hot_check=None):
    misses = 0
    for step, pos in enumerate(seq):
        topk = torch.tensor([[pos]], dtype=torch.int32)
        out = mgr.step(topk, torch.tensor([7]), torch.tensor([10_000], dtype=torch.int32), step)
        misses += int(out.miss_count.sum())
    return misses


def test_an_unguarded_policy_can_lose_to_lru_and_the_guard_bounds_it():
    """a a b c b c ... with 2 slots: LRU-2 keeps the twice-used ``a`` and thrashes."""
    seq = [0, 0] + [1, 2] * 20
    lru = _run_single_row(LRUManager(1, 2), seq)
    lru2 = _run_single_row(make_manager("lru_k2", 1, 2), seq)
    guarded = GuardedManager(1, 2, seed=4, slack_shift=None)
    g = _run_single_row(guarded, seq)
    assert lru == 3
    assert lru2 > lru + 30
    assert lru < g <= lru + 4


def test_lru2_beats_lru_when_reuse_frequency_matters():
    """A position used twice, then every 3 steps among one-off noise, with 2 slots:
    LRU evicts it every time, LRU-2 keeps it (second-to-last use beats "used once")."""
    seq = [0, 0]
    noise = 100
    for _ in range(30):
        seq += [noise, noise + 1, 0]
        noise += 2
    lru = _run_single_row(LRUManager(1, 2), seq)
    lru2 = _run_single_row(make_manager("lru_k2", 1, 2), seq)
    guarded = _run_single_row(make_manager("lru_k2_guarded", 1, 2), seq)
    assert lru == 1 + 90
    assert lru2 == 1 + 60
    assert guarded == lru2


def test_hot_smaller_than_topk_is_rejected():
    t = ResidencyTable.empty(1, 2)
    with pytest.raises(ValueError, match="hot_tokens 2 < top_k 3"):
        residency_manage(
            t.slot_token,
            t.slot_stamp,
            t.row_req,
            torch.zeros((1, 3), dtype=torch.int32),
            torch.tensor([0]),
            torch.tensor([5], dtype=torch.int32),
            0,
        )
    with pytest.raises(ValueError, match="unknown residency policy"):
        make_manager("nope", 1, 2)


def test_find_slots_dense_and_sorted_paths_agree(monkeypatch):
    """The lookup's two paths give the same slots; the sorted one keeps memory bounded
    when positions approach the int32 limit (a dense map there would need gigabytes)."""
    from sglang_ascend_offload.ops import residency as res

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        rows, hot, k = 3, 8, 5
        slot_token = torch.full((rows, hot), -1, dtype=torch.int32)
        for r in range(rows):
            n = int(torch.randint(0, hot + 1, (1,), generator=g))
            slot_token[r, torch.randperm(hot, generator=g)[:n]] = torch.randperm(50, generator=g)[:n].to(torch.int32)
        queries = torch.randint(-1, 50, (rows, k), generator=g, dtype=torch.int32)
        dense = res.find_slots(slot_token, queries, max_position=49)
        assert torch.equal(res.find_slots(slot_token, queries), dense)  # no bound: sorted search
        monkeypatch.setattr(res, "DENSE_MAP_LIMIT", 0)
        assert torch.equal(res.find_slots(slot_token, queries, max_position=49), dense)
        monkeypatch.undo()
        for r in range(rows):
            for j in range(k):
                q, s = int(queries[r, j]), int(dense[r, j])
                assert (s >= 0) == (q >= 0 and q in slot_token[r].tolist())
                assert s < 0 or int(slot_token[r, s]) == q
    top = 2**31 - 1
    far = torch.tensor([[top - 1, 3, -1, -1]], dtype=torch.int32)
    assert res.find_slots(far, torch.tensor([[top - 1, 3, top, 0]], dtype=torch.int32)).tolist() == [[0, 1, -1, -1]]
