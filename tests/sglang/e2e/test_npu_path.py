"""The plugin on an Ascend NPU (skipped elsewhere; run on a CANN runner with ``pytest -m npu``).

* pools on the NPU: SGLang's torch_npu scatter writes land where the CPU pool puts them;
* both backends with torch_npu ops (``npu_lightning_indexer``,
  ``npu_sparse_flash_attention``) agree with each other and with the CPU reference;
* a served DeepSeek-V3.2-style model with offload on and off gives the same greedy
  tokens (model path from ``SGLANG_ASCEND_OFFLOAD_NPU_MODEL``: on an NPU runner without
  it the test fails with what to set, as every missing piece does there,
  ``tests/npu_requirements.py``).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from dsa_harness import LATENT, ROPE, TOPK, Harness, published_context
from npu_requirements import npu_present, require

from sglang_ascend_offload import config as cfg

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
    pytest.mark.usefixtures("plugins_loaded"),
]

NPU_MODEL_ENV = "SGLANG_ASCEND_OFFLOAD_NPU_MODEL"


def test_npu_pool_writes_equal_cpu_pool_writes():
    from types import SimpleNamespace

    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool

    with published_context("npu"):
        common = dict(
            page_size=128,
            dtype=torch.bfloat16,
            kv_lora_rank=LATENT,
            qk_rope_head_dim=ROPE,
            layer_num=2,
            enable_memory_saver=False,
            index_head_dim=128,
            index_size=2048,
            index_page_size=128,
        )
        npu = DeviceDSAPool(2048, device="npu", **common)
        cpu = DeviceDSAPool(2048, device="cpu", **common)
        loc = torch.randperm(2048)[:300] + 128
        loc = loc[loc < 2048 + 128]
        rows = torch.randn(loc.numel(), LATENT + ROPE).to(torch.bfloat16)
        index_k = torch.randn(loc.numel(), 128).to(torch.bfloat16)
        layer = SimpleNamespace(layer_id=1)
        npu.set_kv_buffer(layer, loc.to("npu"), rows[:, :LATENT].to("npu"), rows[:, LATENT:].to("npu"))
        cpu.set_kv_buffer(layer, loc, rows[:, :LATENT], rows[:, LATENT:])
        npu.set_index_k_buffer(1, loc.to("npu"), index_k.to("npu"))
        cpu.set_index_k_buffer(1, loc, index_k)
        assert torch.equal(npu.k_buffer.cpu(), cpu.k_buffer)
        assert torch.equal(npu.v_buffer.cpu(), cpu.v_buffer)
        assert torch.equal(npu.index_k_buffer.cpu(), cpu.index_k_buffer)


def test_npu_backends_agree_with_each_other_and_the_cpu_reference():
    with published_context("npu"):
        conf = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK, ops="npu")
        npu = Harness(device="npu", offload_config=conf, page_size=128, seed=3)
        ref = Harness(
            device="cpu", offload_config=cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK), page_size=128, seed=3
        )
        for h in (npu, ref):
            reqs = [h.new_request("a"), h.new_request("b")]
            h.extend(reqs, [40, 70])
        steps = [(npu.decode(list(npu.requests.values())), ref.decode(list(ref.requests.values()))) for _ in range(8)]
        for dev, cpu in steps:
            for layer in range(npu.layers):
                assert torch.equal(dev.topk[layer].cpu(), dev.offload_topk[layer].cpu())
                torch.testing.assert_close(
                    dev.offload_out[layer].cpu(), dev.dense_out[layer].cpu(), rtol=2e-2, atol=2e-2
                )
                torch.testing.assert_close(dev.dense_out[layer].cpu(), cpu.dense_out[layer], rtol=5e-2, atol=5e-2)
        stats = npu.offload.engine.stats().total
        assert stats.hits + stats.misses == stats.selected > 0


@pytest.mark.slow
def test_served_deepseek_v32_offload_on_equals_off(tmp_path):
    from sglang_ascend_offload.testing.servers import ServerProcess

    model = os.environ.get(NPU_MODEL_ENV)
    require(
        None
        if model
        else f"no model named: set {NPU_MODEL_ENV} to a DeepSeek-V3.2-style checkpoint (or its config "
        "directory, served with --load-format dummy)",
        "served DeepSeek-V3.2 offload on == off",
    )
    base = [
        "--model-path",
        model,
        "--device",
        "npu",
        "--attention-backend",
        "ascend_offload",
        "--disable-cuda-graph",
        "--max-running-requests",
        "8",
        "--kv-cache-dtype",
        "bfloat16",
    ]
    if not os.path.exists(os.path.join(model, "model.safetensors.index.json")):
        base += ["--load-format", "dummy"]
    off = ServerProcess([], log_path=tmp_path / "off.log", base_args=base, cpu=False)
    on = ServerProcess(
        ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", json.dumps({"ops": "npu"})],
        log_path=tmp_path / "on.log",
        base_args=base,
        cpu=False,
    )
    try:
        off.start()
        on.start()
        prefix = list(range(100, 4196))
        prompts = [prefix + list(range(7 * i, 7 * i + 300)) for i in range(4)]
        results = []
        for srv in (off, on):
            srv.generate(prefix, max_new_tokens=1)
            with ThreadPoolExecutor(4) as ex:
                results.append([o["output_ids"] for o in ex.map(lambda p: srv.generate(p, 32, 600), prompts)])
        assert results[0] == results[1]
    finally:
        off.stop()
        on.stop()
