"""Non-uniform TP topology: formulas, complete and disjoint shares, ports."""

import dataclasses

import pytest

from sglang_ascend_offload.transfer.errors import TopologyError
from sglang_ascend_offload.transfer.topology import (
    PER_RANK,
    TP_SHARED,
    PDTopology,
    check_plan,
    decode_port,
    split_range,
)

VALID = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 4), (6, 3)]
INVALID = [(1, 2), (2, 4), (3, 2), (4, 3), (6, 4), (0, 1), (1, 0)]


@pytest.mark.parametrize("p_tp,d_tp", VALID)
def test_valid_pairs_map_every_prefill_rank_to_one_decode_rank(p_tp, d_tp):
    t = PDTopology(p_tp, d_tp)
    assert t.ratio * d_tp == p_tp
    groups = {}
    for p in range(p_tp):
        assert t.d_rank_of(p) == p // t.ratio
        assert t.member_of(p) == p % t.ratio
        groups.setdefault(t.d_rank_of(p), []).append(p)
    assert sorted(groups) == list(range(d_tp))
    for d, members in groups.items():
        assert members == t.contributors(d)
        assert [t.member_of(p) for p in members] == list(range(t.ratio))
        assert sum(t.sends_main(t.member_of(p)) for p in members) == 1  # only member 0


@pytest.mark.parametrize("p_tp,d_tp", INVALID)
def test_invalid_pairs_rejected_at_construction(p_tp, d_tp):
    with pytest.raises(TopologyError, match="invalid P/D topology"):
        PDTopology(p_tp, d_tp)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("num_blocks", [0, 1, 2, 3, 5, 8, 13])
def test_main_and_indexer_shares_are_disjoint_and_complete(p_tp, d_tp, num_blocks):
    t = PDTopology(p_tp, d_tp)
    main = []
    for d in range(d_tp):
        s, c = t.main_share(num_blocks, d)
        main += list(range(s, s + c))
    assert main == list(range(num_blocks))  # disjoint, ordered, union = all blocks
    for d in range(d_tp):
        idx = []
        for m in range(t.ratio):
            s, c = t.indexer_share(num_blocks, m)
            idx += list(range(s, s + c))
        assert idx == list(range(num_blocks))
    # with fewer blocks than members some members have nothing (they still answer)
    if num_blocks < t.ratio:
        assert any(t.indexer_share(num_blocks, m)[1] == 0 for m in range(t.ratio))


def test_split_range_balanced():
    sizes = [split_range(10, 4, i)[1] for i in range(4)]
    assert sizes == [3, 3, 2, 2]
    with pytest.raises(ValueError):
        split_range(3, 2, 2)


def test_rank_bounds_checked():
    t = PDTopology(4, 2)
    with pytest.raises(TopologyError):
        t.d_rank_of(4)
    with pytest.raises(TopologyError):
        t.main_share(3, 2)
    with pytest.raises(TopologyError):
        t.indexer_share(3, 2)


def test_decode_port_formula_and_range():
    assert decode_port(30100, 0, 0, 2) == 30100
    assert decode_port(30100, 0, 1, 2) == 30101
    assert decode_port(30100, 3, 1, 2) == 30107
    ports = {decode_port(30100, dp, tp, 4) for dp in range(3) for tp in range(4)}
    assert len(ports) == 12  # DP and TP endpoints never overlap
    with pytest.raises(TopologyError, match="outside"):
        decode_port(65535, 0, 1, 2)
    with pytest.raises(TopologyError):
        decode_port(30100, 0, 2, 2)
    with pytest.raises(TopologyError):
        decode_port(30100, -1, 0, 2)


# ------------------------------------------------------------------ decode attention TP > 1
ALL_VALID = [(p, d) for p in range(1, 9) for d in range(1, 9) if p >= d and p % d == 0]
ALL_INVALID = [(p, d) for p in range(1, 9) for d in range(1, 9) if p < d or p % d]


@pytest.mark.parametrize("p_tp,d_tp", ALL_VALID)
def test_plan_of_every_valid_pair_covers_main_once_and_each_ranks_indexer(p_tp, d_tp):
    """Every valid pair up to TP 8, requests of 0..17 blocks: the main KV of each block is
    written exactly once into the DP rank's TP-shared pool, each decode rank's indexer
    exactly once per block, by the prefill ranks SGLang pairs it with."""
    t = PDTopology(p_tp, d_tp)
    for n in range(18):
        plan = t.plan(n)
        assert check_plan(t, n, plan) == [], (n, plan)
        assert [c.p_rank for c in plan] == list(range(p_tp))
        for c in plan:
            assert c.d_rank == c.p_rank // t.ratio and c.member == c.p_rank % t.ratio
            assert (c.main[1] > 0) <= (c.member == 0)  # only member 0 writes main KV
            assert c.main == (t.main_share(n, c.d_rank) if c.member == 0 else (0, 0))
        for d in range(d_tp):
            assert [c.p_rank for c in plan if c.d_rank == d] == t.contributors(d)
        # decode ranks' main ranges follow the request order (rank d's range precedes rank d + 1's)
        starts = [c.main for c in plan if c.member == 0]
        assert [s for s, _ in starts] == sorted(s for s, _ in starts)


@pytest.mark.parametrize("p_tp,d_tp", ALL_INVALID)
def test_every_invalid_pair_up_to_8_is_refused(p_tp, d_tp):
    with pytest.raises(TopologyError, match="invalid P/D topology"):
        PDTopology(p_tp, d_tp)


def test_check_plan_names_overlaps_gaps_and_wrong_pairing():
    t = PDTopology(4, 2)
    good = t.plan(5)
    c0, c1, c2, c3 = good
    overlap = [c0, c1, dataclasses.replace(c2, main=(2, 3)), c3]  # block 2 written twice
    assert any("main KV blocks" in p for p in check_plan(t, 5, overlap))
    gap = [c0, dataclasses.replace(c1, indexer=(3, 1)), c2, c3]  # decode rank 0's indexer block 4 missing
    assert any("decode rank 0's indexer" in p for p in check_plan(t, 5, gap))
    wrong = [dataclasses.replace(c0, d_rank=1), c1, c2, c3]
    assert any("sends to decode rank 1" in p for p in check_plan(t, 5, wrong))
    assert any("contributors" in p for p in check_plan(t, 5, good[:3]))


def test_main_kv_placement_rule():
    """A decode TP > 1 needs a TP-shared main-KV pool: the split writes each block once."""
    for p_tp in (1, 2, 4):
        PDTopology(p_tp, 1).check_main_kv(PER_RANK)
        PDTopology(p_tp, 1).check_main_kv(TP_SHARED)
    PDTopology(4, 2).check_main_kv(TP_SHARED)
    with pytest.raises(TopologyError, match="per-rank main-KV pool.*sparse decode offload"):
        PDTopology(4, 2).check_main_kv(PER_RANK)
    with pytest.raises(TopologyError, match="unknown"):
        PDTopology(1, 1).check_main_kv("device")
