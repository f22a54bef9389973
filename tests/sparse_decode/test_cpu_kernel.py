"""The CPU residency kernel (rows form) equals the torch reference bit for bit."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ascend_offload.ops.contract import ResidencyTable
from sglang_ascend_offload.ops.residency import copy_miss_rows, residency_manage
from sglang_ascend_offload.sparse_decode import cpu_kernel

from .test_residency import scenarios

HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _assert_same(out, ref, state, table):
    for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
        assert torch.equal(out[name], getattr(ref, name)), name
    assert torch.equal(state.slot_token, table.slot_token)
    assert torch.equal(state.slot_stamp, table.slot_stamp)
    assert torch.equal(state.row_req, table.row_req)


def _as_dict(res):
    return dict(zip(("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"), res))


@contextlib.contextmanager
def _lookup(impl: str):
    """The int16 dense map's lookup: ``simd`` the AVX-512 loop (the test is skipped
    where the CPU lacks it), ``scalar`` the scalar loop; the default is restored after."""
    available = cpu_kernel.set_simd(impl == "simd")
    try:
        if impl == "simd" and not available:
            pytest.skip("this CPU has no AVX-512 F/BW/VL: only the scalar lookup runs here")
        yield
    finally:
        cpu_kernel.set_simd(True)


LOOKUPS = pytest.mark.parametrize("impl", ["simd", "scalar"])


@pytest.mark.parametrize(
    "dense",
    [False, "int16", "int16_scalar", "int32"],
    ids=["hash_map", "dense_map_int16", "dense_map_int16_scalar_lookup", "dense_map_int32"],
)
@HYP
@given(scn=scenarios())
def test_kernel_equals_reference_on_all_rows(dense, scn):
    """Request churn, idle rows, speculative suffixes: state and outputs identical,
    with either position map (the dense one with int16 or int32 slots; the int16
    one's lookup both vectorised, where the CPU has AVX-512, and scalar)."""
    with _lookup("scalar" if dense == "int16_scalar" else "simd"):
        _check_all_rows("int16" if dense == "int16_scalar" else dense, scn)


def _check_all_rows(dense, scn):
    hot, steps = scn
    rows, k = steps[0][0].shape
    table = ResidencyTable.empty(rows, hot)
    dtype = {"int16": torch.int16, "int32": torch.int32}.get(dense)
    state = cpu_kernel.KernelLRUState.empty(rows, hot, max_positions=16 if dense else None, dense_dtype=dtype)
    assert state.map_kind == (0 if dense else 1)
    if dense:
        assert state.hkeys.dtype == dtype
    all_rows = torch.arange(rows, dtype=torch.int64)
    for step, (topk, req, stable) in enumerate(steps):
        t, r, s = torch.from_numpy(topk), torch.from_numpy(req), torch.from_numpy(stable)
        ref = residency_manage(table.slot_token, table.slot_stamp, table.row_req, t, r, s, step)
        out = _as_dict(cpu_kernel.lru_manage_rows(state, all_rows, t, r, s, step))
        _assert_same(out, ref, state, table)


@HYP
@given(scenarios(), st.randoms(use_true_random=False))
def test_kernel_on_a_subset_of_rows_leaves_the_others_alone(scn, rnd):
    """Each step works on a random permutation of a random subset of the rows (plus
    padding entries on an idle sink row): the rows stepped equal the reference run on
    them, every other row's state is untouched."""
    hot, steps = scn
    rows, k = steps[0][0].shape
    sink = rows
    table = ResidencyTable.empty(rows + 1, hot)
    state = cpu_kernel.KernelLRUState.empty(rows + 1, hot, max_positions=16 if rnd.random() < 0.5 else None)
    for step, (topk, req, stable) in enumerate(steps):
        chosen = [r for r in range(rows) if rnd.random() < 0.6]
        rnd.shuffle(chosen)
        pad = rnd.randint(0, 2)
        batch_rows = torch.tensor(chosen + [sink] * pad, dtype=torch.int64)
        b_topk = torch.cat([torch.from_numpy(topk[chosen]), torch.full((pad, k), -1, dtype=torch.int32)])
        b_req = torch.cat([torch.from_numpy(req[chosen]), torch.full((pad,), -1, dtype=torch.int64)])
        b_stable = torch.cat([torch.from_numpy(stable[chosen]), torch.zeros(pad, dtype=torch.int32)])
        before = state.slot_token.clone(), state.slot_stamp.clone(), state.row_req.clone()
        out = _as_dict(cpu_kernel.lru_manage_rows(state, batch_rows, b_topk, b_req, b_stable, step))
        if chosen:
            idx = torch.tensor(chosen)
            sub = ResidencyTable(
                table.slot_token[idx].clone(), table.slot_stamp[idx].clone(), table.row_req[idx].clone()
            )
            ref = residency_manage(
                sub.slot_token,
                sub.slot_stamp,
                sub.row_req,
                b_topk[: len(chosen)],
                b_req[: len(chosen)],
                b_stable[: len(chosen)],
                step,
            )
            table.slot_token[idx], table.slot_stamp[idx], table.row_req[idx] = (
                sub.slot_token,
                sub.slot_stamp,
                sub.row_req,
            )
            for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
                assert torch.equal(out[name][: len(chosen)], getattr(ref, name)), name
        assert torch.equal(state.slot_token, table.slot_token)
        assert torch.equal(state.slot_stamp, table.slot_stamp)
        assert torch.equal(state.row_req, table.row_req)
        untouched = [r for r in range(rows + 1) if r not in chosen]
        for t_now, t_before in zip((state.slot_token, state.slot_stamp, state.row_req), before):
            assert torch.equal(t_now[untouched], t_before[untouched])
        assert int(out["miss_count"][len(chosen) :].abs().sum()) == 0
        assert bool((out["slots"][len(chosen) :] == -1).all())


def test_kernel_at_a_larger_shape_with_locality_equals_reference():
    """Production-like mix (many hits, some misses, a speculative suffix) at rows 4,
    top-k 256, hot 512 over 12 steps; the mix is checked on the run itself."""
    gen = torch.Generator().manual_seed(3)
    rows, k, hot = 4, 256, 512
    assert hot >= 2 * k  # the LRU bound below relies on it
    table = ResidencyTable.empty(rows, hot)
    state = cpu_kernel.KernelLRUState.empty(rows, hot)
    req = torch.arange(rows, dtype=torch.int64)
    all_rows = torch.arange(rows, dtype=torch.int64)
    # Per row, the positions selected at each step since the row's last reset.
    history = [[] for _ in range(rows)]
    warm_hits = warm_lookups = misses = suffix_hits = 0
    for step in range(12):
        stable = torch.full((rows,), 2000 + 3 * step, dtype=torch.int32)
        base = torch.randperm(600, generator=gen)[: k - 8].to(torch.int32)
        topk = torch.stack(
            [
                torch.cat(
                    [
                        base[torch.randperm(k - 8, generator=gen)],
                        torch.arange(int(stable[0]) - 4, int(stable[0]) + 4, dtype=torch.int32),
                    ]
                )
                for _ in range(rows)
            ]
        )
        if step == 7:
            req[1] = 9  # churn
            history[1] = []
        ref = residency_manage(table.slot_token, table.slot_stamp, table.row_req, topk, req, stable, step)
        out = _as_dict(cpu_kernel.lru_manage_rows(state, all_rows, topk, req, stable, step))
        _assert_same(out, ref, state, table)
        misses += int(ref.miss_count.sum())
        suffix_hits += int((ref.hit_mask & (topk >= stable[:, None])).sum())
        for r in range(rows):
            sel = topk[r].tolist()
            below = [p for p in sel if p < int(stable[r])]  # only these can hit
            hits = int(ref.hit_mask[r].sum())
            # Exact LRU bounds from the construction. Upper: a position never selected
            # since the row's reset is not resident. Lower: with hot >= 2 * top-k the
            # last two steps' selections (at most 2 * k positions, the newest stamps)
            # are all still resident, so each of them below ``stable`` hits.
            seen = set().union(*history[r])
            recent = set().union(*history[r][-2:])
            assert sum(p in recent for p in below) <= hits <= sum(p in seen for p in below), (step, r)
            assert int(ref.miss_count[r]) == k - hits
            if len(history[r]) >= 2:
                warm_hits += hits
                warm_lookups += k
            history[r].append(set(sel))
    # "Many hits": once two steps are resident, a base entry hits at least when one of the
    # two previous steps picked it (probability 1 - (352/600)^2 ~ 0.66 for 248 of 600
    # positions) and the 4 window positions below ``stable`` were picked a step before;
    # with the older steps still partly resident the hit rate is higher. So at least
    # half the lookups of the warm steps hit.
    assert warm_lookups > 0 and 2 * warm_hits > warm_lookups, (warm_hits, warm_lookups)
    # "Some misses": every row-step misses at least its 4 suffix positions (>= stable),
    # which never hit; step 0 and the churned row miss all k.
    assert misses >= rows * k + k + 4 * (rows * 11 - 1), misses
    assert suffix_hits == 0


@LOOKUPS
def test_kernel_dense16_at_a_larger_shape_equals_reference(impl):
    """The int16 dense map at top-k 250 (not a multiple of the 16-entry vectors: masked
    tails), hot 512, positions 0 .. ~1200 with position 0 and the map's last position
    selected, padding entries, a speculative suffix and churn, over 10 steps."""
    with _lookup(impl):
        _check_dense16_larger()


def _check_dense16_larger():
    gen = torch.Generator().manual_seed(5)
    rows, k, hot, width = 3, 250, 512, 1300
    table = ResidencyTable.empty(rows, hot)
    state = cpu_kernel.KernelLRUState.empty(rows, hot, max_positions=width)
    assert state.map_kind == 0 and state.hkeys.dtype == torch.int16
    req = torch.arange(rows, dtype=torch.int64)
    all_rows = torch.arange(rows, dtype=torch.int64)
    for step in range(10):
        stable = torch.full((rows,), width - 1 - (step % 3), dtype=torch.int32)
        topk = torch.full((rows, k), -1, dtype=torch.int32)
        for r in range(rows):
            pos = torch.cat([torch.tensor([0, width - 1]), 1 + torch.randperm(width - 2, generator=gen)[: k - 12]]).to(
                torch.int32
            )
            topk[r, : pos.numel()] = pos[torch.randperm(pos.numel(), generator=gen)]
        if step == 6:
            req[2] = 7  # churn
        ref = residency_manage(table.slot_token, table.slot_stamp, table.row_req, topk, req, stable, step)
        out = _as_dict(cpu_kernel.lru_manage_rows(state, all_rows, topk, req, stable, step))
        _assert_same(out, ref, state, table)
        assert int(out["hit_mask"].sum()) > 0 or step == 0


@LOOKUPS
def test_kernel_rejects_a_position_beyond_the_dense_map(impl):
    with _lookup(impl):
        _check_rejects_beyond_width()


def _check_rejects_beyond_width():
    state = cpu_kernel.KernelLRUState.empty(2, 32, max_positions=40)
    topk = torch.arange(20, dtype=torch.int32).view(1, 20).clone()
    topk[0, 17] = 40
    with pytest.raises(IndexError, match="dense map's width 40"):
        cpu_kernel.lru_manage_rows(
            state,
            torch.tensor([1]),
            topk,
            torch.zeros(1, dtype=torch.int64),
            torch.full((1,), 41, dtype=torch.int32),
            0,
        )


def test_kernel_copy_equals_reference_copy():
    gen = torch.Generator().manual_seed(1)
    rows, hot, dim = 3, 6, 8
    host = torch.randn((50, dim), generator=gen).to(torch.bfloat16)
    table = torch.randperm(50, generator=gen).to(torch.int32).view(1, 50).repeat(rows + 1, 1)
    miss_tokens = torch.tensor([[3, 7, -1, -1], [-1, -1, -1, -1], [1, 2, 4, 9]], dtype=torch.int32)
    miss_slots = torch.tensor([[5, 0, -1, -1], [-1, -1, -1, -1], [1, 2, 3, 4]], dtype=torch.int32)
    count = torch.tensor([2, 0, 4], dtype=torch.int32)
    hot_ref = torch.randn((rows, hot, dim), generator=gen).to(torch.bfloat16)
    hot_k = torch.cat([hot_ref.clone(), torch.zeros((1, hot, dim), dtype=torch.bfloat16)])
    copy_miss_rows(host, hot_ref, miss_tokens, miss_slots, count, table[:rows])
    # the kernel takes engine rows: batch entries 0..2 -> engine rows 2, 0, 1
    perm = torch.tensor([2, 0, 1], dtype=torch.int64)
    hot_k_src = hot_k.clone()
    hot_k_src[perm] = hot_k[:rows]
    cpu_kernel.copy_miss_rows_rows(host, hot_k_src, perm, miss_tokens, miss_slots, count, table)
    assert torch.equal(hot_k_src[perm], hot_ref)
    assert torch.equal(hot_k_src[rows], torch.zeros((hot, dim), dtype=torch.bfloat16))


def test_kernel_rejects_rows_out_of_range():
    state = cpu_kernel.KernelLRUState.empty(2, 4)
    try:
        cpu_kernel.lru_manage_rows(
            state,
            torch.tensor([5]),
            torch.zeros((1, 2), dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int32),
            0,
        )
    except IndexError as exc:
        assert "outside the 2 state rows" in str(exc)
    else:
        raise AssertionError("a row index out of range was accepted")
    assert np.all(state.row_req.numpy() == -1)


def test_dense_map_slot_type_follows_hot_tokens():
    """int16 slots by default while every slot fits (hot_tokens <= 32767), int32 beyond;
    an int16 map that cannot hold the slots is refused."""
    assert cpu_kernel.KernelLRUState.empty(2, 32767, max_positions=8).hkeys.dtype == torch.int16
    assert cpu_kernel.KernelLRUState.empty(2, 32768, max_positions=8).hkeys.dtype == torch.int32
    with pytest.raises(ValueError, match="cannot hold"):
        cpu_kernel.KernelLRUState.empty(2, 32768, max_positions=8, dense_dtype=torch.int16)
