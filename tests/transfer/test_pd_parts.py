"""Small parts: layouts, mismatch reports, coalescing, status combination, block pool."""

import pytest
import torch

from sglang_ascend_offload.transfer.destinations import BlockPool
from sglang_ascend_offload.transfer.layout import (
    RawTensor,
    TensorLayers,
    build_layout,
    coalesce,
    layout_from_regions,
    layout_mismatches,
    registration_regions,
)
from sglang_ascend_offload.transfer.status import DONE, PENDING, RequestStatus, TransferState, combine_rank_statuses


def test_build_layout_from_aliased_slots():
    slots = [torch.zeros(8, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    idx = [torch.zeros(8, 4, 128, dtype=torch.uint8) for _ in range(2)]
    lay = build_layout(
        4,
        [
            TensorLayers("main", "latent", [slots[i % 2] for i in range(5)]),
            TensorLayers("indexer", "indexer", [idx[i % 2] for i in range(5)]),
        ],
    )
    assert lay.num_layers == 5
    latent = lay.main[0]
    assert latent.block_bytes == 4 * 16 * 2 and latent.num_blocks == 8
    assert latent.layer_base_addrs[0] == latent.layer_base_addrs[2] == slots[0].data_ptr()
    assert latent.address(3, 2) == slots[1].data_ptr() + 2 * latent.block_bytes
    assert lay.indexer.block_bytes == 512 and lay.indexer_scale is None
    regions = registration_regions([TensorLayers("main", "latent", [slots[i % 2] for i in range(5)])])
    assert regions == sorted((s.data_ptr(), s.numel() * 2) for s in slots)  # aliases registered once


def test_build_layout_rejects_bad_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        build_layout(4, [TensorLayers("main", "latent", [torch.zeros(8, 4).t()])])
    with pytest.raises(ValueError, match="differ in shape"):
        build_layout(4, [TensorLayers("main", "latent", [torch.zeros(8, 4), torch.zeros(9, 4)])])
    with pytest.raises(ValueError, match="layer count"):
        layout_from_regions(4, [RawTensor("main", "a", 8, 2, [1, 2]), RawTensor("main", "b", 8, 2, [1])])


def test_layout_mismatches_lists_every_difference():
    def lay(layers=2, bt=4, main=(("latent", 64), ("rope", 16)), idx=32, scale=8):
        t = [RawTensor("main", n, b, 4, [1 + i for i in range(layers)]) for n, b in main]
        if idx:
            t.append(RawTensor("indexer", "indexer", idx, 4, [1] * layers))
        if scale:
            t.append(RawTensor("indexer_scale", "scale", scale, 4, [1] * layers))
        return layout_from_regions(bt, t)

    assert layout_mismatches(lay(), lay()) == []
    got = layout_mismatches(lay(), lay(layers=3, bt=8, main=(("rope", 16), ("latent", 64)), idx=0, scale=0))
    text = "\n".join(got)
    for want in (
        "layers: prefill 2, decode 3",
        "tokens per block",
        "main tensor order",
        "indexer presence",
        "LIC8 scale presence",
    ):
        assert want in text
    assert layout_mismatches(lay(), lay(scale=4)) == ["LIC8 scale block bytes: prefill 8, decode 4"]
    assert layout_mismatches(lay(main=(("latent", 64),)), lay()) == ["main tensor count: prefill 1, decode 2"]


def test_coalesce_merges_only_doubly_contiguous_runs():
    d, s, n = coalesce([100, 110, 120, 200, 210], [0, 10, 20, 40, 50], 10)
    assert (d, s, n) == ([100, 200], [0, 40], [30, 20])
    d, s, n = coalesce([100, 110], [0, 30], 10)  # destination contiguous, source not
    assert n == [10, 10]
    assert coalesce([], [], 10) == ([], [], [])


def test_schedulable_only_when_every_decode_rank_is_done():
    failed = RequestStatus(TransferState.FAILED, "read error")
    assert combine_rank_statuses([DONE, DONE]) == DONE
    assert combine_rank_statuses([DONE, PENDING]) == PENDING
    c = combine_rank_statuses([PENDING, failed, DONE])
    assert c.state is TransferState.FAILED and "rank 1: read error" in c.reason
    assert combine_rank_statuses([DONE]).terminal and not PENDING.terminal
    with pytest.raises(ValueError):
        combine_rank_statuses([])


def test_block_pool_leases_and_double_free():
    pool = BlockPool(8, shuffle_seed=3)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.leased == 8
    assert list(a) != sorted(a) or list(b) != sorted(b)  # shuffled ids
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(a)
    assert pool.leased == 5
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
