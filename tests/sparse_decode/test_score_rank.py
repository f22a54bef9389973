"""Score-aware residency: the ``ranked`` trace array, the latent-score model,
``score_rank`` and its guard, the Triton kernel, the sync-free step, idle skipping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ascend_offload.sparse_decode.policies import (
    POLICIES,
    LRUManager,
    RankedInputError,
    ScoreRankManager,
    make_manager,
    slot_ranks,
)
from sglang_ascend_offload.sparse_decode.replay import compact_trace, simulate_policy
from sglang_ascend_offload.sparse_decode.trace import (
    SyntheticTraceSpec,
    Trace,
    TraceError,
    load_trace,
    save_trace,
    synthesize,
    validate_trace,
)

from .test_residency import _check_invariants, _misses_per_request

HYP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCORE_POLICIES = sorted(p for p in POLICIES if POLICIES[p].needs_ranked)
SMALL = dict(steps=30, layers=2, rows=3, top_k=8, min_prompt=4, max_prompt=60, min_decode=3, max_decode=12)


# ------------------------------------------------------------------ trace format
@pytest.mark.parametrize("shape", ["locality", "bursty", "random", "scan"])
def test_latent_traces_are_valid_deterministic_and_round_trip(shape, tmp_path):
    spec = SyntheticTraceSpec(shape=shape, seed=4, rank_depth=20, **SMALL)
    a, b = synthesize(spec), synthesize(spec)
    assert a.ranked is not None and a.ranked.shape == (30, 2, 3, 20) and a.ranked.dtype == np.int32
    assert validate_trace(a.topk, a.seq_lens, a.req_ids, a.ranked) == []
    assert np.array_equal(a.ranked, b.ranked) and np.array_equal(a.topk, b.topk)
    active = a.req_ids != -1
    # first k ranked entries are the top-k as a set; short rows are padded with -1 after their positions
    head = np.sort(a.ranked[..., :8], axis=-1)
    assert np.array_equal(head, np.sort(a.topk, axis=-1))
    lens = a.seq_lens[:, None, :].repeat(2, axis=1)
    valid = (a.ranked >= 0).sum(axis=-1)
    assert np.array_equal(
        valid[active[:, None, :].repeat(2, axis=1)], np.minimum(lens, 20)[active[:, None, :].repeat(2, axis=1)]
    )
    path = tmp_path / "t.npz"
    save_trace(a, path)
    c = load_trace(path)
    assert np.array_equal(c.ranked, a.ranked) and c.rank_depth == 20


def test_latent_locality_ranking_predicts_the_next_selection():
    """The model's point: a position ranked just below the cut is far more likely to be
    selected next step than one outside the ranking."""
    t = synthesize(
        SyntheticTraceSpec(
            steps=60,
            layers=1,
            rows=2,
            top_k=32,
            rank_depth=128,
            min_prompt=1500,
            max_prompt=1500,
            min_decode=70,
            max_decode=70,
            mean_idle=0,
            seed=1,
        )
    )
    near = far = near_n = far_n = 0
    for s in range(59):
        for r in range(2):
            nxt = set(t.topk[s + 1, 0, r].tolist())
            ranked = t.ranked[s, 0, r]
            near += sum(int(p) in nxt for p in ranked[32:64])
            near_n += 32
            outside = set(range(int(t.seq_lens[s, r]))) - set(ranked.tolist())
            far += sum(p in nxt for p in outside)
            far_n += len(outside)
    assert near / near_n > 10 * (far / far_n)


def test_old_traces_load_without_ranked(tmp_path):
    a = synthesize(SyntheticTraceSpec(seed=1, **SMALL))
    assert a.ranked is None and a.rank_depth == 0
    path = tmp_path / "old.npz"
    np.savez_compressed(path, topk=a.topk, seq_lens=a.seq_lens, req_ids=a.req_ids, meta=np.array(a.meta))
    assert load_trace(path).ranked is None


def test_ranked_validation_lists_every_problem():
    spec = SyntheticTraceSpec(seed=2, rank_depth=12, **SMALL)
    t = synthesize(spec)
    act = np.argwhere((t.req_ids != -1) & (t.seq_lens > 12))
    s, r = act[0]
    idle = np.argwhere(t.req_ids == -1)[0]
    bad = t.ranked.copy()
    bad[s, 0, r, 0], bad[s, 0, r, 9] = bad[s, 0, r, 9], bad[s, 0, r, 0]  # a top-k entry swapped past k
    bad[s, 1, r, 10] = bad[s, 1, r, 11]  # repeated position
    bad[idle[0], 0, idle[1], 0] = 0  # idle row not -1
    problems = validate_trace(t.topk, t.seq_lens, t.req_ids, bad)
    text = "\n".join(problems)
    assert "not the top-k selection as a set" in text
    assert "repeated position" in text
    assert "idle rows" in text
    bad2 = t.ranked.copy()
    bad2[s, 0, r, 9] = -1  # a hole: padding must be a suffix
    assert any("padding is a suffix" in p for p in validate_trace(t.topk, t.seq_lens, t.req_ids, bad2))
    bad3 = t.ranked.copy()
    bad3[s, 0, r, 11] = t.seq_lens[s, r] + 5
    assert any(">= their row's seq_len" in p for p in validate_trace(t.topk, t.seq_lens, t.req_ids, bad3))
    assert "R >= top-k" in validate_trace(t.topk, t.seq_lens, t.req_ids, t.ranked[..., :4])[0]
    assert "int32" in validate_trace(t.topk, t.seq_lens, t.req_ids, t.ranked.astype(np.int64))[0]
    with pytest.raises(TraceError):
        save_trace(Trace(t.topk, t.seq_lens, t.req_ids, t.meta, bad), "/nonexistent/never-written.npz")


# ------------------------------------------------------------------ the policy
@st.composite
def ranked_scenarios(draw):
    """Rows over steps with churn, idle rows, speculative suffixes, and a ranking per
    step whose first k are the top-k (the rest: other positions in a drawn order)."""
    rows = draw(st.integers(1, 3))
    k = draw(st.integers(1, 4))
    hot = k + draw(st.integers(0, 4))
    depth = k + draw(st.integers(0, 5))
    universe = draw(st.integers(k + 1, 14))
    steps = draw(st.integers(1, 20))
    reqs = [draw(st.sampled_from([-1, 0, 1])) for _ in range(rows)]
    out = []
    for _ in range(steps):
        topk = np.full((rows, k), -1, dtype=np.int32)
        ranked = np.full((rows, depth), -1, dtype=np.int32)
        stable = np.zeros(rows, dtype=np.int32)
        for r in range(rows):
            if draw(st.integers(0, 7)) == 0:
                reqs[r] = draw(st.sampled_from([-1, 0, 1, 2]))
            stable[r] = draw(st.integers(0, universe))
            if reqs[r] == -1:
                continue
            pos = draw(st.lists(st.integers(0, universe - 1), unique=True, max_size=k))
            topk[r] = draw(st.permutations(pos + [-1] * (k - len(pos))))
            rest = [p for p in draw(st.permutations(list(range(universe)))) if p not in pos]
            if len(pos) < k:
                rest = []  # a short selection is every position the row has: nothing ranks below it
            tail = rest[: depth - len(pos)]
            ranked[r, : len(pos) + len(tail)] = pos + tail
        out.append((topk, np.array(reqs, dtype=np.int64), stable, ranked))
    return hot, out


def _t(topk, req, stable):
    return torch.from_numpy(topk), torch.from_numpy(req), torch.from_numpy(stable)


@pytest.mark.parametrize("policy", SCORE_POLICIES)
@HYP
@given(scn=ranked_scenarios())
def test_contract_invariants_hold_for_score_policies(policy, scn):
    hot, steps = scn
    rows = steps[0][0].shape[0]
    mgr = make_manager(policy, rows, hot)
    for step, (topk, req, stable, ranked) in enumerate(steps):
        before = mgr.table.clone()
        mgr.set_ranked(torch.from_numpy(ranked))
        out = mgr.step(*_t(topk, req, stable), step)
        _check_invariants(before, mgr.table, topk, req, stable, out)


@HYP
@given(scn=ranked_scenarios())
def test_score_rank_with_depth_k_is_lru(scn):
    """With nothing ranked below the cut every non-hit slot is 'unranked': exact LRU."""
    hot, steps = scn
    rows, k = steps[0][0].shape
    lru, ours = LRUManager(rows, hot), ScoreRankManager(rows, hot)
    for step, (topk, req, stable, ranked) in enumerate(steps):
        a = lru.step(*_t(topk, req, stable), step)
        ours.set_ranked(torch.from_numpy(ranked[:, :k]))
        b = ours.step(*_t(topk, req, stable), step)
        assert torch.equal(a.slots, b.slots) and torch.equal(a.miss_slots, b.miss_slots)
        assert torch.equal(lru.table.slot_token, ours.table.slot_token)


def test_score_rank_victim_order_by_rank_then_recency():
    """Slots hold 13, 12, 10, 11, 20 (filled in that order). The ranking puts 12 at rank
    3 and 10 at rank 5; 13, 11, 20 are unranked. Three misses take the unranked ones,
    oldest first (13, 11, 20); LRU would take the three oldest (13, 12, 10)."""
    req, stable = torch.tensor([1]), torch.tensor([100], dtype=torch.int32)
    ranked = torch.tensor([[30, 31, 32, 12, 40, 10, 41]], dtype=torch.int32)
    held = {}
    for policy in ("score_rank", "lru"):
        mgr = make_manager(policy, 1, 5)
        for step, pos in enumerate([13, 12, 10, 11, 20]):
            if mgr.needs_ranked:
                mgr.set_ranked(torch.tensor([[pos]], dtype=torch.int32))
            mgr.step(torch.tensor([[pos]], dtype=torch.int32), req, stable, step)
        if mgr.needs_ranked:
            mgr.set_ranked(ranked)
        out = mgr.step(torch.tensor([[30, 31, 32]], dtype=torch.int32), req, stable, 5)
        assert int(out.miss_count[0]) == 3
        held[policy] = (sorted(mgr.table.slot_token[0].tolist()), out.miss_slots[0].tolist())
    assert held["score_rank"] == ([10, 12, 30, 31, 32], [0, 3, 4])
    assert held["lru"] == ([11, 20, 30, 31, 32], [0, 1, 2])
    assert slot_ranks(torch.tensor([[13, 12, 10, 11, 20]], dtype=torch.int32), ranked, stable).tolist() == [
        [7, 3, 5, 7, 7]
    ]


def test_a_policy_needing_ranked_is_a_clear_error():
    t = synthesize(SyntheticTraceSpec(seed=1, **SMALL))
    for policy in SCORE_POLICIES:
        with pytest.raises(RankedInputError, match="ranked"):
            simulate_policy(t, policy, 16)
        mgr = make_manager(policy, 2, 4)
        with pytest.raises(RankedInputError, match="record_trace_rank_depth"):
            mgr.step(
                torch.zeros((2, 2), dtype=torch.int32), torch.tensor([1, 2]), torch.tensor([5, 5], dtype=torch.int32), 0
            )


# ------------------------------------------------------------------ the guard
@st.composite
def adversarial(draw):
    """Rankings chosen against the policy: reversed, misleading (positions that are
    never selected ranked highest), or random, over short cyclic / random selections."""
    hot, steps = draw(ranked_scenarios())
    mode = draw(st.sampled_from(["mislead", "random", "as_drawn"]))
    if mode == "as_drawn":
        return hot, steps
    out = []
    for topk, req, stable, ranked in steps:
        ranked = ranked.copy()
        k = topk.shape[1]
        for r in range(ranked.shape[0]):
            tail = ranked[r, k:]
            n = int((tail >= 0).sum())
            if mode == "mislead":
                tail[:n] = tail[:n][::-1]
            else:
                tail[:n] = tail[:n][draw(st.permutations(list(range(n))))] if n else tail[:n]
        out.append((topk, req, stable, ranked))
    return hot, out


@HYP
@given(scn=adversarial())
def test_guarded_score_rank_never_exceeds_lru_beyond_its_budget(scn):
    """Per request and at every step: ``misses <= lru_misses + seed`` (+ the optional
    ``lru >> slack_shift``): the guard of ``policies.GuardedManager``."""
    hot, steps = scn
    rows = steps[0][0].shape[0]
    lru = _misses_per_request(LRUManager(rows, hot), [s[:3] for s in steps])
    mgr = make_manager("score_rank_guarded", rows, hot)
    ranked_iter = iter([s[3] for s in steps])

    class Feed:  # sets the step's ranking, then steps (the helper drives .step)
        table = mgr.table

        def step(self, *a):
            mgr.set_ranked(torch.from_numpy(next(ranked_iter)))
            return mgr.step(*a)

    ours = _misses_per_request(Feed(), [s[:3] for s in steps])
    for lru_snap, our_snap in zip(lru, ours):
        for key, m_lru in lru_snap.items():
            assert our_snap[key] <= m_lru + mgr.seed


def test_guard_bounds_a_ranking_that_lies():
    """Selections a, b, fresh, a, b, fresh, ... (k 1, hot 3): LRU misses only the fresh
    ones. A ranking that ranks the last fresh position and leaves a and b unranked
    makes score_rank evict what comes next; the guard keeps it within its seed."""
    a, b = 0, 1
    seq, fresh = [], 100
    for _ in range(30):
        seq += [a, b, fresh]
        fresh += 1
    misses = {}
    for policy in ("lru", "score_rank", "score_rank_guarded"):
        mgr = make_manager(policy, 1, 3)
        total, last_fresh = 0, 99
        for t, pos in enumerate(seq):
            if mgr.needs_ranked:
                mgr.set_ranked(torch.tensor([[pos, last_fresh if pos != last_fresh else 98]], dtype=torch.int32))
            out = mgr.step(
                torch.tensor([[pos]], dtype=torch.int32), torch.tensor([1]), torch.tensor([1000], dtype=torch.int32), t
            )
            total += int(out.miss_count.sum())
            if pos >= 100:
                last_fresh = pos
        misses[policy] = total
    seed = make_manager("score_rank_guarded", 1, 3).seed
    assert misses["lru"] == 32  # a, b once, then every fresh position
    assert misses["score_rank"] >= 1.5 * misses["lru"]  # the lying ranking costs a lot
    assert misses["lru"] < misses["score_rank_guarded"] <= misses["lru"] + seed


# ------------------------------------------------------------------ idle skipping
def test_compacting_idle_rows_and_steps_changes_no_policys_misses():
    spec = SyntheticTraceSpec(seed=6, rank_depth=12, mean_idle=6.0, **SMALL)
    t = synthesize(spec)
    # pad with never-active rows and a run of all-idle steps in the middle
    s, layers, rows, k = t.topk.shape
    pad_rows, idle_steps = 5, 4
    topk = np.full((s + idle_steps, layers, rows + pad_rows, k), -1, np.int32)
    ranked = np.full((s + idle_steps, layers, rows + pad_rows, 12), -1, np.int32)
    seq = np.zeros((s + idle_steps, rows + pad_rows), np.int32)
    req = np.full((s + idle_steps, rows + pad_rows), -1, np.int64)
    half = s // 2
    for dst, src in ((slice(0, half), slice(0, half)), (slice(half + idle_steps, None), slice(half, None))):
        topk[dst, :, 2 : 2 + rows] = t.topk[src]
        ranked[dst, :, 2 : 2 + rows] = t.ranked[src]
        seq[dst, 2 : 2 + rows] = t.seq_lens[src]
        ids = t.req_ids[src]
        req[dst, 2 : 2 + rows] = np.where(ids >= 0, ids + 1000 * (dst.start > 0), -1)  # new requests after the gap
    big = Trace(topk, seq, req, t.meta, ranked)
    assert validate_trace(big.topk, big.seq_lens, big.req_ids, big.ranked) == []
    small = compact_trace(big)
    assert small.rows == rows and small.steps < big.steps
    for policy in ("lru", "lru_k2_guarded", "score_rank", "score_rank_guarded", "belady"):
        plain = simulate_policy(big, policy, 12, compact=False).misses
        assert simulate_policy(big, policy, 12).misses == plain, policy
        assert simulate_policy(small, policy, 12, compact=False).misses == plain, policy


# ------------------------------------------------------------------ Triton rung
def test_triton_score_rank_equals_the_reference_bit_for_bit():
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py on CPU) or a GPU")
    from sglang_ascend_offload.triton_ops.residency import ResidencyKernelConfig
    from sglang_ascend_offload.triton_ops.score_rank import ScoreRankKernelConfig, score_rank_manage

    tiny = ScoreRankKernelConfig(
        residency=ResidencyKernelConfig(lookup_tile=8, max_lookup_block_h=2, victim_block=2, apply_block=2),
        rank_tile=8,
        rank_block_d=4,
    )
    spec = SyntheticTraceSpec(
        steps=10,
        layers=1,
        rows=3,
        top_k=6,
        rank_depth=13,
        min_prompt=4,
        max_prompt=40,
        min_decode=3,
        max_decode=8,
        seed=3,
    )
    t = synthesize(spec)
    for config, steps in ((ScoreRankKernelConfig(), t.steps), (tiny, 6)):  # tiny tiles: slow in the interpreter
        ref = ScoreRankManager(t.rows, 9)
        tri = ref.table.clone()
        misses = 0
        for s in range(steps):
            topk = torch.from_numpy(t.topk[s, 0])
            req = torch.from_numpy(t.req_ids[s])
            stable = torch.from_numpy(t.seq_lens[s]) - int(s % 3 == 0)  # some speculative tails
            stable = stable.clamp(min=0).to(torch.int32)
            ranked = torch.from_numpy(t.ranked[s, 0])
            ref.set_ranked(ranked)
            a = ref.step(topk, req, stable, s)
            b = score_rank_manage(
                tri.slot_token,
                tri.slot_stamp,
                tri.row_req,
                topk,
                req,
                stable,
                torch.tensor(s) if s % 2 else s,
                ranked,
                config,
            )
            for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (s, name)
            assert torch.equal(ref.table.slot_token, tri.slot_token) and torch.equal(
                ref.table.slot_stamp, tri.slot_stamp
            )
            assert torch.equal(ref.table.row_req, tri.row_req)
            misses += int(a.miss_count.sum())
        assert misses > 5


# ------------------------------------------------------------------ sync-free step
def test_score_rank_step_compiles_fullgraph_and_equals_eager():
    """The rows-form step of score_rank's guarded version (its base's victim order + the ghost) under
    torch.compile(fullgraph)
    through churn, padding and speculative suffixes, equal to eager bit for bit; no
    recompilation after the first step (the ranking is a static input buffer)."""
    from sglang_ascend_offload.sparse_decode.engine import decode_layer_step

    from . import test_sync_free as sf

    host, table, steps = sf.scenario()
    for policy in ("score_rank_guarded",):  # the guard runs the score_rank victim order inside
        eager, comp = sf.Run(policy, "torch"), sf.Run(policy, "torch")
        ranked_buf = [torch.full((sf.BATCH, sf.K + 3), -1, dtype=torch.int32) for _ in range(sf.LAYERS)]
        for run in (eager, comp):
            for layer, mgr in enumerate(run.managers):
                mgr.set_ranked(ranked_buf[layer])
        torch._dynamo.reset()
        compiled = torch.compile(decode_layer_step, fullgraph=True, dynamic=False, backend="aot_eager")
        frames = None
        g = torch.Generator().manual_seed(1)
        for step, (rows, req, stable, topks, qs) in enumerate(steps):
            step_t = torch.tensor(step, dtype=torch.int64)
            for layer in range(sf.LAYERS):
                extra = torch.randint(0, int(stable.max()) + 2, (sf.BATCH, 3), generator=g, dtype=torch.int32)
                r = torch.cat([topks[layer], extra], dim=1)
                # keep valid entries distinct: a repeated extra becomes -1 padding at the tail
                for b in range(sf.BATCH):
                    seen, row = set(), []
                    for p in r[b].tolist():
                        if p >= 0 and p not in seen:
                            seen.add(p)
                            row.append(p)
                    r[b] = torch.tensor(row + [-1] * (r.shape[1] - len(row)), dtype=torch.int32)
                ranked_buf[layer].copy_(r)
                args = (rows, topks[layer], req, stable, step_t)
                tail = (table, qs[layer][0], qs[layer][1], sf.SCALE, sf.LATENT)
                _, res_e = decode_layer_step(eager.managers[layer], *args, host, eager.hot[layer], *tail)
                _, res_c = compiled(comp.managers[layer], *args, host, comp.hot[layer], *tail)
                for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
                    assert torch.equal(getattr(res_c, name), getattr(res_e, name)), (policy, step, layer, name)
                for name, v in eager.managers[layer].state().items():
                    assert torch.equal(comp.managers[layer].state()[name], v), (policy, step, layer, name)
            if step == 0:
                frames = sf._compiled_frames()
        assert sf._compiled_frames() == frames, policy


# ------------------------------------------------------------------ the recorder
def test_recorder_writes_ranked_and_the_row_map(tmp_path):
    """TraceRecorder with a rank depth: compact rows, ``ranked`` validated on flush, the
    original engine row of every request in ``meta['row_map']``, top-R asked only while
    a decode step is being recorded."""
    import json

    from sglang_ascend_offload.sglang_plugin.observability.trace_recorder import TraceRecorder

    layers, k, depth = 2, 3, 5
    rec = TraceRecorder(tmp_path / "t.npz", layers, rows=100, top_k=k, max_steps=3, meta={"x": 1}, rank_depth=depth)
    assert rec.rank_depth_now() == 0  # no decode step begun
    batches = [([40, 7], [11, 12], [6, 9]), ([7, 55], [12, 13], [10, 4]), ([55], [13], [5])]
    for step, (engine_rows, reqs, lens) in enumerate(batches):
        rec.begin_step(torch.tensor(lens, dtype=torch.int32), torch.tensor(reqs), torch.tensor(engine_rows))
        assert rec.rank_depth_now() == depth
        for layer in range(layers):
            ranked = torch.full((len(reqs) + 1, depth), -1, dtype=torch.int32)  # + a DP padding row
            for b, n in enumerate(lens):
                order = torch.randperm(n)[:depth]
                ranked[b, : order.numel()] = order.to(torch.int32)
            rec.record_ranked(layer, ranked)
            rec.record_layer(layer, ranked[: len(reqs), :k])
    assert rec.done and rec.rank_depth_now() == 0
    t = load_trace(tmp_path / "t.npz")
    assert t.rows == 2 and t.rank_depth == depth and t.steps == 3  # two rows were ever live together
    meta = json.loads(t.meta)
    assert meta["rank_depth"] == depth and meta["x"] == 1
    assert meta["row_map"] == [[0, 0, 40, 11], [0, 1, 7, 12], [1, 0, 55, 13]]
    assert t.req_ids.tolist() == [[11, 12], [13, 12], [13, -1]]
    with pytest.raises(ValueError, match="top-k"):
        TraceRecorder(tmp_path / "u.npz", 1, 4, top_k=8, max_steps=2, meta={}, rank_depth=4)
