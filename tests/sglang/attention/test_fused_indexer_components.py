"""The fused indexer (LIM / LIM-C8) and Copy-SFA in the served decode, with real SGLang objects.

``dsa_harness.Harness`` at shapes the fused kernels take (8 index heads x 128 dims,
top-k 128, page 64, 256 hot slots): the offload backend with ``ops: "fused"`` runs, on
every decode step, the AscendC kernels on their CPU functional model: LIM (or LIM-C8
with the int8 cache) selects the top-k and steps the residency, Copy-SFA copies the
misses and attends. A second harness with ``ops: "reference"`` takes the same inputs
(same seed). Per step and layer:

* the fused top-k equals the reference offload backend's, bit for bit (and, with the
  bf16 cache, the device-KV backend's reference indexer);
* the residency state (``slot_token`` / ``slot_stamp`` / ``row_req``) and the hit / miss
  counters equal the reference engine's, bit for bit;
* attention equals the reference engine's within the fused attention's tolerance (the
  kernel accumulates in its own order: :data:`ATTENTION_TOL`);

over prefills, a radix-prefix request, decode steps with a finished request replaced
(churn) and DP-attention padding rows. The int8 run also checks the plan names LIM-C8.
"""

from __future__ import annotations

import pytest
import torch
from dsa_harness import Harness, published_context

from sglang_ascend_offload import config as cfg

pytestmark = pytest.mark.usefixtures("plugins_loaded")

PAGE, TOP_K, INDEX_HEADS, HOT = 64, 128, 8, 256
#: max |fused - reference| of an attention output (bf16 outputs of softmax-weighted sums
#: of bf16 rows; the kernel's tiling changes the fp32 summation order)
ATTENTION_TOL = 2e-2


def _harness(ops: str, indexer_dtype: str) -> Harness:
    offload = cfg.SparseDecodeOffloadConfig(hot_tokens=HOT, ops=ops, indexer_dtype=indexer_dtype)
    return Harness(
        offload_config=offload,
        page_size=PAGE,
        top_k=TOP_K,
        index_heads=INDEX_HEADS,
        seed=5,
        max_context=1024,
        slots=4096,
    )


def _same_step(fused, reference, what: str, bf16: bool = True) -> None:
    for layer, (f_topk, r_topk) in enumerate(zip(fused.offload_topk, reference.offload_topk)):
        assert torch.equal(f_topk, r_topk), f"{what}: layer {layer} fused top-k != reference"
        if bf16:  # the device-KV backend's cache is bf16
            assert torch.equal(f_topk, fused.topk[layer]), f"{what}: layer {layer} fused top-k != device-KV indexer"
        diff = (fused.offload_out[layer].float() - reference.offload_out[layer].float()).abs().max().item()
        assert diff <= ATTENTION_TOL, f"{what}: layer {layer} attention differs by {diff}"


def _same_state(hf: Harness, hr: Harness, what: str) -> None:
    for layer in range(hf.layers):
        tf, tr = hf.offload.engine.table(layer), hr.offload.engine.table(layer)
        for name in ("slot_token", "slot_stamp", "row_req"):
            assert torch.equal(getattr(tf, name), getattr(tr, name)), f"{what}: layer {layer} {name} differs"


@pytest.mark.parametrize("indexer_dtype", ["bf16", "int8"])
def test_fused_decode_equals_the_reference_rung(indexer_dtype):
    with published_context():
        hf, hr = _harness("fused", indexer_dtype), _harness("reference", indexer_dtype)
        lim = "quant_lightning_indexer_manage" if indexer_dtype == "int8" else "lightning_indexer_manage"
        assert hf.offload.engine.plan.indexer.ops == (lim,)
        assert hf.offload.engine.plan.attention.ops == ("copy_sparse_flash_attention",)
        assert hf.offload.fused_indexer_op is not None and hr.offload.fused_indexer_op is None
        assert not hr.offload.engine.plan.indexer.fused

        def both(fn):
            return fn(hf), fn(hr)

        def same(pair, what):
            _same_step(*pair, what, bf16=indexer_dtype == "bf16")

        for h in (hf, hr):
            h.new_request("a"), h.new_request("c")
        same(both(lambda h: h.extend([h.requests["a"], h.requests["c"]], [300, 140])), "prefill a + c")
        for h in (hf, hr):
            h.new_request("b", prefix_from="a", prefix_len=192)  # three cached pages of a (radix hit)
        same(both(lambda h: h.extend([h.requests["b"]], [20])), "prefill b")
        for i in range(6):
            live = ("a", "b", "c") if "c" in hf.requests else ("a", "b", "d")
            pad = 4 if i == 2 else 0  # DP-attention padding rows never reach the residency
            same(both(lambda h: h.decode([h.requests[r] for r in live], pad_to=pad)), f"decode {i}")
            _same_state(hf, hr, f"decode {i}")
            if i == 3:  # churn: c finishes, d takes its row
                for h in (hf, hr):
                    h.finish("c")
                    h.new_request("d")
                same(both(lambda h: h.extend([h.requests["d"]], [200])), "prefill d")
        sf, sr = hf.offload.engine.stats().total, hr.offload.engine.stats().total
        assert (sf.hits, sf.misses) == (sr.hits, sr.misses)
        assert sf.hits > 0 and sf.misses > 0


def test_fused_graph_decode_hooks_equal_the_eager_reference():
    """SGLang's CPU graph hooks on the fused backend (bucket 4: padded entries on the sink
    row, churn): the fused indexer reads the static row buffers. Top-k and residency of
    the live rows == the eager reference backend's bit for bit; attention within tolerance."""
    from graph_harness import eager_and_graph_layers
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bucket = 4
    with published_context():
        eager, graph = _harness("reference", "bf16"), _harness("fused", "bf16")
        graph.offload.init_cpu_graph_state(bucket, bucket)
        zeros = torch.zeros(bucket, dtype=torch.int64)
        graph.offload.init_forward_metadata_capture_cpu_graph(
            bucket, bucket, zeros, torch.ones(bucket, dtype=torch.int64), zeros, None, ForwardMode.DECODE, None
        )

        def step(rids, lens=None):
            decode = lens is None
            for layer, (topk_e, topk_g, out_e, out_g) in enumerate(
                eager_and_graph_layers(eager, graph, rids, lens, bucket)
            ):
                assert torch.equal(topk_e, topk_g), f"layer {layer}: fused graph top-k != eager reference"
                diff = (out_e.float() - out_g.float()).abs().max().item()
                assert diff <= ATTENTION_TOL, f"layer {layer}: fused graph attention differs by {diff}"
            if decode:
                r = eager.offload.engine.config.rows
                for layer in range(eager.layers):
                    e, g = eager.offload.engine.table(layer), graph.offload.engine.managers[layer].table
                    # (stamps are offset: the capture took the graph harness's step 0)
                    assert torch.equal(g.slot_token[:r], e.slot_token) and torch.equal(g.row_req[:r], e.row_req)
                    assert bool((g.slot_token[r] == -1).all()) and int(g.row_req[r]) == -1, "the sink row holds data"

        for h in (eager, graph):
            for rid in ("a", "b", "c"):
                h.new_request(rid)
        step(["a", "b", "c"], [300, 90, 140])
        for batch in [["a", "b", "c"]] * 3 + [["a", "c"]] * 2:
            step(batch)
        for h in (eager, graph):
            h.finish("b")
            h.new_request("d")
        step(["d"], [170])
        for batch in [["a", "c", "d"]] * 2 + [["d"]] * 2:
            step(batch)
        assert graph.offload.engine.stats().total.misses > 0


def test_the_fused_indexer_stage_under_torch_compile_equals_eager():
    """What SGLang's CPU graph runner does to the decode step (``torch.compile``): the
    fused indexer stage (residency arguments from static row buffers, then the LIM op on
    the functional model, mutating the residency state) gives the eager result: the same
    top-k, step outputs and state after each of three steps."""
    from sglang_ascend_offload.ops import registry
    from sglang_ascend_offload.sparse_decode import fused_indexer
    from sglang_ascend_offload.sparse_decode.policies import make_manager

    lim = registry.select("lightning_indexer_manage", "fused")
    assert lim.rung == "fused"
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(8, PAGE, 1, 128, generator=gen).to(torch.bfloat16)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    managers = [make_manager("lru", 4, HOT, "cpu", manage_impl="torch") for _ in range(2)]
    rows = torch.tensor([1, 3], dtype=torch.int64)
    owners = torch.tensor([11, 12], dtype=torch.int64)

    def stage(manager, query, weights, lens, step):
        args = fused_indexer.residency_args(manager, rows, owners, lens, step, query.shape[0])
        out = lim(
            query,
            key,
            weights,
            actual_seq_lengths_query=torch.tensor([1, 2], dtype=torch.int32),
            actual_seq_lengths_key=lens,
            block_table=tables,
            sparse_count=TOP_K,
            **args.as_kwargs(),
        )
        return out.topk_indices, out.residency.slots, out.residency.miss_count

    torch._dynamo.reset()
    compiled = torch.compile(stage, dynamic=False)
    for i, lens in enumerate(([200, 150], [201, 151], [202, 152])):
        lens = torch.tensor(lens, dtype=torch.int32)
        query = torch.randn(2, INDEX_HEADS, 128, generator=gen).to(torch.bfloat16)
        weights = torch.randn(2, INDEX_HEADS, generator=gen).to(torch.bfloat16)
        step = torch.tensor(i, dtype=torch.int64)
        got, want = compiled(managers[0], query, weights, lens, step), stage(managers[1], query, weights, lens, step)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        for name in ("slot_token", "slot_stamp", "row_req"):
            assert torch.equal(getattr(managers[0].table, name), getattr(managers[1].table, name))
    assert int(managers[0].table.row_req[1]) == 11 and int(managers[0].table.row_req[0]) == -1


def test_the_npu_indexer_forward_routes_to_the_backend_only_where_it_runs_the_fused_indexer(monkeypatch):
    """``forward_npu_around`` (SGLang's NPU indexer hook): a backend running the fused
    indexer gets the call (its ``run_indexer``: on an NPU SGLang's ``forward_npu`` would
    call the separate indexer on a bf16 cache); any other backend, or none, leaves SGLang's
    method to run; attention-TP-sliced or dynamically quantised inputs are an error naming
    the fix, not a silently wrong top-k."""
    from sglang.srt.model_executor import forward_context

    from sglang_ascend_offload.sglang_plugin.attention import dsa_backend

    with published_context():
        fused, plain = _harness("fused", "bf16"), _harness("reference", "bf16")
    assert fused.offload.owns_npu_indexer() and not plain.offload.owns_npu_indexer()
    assert not fused.dense.owns_npu_indexer()
    calls = []

    def original(self, x, q_lora, positions, forward_batch, layer_id, input_on_attn_tp_slices, dynamic_scale):
        calls.append(("sglang", layer_id))
        return "sglang's top-k"

    def routed(indexer, x, q_lora, positions, forward_batch, layer_id, return_indices):
        calls.append(("backend", layer_id, return_indices))
        return "backend's top-k"

    for backend, want in (
        (fused.offload, "backend's top-k"),
        (plain.offload, "sglang's top-k"),
        (fused.dense, "sglang's top-k"),
        (None, "sglang's top-k"),
    ):
        monkeypatch.setattr(forward_context, "get_attn_backend", lambda b=backend: b)
        if backend is not None:
            monkeypatch.setattr(backend, "run_indexer", routed)
        assert dsa_backend.forward_npu_around(original, object(), "x", "q", "pos", "fb", 3) == want
    assert calls == [("backend", 3, True), ("sglang", 3), ("sglang", 3), ("sglang", 3)]
    monkeypatch.setattr(forward_context, "get_attn_backend", lambda: fused.offload)
    with pytest.raises(RuntimeError, match='attention-TP slices.*dynamic scale.*"fused_lim": false'):
        dsa_backend.forward_npu_around(original, object(), "x", "q", "pos", "fb", 3, True, torch.ones(1))
