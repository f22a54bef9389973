"""Triton ``copy_miss_rows`` vs the reference: bit-exact, only miss slots change."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from sglang_ascend_offload.ops.residency import copy_miss_rows as reference_copy  # noqa: E402
from sglang_ascend_offload.triton_ops.copy_rows import CopyKernelConfig, launch_copy_miss_rows  # noqa: E402

TINY = CopyKernelConfig(block_i=2, block_d=8, validate=True)


def make_case(gen, rows, hot, k, dim, host_rows, ctx, counts, dtype):
    if dtype.is_floating_point:
        host = torch.randn(host_rows, dim, generator=gen).to(dtype)
        hot_buf = torch.randn(rows, hot, dim, generator=gen).to(dtype)
    else:
        host = torch.randint(-100, 100, (host_rows, dim), generator=gen).to(dtype)
        hot_buf = torch.randint(-100, 100, (rows, hot, dim), generator=gen).to(dtype)
    table = torch.randint(0, host_rows, (rows, ctx), generator=gen, dtype=torch.int32)
    tokens = torch.full((rows, k), -1, dtype=torch.int32)
    slots = torch.full((rows, k), -1, dtype=torch.int32)
    for r, n in enumerate(counts):
        tokens[r, :n] = torch.randperm(ctx, generator=gen)[:n].to(torch.int32)
        slots[r, :n] = torch.randperm(hot, generator=gen)[:n].to(torch.int32)
    return host, hot_buf, tokens, slots, torch.tensor(counts, dtype=torch.int32), table


def same_bits(a, b):
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(width), b.view(width))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
@pytest.mark.parametrize("config", [CopyKernelConfig(validate=True), TINY], ids=["default_tiles", "tiny_tiles"])
def test_matches_reference_bit_exact(dtype, config):
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, rows=3, hot=12, k=6, dim=21, host_rows=30, ctx=25, counts=[6, 0, 4], dtype=dtype)
    host, hot, tokens, slots, counts, table = case
    want, got = hot.clone(), hot.clone()
    reference_copy(host, want, tokens, slots, counts, table)
    launch_copy_miss_rows(host, got, tokens, slots, counts, table, config)
    assert same_bits(want, got)
    assert not same_bits(want, hot)  # something was copied
    untouched = torch.ones(3, 12, dtype=torch.bool)
    for r, n in enumerate(counts.tolist()):
        untouched[r, slots[r, :n].long()] = False
    assert same_bits(got[untouched], hot[untouched])


def test_nan_payloads_and_stale_entries_past_miss_count():
    """Bits travel as integers (NaN payloads survive); entries past miss_count,
    even if they hold valid-looking indices, are ignored."""
    gen = torch.Generator().manual_seed(9)
    host, hot, tokens, slots, counts, table = make_case(gen, 2, 8, 4, 5, 10, 12, [2, 1], torch.float32)
    host.view(torch.int32)[:, 0] = 0x7FC00123  # quiet NaN with a payload
    tokens[:, 2:] = 0
    slots[:, 2:] = 7
    want, got = hot.clone(), hot.clone()
    reference_copy(host, want, tokens, slots, counts, table)
    launch_copy_miss_rows(host, got, tokens, slots, counts, table, TINY)
    assert same_bits(want, got)


def test_host_with_row_stride_wider_than_d():
    """The host pool may be a column slice of a wider buffer (row stride != D)."""
    wide = torch.arange(6 * 7, dtype=torch.int16).reshape(6, 7)
    host = wide[:, 2:5]  # [6, 3], row stride 7
    hot = torch.zeros(1, 4, 3, dtype=torch.int16)
    tokens = torch.tensor([[0, 1, 2, -1]], dtype=torch.int32)
    slots = torch.tensor([[3, 0, 1, -1]], dtype=torch.int32)
    table = torch.tensor([[5, 0, 2]], dtype=torch.int32)
    want = hot.clone()
    reference_copy(host, want, tokens, slots, torch.tensor([3], dtype=torch.int32), table)
    launch_copy_miss_rows(host, hot, tokens, slots, torch.tensor([3], dtype=torch.int32), table, TINY)
    assert torch.equal(hot, want) and torch.equal(hot[0, 3], wide[5, 2:5])


def test_validate_rejects_out_of_range_entries():
    gen = torch.Generator().manual_seed(2)
    host, hot, tokens, slots, counts, table = make_case(gen, 2, 8, 4, 5, 10, 12, [2, 1], torch.float32)
    bad = tokens.clone()
    bad[1, 0] = 12  # == token_table width
    with pytest.raises(IndexError, match="miss_tokens outside"):
        launch_copy_miss_rows(host, hot, bad, slots, counts, table, TINY)
    bad = slots.clone()
    bad[0, 1] = 8
    with pytest.raises(IndexError, match="miss_slots outside"):
        launch_copy_miss_rows(host, hot, tokens, bad, counts, table, TINY)
    # without validation the kernel skips the bad entry instead of touching memory out of bounds
    bad_tokens = tokens.clone()
    bad_tokens[1, 0] = 1 << 30
    before = hot.clone()
    launch_copy_miss_rows(host, hot, bad_tokens, slots, counts, table, CopyKernelConfig())
    assert same_bits(hot[1], before[1])


def test_rejects_mismatched_dtypes_and_shapes():
    hot = torch.zeros(2, 4, 3, dtype=torch.bfloat16)
    idx = torch.zeros(2, 2, dtype=torch.int32)
    count = torch.zeros(2, dtype=torch.int32)
    table = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="no casts"):
        launch_copy_miss_rows(torch.zeros(5, 3), hot, idx, idx, count, table)
    with pytest.raises(ValueError, match="host must be"):
        launch_copy_miss_rows(torch.zeros(5, 4, dtype=torch.bfloat16), hot, idx, idx, count, table)
