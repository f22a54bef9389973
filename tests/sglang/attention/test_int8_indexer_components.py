"""The int8 (LIM-C8) index-K cache of the sparse decode pool, with real SGLang objects.

``dsa_harness.Harness`` at the tiny DSA fixture's shapes (4 index heads x 128 dims,
top-k 16, page 64 as SGLang forces for DSA off the NPU): the offload backend over a
``HostMainKVPool`` with ``indexer_dtype: "int8"``, the plain backend over a bf16
``DeviceDSAPool`` on the same slots and inputs. Per layer and forward:

* the int8 cache and its fp16 scales are, at every written slot, exactly
  ``rotate_and_quantize`` of the bf16 keys the plain pool stored (and not the
  unrotated quantisation: the rotation happened);
* the served top-k (prefill and decode) equals the reference C8 composition on the
  same inputs, bit for bit: ``prepare_quant_indexer_inputs(query, bf16 cache)`` and
  ``quant_lightning_indexer``;
* attention through the engine equals attention over device KV with that top-k;
* the static-shape graph decode indexer equals the eager one (C8 arithmetic), with
  padded buckets and churn.
"""

from __future__ import annotations

import pytest
import torch
from dsa_harness import INDEX_DIM, INDEX_HEADS, LATENT, TOPK, Harness, published_context
from graph_harness import BUCKET, eager_and_graph_layers

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.ops.hadamard import (
    prepare_quant_indexer_inputs,
    quantize_per_token_int8,
    rotate_and_quantize,
)
from sglang_ascend_offload.ops.reference import quant_lightning_indexer
from sglang_ascend_offload.sglang_plugin.attention.dsa_backend import graph_decode_topk
from sglang_ascend_offload.sglang_plugin.attention.native_indexer import indexer_query_key_weights

pytestmark = pytest.mark.usefixtures("plugins_loaded")

PAGE = 64  # what SGLang serves DSA with off the NPU


@pytest.fixture
def ctx():
    with published_context():
        yield


def int8_config(**extra) -> cfg.SparseDecodeOffloadConfig:
    return cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK, indexer_dtype="int8", **extra)


def _used_slots(h) -> torch.Tensor:
    table = h.req_to_token_pool.req_to_token
    return torch.cat([table[r.row, : r.length].long() for r in h.requests.values()]).unique()


def _check_cache(h) -> None:
    """The int8 cache == rotate_and_quantize(bf16 keys) at every written slot, bit for bit."""
    slots = _used_slots(h)
    pool = h.offload_pool
    for layer in range(h.layers):
        bf16 = h.dense_pool.get_index_k_buffer(layer).reshape(-1, INDEX_DIM)[slots]
        values, scales = rotate_and_quantize(bf16)
        assert torch.equal(pool.get_index_k_buffer(layer).reshape(-1, INDEX_DIM)[slots], values)
        assert torch.equal(pool.get_index_k_scale_buffer(layer).reshape(-1)[slots], scales)
        unrotated, _ = quantize_per_token_int8(bf16)
        assert not torch.equal(values, unrotated)  # the keys were rotated before quantising


def _check_step(h, step, what: str) -> None:
    """Served int8 top-k == the reference C8 composition; attention == device KV's with it."""
    fb = step.forward_batch
    md = h.offload.forward_metadata
    for layer in range(h.layers):
        inp = step.inputs[layer]
        with torch.no_grad():
            ref_in = indexer_query_key_weights(h.indexers[layer], inp["x"], inp["q_lora"], fb.positions)
        quant = prepare_quant_indexer_inputs(ref_in.query, h.dense_pool.get_index_k_buffer(layer))
        ref = quant_lightning_indexer(
            quant.query,
            quant.key,
            ref_in.weights,
            quant.query_dequant_scale,
            quant.key_dequant_scale,
            actual_seq_lengths_query=md.actual_seq_lengths_q,
            actual_seq_lengths_key=md.seq_lens,
            block_table=md.block_tables,
            sparse_count=TOPK,
        ).reshape(-1, TOPK)
        served = step.offload_topk[layer]
        assert served.dtype == torch.int32 and served.shape == ref.shape
        assert torch.equal(served, ref), f"{what}: layer {layer} int8 top-k != reference C8 composition"
        q = inp["q"].reshape(-1, h.attn_layers[layer].tp_q_head_num, inp["q"].shape[-1])
        with torch.no_grad():
            dense = h.dense.attend(h.attn_layers[layer], fb, q[..., :LATENT], q[..., LATENT:], served)
        assert torch.equal(step.offload_out[layer].reshape(dense.shape), dense), f"{what}: layer {layer} attention"


def test_served_int8_indexer_equals_reference_c8_composition(ctx):
    h = Harness(offload_config=int8_config(), page_size=PAGE, seed=5)
    pool = h.offload_pool
    assert pool.index_k_buffer.dtype == torch.int8 and pool.index_k_scale_buffer.dtype == torch.float16
    assert tuple(pool.index_k_scale_buffer.shape) == tuple(pool.index_k_buffer.shape[:-1])
    assert pool.get_kv_size_bytes() == pool.index_k_buffer.numel() * (INDEX_DIM + 2) // INDEX_DIM
    assert h.offload.index_int8 and not h.dense.index_int8  # the draft / device pools stay bf16
    assert h.offload.engine.plan.indexer.ops[0] == "quant_lightning_indexer"  # the engine's logged plan says so
    a, c = h.new_request("a"), h.new_request("c")
    _check_step(h, h.extend([a, c], [80, 23]), "prefill a + c")
    b = h.new_request("b", prefix_from="a", prefix_len=64)  # a cached page of a (radix hit)
    _check_step(h, h.extend([b], [30]), "prefill b")
    _check_cache(h)
    differs = 0
    for i in range(12):
        step = h.decode([r for r in (a, b, c) if r.rid in h.requests])
        _check_step(h, step, f"decode {i}")
        differs += sum(int((x != y).any()) for x, y in zip(step.topk, step.offload_topk))
        if i == 5:
            h.finish("c")
            c = h.new_request("d")
            _check_step(h, h.extend([c], [40]), "prefill d")
    _check_cache(h)
    stats = h.offload.engine.stats().total
    assert stats.hits > 0 and stats.misses > 0
    assert differs > 0, "the int8 top-k never differed from the bf16 one: the C8 path was not exercised"


def test_bf16_keys_into_the_int8_cache_are_refused(ctx):
    h = Harness(offload_config=int8_config(), page_size=PAGE)
    with pytest.raises(TypeError, match="store_index_k"):
        h.offload_pool.set_index_k_buffer(0, torch.tensor([64]), torch.ones(1, INDEX_DIM, dtype=torch.bfloat16))
    ptrs, lens, _ = h.offload_pool.get_contiguous_buf_infos()  # main, index K, then the scales
    assert ptrs[-1] == h.offload_pool.index_k_scale_buffer[h.layers - 1].data_ptr()
    assert len(ptrs) == 3 * h.layers and lens[-1] == h.offload_pool.index_k_scale_buffer[0].nbytes


def test_graph_decode_topk_c8_equals_the_reference_op():
    """The static-width C8 scoring at served shapes: random int8 caches, scattered block
    tables, lengths from 1 to past top-k, a padding row: == quant_lightning_indexer."""
    gen = torch.Generator().manual_seed(11)
    blocks, b, max_blocks = 9, 4, 3
    keys = torch.randn(blocks, PAGE, 1, INDEX_DIM, generator=gen).to(torch.bfloat16)
    query = torch.randn(b, INDEX_HEADS, INDEX_DIM, generator=gen).to(torch.bfloat16)
    weights = torch.randn(b, INDEX_HEADS, generator=gen)
    quant = prepare_quant_indexer_inputs(query, keys)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:max_blocks] for _ in range(b)]).to(torch.int32)
    lens = torch.tensor([1, 15, 130, 192], dtype=torch.int32)
    got = graph_decode_topk(
        quant.query,
        quant.key,
        weights,
        tables,
        lens,
        TOPK,
        query_scale=quant.query_dequant_scale,
        key_scale=quant.key_dequant_scale,
    )
    ref = quant_lightning_indexer(
        quant.query,
        quant.key,
        weights,
        quant.query_dequant_scale,
        quant.key_dequant_scale,
        actual_seq_lengths_query=torch.arange(1, b + 1, dtype=torch.int32),
        actual_seq_lengths_key=lens,
        block_table=tables,
        sparse_count=TOPK,
    )
    assert torch.equal(got, ref.reshape(b, TOPK))
    with pytest.raises(ValueError, match="both"):
        graph_decode_topk(quant.query, quant.key, weights, tables, lens, TOPK, query_scale=quant.query_dequant_scale)


def test_graph_decode_with_int8_cache_equals_eager(ctx):
    """SGLang's CPU graph hooks on the int8 offload backend (padded buckets, churn): top-k
    and attention of the live rows == the eager int8 backend's, bit for bit."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    eager, graph = (Harness(offload_config=int8_config(), page_size=PAGE, seed=7) for _ in range(2))
    graph.offload.init_cpu_graph_state(BUCKET, BUCKET)
    zeros = torch.zeros(BUCKET, dtype=torch.int64)
    graph.offload.init_forward_metadata_capture_cpu_graph(
        BUCKET, BUCKET, zeros, torch.ones(BUCKET, dtype=torch.int64), zeros, None, ForwardMode.DECODE, None
    )
    for h in (eager, graph):
        for rid in ("a", "b", "c"):
            h.new_request(rid)
    _both(eager, graph, ["a", "b", "c"], [90, 9, 23])
    for batch in [["a", "b", "c"]] * 3 + [["a", "c"]] * 3:
        _both(eager, graph, batch)
    for h in (eager, graph):
        h.finish("b")
        h.new_request("d")
    _both(eager, graph, ["d"], [70])
    for batch in [["a", "c", "d"]] * 3 + [["d"]] * 2:
        _both(eager, graph, batch)


def _both(eager, graph, rids, lens=None) -> None:
    for layer, (topk_e, topk_g, out_e, out_g) in enumerate(eager_and_graph_layers(eager, graph, rids, lens)):
        assert torch.equal(topk_e, topk_g), f"layer {layer}: graph int8 top-k != eager"
        assert torch.equal(out_e, out_g), f"layer {layer}: graph int8 attention != eager"


def test_server_startup_serves_int8_on_cpu_and_refuses_it_on_a_pd_decode():
    """The server's whole startup verdict: int8 passes a colocated CPU launch (eager and
    with decode graphs) and a P/D decode; a P/D decode with speculation stops with
    sglang.indexer_int8_pd and its fix."""
    from startup_verdict import server_rule_ids, server_verdict

    int8 = cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(hot_tokens=64, indexer_dtype="int8"))
    eager = dict(attention_backend="ascend_offload", disable_cuda_graph=True, page_size=64)
    assert server_rule_ids(int8, **eager) == []
    assert (
        server_rule_ids(
            int8, attention_backend="ascend_offload", disable_cuda_graph=False, enable_torch_compile=True, page_size=64
        )
        == []
    )
    pd_args = dict(
        eager,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="ascend_offload",
        disaggregation_decode_retraction_backup="cpu_tensor",
    )
    assert "sglang.indexer_int8_pd" not in server_rule_ids(int8, **pd_args)
    pd = server_verdict(
        int8,
        **pd_args,
        speculative_algorithm="NEXTN",
        speculative_num_steps=1,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=2,
    )
    found = [v for v in pd if v.rule == "sglang.indexer_int8_pd"]
    assert found and "indexer_scale" in found[0].problem and '"indexer_dtype": "bf16"' in found[0].fix


def test_the_c8_graph_indexer_stage_under_torch_compile_equals_eager():
    """What SGLang's CPU graph runner does to the decode step (``torch.compile``, not
    fullgraph): the int8 stage (rotate + quantise the query, C8 static-width top-k) gives
    the eager result. The quantisation's fp16-overflow check is a host read, so the stage
    has a graph break there (docs/sparse_decode.md, "int8 indexer")."""
    gen = torch.Generator().manual_seed(12)
    keys = torch.randn(6, PAGE, 1, INDEX_DIM, generator=gen).to(torch.bfloat16)
    values, scales = rotate_and_quantize(keys)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([150, 40], dtype=torch.int32)

    def stage(query, weights):
        q_values, q_scales = rotate_and_quantize(query)
        return graph_decode_topk(q_values, values, weights, tables, lens, TOPK, query_scale=q_scales, key_scale=scales)

    torch._dynamo.reset()
    compiled = torch.compile(stage, dynamic=False)
    for _ in range(2):
        query = torch.randn(2, INDEX_HEADS, INDEX_DIM, generator=gen).to(torch.bfloat16)
        weights = torch.randn(2, INDEX_HEADS, generator=gen)
        assert torch.equal(compiled(query, weights), stage(query, weights))
