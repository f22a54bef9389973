"""The ``fused`` rung (AscendC LIM, LIM-C8, Copy-SFA) against the reference compositions.

Runs on an Ascend NPU with CANN, torch_npu and the extension built
(``bash ascendc_ops/build.sh --install``); marked ``npu`` and skipped elsewhere with the
reason. Production-like shapes: index heads 64 x dim 128, index-K block 128, top-k
2048, hot buffer 4096 slots per row, contexts of 5K-16K tokens, MLA latent 512 + rope
64, 16 heads (and 4 heads, which the host code pads to 8).

Tolerances (``docs/fused_ops.md``):

* LIM / LIM-C8 top-k: as ``lightning_indexer`` (visible, distinct, ``min(visible, K)``
  entries, each selected score >= K-th reference score - ``2e-2 * max|score|``);
* LIM residency state and outputs: **bit-exact** against the reference
  ``residency_manage`` fed with the kernel's own top-k, over several steps (first
  fill, steady hits, request churn, a speculative position);
* Copy-SFA miss copies: **bit-exact** hot buffer (it starts as NaN on both sides);
  output: ``|fused - ref| <= 2e-2 + 2e-2 * |ref|``.
"""

from __future__ import annotations

import pytest
import torch
from npu_requirements import npu_present, require_npu_extension, requires

from sglang_ascend_offload import platform
from sglang_ascend_offload.ops import fused, hadamard, reference, registry
from sglang_ascend_offload.ops.contract import ResidencyTable
from sglang_ascend_offload.ops.residency import residency_manage
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape

from .test_npu_ops import assert_indexer_close, paged_identity_free

ON_NPU = platform.device_kind() == "npu"
NPU_REASON = "needs an Ascend NPU with CANN and torch_npu"
ATTN_TOL = 2e-2

ROWS, INDEX_HEADS, INDEX_DIM, BLOCK, TOP_K, HOT = 8, 64, 128, 128, 2048, 4096
LATENT, ROPE = 512, 64

pytestmark = [pytest.mark.npu, pytest.mark.skipif(not npu_present(), reason=NPU_REASON)]


def _needs_extension(kernel):
    """Fails on an NPU runner without the built extension (skipped only without an NPU)."""
    return requires(lambda: require_npu_extension(kernel))


# ----------------------------------------------------------------------- inputs
class DecodeRun:
    """ROWS decode rows over a few steps: one token per row, contexts grow by one per step;
    step 2 replaces two requests (first fill again) and marks one position speculative."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.lens = [int(v) for v in torch.randint(5000, 16000, (ROWS,), generator=self.gen)]
        self.req = list(range(100, 100 + ROWS))
        cap = max(self.lens) + 8
        keys = [torch.randn(cap, INDEX_DIM, generator=self.gen).to(torch.bfloat16) for _ in range(ROWS + 2)]
        self.cache, self.table = paged_identity_free(keys, BLOCK, self.gen)
        self.slot_of = list(range(ROWS))  # request -> block-table row

    def step(self, step: int):
        if step == 2:
            for r in (1, 5):
                self.req[r] += 1000
                self.slot_of[r] = ROWS + (r == 5)
                self.lens[r] = 6000 + 100 * r
        else:
            self.lens = [n + 1 for n in self.lens]
        order = torch.randperm(ROWS, generator=self.gen).tolist()  # token t owns row order[t]
        query = torch.randn(ROWS, INDEX_HEADS, INDEX_DIM, generator=self.gen).to(torch.bfloat16)
        weights = (torch.rand(ROWS, INDEX_HEADS, generator=self.gen) * 0.2).to(torch.bfloat16)
        meta = dict(
            actual_seq_lengths_query=torch.arange(1, ROWS + 1, dtype=torch.int32),
            actual_seq_lengths_key=torch.tensor([self.lens[r] for r in order], dtype=torch.int32),
            block_table=self.table[[self.slot_of[r] for r in order]].contiguous(),
        )
        stable = torch.tensor(self.lens, dtype=torch.int32)
        if step == 1:
            stable[3] -= 1  # its newest position may still be rewritten
        rows = dict(
            token_rows=torch.tensor(order, dtype=torch.int32),
            req_ids=torch.tensor(self.req, dtype=torch.int64),
            stable_len=stable,
            step=step,
        )
        return query, weights, meta, rows


def _dev(d):
    return {k: (v.npu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def _state(table: ResidencyTable):
    return dict(slot_token=table.slot_token, slot_stamp=table.slot_stamp, row_req=table.row_req)


def _check_lim_run(quant: bool):
    op = "quant_lightning_indexer_manage" if quant else "lightning_indexer_manage"
    lim = registry.select(op, "fused")
    run = DecodeRun(seed=7 + quant)
    dev_table = ResidencyTable.empty(ROWS, HOT, device="npu")
    ref_table = ResidencyTable.empty(ROWS, HOT)
    hits = 0
    for step in range(3):
        query, weights, meta, rows = run.step(step)
        if quant:
            prep = hadamard.prepare_quant_indexer_inputs(query, run.cache)
            args = (prep.query, prep.key, weights, prep.query_dequant_scale, prep.key_dequant_scale)
            q_deq = hadamard.dequantize_int8(prep.query, prep.query_dequant_scale)
            k_deq = hadamard.dequantize_int8(prep.key, prep.key_dequant_scale)
            scores = reference.indexer_scores_dense(q_deq, k_deq, weights, **meta)
        else:
            args = (query, run.cache, weights)
            scores = reference.indexer_scores_dense(query, run.cache, weights, **meta)
        got = lim(*[a.npu() for a in args], **_dev(meta), **_dev(rows), **_state(dev_table), sparse_count=TOP_K)
        assert_indexer_close(got.topk_indices, scores, TOP_K)

        # the manage half is bit-exact given the kernel's own top-k
        topk = got.topk_indices.cpu()
        want = residency_manage(
            ref_table.slot_token,
            ref_table.slot_stamp,
            ref_table.row_req,
            fused.scatter_token_topk(topk, rows["token_rows"], ROWS),
            rows["req_ids"],
            rows["stable_len"],
            step,
        )
        for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
            assert torch.equal(getattr(got.residency, name).cpu(), getattr(want, name)), (step, name)
        assert torch.equal(got.sparse_indices.cpu(), fused.token_hot_indices(want.slots, rows["token_rows"], HOT))
        for name in ("slot_token", "slot_stamp", "row_req"):
            assert torch.equal(getattr(dev_table, name).cpu(), getattr(ref_table, name)), (step, name)
        hits += int(want.hit_mask.sum())
    assert hits > 0  # the steady path ran


@_needs_extension(fused.LIM_KERNEL)
def test_fused_lim_matches_reference_over_steps():
    _check_lim_run(quant=False)


@_needs_extension(fused.LIM_C8_KERNEL)
def test_fused_lim_c8_matches_reference_over_steps():
    _check_lim_run(quant=True)


def _verify_rows(query, weights, meta, rows):
    """The step as speculative verify rows: two query tokens per request (the second a draft,
    seeing one position more), both owning the request's row, which steps on the union of
    their top-k; the committed length leaves the draft's position speculative."""
    tokens = query.shape[0]
    gen = torch.Generator().manual_seed(int(rows["step"]) + 50)
    query2 = torch.randn(2 * tokens, INDEX_HEADS, INDEX_DIM, generator=gen).to(torch.bfloat16)
    weights2 = (torch.rand(2 * tokens, INDEX_HEADS, generator=gen) * 0.2).to(torch.bfloat16)
    meta2 = dict(
        meta,
        actual_seq_lengths_query=torch.arange(2, 2 * tokens + 1, 2, dtype=torch.int32),
        actual_seq_lengths_key=meta["actual_seq_lengths_key"] + 1,
    )
    rows2 = dict(rows, token_rows=rows["token_rows"].repeat_interleave(2))
    return query2, weights2, meta2, rows2


def check_lim_verify_rows(device: str) -> None:
    """``tokens_per_row = 2`` at DeepSeek-V3.2's shapes (union 2 x 2048 = the 4096 hot slots):
    the manage half bit-exact against the reference union step fed with the kernel's own
    top-k, over steps with churn and a speculative position. ``device``: ``npu`` (the built
    extension) or ``cpu`` (the kernels on their functional model,
    ``tests/ops/test_fused_cpu_model.py``)."""
    lim = registry.select("lightning_indexer_manage", "fused")
    run = DecodeRun(seed=31)
    dev_table = ResidencyTable.empty(ROWS, HOT, device=device)
    ref_table = ResidencyTable.empty(ROWS, HOT)
    hits = 0

    def on(d):
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}

    for step in range(3):
        query, weights, meta, rows = _verify_rows(*run.step(step))
        got = lim(
            query.to(device),
            run.cache.to(device),
            weights.to(device),
            **on(meta),
            **on(rows),
            **_state(dev_table),
            sparse_count=TOP_K,
            tokens_per_row=2,
        )
        scores = reference.indexer_scores_dense(query, run.cache, weights, **meta)
        assert_indexer_close(got.topk_indices, scores, TOP_K)
        topk = got.topk_indices.cpu()
        want = fused.residency_after_indexer(
            topk,
            **_state(ref_table),
            token_rows=rows["token_rows"],
            req_ids=rows["req_ids"],
            stable_len=rows["stable_len"],
            step=step,
            tokens_per_row=2,
        )
        assert got.residency.slots.shape == (ROWS, 2 * TOP_K)
        for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
            assert torch.equal(getattr(got.residency, name).cpu(), getattr(want.residency, name)), (step, name)
        assert torch.equal(got.sparse_indices.cpu(), want.sparse_indices), step
        for name in ("slot_token", "slot_stamp", "row_req"):
            assert torch.equal(getattr(dev_table, name).cpu(), getattr(ref_table, name)), (step, name)
        hits += int(want.residency.hit_mask.sum())
    assert hits > 0


@_needs_extension(fused.LIM_KERNEL)
def test_fused_lim_serves_verify_rows_sharing_a_row():
    check_lim_verify_rows("npu")


# --------------------------------------------------------------------- Copy-SFA
@_needs_extension(fused.COPY_SFA_KERNEL)
@pytest.mark.parametrize("heads", [16, 4])
def test_fused_copy_sfa_matches_reference(heads):
    gen = torch.Generator().manual_seed(20 + heads)
    host_rows, max_ctx = 65536, 16384
    pool = HostKVPool.allocate(HostPoolShape(layers=1, tokens=host_rows, latent_dim=LATENT, rope_dim=ROPE), "pinned")
    host = pool.layer(0)
    host.copy_(torch.randn(host_rows, LATENT + ROPE, generator=gen).to(torch.bfloat16))
    fused.register_host_memory(pool.data)  # the whole pool once; layer views are found inside it
    token_table = torch.stack([torch.randperm(host_rows, generator=gen)[:max_ctx] for _ in range(ROWS)]).to(torch.int32)
    lens = torch.randint(4000, max_ctx - 8, (ROWS,), generator=gen)

    table = ResidencyTable.empty(ROWS, HOT)
    hot_ref = torch.full((ROWS, HOT, LATENT + ROPE), float("nan"), dtype=torch.bfloat16)
    hot_dev = hot_ref.npu()
    copy_sfa = registry.select("copy_sparse_flash_attention", "fused")
    scale = (LATENT + ROPE) ** -0.5
    for step in range(3):
        token_rows = torch.randperm(ROWS, generator=gen).to(torch.int32)
        # fresh random selections: about K / context of them repeat (hits), the rest miss
        topk = torch.stack([torch.randperm(int(lens[r]) + step, generator=gen)[:TOP_K] for r in token_rows.tolist()])
        topk = topk.to(torch.int32).unsqueeze(1)
        topk[0, 0, TOP_K // 2 :] = -1  # a token with fewer selected positions
        res = residency_manage(
            table.slot_token,
            table.slot_stamp,
            table.row_req,
            fused.scatter_token_topk(topk, token_rows, ROWS),
            torch.arange(ROWS, dtype=torch.int64),
            (lens + step).to(torch.int32),
            step,
        )
        sparse = fused.token_hot_indices(res.slots, token_rows, HOT)
        query = torch.randn(ROWS, heads, LATENT, generator=gen).to(torch.bfloat16)
        query_rope = torch.randn(ROWS, heads, ROPE, generator=gen).to(torch.bfloat16)
        kw = dict(
            token_rows=token_rows,
            miss_tokens=res.miss_tokens,
            miss_slots=res.miss_slots,
            miss_count=res.miss_count,
            token_table=token_table,
        )
        want = fused.copy_sparse_flash_attention(query, host, hot_ref, sparse, scale, query_rope=query_rope, **kw)
        got = copy_sfa(query.npu(), host, hot_dev, sparse.npu(), scale, query_rope=query_rope.npu(), **_dev(kw))
        assert torch.equal(hot_dev.cpu().view(torch.int16), hot_ref.view(torch.int16)), step
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=ATTN_TOL, rtol=ATTN_TOL)
    pool.close()
