"""Host KV pool: rows by caller slots, the TP-shared mapping across processes, the gate."""

from __future__ import annotations

import multiprocessing
import os
import uuid

import pytest
import torch
from npu_requirements import npu_present, require_package, requires

from sglang_ascend_offload import platform
from sglang_ascend_offload.sparse_decode.host_pool import AppendGate, AppendTimeout, HostKVPool, HostPoolShape

from . import tp_worker


def test_rows_are_indexed_by_the_callers_slots():
    pool = HostKVPool.allocate(HostPoolShape(layers=2, tokens=10, latent_dim=4, rope_dim=2), "pinned")
    assert pool.shape.row_bytes == 12 and pool.shape.nbytes == 2 * 10 * 12
    rows = torch.randn((3, 6)).to(torch.bfloat16)
    slots = torch.tensor([7, 2, 9])
    assert pool.write_rows(1, slots, rows) == 3 * 12
    assert torch.equal(pool.read_rows(1, slots), rows)
    assert torch.equal(pool.latent(1)[slots], rows[:, :4]) and torch.equal(pool.rope(1)[slots], rows[:, 4:])
    assert not pool.layer(0).any() and not pool.layer(1)[[0, 1, 3]].any()
    with pytest.raises(ValueError, match="dtype"):
        pool.write_rows(0, slots, rows.float())
    with pytest.raises(ValueError, match="do not fit"):
        pool.write_rows(0, slots, rows[:, :5])


def test_default_geometry_is_deepseek_v32_row():
    s = HostPoolShape(layers=61, tokens=1)
    assert (s.row_dim, s.row_bytes) == (576, 1152)


def test_shared_pool_attach_checks(tmp_path):
    path = tmp_path / "pool"
    shape = HostPoolShape(1, 4, 4, 2)
    with pytest.raises(FileNotFoundError, match="create_shared"):
        HostKVPool.attach_shared(shape, path)
    owner = HostKVPool.create_shared(shape, path)
    with pytest.raises(FileExistsError):
        HostKVPool.create_shared(shape, path)
    with pytest.raises(ValueError, match="same pool shape"):
        HostKVPool.attach_shared(HostPoolShape(1, 5, 4, 2), path)
    other = HostKVPool.attach_shared(shape, path)
    owner.write_rows(0, torch.tensor([3]), torch.ones((1, 6), dtype=torch.bfloat16))
    assert torch.equal(other.read_rows(0, torch.tensor([3])), torch.ones((1, 6), dtype=torch.bfloat16))
    owner.close()
    assert not path.exists()


def test_gate_wait_has_a_deadline():
    gate = AppendGate(layers=3)
    gate.publish(0, 2)
    gate.wait(0, 1, timeout_s=1)  # earlier units count as published
    with pytest.raises(AppendTimeout, match="step 1 layer 0"):
        gate.wait(1, 0, timeout_s=0.05)


def test_two_tp_ranks_share_one_pool_and_rank1_reads_rank0_appends():
    """Rank 0 appends (with random delays), rank 1 only reads: identical outputs.

    ``fork`` keeps the test fast (no second torch import); the workers set one torch
    thread before any op, which keeps OpenMP fork-safe.
    """
    ctx = multiprocessing.get_context("fork")
    path = f"/dev/shm/sao_test_pool_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    gate = AppendGate(tp_worker.LAYERS, ctx)
    created, finished = ctx.Event(), ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=tp_worker.rank_main, args=(rank, path, gate, created, finished, results)) for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, outputs, misses, d2h, err = results.get(timeout=120)
            assert err is None, f"rank {rank}: {err}"
            got[rank] = (outputs, misses, d2h)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        leftover = os.path.exists(path)
        if leftover:
            os.unlink(path)
    out0, misses0, d2h0 = got[0]
    out1, misses1, d2h1 = got[1]
    assert (out0 == out1).all(), "rank 1 attended rows that differ from rank 0's"
    assert out0.any()
    assert misses0 == misses1 > 0
    assert d2h0 > 0 and d2h1 == 0  # only TP rank 0 moved new rows device -> host
    assert not leftover  # the creator removed the mapping file


def test_memfabric_kind_is_npu_only_with_a_clear_error():
    if platform.device_kind() == "npu":
        pytest.skip("covered by the npu test")
    with pytest.raises(RuntimeError, match="needs an Ascend NPU"):
        HostKVPool.allocate(HostPoolShape(1, 4), "memfabric")


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with memfabric-hybrid")
@requires(lambda: require_package("memfabric_hybrid", "the [npu] extra"))
def test_memfabric_pool_rows_round_trip_to_the_device():
    pool = HostKVPool.allocate(HostPoolShape(layers=2, tokens=256), "memfabric")
    rows = torch.randn((5, 576)).to(torch.bfloat16)
    slots = torch.tensor([1, 17, 64, 200, 255])
    pool.write_rows(1, slots, rows)
    on_device = pool.read_rows(1, slots).to(platform.default_device())
    assert torch.equal(on_device.cpu(), rows)


def test_shared_pool_header_reserve_and_unlink_keeps_the_mapping(tmp_path):
    path = tmp_path / "pool_h"
    shape = HostPoolShape(2, 8, 4, 2)
    with pytest.raises(ValueError, match="multiple of the page size"):
        HostKVPool.create_shared(shape, path, header_bytes=100)
    owner = HostKVPool.create_shared(shape, path, header_bytes=4096, reserve=True)
    assert path.stat().st_size == 4096 + shape.nbytes
    assert path.stat().st_blocks * 512 >= 4096 + shape.nbytes  # reserved, not sparse
    with pytest.raises(ValueError, match="header"):
        HostKVPool.attach_shared(shape, path)  # the header must be declared
    other = HostKVPool.attach_shared(shape, path, header_bytes=4096)
    owner.mapping[:8] = b"HEADER!!"
    rows = torch.arange(12, dtype=torch.float32).view(2, 6).to(torch.bfloat16)
    owner.write_rows(1, torch.tensor([0, 7]), rows)
    owner.unlink()
    assert not path.exists()
    assert torch.equal(other.read_rows(1, torch.tensor([0, 7])), rows)  # still mapped after the unlink
    assert bytes(other.mapping[:8]) == b"HEADER!!" and not other.layer(0).any()  # header apart from rows
    other.close()
    owner.close()
