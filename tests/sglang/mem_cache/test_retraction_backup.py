"""Retraction backups of the plugin's pools (P/D decode, ``--disaggregation-decode-retraction-backup
cpu_tensor``): ``get_cpu_copy`` at a request's slots, then ``load_cpu_copy`` into other
slots (the resumed request's) must reproduce every layer's main KV and index K there
bit for bit, through the pool's own write path, and touch no other slot.

Real pools on CPU: the plugin's ``DeviceDSAPool`` (device main KV, the draft model's
pool too) and the sparse-decode ``HostMainKVPool`` (main KV in the host pool). On an NPU
(npu-marked; in CI the stand-in): the same backup and restore with the pools on the
device, equal to the CPU pools' run bit for bit, the backup in host memory, and the host
pool's main KV never crossing to the device (only the index K does).
"""

from __future__ import annotations

import contextlib

import npu_standin
import pytest
import torch
from dsa_harness import INDEX_DIM, LATENT, ROPE, TOPK, hot_plan_for, published_context
from npu_requirements import npu_present

from sglang_ascend_offload import config as cfg

pytestmark = pytest.mark.usefixtures("plugins_loaded")

PAGE, SLOTS, LAYERS = 16, 8 * 16, 2


@pytest.fixture
def ctx():
    with published_context():
        yield


def _common(device="cpu"):
    return dict(
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        layer_num=LAYERS,
        device=device,
        enable_memory_saver=False,
        index_head_dim=INDEX_DIM,
    )


def _device_pool(device="cpu"):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool

    return DeviceDSAPool(SLOTS, index_size=SLOTS, index_page_size=PAGE, **_common(device))


def _host_pool(device="cpu"):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

    sd = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK)
    common = _common(device)
    return HostMainKVPool(SLOTS, hot_plan=hot_plan_for(common, sd, top_k=TOPK, req_slots=4), offload=sd, **common)


class _Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


def _fill(pool, slots, seed):
    """Write random KV and index K at ``slots`` of every layer through the pool's write path
    (the tensors on the pool's device, as a forward hands them over)."""
    gen = torch.Generator().manual_seed(seed)
    dev = pool.index_k_buffer.device
    loc = torch.as_tensor(slots, dtype=torch.long).to(dev)
    for lid in range(LAYERS):
        latent = torch.randn(len(slots), 1, LATENT, generator=gen).to(torch.bfloat16)
        rope = torch.randn(len(slots), 1, ROPE, generator=gen).to(torch.bfloat16)
        pool.set_kv_buffer(_Layer(lid), loc, latent.to(dev), rope.to(dev))
        index_k = torch.randn(len(slots), INDEX_DIM, generator=gen).to(torch.bfloat16)
        pool.set_index_k_buffer(lid, loc, index_k.to(dev))


def _rows(pool, lid, slots):
    """``[n, latent + rope]`` main rows and ``[n, index dim]`` index rows at ``slots`` (host)."""
    loc = torch.as_tensor(slots, dtype=torch.long)
    if pool.k_buffer is None:
        main = pool.read_host_rows(lid, loc)
    else:
        k, v = pool.k_buffer[lid].cpu(), pool.v_buffer[lid].cpu()
        main = torch.cat((k.view(-1, LATENT)[loc], v.view(-1, ROPE)[loc]), dim=-1)
    return main.cpu(), pool.index_k_buffer[lid].cpu().view(-1, INDEX_DIM)[loc]


OLD = [17, 18, 19, 40, 41, 90, 91, 92, 93]  # a request's slots (not contiguous: pages of a request)
NEW = [64, 65, 66, 67, 68, 69, 70, 71, 120]  # where it resumes
OTHERS = [20, 21, 22, 100]


def _retract_and_resume(pool, around=contextlib.nullcontext):
    """Fill, back up ``OLD``, reuse ``OLD`` for another request, restore into ``NEW`` (the
    backup and the restore each inside ``around()``); returns ``(backup, want, untouched)``:
    what ``OLD`` held and what ``OTHERS`` held."""
    _fill(pool, OLD, seed=1)
    _fill(pool, OTHERS, seed=2)
    want = [_rows(pool, lid, OLD) for lid in range(LAYERS)]
    untouched = [_rows(pool, lid, OTHERS) for lid in range(LAYERS)]
    with around():
        backup = pool.get_cpu_copy(torch.tensor(OLD))
    _fill(pool, OLD, seed=3)  # the freed slots are reused by another request meanwhile
    with around():
        pool.load_cpu_copy(backup, torch.tensor(NEW))
    return backup, want, untouched


def _tensors(backup):
    """Every tensor of a backup: the plugin's ``RetractedKV``, or SGLang's nested lists."""
    if hasattr(backup, "main"):
        return backup.main + backup.index_k
    if isinstance(backup, torch.Tensor):
        return [backup]
    return [t for part in backup for t in _tensors(part)]


def _assert_resumed(pool, want, untouched):
    for lid in range(LAYERS):
        got = _rows(pool, lid, NEW)
        assert torch.equal(got[0], want[lid][0]) and torch.equal(got[1], want[lid][1]), lid
        still = _rows(pool, lid, OTHERS)
        assert torch.equal(still[0], untouched[lid][0]) and torch.equal(still[1], untouched[lid][1]), lid


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_retracted_request_resumes_bit_exact_in_new_slots(ctx, kind):
    pool = _device_pool() if kind == "device" else _host_pool()
    backup, want, untouched = _retract_and_resume(pool)
    assert backup.num_tokens == len(OLD)
    assert all(t.device.type == "cpu" for t in backup.main + backup.index_k)
    _assert_resumed(pool, want, untouched)
    if kind == "host":
        assert pool.k_buffer is None  # no device main KV on the way


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu")
@pytest.mark.parametrize("kind", ["device", "host"])
def test_retraction_on_the_npu_equals_the_cpu_run(kind):
    """Both pools on the NPU (the device pool backs up through SGLang's NPU copy, the host
    pool through the plugin's): the backup is in host memory, the resumed request's rows
    and every other slot equal the CPU pools' run bit for bit. The sparse-decode host
    pool's main KV never crosses to the device: on the stand-in, the backup reads back only
    the index K rows and the restore copies only them (with their slots) to the device."""
    make = _device_pool if kind == "device" else _host_pool
    with published_context("npu"):
        cpu_pool = make("cpu")
        cpu_backup, cpu_want, _ = _retract_and_resume(cpu_pool)
        pool = make("npu")
        assert pool.index_k_buffer.device.type == "npu"
        windows = []

        @contextlib.contextmanager
        def counted():
            from npu_standin import transfers

            with transfers.counting() as window:
                yield
            windows.append(window)

        around = counted if npu_standin.installed() else contextlib.nullcontext
        backup, want, untouched = _retract_and_resume(pool, around)
    assert all(t.device.type == "cpu" for t in _tensors(backup))
    _assert_resumed(pool, want, untouched)
    for lid in range(LAYERS):  # the whole pool, and what the request held, equal the CPU run's
        assert torch.equal(want[lid][0], cpu_want[lid][0]) and torch.equal(want[lid][1], cpu_want[lid][1])
        for slots in (NEW, OTHERS, OLD):
            got, cpu = _rows(pool, lid, slots), _rows(cpu_pool, lid, slots)
            assert torch.equal(got[0], cpu[0]) and torch.equal(got[1], cpu[1]), (lid, slots)
    if kind != "host":
        return
    for got, cpu in zip(_tensors(backup), _tensors(cpu_backup)):  # the plugin's backup, as on CPU
        assert torch.equal(got, cpu)
    if windows:
        index_rows, slot_index = len(OLD) * INDEX_DIM * 2, len(OLD) * 8  # bytes per indexer layer
        seen = [(t.kind, t.nbytes) for w in windows for t in w.seen if t.site.startswith("sglang_ascend_offload/")]
        assert sorted(seen) == sorted(
            [("d2h", index_rows), ("h2d", slot_index)] * LAYERS  # backup: the slots over, the index K back
            + [("h2d", index_rows), ("h2d", slot_index)] * LAYERS  # restore: the index K rows at their slots
        ), [(t.kind, t.nbytes, t.site) for w in windows for t in w.seen]  # no main-KV row (576 bf16) crossed


def test_a_backup_restored_into_a_different_size_is_refused(ctx):
    pool = _host_pool()
    _fill(pool, [3, 4, 5], seed=1)
    backup = pool.get_cpu_copy([3, 4, 5])
    with pytest.raises(ValueError, match="backup of 3 tokens restored into 2 slots"):
        pool.load_cpu_copy(backup, [7, 8])
