"""The served fused indexer on an Ascend NPU: the twin of ``test_fused_indexer_components.py``.

The same harness (real SGLang objects, the plugin's pools and backends) on the NPU: the
offload backend with the NPU default (``ops: auto``: fused LIM / LIM-C8 + Copy-SFA of the
built ``_C_ascend`` extension) against one with ``ops: "npu"`` (the separate torch_npu
indexer, the residency op and the separate copy + attention), same seed and inputs, over
prefills, a radix prefix, decode steps with churn. Top-k, residency state and hit / miss
counters must be equal; attention within the fused kernels' tolerance. The fused
indexer's top-k against torch_npu's is where the real ``Sort`` / ``MrgSort`` tie order
shows (the functional model cannot check it). On a runner without an NPU it skips with
its reason; on an NPU runner a missing torch_npu or extension fails.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from dsa_harness import Harness, published_context
from npu_requirements import npu_present, require_npu, require_npu_extension, requires

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.ops import fused

pytestmark = [
    pytest.mark.npu,
    pytest.mark.usefixtures("plugins_loaded"),
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]

ATTENTION_TOL = 2e-2


def _ready():
    require_npu()
    for kernel in (fused.LIM_KERNEL, fused.LIM_C8_KERNEL, fused.COPY_SFA_KERNEL):
        require_npu_extension(kernel)


@requires(_ready)
@pytest.mark.parametrize("indexer_dtype", ["bf16", "int8"])
def test_npu_default_fused_decode_equals_the_separate_torch_npu_ops(indexer_dtype):
    importlib.import_module("torch_npu")
    with published_context("npu"):
        hs = [
            Harness(
                offload_config=cfg.SparseDecodeOffloadConfig(hot_tokens=256, ops=ops, indexer_dtype=indexer_dtype),
                page_size=128,
                top_k=128,
                index_heads=8,
                seed=5,
                max_context=1024,
                slots=4096,
                device="npu",
            )
            for ops in ("auto", "npu")
        ]
        fused_h, separate = hs
        assert fused_h.offload.engine.plan.indexer.fused and fused_h.offload.engine.plan.attention.fused
        assert not separate.offload.engine.plan.indexer.fused

        def step(fn):
            results = [fn(h) for h in hs]
            for layer in range(fused_h.layers):
                assert torch.equal(results[0].offload_topk[layer].cpu(), results[1].offload_topk[layer].cpu())
                diff = (results[0].offload_out[layer].float() - results[1].offload_out[layer].float()).abs().max()
                assert float(diff) <= ATTENTION_TOL

        for h in hs:
            h.new_request("a"), h.new_request("c")
        step(lambda h: h.extend([h.requests["a"], h.requests["c"]], [300, 140]))
        for h in hs:
            h.new_request("b", prefix_from="a", prefix_len=256)
        step(lambda h: h.extend([h.requests["b"]], [20]))
        for i in range(6):
            live = ("a", "b", "c") if "c" in fused_h.requests else ("a", "b", "d")
            step(lambda h: h.decode([h.requests[r] for r in live]))
            for layer in range(fused_h.layers):
                a, b = fused_h.offload.engine.table(layer), separate.offload.engine.table(layer)
                assert torch.equal(a.slot_token.cpu(), b.slot_token.cpu())
            if i == 3:
                for h in hs:
                    h.finish("c")
                    h.new_request("d")
                step(lambda h: h.extend([h.requests["d"]], [200]))
        sa, sb = fused_h.offload.engine.stats().total, separate.offload.engine.stats().total
        assert (sa.hits, sa.misses) == (sb.hits, sb.misses) and sa.misses > 0
