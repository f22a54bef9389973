"""Triton ``residency_manage`` vs the reference: identical outputs and state, bit for bit.

Kernels run through the Triton interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` on CPU). Every case runs with the default tiles and with tiny
tiles, so the chunked paths (several slot blocks per row, several stamp groups,
several apply programs) are exercised on small shapes.
"""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from triton_case_gen import (  # noqa: E402
    DEFAULT,
    TINY,
    drifting_trace,
    random_state,
    random_topk,
    run_both,
    step_input,
)

from sglang_ascend_offload.ops.contract import ResidencyTable  # noqa: E402
from sglang_ascend_offload.triton_ops.residency import launch_residency_manage  # noqa: E402

CONFIGS = pytest.mark.parametrize("config", [DEFAULT, TINY], ids=["default_tiles", "tiny_tiles"])
INT32_MAX = 2**31 - 1


def tables(rows, hot):
    ref = ResidencyTable.empty(rows, hot)
    return ref, ref.clone()


@CONFIGS
def test_multi_step_trace_state_stays_identical(config):
    """Locality, churn, idle rows and speculative tails over many steps."""
    gen = torch.Generator().manual_seed(7)
    rows, hot, k = 4, 20, 8
    ref, tri = tables(rows, hot)
    hits = misses = 0
    steps = 14 if config is DEFAULT else 8  # tiny tiles are slow in the interpreter
    for inp in drifting_trace(gen, rows, k, steps=steps):
        out = run_both(ref, tri, inp, config, where=f"step {inp.step}")
        hits += int(out.hit_mask.sum())
        misses += int(out.miss_count.sum())
    assert hits > 10 and misses > 10  # the trace really mixes hits and misses


@CONFIGS
def test_arbitrary_states_victim_order(config):
    """Random valid states with many tied stamps: the victim order (stamp, slot)
    across several stamp groups, with hit slots excluded."""
    gen = torch.Generator().manual_seed(11)
    rows, hot, k, max_pos = 5, 24, 10, 40
    for trial in range(3 if config is DEFAULT else 2):
        ref = random_state(gen, rows, hot, max_pos, stamp_values=4)
        tri = ref.clone()
        # select half from what the row holds (hits) and half from anywhere
        topk = random_topk(gen, rows, k, 0, max_pos)
        held = ref.slot_token[:, : k // 2].clone()
        topk[:, : k // 2] = torch.where(held >= 0, held, topk[:, : k // 2])
        for r in range(rows):  # keep valid entries distinct after the overwrite
            seen = set()
            for j in range(k):
                v = int(topk[r, j])
                if v in seen:
                    topk[r, j] = -1
                seen.add(v)
        inp = step_input(topk, torch.arange(rows), torch.full((rows,), max_pos), step=3 + trial)
        out = run_both(ref, tri, inp, config, where=f"trial {trial}")
        assert int(out.hit_mask.sum()) > 0


@CONFIGS
def test_empty_rows_and_idle_rows(config):
    rows, hot = 3, 8
    ref, tri = tables(rows, hot)
    run_both(ref, tri, step_input([[0, 1, 2, 3], [5, 6, -1, -1], [1, 2, 3, 4]], [10, 11, 12], [9, 9, 9], 0), config)
    # row 0: active but nothing selected; row 1: becomes idle (reset, outputs all padding)
    out = run_both(ref, tri, step_input([[-1] * 4, [5, 6, 7, 8], [1, 2, 3, 4]], [10, -1, 12], [9, 9, 9], 1), config)
    assert out.miss_count.tolist() == [0, 0, 0]
    assert out.slots[1].tolist() == [-1] * 4 and not bool(out.hit_mask[1].any())
    assert int(tri.row_req[1]) == -1 and bool((tri.slot_token[1] == -1).all())


@CONFIGS
def test_all_hits_then_all_misses(config):
    rows, hot = 2, 12
    ref, tri = tables(rows, hot)
    first = [[0, 1, 2, 3, 4, 5], [10, 20, 30, 40, 50, 60]]
    run_both(ref, tri, step_input(first, [1, 2], [100, 100], 0), config)
    out = run_both(ref, tri, step_input([list(reversed(first[0])), first[1]], [1, 2], [100, 100], 1), config)
    assert bool(out.hit_mask.all()) and out.miss_count.tolist() == [0, 0]
    out = run_both(
        ref, tri, step_input([[6, 7, 8, 9, 10, 11], [61, 62, 63, 64, 65, 66]], [1, 2], [100, 100], 2), config
    )
    assert not bool(out.hit_mask.any()) and out.miss_count.tolist() == [6, 6]


@CONFIGS
def test_capacity_exactly_top_k(config):
    """H == K: every miss evicts, and a full turnover replaces every slot."""
    gen = torch.Generator().manual_seed(3)
    rows, k = 3, 8
    ref, tri = tables(rows, k)
    for step in range(6):
        topk = random_topk(gen, rows, k, 0, 14, fill=[k, k - 2, k // 2])
        run_both(ref, tri, step_input(topk, [0, 1, 2], [14, 14, 14], step), config, where=f"step {step}")


@CONFIGS
def test_padding_interleaved(config):
    rows, hot = 2, 10
    ref, tri = tables(rows, hot)
    run_both(
        ref,
        tri,
        step_input([[-1, 3, -1, 5, 7, -1, 9, -1], [0, -1, -1, -1, -1, -1, -1, 2]], [0, 1], [20, 20], 0),
        config,
    )
    out = run_both(
        ref, tri, step_input([[5, -1, 4, -1, -1, 3, -1, 8], [-1, 2, 1, -1, 0, -1, -1, -1]], [0, 1], [20, 20], 1), config
    )
    assert out.slots[0].tolist()[1] == -1 and out.miss_count.tolist() == [2, 1]


@CONFIGS
def test_request_reset(config):
    rows, hot = 2, 8
    ref, tri = tables(rows, hot)
    sel = [[1, 2, 3, 4], [1, 2, 3, 4]]
    run_both(ref, tri, step_input(sel, [5, 6], [10, 10], 0), config)
    out = run_both(ref, tri, step_input(sel, [5, 7], [10, 10], 1), config)  # row 1: new request
    assert bool(out.hit_mask[0].all()) and not bool(out.hit_mask[1].any())
    assert int(tri.row_req[1]) == 7


@CONFIGS
def test_speculative_suffix(config):
    """Positions >= stable_len are never hits and empty their slots."""
    rows, hot = 2, 10
    ref, tri = tables(rows, hot)
    run_both(ref, tri, step_input([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], [0, 1], [5, 10], 0), config)
    # row 0: positions 3, 4 are speculative now; row 1: 8, 9 speculative
    out = run_both(ref, tri, step_input([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], [0, 1], [3, 8], 1), config)
    assert out.hit_mask[0].tolist() == [True, True, True, False, False]
    assert out.hit_mask[1].tolist() == [True, True, True, False, False]
    run_both(ref, tri, step_input([[2, 3, 4, -1, -1], [9, 8, -1, -1, -1]], [0, 1], [0, 9], 2), config)


@CONFIGS
def test_positions_and_steps_near_integer_limits(config):
    rows, hot = 2, 8
    ref, tri = tables(rows, hot)
    top = INT32_MAX
    big_step = 2**60
    sel = [[top - 1, top - 2, top - 3, 0], [top - 10, -1, top - 1, 7]]
    run_both(ref, tri, step_input(sel, [0, 1], [top, top - 1], big_step), config)
    out = run_both(ref, tri, step_input(sel, [0, 1], [top, top - 1], big_step + 1), config)
    assert out.hit_mask[0].tolist() == [True, True, True, True]
    assert out.hit_mask[1].tolist() == [True, False, False, True]  # top-1 >= stable_len of row 1
    assert int(tri.slot_stamp.max()) == 2 * (big_step + 1) + 2


def test_zero_rows_and_zero_k():
    ref, tri = tables(0, 4)
    run_both(ref, tri, step_input(torch.empty((0, 2), dtype=torch.int32), torch.empty(0), torch.empty(0), 0))
    # K = 0 still resets rows and drops speculative slots
    ref, tri = tables(2, 4)
    run_both(ref, tri, step_input([[1, 2], [3, 4]], [0, 1], [9, 9], 0))
    run_both(ref, tri, step_input(torch.empty((2, 0), dtype=torch.int32), [5, 1], [9, 4], 1))
    assert bool((tri.slot_token[0] == -1).all()) and int(tri.row_req[0]) == 5


def test_rejects_bad_arguments():
    ref = ResidencyTable.empty(2, 4)
    topk = torch.zeros((2, 5), dtype=torch.int32)
    req, stable = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="hot_tokens 4 < top_k 5"):
        launch_residency_manage(ref.slot_token, ref.slot_stamp, ref.row_req, topk, req, stable, 0)
    with pytest.raises(ValueError, match="step=-1"):
        launch_residency_manage(ref.slot_token, ref.slot_stamp, ref.row_req, topk[:, :2], req, stable, -1)
    with pytest.raises(ValueError, match="slot_stamp must be a contiguous"):
        launch_residency_manage(
            ref.slot_token, ref.slot_stamp.to(torch.int32), ref.row_req, topk[:, :2], req, stable, 0
        )
    with pytest.raises(ValueError, match="slot_token must be a contiguous"):
        launch_residency_manage(ref.slot_token.t(), ref.slot_stamp, ref.row_req, topk[:, :2], req, stable, 0)
    with pytest.raises(ValueError, match="req_ids must be an integer tensor"):
        launch_residency_manage(ref.slot_token, ref.slot_stamp, ref.row_req, topk[:, :2], torch.zeros(2), stable, 0)
