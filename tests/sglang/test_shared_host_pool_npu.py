"""NPU: one MemFabric host pool per group, allocated by rank 0, read by rank 1 through
MemFabric's global virtual addresses (``sglang_plugin.memfabric_shared_pool``).

Two ranks (spawned processes on devices 0 and 1): rank 0 allocates the pool and
appends rows from the NPU (L2G); rank 1 reads them back (G2H, and G2L onto its own
device) and must get them bit for bit; both see the same GVA for rank 0's pool; then
both tear down (leave, destroy, uninitialize) without errors. Skips here (no NPU).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytestmark = pytest.mark.npu

LAYERS, TOKENS = 2, 256
SLOTS = [3, 4, 5, 100, 255]


def _expected(layer: int):
    import torch

    g = torch.Generator().manual_seed(1000 + layer)
    return torch.randn((len(SLOTS), 576), generator=g).to(torch.bfloat16)


def _rank(rank: int, q_obj, barrier, results):
    err = None
    pool = None
    try:
        import torch
        import torch_npu  # noqa: F401 - registers the NPU device

        from sglang_ascend_offload.sglang_plugin.memfabric_shared_pool import MemfabricGroupPool, MemfabricPoolConfig
        from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape

        torch.npu.set_device(rank)

        def broadcast(obj):
            if rank == 0:
                q_obj.put(obj)
                return obj
            return q_obj.get(timeout=60)

        pool = MemfabricGroupPool(HostPoolShape(LAYERS, TOKENS), rank, 2, MemfabricPoolConfig(device_id=rank),
                                  broadcast, lambda: barrier.wait(60))
        if rank == 0:
            for layer in range(LAYERS):
                pool.write_rows(layer, torch.tensor(SLOTS), _expected(layer).to(f"npu:{rank}"))
            torch.npu.synchronize()
        barrier.wait(60)  # the append happened before the read
        same = []
        if rank == 1:
            for layer in range(LAYERS):
                host = pool.read_rows(layer, torch.tensor(SLOTS))
                dev = pool.read_rows(layer, torch.tensor(SLOTS), device=torch.device(f"npu:{rank}")).cpu()
                same.append(bool(torch.equal(host, _expected(layer)) and torch.equal(dev, _expected(layer))))
        results.put((rank, pool.base, same, None))
        barrier.wait(60)
        pool.close()
        pool = None
        results.put((rank, "closed", None, None))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        err = f"{type(exc).__name__}: {exc}"
        results.put((rank, None, None, err))
    finally:
        if pool is not None:
            pool.close()


def test_two_ranks_rank1_reads_rank0_appends_bit_exactly_through_global_addresses():
    ctx = mp.get_context("spawn")
    q_obj, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_rank, args=(r, q_obj, barrier, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(4):
            rank, a, b, err = results.get(timeout=300)
            assert err is None, f"rank {rank}: {err}"
            got.setdefault(rank, []).append((a, b))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    (base0, _), (closed0, _) = got[0]
    (base1, same), (closed1, _) = got[1]
    assert base0 == base1 != 0  # one pool, one global address
    assert same == [True] * LAYERS
    assert closed0 == closed1 == "closed"
    assert all(p.exitcode == 0 for p in procs)
