"""Device bytes of the int8 (LIM-C8) index-K cache: the pool that is served, the sizing
hooks SGLang's KV budget goes through, and the capacity planner agree on
``index_head_dim + 2`` bytes per token and layer (int8 keys + one fp16 scale)."""

from __future__ import annotations

import types

import pytest
import torch
from dsa_harness import INDEX_DIM, TOPK, Harness, published_context

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.model_specs import load_hf_config
from sglang_ascend_offload.sglang_plugin.args import carrier
from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import device_kv_budget
from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import sparse_decode as offload_sizing
from sglang_ascend_offload.testing.servers import TINY_DSA

pytestmark = pytest.mark.usefixtures("plugins_loaded")


def _kvc(device="cpu"):
    hf = types.SimpleNamespace(index_topk=16, index_head_dim=INDEX_DIM)
    return types.SimpleNamespace(
        device=device, model_config=types.SimpleNamespace(hf_config=hf, kv_lora_rank=512, qk_rope_head_dim=64)
    )


def test_index_k_bytes_per_token():
    assert device_kv_budget.index_k_bytes_per_token(128) == 256
    assert device_kv_budget.index_k_bytes_per_token(128, "int8") == 130
    with pytest.raises(ValueError, match="fp8"):
        device_kv_budget.index_k_bytes_per_token(128, "fp8")
    kvc = _kvc()
    assert device_kv_budget.cpu_cell_bytes(kvc, 2, offloaded=True, indexer_dtype="int8") == 2 * 130
    assert device_kv_budget.cpu_cell_bytes(kvc, 2, offloaded=False) == 2 * ((512 + 64) * 2 + 256)


def test_the_served_pool_and_the_capacity_planner_count_the_same_bytes():
    """What the pool allocates per token and layer == the planner's int8 figure for the
    fixture's config (and its bf16 figure for a bf16 pool)."""
    with published_context():
        for dtype in ("bf16", "int8"):
            h = Harness(
                offload_config=cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK, indexer_dtype=dtype), page_size=64
            )
            pool = h.offload_pool
            per_token = pool.index_k_buffer[0, 0, 0].nbytes
            if pool.index_k_scale_buffer is not None:
                per_token += pool.index_k_scale_buffer[0, 0, 0].nbytes
            planned = load_hf_config(str(TINY_DSA / "config.json"), indexer_dtype=dtype).indexer_bytes_per_layer()
            assert per_token == planned == device_kv_budget.index_k_bytes_per_token(INDEX_DIM, dtype)
            tokens = pool.index_k_buffer.shape[1] * pool.index_k_buffer.shape[2]
            assert pool.get_kv_size_bytes() == h.layers * tokens * planned
            assert ("int8 + fp16 scales" in pool.index_cache_summary()) == (dtype == "int8")


@pytest.fixture
def served_int8(monkeypatch):
    sd = cfg.SparseDecodeOffloadConfig(indexer_dtype="int8")
    monkeypatch.setattr(offload_sizing, "_served", lambda kvc: sd)
    monkeypatch.setattr(carrier, "serves_plugin_pool", lambda kvc: True)
    return sd


def test_sglang_cell_counts_the_int8_cache(served_int8, monkeypatch):
    """SGLang's per-token cell with the int8 pool: on a device (an NPU's sizing path) and on
    a CPU that accounts like a device (--device-kv-budget), index_head_dim + 2 per layer."""
    configurator = types.SimpleNamespace(_compute_dsa_indexer_cell_size=lambda kvc, num_layers: 132 * num_layers)
    assert offload_sizing.cell_size_after(1284 * 61, configurator, _kvc("npu"), 61) == 130 * 61
    monkeypatch.setenv(
        carrier.CONFIG_ENV, cfg.to_json(cfg.OffloadConfig(sparse_decode=served_int8, device_kv_budget_bytes=2**20))
    )
    assert offload_sizing.cell_size_after(2816, configurator, _kvc("cpu"), 2) == 2 * 130
    assert torch.int8.itemsize * INDEX_DIM + torch.float16.itemsize == 130
