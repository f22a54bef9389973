"""The overflow area: a verify round whose union exceeds the request's hot buffer is exact.

A request's ``n`` verify rows share ``H`` hot slots (``H >= K``, possibly ``< n * K``).
Random rounds whose unions are larger than ``H`` run through the engine on every policy
and implementation (torch reference; the CPU kernels of ``lru``, ``score_rank`` and
``score_rank_guarded``; the Triton rung of ``lru`` and ``score_rank`` through the
interpreter); after every layer step each query row's attention must ``torch.equal``
the same attention over the full host KV with its logical top-k, and the overflow
counters must count what overflowed (``sparse_decode/overflow.py``). Candidate positions
(``>= committed length``) are rewritten in the host pool every round, as a verify
forward rewrites them, so a stale overflow or resident copy would show.

The negative control drops the overflow entries (attention over the resident part only):
the same check fails. The step with overflow also traces under
``torch.compile(fullgraph=True)`` equal to eager (no host branch on whether it overflows).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ascend_offload.ops import registry
from sglang_ascend_offload.ops.request_union import union_of_rows
from sglang_ascend_offload.sparse_decode import overflow
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine, decode_layer_step
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.policies import POLICIES, make_manager, needs_ranked
from sglang_ascend_offload.sparse_decode.verify import full_kv_attention

HYP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LATENT, ROPE, HEADS = 16, 8, 2
MAX_CTX = 40  # positions per request; host slot of (engine row r, position p) = r * MAX_CTX + p


def _triton_available() -> bool:
    registry.ensure_registered()
    impl = registry.implementations("residency_manage").get("triton")
    return impl is not None and impl.unavailable() is None


TRITON = pytest.mark.skipif(not _triton_available(), reason="the triton rung needs triton (TRITON_INTERPRET=1 on CPU)")
IMPLEMENTATIONS = [pytest.param(p, "torch", "reference", id=f"{p}-torch") for p in POLICIES]
IMPLEMENTATIONS += [
    pytest.param(p, "kernel", "reference", id=f"{p}-cpu-kernel") for p in ("lru", "score_rank", "score_rank_guarded")
]
IMPLEMENTATIONS += [pytest.param(p, "torch", "triton", id=f"{p}-triton", marks=TRITON) for p in ("lru", "score_rank")]


@st.composite
def rounds(draw):
    """``G`` requests x ``n`` rows, top-k ``K``, ``H`` in ``[K, n*K)``; each round's rows
    select mostly distinct positions (unions beyond ``H``), committed lengths advance."""
    g = draw(st.integers(1, 3))
    n = draw(st.integers(2, 4))
    k = draw(st.integers(2, 6))
    hot = draw(st.integers(k, n * k - 1))
    reqs = [draw(st.sampled_from([-1, 0, 1])) for _ in range(g)]
    lens = [draw(st.integers(n * k, MAX_CTX - n - 2)) for _ in range(g)]
    out = []
    for _ in range(draw(st.integers(1, 6))):
        topk = np.full((g * n, k), -1, dtype=np.int32)
        for i in range(g):
            if draw(st.integers(0, 5)) == 0:
                reqs[i] = draw(st.sampled_from([-1, 0, 1, 2]))
                lens[i] = draw(st.integers(n * k, MAX_CTX - n - 2))
            if reqs[i] == -1:
                continue
            for j in range(n):
                visible = lens[i] + j + 1  # row j attends positions 0 .. L + j
                own = draw(st.lists(st.integers(0, visible - 1), unique=True, min_size=1, max_size=k))
                topk[i * n + j, : len(own)] = own
        ranked = np.full((g * n, k + 3), -1, dtype=np.int32)
        for r in range(g * n):
            picked = [int(p) for p in topk[r] if p >= 0]
            rest = [p for p in range(MAX_CTX) if p not in picked][: k + 3 - len(picked)]
            ranked[r, : len(picked) + len(rest)] = picked + rest
        out.append((topk, np.array(reqs, dtype=np.int64), np.array(lens, dtype=np.int32), ranked))
        for i in range(g):
            lens[i] = min(MAX_CTX - n - 2, lens[i] + draw(st.integers(1, n)))
    return g, n, k, hot, out


def _engine(policy, impl, rung, g, n, k, hot):
    pool = HostKVPool.allocate(HostPoolShape(1, (g + 1) * MAX_CTX, LATENT, ROPE), "pinned")
    cfg = EngineConfig(
        layers=1,
        rows=g,
        hot_tokens=hot,
        top_k=k,
        latent_dim=LATENT,
        rope_dim=ROPE,
        policy=policy,
        ops=rung,
        manage_impl=impl,
        max_context=MAX_CTX,
        rows_per_request=n,
    )
    return SparseDecodeEngine(cfg, pool, device="cpu"), pool


def _replay(policy, impl, rung, g, n, k, hot, steps, gen):
    """Run ``steps`` and check every query row against the full KV; returns the overflow
    positions the engine counted and those the rounds had (by hand)."""
    engine, pool = _engine(policy, impl, rung, g, n, k, hot)
    table = (torch.arange(g)[:, None] * MAX_CTX + torch.arange(MAX_CTX)[None, :]).to(torch.int32)
    pool.write_rows(0, torch.arange(g * MAX_CTX), torch.randn((g * MAX_CTX, LATENT + ROPE), generator=gen).bfloat16())
    want = 0
    for step, (topk_np, req_np, lens_np, ranked_np) in enumerate(steps):
        req, stable = torch.from_numpy(req_np), torch.from_numpy(lens_np)
        # this round's candidate rows L .. L+n-1 get fresh content (a verify forward's append)
        for i in range(g):
            if req[i] >= 0:
                cand = torch.arange(int(stable[i]), int(stable[i]) + n) + i * MAX_CTX
                pool.write_rows(0, cand, torch.randn((n, LATENT + ROPE), generator=gen).bfloat16())
        engine.begin_step(req, table, stable, step=step, rows=torch.arange(g, dtype=torch.int64))
        topk = torch.from_numpy(topk_np)
        topk = torch.where(req.repeat_interleave(n)[:, None] >= 0, topk, torch.full_like(topk, -1))
        if needs_ranked(policy):
            engine.set_ranked(0, torch.from_numpy(ranked_np))
        query = torch.randn((g * n, HEADS, LATENT), generator=gen).bfloat16()
        query_rope = torch.randn((g * n, HEADS, ROPE), generator=gen).bfloat16()
        out = engine.run_layer(0, topk, query, query_rope, 0.3).output
        row_table = table.repeat_interleave(n, dim=0)
        ref = full_kv_attention(engine.attention_op, pool, 0, topk, row_table, query, query_rope, 0.3)
        assert torch.equal(out, ref), f"step {step}: attention differs from the full-KV reference"
        union = union_of_rows(topk, n)
        want += int(torch.clamp((union.positions >= 0).sum(dim=1) - hot, min=0).sum())
    return engine.stats().total.overflow_positions, want


@pytest.mark.parametrize("policy,impl,rung", IMPLEMENTATIONS)
@HYP
@given(scn=rounds(), seed=st.integers(0, 2**16))
def test_rounds_beyond_the_hot_buffer_equal_attention_over_the_full_kv(policy, impl, rung, scn, seed):
    g, n, k, hot, steps = scn
    if rung == "triton":
        steps = steps[:2]  # the interpreter is slow
    counted, want = _replay(policy, impl, rung, g, n, k, hot, steps, torch.Generator().manual_seed(seed))
    assert counted == want


def _overflowing_scenario():
    """One request, 3 rows x top-k 4 of disjoint positions over 6 hot slots: 6 overflow."""
    topk = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=np.int32)
    ranked = np.concatenate([topk, np.full((3, 3), -1, dtype=np.int32)], axis=1)
    return 1, 3, 4, 6, [(topk, np.array([0]), np.array([20], dtype=np.int32), ranked)] * 2


def test_the_scenario_overflows_and_is_counted():
    g, n, k, hot, steps = _overflowing_scenario()
    counted, want = _replay("lru", "torch", "reference", g, n, k, hot, steps, torch.Generator().manual_seed(0))
    assert counted == want == 2 * 6


def test_negative_control_dropping_the_overflow_positions_fails(monkeypatch):
    """Attention over the resident part only (the overflow entries left at -1): the
    full-KV check sees it."""
    monkeypatch.setattr(overflow, "flat_indices", lambda flat, *a, **kw: flat)
    g, n, k, hot, steps = _overflowing_scenario()
    with pytest.raises(AssertionError, match="full-KV reference"):
        _replay("lru", "torch", "reference", g, n, k, hot, steps, torch.Generator().manual_seed(0))


def test_negative_control_an_area_of_the_wrong_layer_fails(monkeypatch):
    """The overflow rows read at another base (the hot rows of the layer instead of the
    area): the check sees it."""
    monkeypatch.setattr(overflow, "flat_indices", lambda flat, u, tr, slots, base: overflow_flat_at(flat, u, tr, slots))
    g, n, k, hot, steps = _overflowing_scenario()
    with pytest.raises(AssertionError, match="full-KV reference"):
        _replay("lru", "torch", "reference", g, n, k, hot, steps, torch.Generator().manual_seed(0))


_FLAT_INDICES = overflow.flat_indices


def overflow_flat_at(flat, union, token_rows, slots):
    return _FLAT_INDICES(flat, union, token_rows, slots, 0)


def test_the_union_keeps_the_best_ranked_positions_resident():
    """Resident part: the positions with the best column over the rows, ties by position."""
    topk = torch.tensor([[9, 3, 1], [3, 7, 5]], dtype=torch.int32)
    u = union_of_rows(topk, 2, capacity=4)
    # best columns: 9->0, 3->0, 1->2, 7->1, 5->2; by (column, position): 3, 9, 7, 1 | 5
    assert u.positions.tolist() == [[1, 3, 7, 9]] and u.overflow.tolist() == [[5, -1]]
    assert u.overflow_count.tolist() == [1]
    assert u.resident.tolist() == [[True, True, True], [True, True, False]]
    assert union_of_rows(topk, 2, capacity=6).overflow is None  # a buffer of n x K never overflows


def test_the_overflowing_step_compiles_equal_to_eager():
    if os.environ.get("SAO_SKIP_COMPILE_TESTS"):
        pytest.skip("SAO_SKIP_COMPILE_TESTS is set")
    g, n, k, hot = 2, 3, 4, 6
    gen = torch.Generator().manual_seed(1)
    host = torch.randn((2 * MAX_CTX, LATENT + ROPE), generator=gen).bfloat16()
    table = (torch.arange(g)[:, None] * MAX_CTX + torch.arange(MAX_CTX)[None, :]).to(torch.int32)

    def state():
        mgr = make_manager("lru", g + 1, hot, None, registry.select("residency_manage", "reference"))
        storage = torch.zeros((g + 1) * hot + (g + 1) * 16, LATENT + ROPE, dtype=torch.bfloat16)
        hot_buf = storage[: (g + 1) * hot].view(g + 1, hot, LATENT + ROPE)
        area = storage[(g + 1) * hot :].view(g + 1, 16, LATENT + ROPE)
        counters = torch.zeros(2, dtype=torch.int64)  # the stats' device counters, added to in the step
        return mgr, hot_buf, overflow.OverflowView(area=area, kv=storage, base=(g + 1) * hot, counters=counters)

    def step(mgr, hot_buf, view, topk, q, qr, s):
        rows = torch.arange(g, dtype=torch.int64)
        args = (rows, topk, torch.tensor([0, 1]), torch.tensor([20, 20], dtype=torch.int32), s, host, hot_buf, table)
        return decode_layer_step(mgr, *args, q, qr, 0.3, LATENT, rows_per_request=n, overflow_view=view)[0]

    eager_state, compiled_state = state(), state()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for s in range(3):
        topk = torch.stack([torch.randperm(20, generator=gen)[:k] for _ in range(g * n)]).to(torch.int32)
        q = torch.randn((g * n, HEADS, LATENT), generator=gen).bfloat16()
        qr = torch.randn((g * n, HEADS, ROPE), generator=gen).bfloat16()
        step_t = torch.tensor(s, dtype=torch.int64)
        assert torch.equal(step(*eager_state, topk, q, qr, step_t), compiled(*compiled_state, topk, q, qr, step_t))
    counted = eager_state[2].counters
    assert torch.equal(compiled_state[2].counters, counted) and int(counted[0]) > 0  # it did overflow, and counted
