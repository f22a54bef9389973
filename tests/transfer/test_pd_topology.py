"""Non-uniform TP topology: formulas, complete and disjoint shares, ports."""

import pytest

from sglang_ascend_offload.transfer.errors import TopologyError
from sglang_ascend_offload.transfer.topology import PDTopology, decode_port, split_range

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
