"""The reference rung is the specification: check it against independent computations.

Independent checks are plain loops / dense float64 math over tiny cases. Where only
copies and gathers differ between two computations, results must be bit-identical
(``torch.equal``). Tolerances, where math differs:

* attention vs a dense float64 softmax: fp32 inputs 2e-5 abs + 2e-5 rel; bf16 inputs
  (bf16 output rounding, 2**-8 relative) 1e-2 abs + 1e-2 rel;
* C8 (Hadamard + int8) indexer scores vs exact: per (token, position),
  ``|c8 - exact| <= 0.005 * sum_h |w_h| * |q_h| * |k|`` (measured max 0.0008 with an
  outlier channel; 0.0018 without the rotation).
"""

from __future__ import annotations

import pytest
import torch

from sglang_ascend_offload import platform
from sglang_ascend_offload.ops import hadamard, reference, registry
from sglang_ascend_offload.ops.registry import OpUnavailableError

C8_SCORE_TOLERANCE = 0.005
NO_BLOCK = 10**6  # unused block-table entries: reading one would raise


# ----------------------------------------------------------------------- helpers
def make_paged(seqs, block_size, num_blocks, gen, fill=float("nan")):
    """Lay logical per-request rows ``seqs[b]`` ([L_b, D]) into a shuffled paged cache.

    Returns (cache [num_blocks, block_size, 1, D], block_table int32 [B, max_blocks]);
    unused slots hold ``fill`` and unused table entries hold NO_BLOCK.
    """
    dim, dtype = seqs[0].shape[1], seqs[0].dtype
    cache = torch.full((num_blocks, block_size, 1, dim), fill, dtype=dtype)
    need = [(s.shape[0] + block_size - 1) // block_size for s in seqs]
    max_blocks = max(need) + 1
    table = torch.full((len(seqs), max_blocks), NO_BLOCK, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for b, seq in enumerate(seqs):
        for j in range(need[b]):
            blk = free.pop()
            table[b, j] = blk
            part = seq[j * block_size : (j + 1) * block_size]
            cache[blk, : part.shape[0], 0] = part
    return cache, table


def paged_with_table(seqs, block_size, table, num_blocks, fill=float("nan")):
    """Lay rows into a cache following a given block table."""
    dim, dtype = seqs[0].shape[1], seqs[0].dtype
    cache = torch.full((num_blocks, block_size, 1, dim), fill, dtype=dtype)
    for b, seq in enumerate(seqs):
        for p in range(seq.shape[0]):
            cache[int(table[b, p // block_size]), p % block_size, 0] = seq[p]
    return cache


def cumulative(q_lens):
    return torch.tensor(q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)


class IndexerCase:
    """Three requests: a chunked prefill over a prefix, a decode token, an MTP-style
    three-token verify; index keys laid out in a shuffled paged cache."""

    def __init__(
        self, seed=0, q_lens=(5, 1, 3), kv_lens=(13, 9, 6), heads=4, dim=16, block_size=4, dtype=torch.bfloat16
    ):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens, self.block_size = list(q_lens), list(kv_lens), block_size
        self.keys = [torch.randn(n, dim, generator=gen).to(dtype) for n in kv_lens]
        total = sum(q_lens)
        self.query = torch.randn(total, heads, dim, generator=gen).to(dtype)
        self.weights = torch.randn(total, heads, generator=gen).to(dtype)
        blocks = sum((n + block_size - 1) // block_size for n in kv_lens) + 3
        self.cache, self.table = make_paged(self.keys, block_size, blocks, gen)
        self.cu_q = cumulative(q_lens)
        self.kv = torch.tensor(kv_lens, dtype=torch.int32)

    def kwargs(self, **over):
        kw = dict(
            actual_seq_lengths_query=self.cu_q,
            actual_seq_lengths_key=self.kv,
            block_table=self.table,
            layout_query="TND",
            layout_key="PA_BSND",
            sparse_mode=3,
        )
        kw.update(over)
        return kw

    def token_positions(self):
        """(request, position) of every query token, from first principles."""
        out = []
        for b, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens)):
            out += [(b, kv - q + i) for i in range(q)]
        return out


def loop_topk(case: IndexerCase, k: int) -> torch.Tensor:
    """Plain loops in float64, then torch.topk; -1 padded. [T, 1, k] int32."""
    rows = []
    for t, (b, pos) in enumerate(case.token_positions()):
        scores = []
        for s in range(pos + 1):
            total = 0.0
            for h in range(case.query.shape[1]):
                dot = float(torch.dot(case.query[t, h].double(), case.keys[b][s].double()))
                total += float(case.weights[t, h]) * max(dot, 0.0)
            scores.append(total)
        top = torch.topk(torch.tensor(scores, dtype=torch.float64), min(k, pos + 1)).indices.tolist()
        rows.append(top + [-1] * (k - len(top)))
    return torch.tensor(rows, dtype=torch.int32).unsqueeze(1)


# ----------------------------------------------------------------------- indexer
def test_indexer_matches_independent_loops():
    case = IndexerCase(dtype=torch.float32)
    out = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=6, **case.kwargs())
    assert out.dtype == torch.int32 and out.shape == (sum(case.q_lens), 1, 6)
    assert torch.equal(out, loop_topk(case, 6))


def test_indexer_bf16_inputs_match_loops():
    case = IndexerCase(seed=1)  # bf16 query/key/weights, scored in float32
    out = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=4, **case.kwargs())
    assert torch.equal(out, loop_topk(case, 4))


def test_indexer_paged_equals_contiguous_layout():
    case = IndexerCase(seed=2)
    bs = case.block_size
    # contiguous: request b's blocks are consecutive, in order
    counts = [(n + bs - 1) // bs for n in case.kv_lens]
    table = torch.full_like(case.table, NO_BLOCK)
    start = 0
    for b, n in enumerate(counts):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    contiguous = paged_with_table(case.keys, bs, table, start)
    shuffled = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=5, **case.kwargs())
    linear = reference.lightning_indexer(
        case.query, contiguous, case.weights, sparse_count=5, **case.kwargs(block_table=table)
    )
    assert torch.equal(shuffled, linear)


def test_indexer_is_causal():
    case = IndexerCase(seed=3)
    k = 16  # more than any visible count: every visible position is returned
    out = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=k, **case.kwargs())
    for t, (b, pos) in enumerate(case.token_positions()):
        got = out[t, 0]
        valid = got[got >= 0]
        assert sorted(valid.tolist()) == list(range(pos + 1)), (t, pos)
    # changing keys the first prefill token cannot see does not change its result
    first_pos = case.token_positions()[0][1]
    keys2 = [k_.clone() for k_ in case.keys]
    keys2[0][first_pos + 1 :] = 100.0
    cache2 = paged_with_table(keys2, case.block_size, case.table, case.cache.shape[0])
    out2 = reference.lightning_indexer(case.query, cache2, case.weights, sparse_count=3, **case.kwargs())
    out1 = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=3, **case.kwargs())
    assert torch.equal(out1[0], out2[0])
    assert not torch.equal(out1[case.q_lens[0] - 1], out2[case.q_lens[0] - 1])  # the last one sees them


def test_indexer_sparse_mode_0_sees_whole_request():
    case = IndexerCase(seed=4)
    out = reference.lightning_indexer(
        case.query, case.cache, case.weights, sparse_count=16, **case.kwargs(sparse_mode=0)
    )
    for t, (b, _pos) in enumerate(case.token_positions()):
        valid = out[t, 0][out[t, 0] >= 0]
        assert sorted(valid.tolist()) == list(range(case.kv_lens[b]))


def test_indexer_pads_with_minus_one():
    case = IndexerCase(seed=5, q_lens=(1, 2), kv_lens=(3, 5))
    out = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=8, **case.kwargs())
    expected_valid = [3, 4, 5]  # decode sees 3; verify tokens at positions 3 and 4
    for t, n in enumerate(expected_valid):
        assert (out[t, 0, :n] >= 0).all() and (out[t, 0, n:] == -1).all()


def test_indexer_padding_tokens_get_minus_one():
    case = IndexerCase(seed=6, q_lens=(2,), kv_lens=(7,))
    query = torch.cat((case.query, torch.randn(3, *case.query.shape[1:]).to(case.query.dtype)))
    weights = torch.cat((case.weights, torch.ones(3, case.weights.shape[1]).to(case.weights.dtype)))
    out = reference.lightning_indexer(query, case.cache, weights, sparse_count=4, **case.kwargs())
    assert (out[2:] == -1).all()
    assert (out[:2] >= 0).all()


def test_indexer_batch_equals_per_request_calls():
    case = IndexerCase(seed=7)
    batched = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=5, **case.kwargs())
    start = 0
    for b, q in enumerate(case.q_lens):
        single = reference.lightning_indexer(
            case.query[start : start + q],
            case.cache,
            case.weights[start : start + q],
            sparse_count=5,
            **case.kwargs(
                actual_seq_lengths_query=torch.tensor([q], dtype=torch.int32),
                actual_seq_lengths_key=case.kv[b : b + 1],
                block_table=case.table[b : b + 1],
            ),
        )
        assert torch.equal(batched[start : start + q], single), b
        start += q


def test_indexer_chunking_does_not_change_result(monkeypatch):
    case = IndexerCase(seed=8, kv_lens=(23, 17, 11), block_size=4)
    whole = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=7, **case.kwargs())
    monkeypatch.setattr(reference, "INDEXER_CONTEXT_CHUNK", 3)
    monkeypatch.setattr(reference, "INDEXER_SCORE_BUDGET", 1)  # one token per group
    chunked = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=7, **case.kwargs())
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("chunk", [4096, 3])
def test_indexer_ties_go_to_lower_position(monkeypatch, chunk):
    monkeypatch.setattr(reference, "INDEXER_CONTEXT_CHUNK", chunk)
    gen = torch.Generator().manual_seed(9)
    heads, dim, kv = 2, 8, 14
    strong, weak = torch.randn(dim, generator=gen).abs(), torch.randn(dim, generator=gen).abs() * 0.1
    is_strong = torch.tensor([s % 3 == 2 for s in range(kv)])
    keys = torch.where(is_strong.unsqueeze(1), strong, weak)  # two distinct score values only
    query = torch.ones(1, heads, dim)
    weights = torch.ones(1, heads)
    cache, table = make_paged([keys], 4, 6, gen)
    out = reference.lightning_indexer(
        query,
        cache,
        weights,
        actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor([kv], dtype=torch.int32),
        block_table=table,
        sparse_count=8,
    )
    strong_pos = [s for s in range(kv) if is_strong[s]]
    weak_pos = [s for s in range(kv) if not is_strong[s]]
    assert out[0, 0].tolist() == (strong_pos + weak_pos)[:8]


def test_indexer_dense_scores_helper_agrees_with_topk():
    case = IndexerCase(seed=10, dtype=torch.float32)
    dense = reference.indexer_scores_dense(
        case.query,
        case.cache,
        case.weights,
        **{k: v for k, v in case.kwargs().items() if k not in ("layout_query", "layout_key")},
    )
    out = reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=4, **case.kwargs())
    assert torch.equal(torch.topk(dense, 4).indices.to(torch.int32), out[:, 0])


def test_indexer_rejects_bad_metadata():
    case = IndexerCase(seed=11)
    with pytest.raises(ValueError, match="kv length"):
        reference.lightning_indexer(
            case.query,
            case.cache,
            case.weights,
            sparse_count=4,
            **case.kwargs(actual_seq_lengths_key=torch.tensor([2, 9, 6], dtype=torch.int32)),
        )
    with pytest.raises(ValueError, match="layout"):
        reference.lightning_indexer(
            case.query, case.cache, case.weights, sparse_count=4, **case.kwargs(layout_key="BSND")
        )
    with pytest.raises(ValueError, match="sparse_mode"):
        reference.lightning_indexer(case.query, case.cache, case.weights, sparse_count=4, **case.kwargs(sparse_mode=1))


# ------------------------------------------------------------ Hadamard + C8 indexer
def test_hadamard_rotation_is_the_normalised_sylvester_transform():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, 3, 64, generator=gen)
    mat = hadamard.hadamard_matrix(64)
    torch.testing.assert_close(mat @ mat.T, torch.eye(64), atol=1e-6, rtol=0)
    rotated = hadamard.hadamard_rotate(x)
    torch.testing.assert_close(rotated, x @ mat, atol=1e-5, rtol=1e-5)
    # orthonormal: dot products survive
    torch.testing.assert_close((rotated[0] * rotated[1]).sum(-1), (x[0] * x[1]).sum(-1), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard.hadamard_rotate(torch.randn(2, 48))


def test_int8_quantisation_error_and_zero_rows():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(6, 4, 128, generator=gen) * torch.rand(6, 4, 1, generator=gen) * 10
    x[2, 1] = 0.0
    values, scales = hadamard.quantize_per_token_int8(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (6, 4)
    amax = x.abs().amax(-1)
    assert (values.abs() <= 127).all()
    err = (hadamard.dequantize_int8(values, scales) - x).abs().amax(-1)
    bound = scales.float() * 0.5 + amax * 2.0**-10  # half a step + fp16 rounding of the scale
    assert (err <= bound + 1e-7).all()
    assert scales[2, 1] == 0 and (values[2, 1] == 0).all()


class QuantCase:
    """One request, 40 index keys, scores well separated by construction."""

    def __init__(self, seed=14, kv=40, heads=4, dim=128, block_size=16):
        gen = torch.Generator().manual_seed(seed)
        direction = torch.randn(dim, generator=gen)
        direction /= direction.norm()
        magnitude = 1.0 + 0.5 * torch.randperm(kv, generator=gen).float()  # distinct, gap 0.5
        noise = torch.randn(kv, dim, generator=gen) * 0.02
        self.keys = (magnitude.unsqueeze(1) * direction + noise).to(torch.bfloat16)
        q_lens = [2]
        self.query = (direction + 0.05 * torch.randn(2, heads, dim, generator=gen)).to(torch.bfloat16)
        self.weights = (0.5 + torch.rand(2, heads, generator=gen)).to(torch.bfloat16)
        self.cache, self.table = make_paged([self.keys], block_size, 4, gen, fill=0.0)
        self.kw = dict(
            actual_seq_lengths_query=cumulative(q_lens),
            actual_seq_lengths_key=torch.tensor([kv], dtype=torch.int32),
            block_table=self.table,
            sparse_count=12,
        )


def test_c8_indexer_matches_bf16_on_well_separated_scores():
    case = QuantCase()
    prep = hadamard.prepare_quant_indexer_inputs(case.query, case.cache)
    assert prep.query.dtype == torch.int8 and prep.query_dequant_scale.shape == case.query.shape[:2]
    assert prep.key_dequant_scale.shape == case.cache.shape[:3]
    c8 = reference.quant_lightning_indexer(
        prep.query, prep.key, case.weights, prep.query_dequant_scale, prep.key_dequant_scale, **case.kw
    )
    exact = reference.lightning_indexer(case.query, case.cache, case.weights, **case.kw)
    # precondition that makes the comparison meaningful: adjacent top-k score gaps
    # exceed twice the largest C8 scoring error
    dense = reference.indexer_scores_dense(
        case.query, case.cache, case.weights, **{k: v for k, v in case.kw.items() if k != "sparse_count"}
    )
    deq = reference.indexer_scores_dense(
        hadamard.dequantize_int8(prep.query, prep.query_dequant_scale),
        hadamard.dequantize_int8(prep.key, prep.key_dequant_scale),
        case.weights,
        **{k: v for k, v in case.kw.items() if k != "sparse_count"},
    )
    visible = torch.isfinite(dense)
    max_err = (deq[visible] - dense[visible]).abs().max()
    top = torch.sort(dense, dim=1, descending=True).values[:, :13]
    assert (top[:, :-1] - top[:, 1:]).min() > 2 * max_err
    assert torch.equal(c8, exact)


def test_c8_scores_within_stated_tolerance_of_exact():
    gen = torch.Generator().manual_seed(15)
    heads, dim, kv = 8, 128, 64
    query = torch.randn(3, heads, dim, generator=gen).to(torch.bfloat16)
    keys = torch.randn(kv, dim, generator=gen)
    keys[:, 5] *= 20  # an outlier channel: what the rotation is for
    keys = keys.to(torch.bfloat16)
    weights = torch.randn(3, heads, generator=gen)
    w = weights.double().unsqueeze(2)
    exact = (torch.einsum("thd,sd->ths", query.double(), keys.double()).relu() * w).sum(1)
    scale = (w.abs() * query.double().norm(dim=-1).unsqueeze(2) * keys.double().norm(dim=-1)).sum(1)

    def relative_error(quantize):
        q_int, q_scale = quantize(query)
        k_int, k_scale = quantize(keys)
        q_deq, k_deq = hadamard.dequantize_int8(q_int, q_scale), hadamard.dequantize_int8(k_int, k_scale)
        c8 = (torch.einsum("thd,sd->ths", q_deq.double(), k_deq.double()).relu() * w).sum(1)
        return float(((c8 - exact).abs() / scale).max())

    rotated = relative_error(hadamard.rotate_and_quantize)
    assert rotated <= C8_SCORE_TOLERANCE, rotated
    assert rotated < relative_error(hadamard.quantize_per_token_int8)  # the rotation pays off


def test_c8_op_equals_float_indexer_on_dequantised_inputs():
    case = IndexerCase(seed=16, heads=4, dim=32, dtype=torch.bfloat16)
    prep = hadamard.prepare_quant_indexer_inputs(case.query, case.cache.nan_to_num(0.0))
    c8 = reference.quant_lightning_indexer(
        prep.query,
        prep.key,
        case.weights,
        prep.query_dequant_scale,
        prep.key_dequant_scale,
        sparse_count=5,
        **case.kwargs(),
    )
    q_deq = hadamard.dequantize_int8(prep.query, prep.query_dequant_scale)
    k_deq = hadamard.dequantize_int8(prep.key, prep.key_dequant_scale)
    as_float = reference.lightning_indexer(q_deq, k_deq, case.weights, sparse_count=5, **case.kwargs())
    assert torch.equal(c8, as_float)
    # a [blocks, block_size, 1, 1] scale is accepted too
    c8_4d = reference.quant_lightning_indexer(
        prep.query,
        prep.key,
        case.weights,
        prep.query_dequant_scale,
        prep.key_dequant_scale.unsqueeze(-1),
        sparse_count=5,
        **case.kwargs(),
    )
    assert torch.equal(c8, c8_4d)


# -------------------------------------------------------------- sparse attention
class AttnCase:
    """Paged MLA latent/rope caches for three requests and their query tokens."""

    def __init__(
        self,
        seed=20,
        q_lens=(3, 1, 2),
        kv_lens=(9, 6, 11),
        heads=4,
        d_latent=32,
        d_rope=8,
        block_size=4,
        dtype=torch.float32,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens, self.block_size = list(q_lens), list(kv_lens), block_size
        self.latent = [torch.randn(n, d_latent, generator=gen).to(dtype) for n in kv_lens]
        self.rope = [torch.randn(n, d_rope, generator=gen).to(dtype) for n in kv_lens]
        total = sum(q_lens)
        self.query = torch.randn(total, heads, d_latent, generator=gen).to(dtype)
        self.query_rope = torch.randn(total, heads, d_rope, generator=gen).to(dtype)
        blocks = sum((n + block_size - 1) // block_size for n in kv_lens) + 2
        self.key, self.table = make_paged(self.latent, block_size, blocks, gen)
        self.key_rope = paged_with_table(self.rope, block_size, self.table, blocks)
        self.cu_q = cumulative(q_lens)
        self.kv = torch.tensor(kv_lens, dtype=torch.int32)
        self.scale = (d_latent + d_rope) ** -0.5
        self.gen = gen

    def positions(self):
        out = []
        for b, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens)):
            out += [(b, kv - q + i) for i in range(q)]
        return out

    def paged(self, indices, **over):
        kw = dict(
            query_rope=self.query_rope,
            key_rope=self.key_rope,
            block_table=self.table,
            actual_seq_lengths_query=self.cu_q,
            actual_seq_lengths_kv=self.kv,
            layout_query="TND",
            layout_kv="PA_BSND",
            sparse_mode=3,
        )
        kw.update(over)
        return reference.sparse_mla_attention(self.query, self.key, None, indices, self.scale, **kw)

    def dense(self, t, b, positions):
        """float64 softmax attention of token t over the given logical rows."""
        lat = self.latent[b][positions].double()
        rop = self.rope[b][positions].double()
        logits = (self.query[t].double() @ lat.T + self.query_rope[t].double() @ rop.T) * self.scale
        return torch.softmax(logits, dim=-1) @ lat

    def physical_rows(self, t, indices_row):
        b, _ = self.positions()[t]
        bs = self.block_size
        return [int(self.table[b, p // bs]) * bs + p % bs if p >= 0 else -1 for p in indices_row]


def all_visible_indices(case, k, gen):
    rows = []
    for b, pos in case.positions():
        perm = torch.randperm(pos + 1, generator=gen).tolist()
        rows.append(perm + [-1] * (k - len(perm)))
    return torch.tensor(rows, dtype=torch.int32).unsqueeze(1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
def test_attention_over_all_visible_equals_dense_causal(dtype, tol):
    case = AttnCase(dtype=dtype)
    idx = all_visible_indices(case, 12, case.gen)
    out = case.paged(idx)
    assert out.dtype == dtype and out.shape == case.query.shape
    for t, (b, pos) in enumerate(case.positions()):
        expected = case.dense(t, b, list(range(pos + 1)))
        torch.testing.assert_close(out[t].double(), expected, atol=tol, rtol=tol)


def test_attention_ignores_minus_one_and_garbage_rows():
    case = AttnCase(seed=21)
    chosen = [[0, 2], [1], [4, 3, 0], [5, 1], [2, 7], [0]]
    rows = []
    for sel in chosen:
        row = [-1] * 6
        for j, p in zip([1, 3, 4], sel):
            row[j] = p
        rows.append(row)
    idx = torch.tensor(rows, dtype=torch.int32).unsqueeze(1)
    out = case.paged(idx)  # unused cache slots hold NaN
    assert torch.isfinite(out).all()
    for t, (b, _pos) in enumerate(case.positions()):
        torch.testing.assert_close(out[t].double(), case.dense(t, b, chosen[t]), atol=2e-5, rtol=2e-5)
    # flat buffer whose row 0 (where ignored entries are clamped for the gather) is NaN
    flat_idx = torch.tensor(
        [[r + 1 if r >= 0 else -1 for r in case.physical_rows(t, idx[t, 0].tolist())] for t in range(idx.shape[0])],
        dtype=torch.int32,
    ).unsqueeze(1)
    nan_row = lambda x: torch.cat((torch.full_like(x[:1], float("nan")), x))  # noqa: E731
    flat = reference.sparse_mla_attention(
        case.query,
        nan_row(case.key.reshape(-1, 32)),
        None,
        flat_idx,
        case.scale,
        query_rope=case.query_rope,
        key_rope=nan_row(case.key_rope.reshape(-1, 8)),
        layout_kv="flat",
    )
    assert torch.equal(flat, out)


def test_attention_masks_entries_beyond_causal_position():
    case = AttnCase(seed=22)
    t = 0
    b, pos = case.positions()[t]
    idx = torch.full((len(case.positions()), 1, 3), -1, dtype=torch.int32)
    idx[t, 0] = torch.tensor([0, pos + 1, 1])  # pos+1 is in the cache but in this token's future
    out = case.paged(idx)
    torch.testing.assert_close(out[t].double(), case.dense(t, b, [0, 1]), atol=2e-5, rtol=2e-5)


def test_attention_all_minus_one_gives_zeros():
    case = AttnCase(seed=23)
    idx = torch.full((case.query.shape[0], 1, 5), -1, dtype=torch.int32)
    out = case.paged(idx)
    assert torch.equal(out, torch.zeros_like(out))
    flat = reference.sparse_mla_attention(
        case.query,
        torch.full((8, 32), float("nan")),
        None,
        idx,
        case.scale,
        query_rope=case.query_rope,
        key_rope=torch.full((8, 8), float("nan")),
        layout_kv="flat",
    )
    assert torch.equal(flat, torch.zeros_like(flat))


def test_attention_flat_equals_paged_bitwise():
    case = AttnCase(seed=24, dtype=torch.bfloat16)
    idx = all_visible_indices(case, 12, case.gen)
    idx[0, 0, 2] = -1
    paged = case.paged(idx)
    flat_idx = torch.tensor(
        [case.physical_rows(t, idx[t, 0].tolist()) for t in range(idx.shape[0])], dtype=torch.int32
    ).unsqueeze(1)
    flat = reference.sparse_mla_attention(
        case.query,
        case.key.reshape(-1, 32),
        None,
        flat_idx,
        case.scale,
        query_rope=case.query_rope,
        key_rope=case.key_rope.reshape(-1, 8),
        layout_kv="flat",
    )
    assert torch.equal(paged, flat)


def test_attention_hot_buffer_gather_is_bit_identical_to_full_kv():
    """The offload invariant: the same rows from a hot buffer (remapped indices) and
    from the full paged KV (logical indices) give torch.equal outputs."""
    case = AttnCase(seed=25, dtype=torch.bfloat16)
    gen = case.gen
    k = 12
    idx = all_visible_indices(case, k, gen)
    idx[1, 0, 0] = -1
    full = case.paged(idx)
    num_tokens = idx.shape[0]
    slots_per_token = 16
    hot_latent = torch.randn(num_tokens * slots_per_token, 32, generator=gen).to(torch.bfloat16)
    hot_rope = torch.full((num_tokens * slots_per_token, 8), float("inf")).to(torch.bfloat16)
    remapped = torch.full_like(idx, -1)
    for t, (b, _pos) in enumerate(case.positions()):
        slots = (torch.randperm(slots_per_token, generator=gen)[:k] + t * slots_per_token).tolist()
        for j, p in enumerate(idx[t, 0].tolist()):
            if p < 0:
                continue
            hot_latent[slots[j]] = case.latent[b][p]
            hot_rope[slots[j]] = case.rope[b][p]
            remapped[t, 0, j] = slots[j]
    hot = reference.sparse_mla_attention(
        case.query,
        hot_latent.view(-1, 1, 32),
        hot_latent.view(-1, 1, 32),
        remapped,
        case.scale,
        query_rope=case.query_rope,
        key_rope=hot_rope,
        layout_kv="flat",
    )
    assert torch.equal(full, hot)


def test_attention_padding_tokens_and_argument_checks():
    case = AttnCase(seed=26)
    query = torch.cat((case.query, torch.randn(2, *case.query.shape[1:])))
    query_rope = torch.cat((case.query_rope, torch.randn(2, *case.query_rope.shape[1:])))
    idx = all_visible_indices(case, 12, case.gen)
    idx = torch.cat((idx, torch.zeros(2, 1, 12, dtype=torch.int32)))
    out = reference.sparse_mla_attention(
        query,
        case.key,
        None,
        idx,
        case.scale,
        query_rope=query_rope,
        key_rope=case.key_rope,
        block_table=case.table,
        actual_seq_lengths_query=case.cu_q,
        actual_seq_lengths_kv=case.kv,
    )
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    with pytest.raises(ValueError, match="value"):
        reference.sparse_mla_attention(
            case.query,
            case.key,
            case.key.clone(),
            idx[:-2],
            case.scale,
            query_rope=case.query_rope,
            key_rope=case.key_rope,
            block_table=case.table,
            actual_seq_lengths_query=case.cu_q,
            actual_seq_lengths_kv=case.kv,
        )
    with pytest.raises(ValueError, match="rows >="):
        reference.sparse_mla_attention(
            case.query,
            torch.zeros(4, 32),
            None,
            torch.full((6, 1, 2), 4, dtype=torch.int32),
            1.0,
            query_rope=case.query_rope,
            key_rope=torch.zeros(4, 8),
            layout_kv="flat",
        )


def test_attention_token_grouping_does_not_change_result(monkeypatch):
    case = AttnCase(seed=27, dtype=torch.bfloat16)
    idx = all_visible_indices(case, 12, case.gen)
    whole = case.paged(idx)
    monkeypatch.setattr(reference, "ATTENTION_BUDGET", 1)  # one token per group
    assert torch.equal(whole, case.paged(idx))


# ------------------------------------------------------------------- row copies
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_and_scatter_rows_are_bit_exact(dtype, index_dtype):
    gen = torch.Generator().manual_seed(30)
    src = (torch.randn(50, 3, 16, generator=gen) * 50).to(dtype)
    index = torch.randperm(50, generator=gen)[:17].to(index_dtype)
    rows = reference.gather_rows(src, index)
    assert rows.shape == (17, 3, 16) and rows.dtype == dtype
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.int8: torch.int8}[dtype]
    for j, i in enumerate(index.tolist()):
        assert torch.equal(rows[j].view(bits), src[i].view(bits))
    dst = torch.zeros(40, 3, 16, dtype=dtype)
    before = dst.clone()
    slots = torch.randperm(40, generator=gen)[:17].to(index_dtype)
    assert reference.scatter_rows(dst, slots, rows) is dst
    touched = torch.zeros(40, dtype=torch.bool)
    touched[slots.long()] = True
    for j, s in enumerate(slots.tolist()):
        assert torch.equal(dst[s].view(bits), rows[j].view(bits))
    assert torch.equal(dst[~touched], before[~touched])


def test_scatter_rows_refuses_implicit_casts_and_bad_shapes():
    dst = torch.zeros(8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        reference.scatter_rows(dst, torch.tensor([1]), torch.ones(1, 4))
    with pytest.raises(ValueError, match="do not fit"):
        reference.scatter_rows(dst, torch.tensor([1, 2]), torch.ones(1, 4, dtype=torch.bfloat16))


# --------------------------------------------------------------------- registry
def test_registry_reference_selection_runs():
    impl = registry.select("sparse_mla_attention", "reference")
    assert impl.rung == "reference"
    case = AttnCase(seed=40)
    idx = all_visible_indices(case, 12, case.gen)
    assert torch.equal(
        impl(
            case.query,
            case.key,
            None,
            idx,
            case.scale,
            query_rope=case.query_rope,
            key_rope=case.key_rope,
            block_table=case.table,
            actual_seq_lengths_query=case.cu_q,
            actual_seq_lengths_kv=case.kv,
        ),
        case.paged(idx),
    )


def test_every_op_here_has_reference_and_npu_rungs():
    for op in ("lightning_indexer", "quant_lightning_indexer", "sparse_mla_attention", "gather_rows", "scatter_rows"):
        assert {"reference", "npu"} <= set(registry.implementations(op)), op


@pytest.mark.skipif(platform.device_kind() == "npu", reason="checks the error raised off Ascend")
@pytest.mark.parametrize("op", ["sparse_mla_attention", "lightning_indexer", "quant_lightning_indexer", "gather_rows"])
def test_registry_npu_rung_off_ascend_says_why(op):
    with pytest.raises(OpUnavailableError) as err:
        registry.select(op, "npu")
    message = str(err.value)
    assert op in message and ("torch_npu is not importable" in message or "no NPU device" in message)


def test_registry_rung_without_implementation_is_refused_not_substituted():
    """An explicit rung that lacks an op is an error naming the rungs it has; which rung
    runs such an op in a decode setup is the operator plan's (``op_rungs.py``), named there."""
    without_triton = [op for op in registry.ops() if "triton" not in registry.implementations(op)]
    assert without_triton, "every op has a triton rung; nothing to check"
    for op in without_triton:
        with pytest.raises(OpUnavailableError, match=rf"op '{op}' has no 'triton' implementation \(it has: "):
            registry.select(op, "triton")


@pytest.mark.skipif(platform.device_kind() != "cpu", reason="auto resolution is device specific")
def test_registry_auto_on_cpu_is_reference():
    for op in ("lightning_indexer", "sparse_mla_attention", "gather_rows"):
        assert registry.select(op, "auto").rung == "reference"
