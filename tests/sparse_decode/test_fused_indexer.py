"""The fused indexer's residency arguments (``sparse_decode/fused_indexer.py``) and where
the plan lets the fused indexer serve.

LIM / LIM-C8 step the residency of *every* state row. The engine's batch is turned
into all-rows arguments so that, against the manager's own rows-form step on the same
top-k:

* the batch rows' step outputs and state are bit-identical (``batch_rows_step``),
* every row outside the batch is untouched (slots, stamps and owner), including a row
  whose context is shorter than its slots' positions (``stable_len = INT32_MAX``),
* padding entries on the sink row select nothing and leave it idle,

over steps with churn (a row changing owner). With ``n`` speculative verify rows per
request, the operator's step of a row shared by its ``n`` query tokens (the union of
their top-k) read back per query row (``engine.fused_request_step``) is bit-identical to
the engine's own per-request step (``engine.step_requests``) on the same top-k. The
reference LIM composition runs here; the fused kernels are held to it bit for bit by
``tests/ops/test_fused_cpu_model.py`` and ``check-kernels``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ascend_offload.ops.fused import lightning_indexer_manage
from sglang_ascend_offload.sparse_decode import fused_indexer
from sglang_ascend_offload.sparse_decode.engine import fused_request_step, step_requests
from sglang_ascend_offload.sparse_decode.op_selection import select_ops
from sglang_ascend_offload.sparse_decode.policies import make_manager

ROWS, HOT, K, PAGE, HEADS, DIM = 5, 64, 32, 32, 8, 128  # state rows: 4 engine rows + the sink


def _indexer_inputs(gen, lens, tables):
    b = lens.shape[0]
    query = torch.randn(b, HEADS, DIM, generator=gen).to(torch.bfloat16)
    weights = torch.randn(b, HEADS, generator=gen).to(torch.bfloat16)
    meta = dict(
        actual_seq_lengths_query=torch.arange(1, b + 1, dtype=torch.int32),
        actual_seq_lengths_key=lens,
        block_table=tables,
        sparse_count=K,
    )
    return query, weights, meta


def test_all_rows_arguments_step_the_batch_rows_and_leave_the_others_alone():
    gen = torch.Generator().manual_seed(4)
    key = torch.randn(4 * 8, PAGE, 1, DIM, generator=gen).to(torch.bfloat16)
    tables = torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8)
    fused_side = make_manager("lru", ROWS, HOT, "cpu", manage_impl="torch")
    reference = make_manager("lru", ROWS, HOT, "cpu", manage_impl="torch")
    sink = ROWS - 1
    owners = {0: 10, 1: 11, 2: 12, 3: 13}
    lens = {0: 100, 1: 180, 2: 60, 3: 240}
    batches = [[0, 1, 2, 3], [1, 3], [0, 2, 3], [2, 0], [3, 1, 0, 2]]
    for step, batch in enumerate(batches):
        if step == 3:
            owners[2] = 22  # churn: row 2 serves another request (reset)
            lens[2] = 40
        for r in batch:
            lens[r] += 1
        padded = batch + [-1]  # one padding entry, on the sink row
        rows = torch.tensor([r if r >= 0 else sink for r in padded], dtype=torch.int64)
        req_ids = torch.tensor([owners[r] if r >= 0 else -1 for r in padded], dtype=torch.int64)
        stable = torch.tensor([lens[r] if r >= 0 else 0 for r in padded], dtype=torch.int32)
        seq = torch.tensor([lens[r] if r >= 0 else 1 for r in padded], dtype=torch.int32)
        table_rows = tables[torch.tensor([max(r, 0) for r in padded])]
        query, weights, meta = _indexer_inputs(gen, seq, table_rows)
        before = [
            t.clone() for t in (fused_side.table.slot_token, fused_side.table.slot_stamp, fused_side.table.row_req)
        ]
        args = fused_indexer.residency_args(fused_side, rows, req_ids, stable, step, query.shape[0])
        assert args.token_rows.tolist() == batch + [-1]
        result = lightning_indexer_manage(query, key, weights, **meta, **args.as_kwargs())
        got = fused_indexer.batch_rows_step(result.residency, rows)
        topk = result.topk_indices.reshape(len(padded), K)
        want = reference.step_rows(rows, topk, req_ids, stable, step)
        live = torch.tensor([r >= 0 for r in padded])
        for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
            assert torch.equal(getattr(got, name)[live], getattr(want, name)[live]), (step, name)
        assert int(got.miss_count[~live].sum()) == 0 and bool((got.slots[~live] == -1).all())
        for r in range(ROWS - 1):
            if r in batch:
                continue
            assert torch.equal(fused_side.table.slot_token[r], before[0][r]), (step, r)
            assert torch.equal(fused_side.table.slot_stamp[r], before[1][r]), (step, r)
            assert int(fused_side.table.row_req[r]) == int(before[2][r])
        for r in batch:
            assert torch.equal(fused_side.table.slot_token[r], reference.table.slot_token[r])
            assert torch.equal(fused_side.table.slot_stamp[r], reference.table.slot_stamp[r])
        assert int(fused_side.table.row_req[sink]) == -1 and bool((fused_side.table.slot_token[sink] == -1).all())
    assert int(fused_side.table.row_req[2]) == 22


def test_managers_the_fused_indexer_cannot_step_are_refused():
    with pytest.raises(ValueError, match="exact LRU"):
        fused_indexer.check_manager(make_manager("lru_k2_guarded", 3, HOT, "cpu"))
    kernel = SimpleNamespace(policy="lru", impl="kernel")
    with pytest.raises(ValueError, match="manage_impl='torch'"):
        fused_indexer.check_manager(kernel)
    fused_indexer.check_manager(make_manager("lru", 3, HOT, "cpu", manage_impl="torch"))
    with pytest.raises(ValueError, match="2 batch entries x 1 rows"):
        fused_indexer.residency_args(
            make_manager("lru", 3, HOT, "cpu", manage_impl="torch"),
            torch.tensor([0, 1]),
            torch.tensor([1, 2]),
            torch.tensor([5, 5]),
            0,
            1,
        )
    with pytest.raises(ValueError, match="2 batch entries x 2 rows"):
        fused_indexer.residency_args(
            make_manager("lru", 3, HOT, "cpu", manage_impl="torch"),
            torch.tensor([0, 1]),
            torch.tensor([1, 2]),
            torch.tensor([5, 5]),
            0,
            3,
            2,
        )


@pytest.mark.parametrize(
    "obstacle, words",
    [
        (dict(policy="lru_k2_guarded"), "exact LRU"),
        (dict(rows_per_request=15), "at most 14 query tokens"),
        (dict(indexer_wired=False), "does not call"),
    ],
)
def test_where_the_fused_indexer_cannot_serve(obstacle, words):
    ext = SimpleNamespace(
        **{
            k: object()
            for k in (
                "npu_fused_lightning_indexer_manage",
                "npu_fused_scatter_copy_sparse_flash_attention",
                "npu_fused_register_host_memory",
            )
        }
    )
    default = select_ops("npu", extension=ext, **obstacle).check()  # the NPU default gives way, with the reason
    assert not default.indexer.fused and default.indexer.source == "consumer" and words in default.indexer.reason
    assert default.indexer.ops[-1] == "residency_manage"
    explicit = select_ops("npu", fused_lim=True, extension=ext, **obstacle)
    assert [p.rule for p in explicit.problems if p.rule == "sglang.fused_not_wired"] == ["sglang.fused_not_wired"]
    assert words in next(p.problem for p in explicit.problems if p.rule == "sglang.fused_not_wired")
    served = select_ops("npu", extension=ext).check()
    assert served.indexer.fused and served.indexer.ops == ("lightning_indexer_manage",)


@pytest.mark.parametrize("n", [2, 3])
def test_verify_rows_step_their_shared_row_once_as_the_engine_does(n):
    """``n`` query tokens per request (its verify rows): the operator steps the request's row
    on the union of their top-k, and each token reads its own slots back; against the
    engine's :func:`step_requests` over the same top-k, per query row and per request,
    bit for bit, over steps with churn and a padding entry; rows outside the batch stay."""
    gen = torch.Generator().manual_seed(10 + n)
    hot = n * K
    key = torch.randn(4 * 8, PAGE, 1, DIM, generator=gen).to(torch.bfloat16)
    tables = torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8)
    fused_side = make_manager("lru", ROWS, hot, "cpu", manage_impl="torch")
    reference = make_manager("lru", ROWS, hot, "cpu", manage_impl="torch")
    sink = ROWS - 1
    owners = {0: 10, 1: 11, 2: 12, 3: 13}
    lens = {0: 100, 1: 180, 2: 60, 3: 240}
    shared_hits = 0
    for step, batch in enumerate([[0, 1, 2, 3], [1, 3], [0, 2, 3], [2, 0], [3, 1, 0, 2], [3, 1, 0, 2]]):
        if step == 3:
            owners[2], lens[2] = 22, 40  # churn
        for r in batch:
            lens[r] += 1
        padded = batch + [-1]
        rows = torch.tensor([r if r >= 0 else sink for r in padded], dtype=torch.int64)
        req_ids = torch.tensor([owners[r] if r >= 0 else -1 for r in padded], dtype=torch.int64)
        stable = torch.tensor([lens[r] if r >= 0 else 0 for r in padded], dtype=torch.int32)
        # each request's n query tokens: the last sees stable + n - 1 positions (its drafts)
        seq = torch.tensor([lens[r] + n - 1 if r >= 0 else n for r in padded], dtype=torch.int32)
        b = len(padded)
        query = torch.randn(b * n, HEADS, DIM, generator=gen).to(torch.bfloat16)
        weights = torch.randn(b * n, HEADS, generator=gen).to(torch.bfloat16)
        meta = dict(
            actual_seq_lengths_query=torch.arange(n, b * n + 1, n, dtype=torch.int32),
            actual_seq_lengths_key=seq,
            block_table=tables[torch.tensor([max(r, 0) for r in padded])],
            sparse_count=K,
        )
        before = [t.clone() for t in (fused_side.table.slot_token, fused_side.table.slot_stamp)]
        args = fused_indexer.residency_args(fused_side, rows, req_ids, stable, step, b * n, n)
        assert args.token_rows.tolist() == [r for r in batch for _ in range(n)] + [-1] * n
        result = lightning_indexer_manage(query, key, weights, **meta, **args.as_kwargs())
        topk = result.topk_indices.reshape(b * n, K)
        got = fused_request_step(result.residency, rows, topk, n)
        want = step_requests(reference, rows, topk, req_ids, stable, step, n)
        live = torch.tensor([r >= 0 for r in padded])
        assert got.residency.slots.shape == (b, n * K)
        for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
            assert torch.equal(getattr(got.residency, name)[live], getattr(want.residency, name)[live]), (step, name)
        row_live = live.repeat_interleave(n)
        assert torch.equal(got.slots[row_live], want.slots[row_live]), step
        assert torch.equal(got.token_rows, want.token_rows)
        # the operator's own flat indices are the same slots
        flat = result.sparse_indices.reshape(b * n, K)[row_live]
        expect = torch.where(
            want.slots[row_live] >= 0,
            got.token_rows[row_live, None] * hot + want.slots[row_live],
            torch.full_like(want.slots[row_live], -1),
        )
        assert torch.equal(flat.to(torch.int64), expect.to(torch.int64)), step
        for r in range(ROWS - 1):
            if r not in batch:
                assert torch.equal(fused_side.table.slot_token[r], before[0][r]), (step, r)
                assert torch.equal(fused_side.table.slot_stamp[r], before[1][r]), (step, r)
            else:
                assert torch.equal(fused_side.table.slot_token[r], reference.table.slot_token[r])
                assert torch.equal(fused_side.table.slot_stamp[r], reference.table.slot_stamp[r])
        rc = got.row_counts()
        assert rc[0] is not None and int(rc[0]) >= int(got.residency.hit_mask.sum() + got.residency.miss_count.sum())
        shared_hits += int(got.residency.hit_mask[live].sum())
    assert shared_hits > 0  # the repeated batch hits what the verify rows brought in
