"""P/D into a decode with the int8 (LIM-C8) index-K cache, in one process with real pools
and real Mooncake engines over TCP (``test_pd_backend_components.Pair``).

The decode's sparse decode pool (``indexer_dtype: "int8"``) advertises it; the prefill
(a bf16 ``DeviceDSAPool``) packs each layer's index-K pages into int8 keys + fp16 scales
(``rotate_and_quantize``) in its staging next to the packed main rows, and the decode
pulls them as the layout's ``indexer`` and ``indexer_scale`` tensors. What lands must be,
bit for bit, the main rows of the prefill pages and ``rotate_and_quantize`` of their bf16
keys: exactly what the decode's own indexer would have stored for those tokens. A
retraction backup of the int8 cache restores keys and scales unchanged.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from dsa_harness import INDEX_DIM, TOPK, hot_plan_for, published_context
from pd_components_harness import LATENT, LAYERS, PAGE, ROPE, SLOTS, Pair, _common, device_pool

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.ops.hadamard import rotate_and_quantize
from sglang_ascend_offload.transfer import pool_layouts as layouts

pytestmark = [
    pytest.mark.usefixtures("plugins_loaded"),
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)",
    ),
    pytest.mark.timeout(120),
]


@pytest.fixture
def ctx():
    with published_context():
        yield


def int8_host_pool():
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

    sd = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK, indexer_dtype="int8")
    return HostMainKVPool(SLOTS, hot_plan=hot_plan_for(_common(), sd, top_k=TOPK, req_slots=4), offload=sd, **_common())


def assert_int8_index_equal(p_pool, d_pool, src, dst):
    for layer in range(LAYERS):
        values, scales = rotate_and_quantize(p_pool.index_k_buffer[layer][src])
        assert torch.equal(d_pool.index_k_buffer[layer][dst], values), layer
        assert torch.equal(d_pool.index_k_scale_buffer[layer][dst], scales), layer


def test_the_int8_cache_is_advertised_and_laid_out_with_its_scales(ctx):
    d = int8_host_pool()
    tensors = layouts.destination_tensors(d)
    assert [t.role for t in tensors] == ["main", "indexer", "indexer_scale"]
    staging = layouts.PackedStaging(device_pool(), slots=2, max_blocks=4, indexer_dtype="int8")
    src = layouts.layout_of(d, staging.tensors())
    dst = layouts.layout_of(d, tensors)
    assert src.indexer.block_bytes == dst.indexer.block_bytes == PAGE * INDEX_DIM
    assert src.indexer_scale.block_bytes == dst.indexer_scale.block_bytes == PAGE * 2
    assert staging.indexer_blocks([7, 3]) == [0, 1]
    with pytest.raises(layouts.LayoutError, match="draft"):
        layouts.PackedStaging(device_pool(), indexer_dtype="int8", draft_pool=device_pool(layers=1, start_layer=LAYERS))


def test_requests_arrive_as_int8_keys_and_scales(ctx):
    pair = Pair(int8_host_pool())
    try:
        assert pair.sink.advert().indexer_dtype == "int8"
        jobs = {
            21: ([3, 7, 1], [9, 4, 12]),
            22: ([2, 5, 8, 10, 11, 13, 14, 15], [1, 2, 3, 5, 6, 7, 8, 10]),
            23: ([6], [15]),
        }

        def check(p_pool, d_pool, src, dst):
            _assert_main_rows(p_pool, d_pool, src, dst)
            assert_int8_index_equal(p_pool, d_pool, src, dst)

        pair.transfer_all(jobs, check)
        link = pair.links.links()[0]
        assert link.staging.packs_indexer and pair.links.stats.packed_layers == LAYERS * len(jobs)
    finally:
        pair.close()


def _assert_main_rows(p_pool, d_pool, src, dst):
    for layer in range(LAYERS):
        want = torch.cat(
            (
                p_pool.k_buffer[layer][src].reshape(len(src), PAGE, LATENT),
                p_pool.v_buffer[layer][src].reshape(len(src), PAGE, ROPE),
            ),
            dim=-1,
        )
        assert torch.equal(d_pool.host_page_blocks(layer)[dst], want), layer


def test_a_retraction_backup_of_the_int8_cache_restores_keys_and_scales(ctx):
    pool = int8_host_pool()
    gen = torch.Generator().manual_seed(4)
    for buf in (pool.index_k_buffer,):
        buf.copy_(torch.randint(-127, 128, buf.shape, generator=gen, dtype=torch.int8))
    pool.index_k_scale_buffer.copy_(torch.rand(pool.index_k_scale_buffer.shape, generator=gen).half())
    slots = torch.tensor([17, 18, 40, 41])
    backup = pool.get_cpu_copy(slots)
    assert backup.index_scale is not None and backup.index_scale[0].dtype == torch.float16
    new = torch.tensor([70, 71, 72, 90])
    pool.load_cpu_copy(backup, new)
    for layer in range(LAYERS):
        keys = pool.index_k_buffer[layer].reshape(-1, INDEX_DIM)
        scales = pool.index_k_scale_buffer[layer].reshape(-1)
        assert torch.equal(keys[new], keys[slots]) and torch.equal(scales[new], scales[slots])
    with pytest.raises(TypeError, match="int8"):
        pool.write_index_rows(0, new, keys[slots].to(torch.bfloat16), scales[slots])


def test_a_layerwise_prefill_packs_int8_keys_and_scales_too(ctx, monkeypatch):
    """The layerwise prefill's publisher (``test_pd_layerwise_publish.run_transfer``: a
    request in two chunks through one shared buffer, decode reads slowed down) into an
    int8 decode: main rows as before, the index K as int8 keys + scales of the bf16 keys a
    prefill without layerwise offload holds; the shared buffer still waits for the reads."""
    import test_pd_layerwise_publish as lw

    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

    made, seen = {}, {}

    def int8_pool(page=PAGE, layers=LAYERS):
        sd = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK, indexer_dtype="int8")
        common = _common(page, layers)
        made["pool"] = HostMainKVPool(
            SLOTS, hot_plan=hot_plan_for(common, sd, top_k=TOPK, req_slots=4), offload=sd, **common
        )
        return made["pool"]

    def then(pub, h, src):
        seen["keys"] = [h.dense_pool.index_k_buffer[layer][src].clone() for layer in range(lw.LAYERS)]
        seen["src"] = src

    monkeypatch.setattr(lw, "host_pool", int8_pool)
    p, d, bad, order, busy, pipelined = lw.run_transfer(gate_reads=True, decode="host_rows", then=then)
    assert p.state is lw.TransferState.DONE and d.state is lw.TransferState.DONE, (p, d)
    # main rows equal; the index K is int8 here, so the bf16 comparison flags exactly it
    assert sorted(bad) == [(layer, "index_k_buffer") for layer in range(lw.LAYERS)]
    dst = list(range(1, len(seen["src"]) + 1))
    for layer, keys in enumerate(seen["keys"]):
        values, scales = rotate_and_quantize(keys)
        assert torch.equal(made["pool"].index_k_buffer[layer][dst], values), layer
        assert torch.equal(made["pool"].index_k_scale_buffer[layer][dst], scales), layer
    assert sorted(e[1] for e in order if e[0] == "read_done") == sorted(pipelined) and busy == []
