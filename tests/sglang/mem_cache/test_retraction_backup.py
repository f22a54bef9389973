"""Retraction backups of the plugin's pools (P/D decode, ``--disaggregation-decode-retraction-backup
cpu_tensor``): ``get_cpu_copy`` at a request's slots, then ``load_cpu_copy`` into other
slots (the resumed request's) must reproduce every layer's main KV and index K there
bit for bit, through the pool's own write path, and touch no other slot.

Real pools on CPU: the plugin's ``DeviceDSAPool`` (device main KV, the draft model's
pool too) and the sparse-decode ``HostMainKVPool`` (main KV in the host pool).
"""

from __future__ import annotations

import pytest
import torch
from dsa_harness import INDEX_DIM, LATENT, ROPE, TOPK, hot_plan_for, published_context

from sglang_ascend_offload import config as cfg

pytestmark = pytest.mark.usefixtures("plugins_loaded")

PAGE, SLOTS, LAYERS = 16, 8 * 16, 2


@pytest.fixture
def ctx():
    with published_context():
        yield


def _common():
    return dict(
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        index_head_dim=INDEX_DIM,
    )


def _device_pool():
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool

    return DeviceDSAPool(SLOTS, index_size=SLOTS, index_page_size=PAGE, **_common())


def _host_pool():
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

    sd = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK)
    return HostMainKVPool(SLOTS, hot_plan=hot_plan_for(_common(), sd, top_k=TOPK, req_slots=4), offload=sd, **_common())


class _Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


def _fill(pool, slots, seed):
    """Write random KV and index K at ``slots`` of every layer through the pool's write path."""
    gen = torch.Generator().manual_seed(seed)
    loc = torch.as_tensor(slots, dtype=torch.long)
    for lid in range(LAYERS):
        latent = torch.randn(len(slots), 1, LATENT, generator=gen).to(torch.bfloat16)
        rope = torch.randn(len(slots), 1, ROPE, generator=gen).to(torch.bfloat16)
        pool.set_kv_buffer(_Layer(lid), loc, latent, rope)
        pool.set_index_k_buffer(lid, loc, torch.randn(len(slots), INDEX_DIM, generator=gen).to(torch.bfloat16))


def _rows(pool, lid, slots):
    """``[n, latent + rope]`` main rows and ``[n, index dim]`` index rows at ``slots``."""
    loc = torch.as_tensor(slots, dtype=torch.long)
    if pool.k_buffer is None:
        main = pool.read_host_rows(lid, loc)
    else:
        main = torch.cat((pool.k_buffer[lid].view(-1, LATENT)[loc], pool.v_buffer[lid].view(-1, ROPE)[loc]), dim=-1)
    return main, pool.index_k_buffer[lid].view(-1, INDEX_DIM)[loc]


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_retracted_request_resumes_bit_exact_in_new_slots(ctx, kind):
    pool = _device_pool() if kind == "device" else _host_pool()
    old = [17, 18, 19, 40, 41, 90, 91, 92, 93]  # a request's slots (not contiguous: pages of a request)
    new = [64, 65, 66, 67, 68, 69, 70, 71, 120]  # where it resumes
    others = [20, 21, 22, 100]
    _fill(pool, old, seed=1)
    _fill(pool, others, seed=2)
    want = [_rows(pool, lid, old) for lid in range(LAYERS)]
    untouched = [_rows(pool, lid, others) for lid in range(LAYERS)]
    backup = pool.get_cpu_copy(torch.tensor(old))
    assert backup.num_tokens == len(old)
    assert all(t.device.type == "cpu" for t in backup.main + backup.index_k)
    _fill(pool, old, seed=3)  # the freed slots are reused by another request meanwhile
    pool.load_cpu_copy(backup, torch.tensor(new))
    for lid in range(LAYERS):
        got = _rows(pool, lid, new)
        assert torch.equal(got[0], want[lid][0]) and torch.equal(got[1], want[lid][1]), lid
        still = _rows(pool, lid, others)
        assert torch.equal(still[0], untouched[lid][0]) and torch.equal(still[1], untouched[lid][1]), lid
    if kind == "host":
        assert pool.k_buffer is None  # no device main KV on the way


def test_a_backup_restored_into_a_different_size_is_refused(ctx):
    pool = _host_pool()
    _fill(pool, [3, 4, 5], seed=1)
    backup = pool.get_cpu_copy([3, 4, 5])
    with pytest.raises(ValueError, match="backup of 3 tokens restored into 2 slots"):
        pool.load_cpu_copy(backup, [7, 8])
