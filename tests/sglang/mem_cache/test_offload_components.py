"""Pools and backends with real SGLang objects: offload on == offload off, bit for bit.

A prefill of two requests (one sharing the other's cached prefix), then many decode
steps with request churn; per layer and step both backends get the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dsa_harness import LATENT, ROPE, TOPK, Harness, make_indexer, published_context

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.sparse_decode.trace import load_trace

pytestmark = pytest.mark.usefixtures("plugins_loaded")


@pytest.fixture
def ctx():
    with published_context():
        yield


def assert_same(step, what):
    for layer, (a, b) in enumerate(zip(step.topk, step.offload_topk)):
        assert torch.equal(a, b), f"{what}: layer {layer} top-k differs"
    for layer, (a, b) in enumerate(zip(step.dense_out, step.offload_out)):
        assert torch.equal(a, b), f"{what}: layer {layer} attention output differs"


def test_prefill_and_decode_bit_exact_with_shared_prefix_and_churn(ctx, tmp_path):
    trace_file = tmp_path / "trace.npz"
    h = Harness(
        offload_config=cfg.SparseDecodeOffloadConfig(
            hot_tokens=2 * TOPK, record_trace=str(trace_file), record_trace_max_steps=12
        )
    )
    a = h.new_request("a")
    assert_same(h.extend([a], [40]), "prefill a")
    b = h.new_request("b", prefix_from="a", prefix_len=32)  # two cached pages of a
    c = h.new_request("c")
    assert_same(h.extend([b, c], [9, 23]), "prefill b (prefix hit) + c")

    table = h.req_to_token_pool.req_to_token
    assert torch.equal(table[b.row, :32], table[a.row, :32])  # the prefix is stored once
    for layer in range(h.layers):
        slots = table[a.row, :40].long()
        dense_rows = torch.cat(
            (h.dense_pool.k_buffer[layer].view(-1, LATENT)[slots], h.dense_pool.v_buffer[layer].view(-1, ROPE)[slots]),
            dim=1,
        )
        assert torch.equal(h.offload_pool.host_rows(layer)[slots], dense_rows)
    assert h.offload_pool.k_buffer is None and h.offload_pool.v_buffer is None  # no device main KV

    sparse_seen = False
    for step in range(30):
        batch = [r for r in (a, b, c) if r.rid in h.requests]
        result = h.decode(batch)
        assert_same(result, f"decode step {step}")
        if step == 0:
            first_decode_topk = result.topk[0][:2].numpy()
        lens = torch.tensor([r.length for r in batch])
        valid = result.topk[0] >= 0
        sparse_seen |= bool((valid.sum(1) < lens).any())  # fewer selected than visible: really sparse
        if step == 10:
            h.finish("c")  # churn: c leaves, d takes its row
            d = h.new_request("d")
            assert_same(h.extend([d], [50]), "prefill d")
            c = d
    assert sparse_seen

    stats = h.offload.engine.stats()
    total = stats.total
    assert stats.steps == 30
    assert total.hits + total.misses == total.selected > 0
    assert total.h2d_bytes == total.misses * (LATENT + ROPE) * 2
    assert total.hits > 0  # the hot buffer is reused across steps

    trace = load_trace(trace_file)  # validated on load
    assert trace.steps == 12 and trace.layers == h.layers and trace.top_k == TOPK
    # compact trace rows: as many as requests were live together (3), not the
    # req_to_token rows (5); the first batch's entries take trace rows 0, 1, 2 in order
    assert trace.rows == 3 < h.req_to_token_pool.req_to_token.shape[0]
    assert np.array_equal(trace.topk[0, 0][[0, 1]], first_decode_topk)
    assert (trace.seq_lens[0][[0, 1]] == [41, 42]).all()
    assert (trace.req_ids[0][[0, 1]] >= 0).all()


def test_dp_attention_padding_rows_never_reach_the_engine(ctx):
    """SGLang's DP attention pads decode batches with aliases of row 0, which may be a live
    request's row; here the padding names ``a``'s row, so a padding entry reaching the
    engine would replace ``a``'s top-k and residency."""
    h = Harness(offload_config=cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK))
    a, b = h.new_request("a"), h.new_request("b")
    assert_same(h.extend([a, b], [40, 37]), "prefill")
    for step in range(8):
        result = h.decode([a, b], pad_to=4, pad_row=a.row)
        for layer in range(h.layers):  # the real rows: top-k and attention as without padding
            assert torch.equal(result.topk[layer][:2], result.offload_topk[layer][:2]), (step, layer)
            assert torch.equal(result.dense_out[layer][:2], result.offload_out[layer][:2]), (step, layer)
            assert torch.count_nonzero(result.offload_out[layer][2:]) == 0  # padding attends nothing
    assert h.offload.engine.stats().total.selected > 0


def test_decode_output_equals_full_kv_reference(ctx):
    """Independent of the dense backend: each decode output equals the attention op
    over the whole host pool with the logical top-k mapped to host slots
    (``sparse_decode.verify.full_kv_attention``)."""
    from sglang_ascend_offload.ops import registry
    from sglang_ascend_offload.sparse_decode.verify import full_kv_attention

    h = Harness(offload_config=cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK))
    reqs = [h.new_request("x"), h.new_request("y")]
    h.extend(reqs, [30, 45])
    op = registry.select("sparse_mla_attention", "reference")
    table = h.req_to_token_pool.req_to_token
    rows = [r.row for r in reqs]
    for _ in range(6):
        res = h.decode(reqs)
        for layer in range(h.layers):
            q = res.inputs[layer]["q"]
            expected = full_kv_attention(
                op,
                h.offload_pool.host_pool,
                layer,
                res.topk[layer],
                table[rows],
                q[..., :LATENT],
                q[..., LATENT:],
                0.125,
            )
            assert torch.equal(res.offload_out[layer], expected.reshape(len(rows), -1))


def test_indexer_rope_matches_sglang_rotary_embedding(ctx):
    """Interleaved rope equals SGLang's own ``forward_native``; the neox variant is
    the interleaved one on de-interleaved dims (SGLang's neox forward_native is broken
    on 2-D slices, which is why the plugin computes the indexer rope itself)."""
    from sglang_ascend_offload.sglang_plugin.attention.native_indexer import apply_indexer_rope

    ix = make_indexer(0, neox=False)
    rope = ix.rotary_emb
    positions = torch.tensor([0, 3, 17, 200, 1999])
    q = torch.randn(5, 4, ROPE)
    k = torch.randn(5, 1, ROPE)
    ref_q, ref_k = rope.forward_native(positions, q.clone(), k.clone())
    assert torch.allclose(apply_indexer_rope(q, positions, rope.cos_sin_cache, neox=False), ref_q, atol=1e-5)
    assert torch.allclose(apply_indexer_rope(k, positions, rope.cos_sin_cache, neox=False), ref_k, atol=1e-5)

    half = ROPE // 2
    to_interleaved = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()
    neox = apply_indexer_rope(q, positions, rope.cos_sin_cache, neox=True)
    inter = apply_indexer_rope(q[..., to_interleaved], positions, rope.cos_sin_cache, neox=False)
    assert torch.allclose(neox[..., to_interleaved], inter, atol=1e-6)


def test_indexer_path_stores_keys_and_selects_the_best_causal_positions(ctx):
    """run_indexer: index K of the new tokens lands at their slots (bit-exact), and the
    top-k are the highest-scoring visible positions of ``sum_h w * relu(q.k)``."""
    from sglang_ascend_offload.sglang_plugin.attention.native_indexer import indexer_query_key_weights

    h = Harness()
    r = h.new_request("r")
    n = 37
    res = h.extend([r], [n])
    slots = h.req_to_token_pool.req_to_token[r.row, :n].long()
    positions = torch.arange(n)
    for layer in range(h.layers):
        inp = res.inputs[layer]
        with torch.no_grad():
            ixin = indexer_query_key_weights(h.indexers[layer], inp["x"], inp["q_lora"], positions)
        stored = h.dense_pool.index_k_buffer[layer].view(-1, 128)[slots]
        assert torch.equal(stored, ixin.key)
        assert torch.equal(h.offload_pool.index_k_buffer[layer].view(-1, 128)[slots], ixin.key)
        logits = torch.einsum("thd,sd->ths", ixin.query.float(), stored.float())
        score = (torch.relu(logits) * ixin.weights[:, :, None]).sum(1)  # [t, s]
        topk = res.topk[layer]
        for t in range(n):
            chosen = topk[t][topk[t] >= 0].long()
            assert chosen.numel() == min(t + 1, TOPK) and int(chosen.max()) <= t
            assert len(set(chosen.tolist())) == chosen.numel()
            rest = torch.tensor([s for s in range(t + 1) if s not in set(chosen.tolist())], dtype=torch.long)
            if rest.numel():
                assert float(score[t, chosen].min()) >= float(score[t, rest].max()) - 1e-3 * float(score[t].abs().max())


def test_graph_hooks_match_eager_metadata(ctx):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    h = Harness()
    reqs = [h.new_request("g1"), h.new_request("g2")]
    h.extend(reqs, [20, 70])
    h.decode(reqs)
    eager = h.dense.forward_metadata
    h.dense.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    fb = h._batch(
        ForwardMode.DECODE,
        reqs,
        torch.tensor([0, 0]),
        torch.tensor([r.length - 1 for r in reqs]),
        torch.tensor([r.length for r in reqs]),
        None,
        None,
    )
    h.dense.init_forward_metadata_out_graph(fb, in_capture=True)
    h.dense.init_forward_metadata_in_graph(fb)
    graph = h.dense.forward_metadata
    blocks = eager.block_tables.shape[1]
    assert torch.equal(graph.block_tables[:, :blocks], eager.block_tables)
    assert torch.equal(graph.seq_lens, eager.seq_lens)
    assert torch.equal(graph.actual_seq_lengths_q, eager.actual_seq_lengths_q)
    assert graph.block_tables.data_ptr() == h.dense.graph.block_tables.data_ptr()  # static buffer
