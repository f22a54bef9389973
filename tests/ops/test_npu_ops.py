"""The ``npu`` rung (torch_npu built-ins) against the reference.

Two parts:

* ``npu``-marked tests run the real torch_npu operators on an Ascend NPU and compare
  with the reference rung (computed on CPU copies of the same inputs). Skipped with a
  reason elsewhere. Tolerances:
    - lightning indexers: every returned index is visible and distinct, the count of
      valid entries is ``min(visible, K)``, and each selected position's reference
      score is at least the reference K-th best score minus ``2e-2 * max|score|`` of
      that token (bf16/int8 kernels accumulate differently, so exact near-ties may
      swap);
    - sparse attention, bf16: ``|npu - ref| <= 2e-2 + 2e-2 * |ref|``;
    - gather/scatter: bit-exact.
* Unmarked tests run everywhere: they drive the wrappers against a stand-in
  ``torch_npu`` whose functions have the documented torch_npu signatures and compute
  with the reference, which checks argument names, tensor plumbing and the
  ``flat``-to-``PA_BSND`` mapping without an NPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from npu_requirements import npu_present

from sglang_ascend_offload import platform
from sglang_ascend_offload.ops import hadamard, npu_impls, reference, registry

ON_NPU = platform.device_kind() == "npu"
NPU_REASON = "needs an Ascend NPU with CANN and torch_npu"

INDEXER_SCORE_TOL = 2e-2
ATTN_TOL = 2e-2


# ----------------------------------------------------------------------- inputs
def paged_identity_free(seqs, block_size, gen):
    """Shuffled paged cache [blocks, bs, 1, D] (zeros in unused slots) + int32 table."""
    dim, dtype = seqs[0].shape[1], seqs[0].dtype
    need = [(s.shape[0] + block_size - 1) // block_size for s in seqs]
    blocks = sum(need) + 2
    cache = torch.zeros(blocks, block_size, 1, dim, dtype=dtype)
    table = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    order = torch.randperm(blocks, generator=gen).tolist()
    for b, seq in enumerate(seqs):
        for j in range(need[b]):
            blk = order.pop()
            table[b, j] = blk
            part = seq[j * block_size : (j + 1) * block_size]
            cache[blk, : part.shape[0], 0] = part
    return cache, table


def indexer_inputs(seed, q_lens, kv_lens, heads, dim, block_size, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, dim, generator=gen).to(dtype) for n in kv_lens]
    cache, table = paged_identity_free(keys, block_size, gen)
    total = sum(q_lens)
    query = torch.randn(total, heads, dim, generator=gen).to(dtype)
    weights = (torch.randn(total, heads, generator=gen) * 0.1).to(dtype)
    meta = dict(
        actual_seq_lengths_query=torch.tensor(q_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        actual_seq_lengths_key=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=table,
    )
    return query, cache, weights, meta


def attention_inputs(seed, q_lens, kv_lens, heads, d_latent, d_rope, block_size, k, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    latent = [torch.randn(n, d_latent, generator=gen).to(dtype) for n in kv_lens]
    rope = [torch.randn(n, d_rope, generator=gen).to(dtype) for n in kv_lens]
    key, table = paged_identity_free(latent, block_size, gen)
    key_rope = torch.zeros(*key.shape[:3], d_rope, dtype=dtype)
    for b, seq in enumerate(rope):
        for p in range(seq.shape[0]):
            key_rope[int(table[b, p // block_size]), p % block_size, 0] = seq[p]
    total = sum(q_lens)
    query = torch.randn(total, heads, d_latent, generator=gen).to(dtype)
    query_rope = torch.randn(total, heads, d_rope, generator=gen).to(dtype)
    rows = []
    for q, kv in zip(q_lens, kv_lens):
        for i in range(q):
            visible = kv - q + i + 1
            pick = torch.randperm(visible, generator=gen)[: min(k, visible)].tolist()
            rows.append(pick + [-1] * (k - len(pick)))
    indices = torch.tensor(rows, dtype=torch.int32).unsqueeze(1)
    meta = dict(
        block_table=table,
        actual_seq_lengths_query=torch.tensor(q_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        actual_seq_lengths_kv=torch.tensor(kv_lens, dtype=torch.int32),
    )
    return query, query_rope, key, key_rope, indices, meta


def to(device, mapping):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mapping.items()}


def assert_indexer_close(npu_out, ref_scores, sparse_count):
    """See the module docstring for what 'close' means for top-k."""
    npu_out = npu_out.cpu().reshape(ref_scores.shape[0], -1)
    assert npu_out.shape[1] == sparse_count
    for t in range(ref_scores.shape[0]):
        scores = ref_scores[t]
        visible = int(torch.isfinite(scores).sum())
        got = npu_out[t][npu_out[t] >= 0].long()
        assert got.numel() == min(visible, sparse_count), t
        assert got.unique().numel() == got.numel() and int(got.max()) < visible, t
        kth = torch.sort(scores[:visible], descending=True).values[min(visible, sparse_count) - 1]
        tol = INDEXER_SCORE_TOL * float(scores[:visible].abs().max())
        assert float(scores[got].min()) >= float(kth) - tol, t


# ------------------------------------------------------------------ real NPU tests
@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason=NPU_REASON)
@pytest.mark.parametrize("seed", [0, 1])
def test_npu_lightning_indexer_matches_reference(seed):
    query, cache, weights, meta = indexer_inputs(seed, [4, 1, 2], [3000, 1500, 2200], 64, 128, 128)
    impl = registry.select("lightning_indexer", "npu")
    out = impl(query.npu(), cache.npu(), weights.npu(), sparse_count=2048, **to("npu", meta))
    assert out.dtype == torch.int32 and tuple(out.shape) == (7, 1, 2048)
    scores = reference.indexer_scores_dense(query, cache, weights, **meta)
    assert_indexer_close(out, scores, 2048)


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason=NPU_REASON)
def test_npu_quant_lightning_indexer_matches_reference():
    query, cache, weights, meta = indexer_inputs(2, [3, 1], [2600, 900], 64, 128, 128)
    prep = hadamard.prepare_quant_indexer_inputs(query, cache)
    weights16 = weights.to(torch.float16)  # the kernel documents fp16 weights
    impl = registry.select("quant_lightning_indexer", "npu")
    out = impl(
        prep.query.npu(),
        prep.key.npu(),
        weights16.npu(),
        prep.query_dequant_scale.npu(),
        prep.key_dequant_scale.npu(),
        sparse_count=2048,
        **to("npu", meta),
    )
    assert out.dtype == torch.int32 and tuple(out.shape) == (4, 1, 2048)
    q_deq = hadamard.dequantize_int8(prep.query, prep.query_dequant_scale)
    k_deq = hadamard.dequantize_int8(prep.key, prep.key_dequant_scale)
    scores = reference.indexer_scores_dense(q_deq, k_deq, weights16, **meta)
    assert_indexer_close(out, scores, 2048)


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason=NPU_REASON)
@pytest.mark.parametrize("heads", [16, 128])
def test_npu_sparse_attention_paged_matches_reference(heads):
    query, query_rope, key, key_rope, idx, meta = attention_inputs(3, [2, 1], [3000, 700], heads, 512, 64, 128, 2048)
    scale = (512 + 64) ** -0.5
    impl = registry.select("sparse_mla_attention", "npu")
    key_npu = key.npu()
    out = impl(
        query.npu(),
        key_npu,
        key_npu,
        idx.npu(),
        scale,
        query_rope=query_rope.npu(),
        key_rope=key_rope.npu(),
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=3,
        **to("npu", meta),
    )
    ref = reference.sparse_mla_attention(query, key, None, idx, scale, query_rope=query_rope, key_rope=key_rope, **meta)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=ATTN_TOL, rtol=ATTN_TOL)


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason=NPU_REASON)
def test_npu_sparse_attention_flat_hot_buffer_matches_reference():
    gen = torch.Generator().manual_seed(4)
    tokens, heads, k, slots = 3, 16, 2048, 4096
    latent = torch.randn(slots, 512, generator=gen).to(torch.bfloat16)
    rope = torch.randn(slots, 64, generator=gen).to(torch.bfloat16)
    query = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16)
    query_rope = torch.randn(tokens, heads, 64, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(slots, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    idx[1, 100:] = -1
    idx = idx.unsqueeze(1)
    scale = 0.04
    impl = registry.select("sparse_mla_attention", "npu")
    out = impl(
        query.npu(),
        latent.npu(),
        None,
        idx.npu(),
        scale,
        query_rope=query_rope.npu(),
        key_rope=rope.npu(),
        layout_kv="flat",
    )
    ref = reference.sparse_mla_attention(
        query, latent, None, idx, scale, query_rope=query_rope, key_rope=rope, layout_kv="flat"
    )
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=ATTN_TOL, rtol=ATTN_TOL)


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason=NPU_REASON)
def test_npu_gather_scatter_bit_exact():
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(4096, 576, generator=gen).to(torch.bfloat16)
    index = torch.randperm(4096, generator=gen)[:777].to(torch.int32)
    gather = registry.select("gather_rows", "npu")
    rows = gather(src.npu(), index.npu())
    assert torch.equal(rows.cpu().view(torch.int16), reference.gather_rows(src, index).view(torch.int16))
    dst = torch.randn(2048, 576, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(2048, generator=gen)[:777]
    scatter = registry.select("scatter_rows", "npu")
    got = scatter(dst.npu(), slots.npu(), rows).cpu()
    expected = reference.scatter_rows(dst.clone(), slots, rows.cpu())
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


# --------------------------------------------- wrappers against a stand-in torch_npu
def _stand_in_torch_npu(calls):
    """A module with torch_npu's documented signatures, computing with the reference."""
    mod = types.ModuleType("torch_npu")

    def npu_lightning_indexer(
        query,
        key,
        weights,
        *,
        actual_seq_lengths_query=None,
        actual_seq_lengths_key=None,
        block_table=None,
        layout_query="BSND",
        layout_key="BSND",
        sparse_count=2048,
        sparse_mode=3,
        pre_tokens=2**63 - 1,
        next_tokens=2**63 - 1,
        return_value=False,
    ):
        calls.append("npu_lightning_indexer")
        assert block_table.dtype == torch.int32 and actual_seq_lengths_key.dtype == torch.int32
        idx = reference.lightning_indexer(
            query,
            key,
            weights,
            actual_seq_lengths_query=actual_seq_lengths_query,
            actual_seq_lengths_key=actual_seq_lengths_key,
            block_table=block_table,
            layout_query=layout_query,
            layout_key=layout_key,
            sparse_count=sparse_count,
            sparse_mode=sparse_mode,
        )
        return idx, torch.zeros(idx.shape, dtype=query.dtype)

    def npu_quant_lightning_indexer(
        query,
        key,
        weights,
        query_dequant_scale,
        key_dequant_scale,
        *,
        actual_seq_lengths_query=None,
        actual_seq_lengths_key=None,
        block_table=None,
        query_quant_mode=0,
        key_quant_mode=0,
        layout_query="BSND",
        layout_key="BSND",
        sparse_count=2048,
        sparse_mode=3,
    ):
        calls.append("npu_quant_lightning_indexer")
        assert key_dequant_scale.dim() == 3, "PA_BSND key scale is [blocks, block_size, N2]"
        # op-plugin docs/context/torch_npu-npu_quant_lightning_indexer.md (A2 and A3): int8
        # query / key take float16 weights, query_dequant_scale and key_dequant_scale
        dtypes = (weights.dtype, query_dequant_scale.dtype, key_dequant_scale.dtype)
        assert dtypes == (torch.float16,) * 3, f"int8 indexer needs fp16 weights and scales, got {dtypes}"
        return reference.quant_lightning_indexer(
            query,
            key,
            weights,
            query_dequant_scale,
            key_dequant_scale,
            actual_seq_lengths_query=actual_seq_lengths_query,
            actual_seq_lengths_key=actual_seq_lengths_key,
            block_table=block_table,
            query_quant_mode=query_quant_mode,
            key_quant_mode=key_quant_mode,
            layout_query=layout_query,
            layout_key=layout_key,
            sparse_count=sparse_count,
            sparse_mode=sparse_mode,
        )

    def npu_sparse_flash_attention(
        query,
        key,
        value,
        sparse_indices,
        scale_value,
        *,
        block_table=None,
        actual_seq_lengths_query=None,
        actual_seq_lengths_kv=None,
        query_rope=None,
        key_rope=None,
        sparse_block_size=1,
        layout_query="BSND",
        layout_kv="BSND",
        sparse_mode=3,
        pre_tokens=2**63 - 1,
        next_tokens=2**63 - 1,
        attention_mode=0,
        return_softmax_lse=False,
    ):
        calls.append("npu_sparse_flash_attention")
        assert layout_kv == "PA_BSND" and attention_mode == 2 and value is key
        assert sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 3
        out = reference.sparse_mla_attention(
            query,
            key,
            None,
            sparse_indices,
            scale_value,
            block_table=block_table,
            actual_seq_lengths_query=actual_seq_lengths_query,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            query_rope=query_rope,
            key_rope=key_rope,
            sparse_block_size=sparse_block_size,
            layout_query=layout_query,
            layout_kv=layout_kv,
            sparse_mode=sparse_mode,
            attention_mode=attention_mode,
        )
        return out, torch.empty(0), torch.empty(0)

    mod.npu_lightning_indexer = npu_lightning_indexer
    mod.npu_quant_lightning_indexer = npu_quant_lightning_indexer
    mod.npu_sparse_flash_attention = npu_sparse_flash_attention
    return mod


@pytest.fixture
def stand_in(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", _stand_in_torch_npu(calls))
    return calls


def test_indexer_wrappers_plumb_arguments(stand_in):
    query, cache, weights, meta = indexer_inputs(6, [3, 1], [40, 17], 4, 32, 16)
    meta64 = dict(meta, actual_seq_lengths_key=meta["actual_seq_lengths_key"].long())
    got = npu_impls.lightning_indexer_npu(query, cache, weights, sparse_count=8, **meta64)
    assert torch.equal(got, reference.lightning_indexer(query, cache, weights, sparse_count=8, **meta))
    prep = hadamard.prepare_quant_indexer_inputs(query, cache)
    for key_scale in (prep.key_dequant_scale, prep.key_dequant_scale.unsqueeze(-1)):
        got = npu_impls.quant_lightning_indexer_npu(
            prep.query, prep.key, weights, prep.query_dequant_scale, key_scale, sparse_count=8, **meta
        )
        expected = reference.quant_lightning_indexer(
            prep.query, prep.key, weights, prep.query_dequant_scale, prep.key_dequant_scale, sparse_count=8, **meta
        )
        assert torch.equal(got, expected)
    assert stand_in == ["npu_lightning_indexer"] + ["npu_quant_lightning_indexer"] * 2


def test_the_c8_wrapper_hands_torch_npu_fp16_weights_from_bf16_ones_exactly(stand_in):
    """The model's indexer weights are bf16 (the fused LIM-C8 takes them so); torch_npu's int8
    indexer takes fp16 weights and scales: the wrapper converts them, and the result equals
    the reference on the bf16 weights (the conversion is exact at these magnitudes). The
    documented rule is held by the stand-in: called with the bf16 weights as they come, it
    refuses (negative control: the wrapper that passed them through failed here)."""
    query, cache, weights, meta = indexer_inputs(9, [2, 2], [48, 33], 4, 32, 16)
    assert weights.dtype == torch.bfloat16
    prep = hadamard.prepare_quant_indexer_inputs(query, cache)
    args = (prep.query, prep.key, weights, prep.query_dequant_scale.float(), prep.key_dequant_scale)
    got = npu_impls.quant_lightning_indexer_npu(*args, sparse_count=8, **meta)
    expected = reference.quant_lightning_indexer(
        prep.query, prep.key, weights, prep.query_dequant_scale, prep.key_dequant_scale, sparse_count=8, **meta
    )
    assert torch.equal(got, expected) and stand_in == ["npu_quant_lightning_indexer"]
    raw = sys.modules["torch_npu"].npu_quant_lightning_indexer
    with pytest.raises(AssertionError, match="fp16 weights and scales"):
        raw(*args[:4], prep.key_dequant_scale, sparse_count=8, **meta)


def test_attention_wrapper_paged_and_flat_mapping(stand_in):
    query, query_rope, key, key_rope, idx, meta = attention_inputs(7, [2, 1], [50, 20], 4, 32, 8, 16, 24)
    paged = npu_impls.sparse_mla_attention_npu(
        query, key, key, idx, 0.1, query_rope=query_rope, key_rope=key_rope, **meta
    )
    assert torch.equal(
        paged,
        reference.sparse_mla_attention(query, key, None, idx, 0.1, query_rope=query_rope, key_rope=key_rope, **meta),
    )
    # flat: a 96-row buffer (block 32) and a 48-row one (block 16), as [S, D] and [S, 1, D]
    gen = torch.Generator().manual_seed(8)
    for rows, shape in ((96, lambda x: x), (48, lambda x: x.unsqueeze(1))):
        latent = torch.randn(rows, 32, generator=gen).to(torch.bfloat16)
        rope = torch.randn(rows, 8, generator=gen).to(torch.bfloat16)
        flat_idx = torch.stack([torch.randperm(rows, generator=gen)[:24] for _ in range(3)]).to(torch.int32)
        flat_idx[0, 5:] = -1
        flat_idx = flat_idx.unsqueeze(1)
        got = npu_impls.sparse_mla_attention_npu(
            query, shape(latent), None, flat_idx, 0.1, query_rope=query_rope, key_rope=shape(rope), layout_kv="flat"
        )
        expected = reference.sparse_mla_attention(
            query, latent, None, flat_idx, 0.1, query_rope=query_rope, key_rope=rope, layout_kv="flat"
        )
        assert torch.equal(got, expected)
    # a buffer of any row count (40: no multiple of the 16-row blocks): each token's selection
    # is gathered into blocks of its own, so the buffer's size does not matter
    latent, rope = latent[:40], rope[:40]
    flat_idx = torch.where(flat_idx < 40, flat_idx, torch.full_like(flat_idx, -1))
    got = npu_impls.sparse_mla_attention_npu(
        query, latent, None, flat_idx, 0.1, query_rope=query_rope, key_rope=rope, layout_kv="flat"
    )
    expected = reference.sparse_mla_attention(
        query, latent, None, flat_idx, 0.1, query_rope=query_rope, key_rope=rope, layout_kv="flat"
    )
    assert torch.equal(got, expected)


def test_copy_wrappers_are_bit_exact_on_cpu_tensors():
    src = torch.randn(30, 8).to(torch.bfloat16)
    index = torch.tensor([4, 0, 29, 7], dtype=torch.int32)
    assert torch.equal(npu_impls.gather_rows_npu(src, index).view(torch.int16), src[index.long()].view(torch.int16))
    dst = torch.zeros(10, 8, dtype=torch.bfloat16)
    npu_impls.scatter_rows_npu(dst, torch.tensor([9, 2, 5, 0]), src[:4])
    assert torch.equal(dst[[9, 2, 5, 0]].view(torch.int16), src[:4].view(torch.int16))


@pytest.mark.skipif(ON_NPU, reason="checks the reasons given off Ascend")
def test_fused_rung_check_reports_missing_pieces():
    reason = npu_impls.fused_op_unavailable("npu_fused_lightning_indexer_manage")
    assert reason is not None and ("torch_npu" in reason or "NPU" in reason)
