"""Belady's rule is the optimum: equal to exhaustive search on tiny traces, <= every policy."""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ascend_offload.sparse_decode.belady import NEVER, BeladyManager, next_use_table
from sglang_ascend_offload.sparse_decode.policies import POLICIES
from sglang_ascend_offload.sparse_decode.replay import simulate_policy
from sglang_ascend_offload.sparse_decode.trace import SyntheticTraceSpec, Trace, synthesize


def _brute_force_min_misses(sets, hot):
    """Minimum misses over every eviction choice (one row, one request)."""

    @lru_cache(maxsize=None)
    def best(t, cache):
        if t == len(sets):
            return 0
        need = frozenset(sets[t])
        misses = len(need - cache)
        union = cache | need
        if len(union) <= hot:
            return misses + best(t + 1, union)
        extra = sorted(cache - need)
        keep = hot - len(need)
        return misses + min(best(t + 1, need | frozenset(c)) for c in itertools.combinations(extra, keep))

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_belady_equals_exhaustive_search(data):
    k = data.draw(st.integers(1, 3))
    hot = k + data.draw(st.integers(0, 2))
    steps = data.draw(st.integers(1, 9))
    sets = [data.draw(st.lists(st.integers(0, 6), unique=True, min_size=1, max_size=k)) for _ in range(steps)]
    topk = np.full((steps, 1, 1, k), -1, dtype=np.int32)
    for t, s in enumerate(sets):
        topk[t, 0, 0, : len(s)] = s
    trace = Trace(topk, np.full((steps, 1), 10, dtype=np.int32), np.zeros((steps, 1), dtype=np.int64))
    assert simulate_policy(trace, "belady", hot).misses == _brute_force_min_misses(tuple(map(tuple, sets)), hot)


def test_next_use_is_per_row_and_request():
    topk = np.array([[[[5, -1]], [[5, 6]]], [[[6, 5]], [[5, -1]]], [[[5, -1]], [[6, -1]]]], dtype=np.int32)
    topk = topk.reshape(3, 1, 2, 2)  # steps 3, layers 1, rows 2, k 2
    reqs = np.array([[0, 1], [0, 2], [0, 2]], dtype=np.int64)  # row 1 changes request at step 1
    nu = next_use_table(topk, reqs)
    assert nu[0, 0, 0].tolist() == [1, -1]  # position 5, row 0: next at step 1
    assert nu[1, 0, 0].tolist() == [NEVER, 2]
    assert nu[0, 0, 1].tolist() == [NEVER, NEVER]  # row 1's request 1 ends after step 0
    assert nu[1, 0, 1].tolist() == [NEVER, -1]


def test_belady_is_a_lower_bound_for_every_policy_and_capacity():
    trace = synthesize(
        SyntheticTraceSpec(
            steps=60,
            layers=2,
            rows=3,
            top_k=16,
            min_prompt=8,
            max_prompt=200,
            min_decode=5,
            max_decode=40,
            noise_skew=1.0,
            seed=5,
        )
    )
    for hot in (16, 24, 40):
        opt = simulate_policy(trace, "belady", hot).misses
        for policy in (p for p in POLICIES if not POLICIES[p].needs_ranked):  # ranked ones: test_score_rank.py
            assert opt <= simulate_policy(trace, policy, hot).misses
    # capacity top_k: every policy equals the top-k cache (nothing to choose)
    cache = {simulate_policy(trace, p, 16).misses for p in POLICIES if not POLICIES[p].needs_ranked}
    assert len(cache) == 1


def test_belady_manager_needs_the_future():
    mgr = BeladyManager(1, 2)
    try:
        mgr.step(torch.tensor([[1]], dtype=torch.int32), torch.tensor([0]), torch.tensor([5], dtype=torch.int32), 0)
    except RuntimeError as exc:
        assert "set_next_use" in str(exc)
    else:
        raise AssertionError("expected an error")
