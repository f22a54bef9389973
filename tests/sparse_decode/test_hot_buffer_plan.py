"""The hot-buffer plan (``sparse_decode/sizing.py``): the hot_tokens rules, the rows and the
bytes, computed by hand here; that every user of the plan agrees with the pool's real
allocation is ``tests/sglang/mem_cache/test_hot_buffer_agreement.py``."""

from __future__ import annotations

import pytest

from sglang_ascend_offload.sparse_decode import sizing
from sglang_ascend_offload.sparse_decode.sizing import HotBufferPlan


def test_the_default_is_twice_top_k_rounded_to_the_page():
    assert sizing.default_hot_tokens(2048, 128) == 4096
    assert sizing.default_hot_tokens(100, 64) == 256  # 200 rounded up to whole pages
    assert sizing.default_hot_tokens(100, None) == 200
    assert sizing.resolve_hot_tokens(None, 16, 64) == 64
    assert sizing.resolve_hot_tokens(48, 16, 64) == 48  # a configured value stands (the rules judge it)


def test_the_least_valid_value_holds_one_top_k_with_or_without_verify_rows():
    assert sizing.required_hot_tokens(2048) == 2048
    assert sizing.least_hot_tokens(100, 64) == 128  # 100 rounded up to whole pages


def test_overflow_slots_are_what_the_union_can_hold_beyond_the_buffer():
    assert sizing.overflow_slots(2048, 4096, 4) == 4096  # DeepSeek-V3.2 at MTP-3, the default buffer
    assert sizing.overflow_slots(2048, 4096, 2) == 0  # the union of two rows always fits 2 x top-k
    assert sizing.overflow_slots(2048, 4096, 1) == 0
    assert sizing.overflow_slots(100, 200, 3) == 112  # 100, rounded up to the 16-row blocks
    assert sizing.overflow_slots(16, 16, 4) == 48


def test_verify_rows_need_a_speculative_algorithm_and_a_count():
    assert sizing.verify_rows(None, 4) == 1
    assert sizing.verify_rows("EAGLE", None) == 1
    assert sizing.verify_rows("EAGLE", 4) == 4
    assert sizing.verify_rows("mtp", 2) == 2


def test_pre_allocation_slots_only_on_a_pd_decode():
    assert sizing.pre_alloc_slots("decode", 8) == 8
    assert sizing.pre_alloc_slots("decode", None) == 0
    assert sizing.pre_alloc_slots("prefill", 8) == 0 and sizing.pre_alloc_slots("null", 8) == 0


def test_rows_and_bytes_by_hand():
    plan = HotBufferPlan.build(
        configured_hot_tokens=None,
        top_k=2048,
        page_size=128,
        verify_rows=4,
        layers=61,
        row_dim=576,
        running_requests=32,
        pre_alloc_slots=8,
    )
    assert plan.hot_tokens == 4096  # 2 x top-k: the verify rows share plain decode's buffer
    assert plan.req_slots == 32 + 8 + 1  # SGLang's req_to_token rows: running, pre-allocated, padding
    assert plan.hot_rows == 42 and plan.fixed_hot_rows == 10  # + the engine's sink row
    row = 61 * 4096 * 576 * 2
    table = 61 * (4096 * (4 + 8) + 8)
    over = (4 * 2048 - 4096) * 576 * 2  # one layer's worth: the layers share the overflow area
    assert plan.overflow_slots == 4096 and plan.overflow_bytes_per_row == over
    assert plan.hot_bytes_per_row == row and plan.residency_bytes_per_row == table
    assert plan.device_bytes_per_row == row + table + over
    assert plan.hot_buffer_bytes == 42 * row and plan.residency_table_bytes == 42 * table
    assert plan.overflow_bytes == 42 * over
    assert plan.device_bytes == 42 * (row + table + over)
    assert plan.host_bytes_per_token == 61 * 576 * 2
    assert plan.with_running_requests(1).hot_rows == 11
    # what fits: every fixed row first, then one row per request
    per_row = row + table + over
    assert plan.running_requests_fitting(20 * per_row) == 10
    assert plan.running_requests_fitting(10 * per_row + row) == 0
    d = plan.to_dict()
    assert d["hot_rows"] == 42 and d["device_bytes"] == plan.device_bytes and d["verify_rows"] == 4
    assert d["overflow_slots"] == 4096 and d["overflow_bytes"] == 42 * over
    no_overflow = HotBufferPlan(layers=61, row_dim=576, top_k=2048, hot_tokens=8192, verify_rows=4, running_requests=1)
    assert no_overflow.overflow_slots == 0 and no_overflow.device_bytes_per_row == 61 * 8192 * (1152 + 12) + 61 * 8


def test_words_name_every_row():
    plan = HotBufferPlan(layers=2, row_dim=576, top_k=16, hot_tokens=64, verify_rows=4, running_requests=1)
    assert plan.rows_in_words() == "3 hot rows (1 request + 1 padding slot + 1 sink row)"
    assert "one per request shared by its 4 verify rows" in plan.formula()
    pd = HotBufferPlan(
        layers=2, row_dim=576, top_k=16, hot_tokens=64, verify_rows=1, running_requests=5, pre_alloc_slots=2
    )
    assert pd.rows_in_words() == "9 hot rows (5 requests + 2 P/D pre-allocation slots + 1 padding slot + 1 sink row)"


@pytest.mark.parametrize(
    "field,value",
    [("layers", 0), ("hot_tokens", 0), ("verify_rows", 0), ("running_requests", 0), ("pre_alloc_slots", -1)],
)
def test_a_plan_out_of_range_is_refused(field, value):
    kw = dict(layers=2, row_dim=576, top_k=16, hot_tokens=64, verify_rows=1, running_requests=1, pre_alloc_slots=0)
    kw[field] = value
    with pytest.raises(ValueError, match="HotBufferPlan"):
        HotBufferPlan(**kw)
