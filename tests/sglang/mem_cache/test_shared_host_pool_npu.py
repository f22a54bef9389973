"""NPU: one MemFabric host pool per attention-DP group, allocated by TP rank 0 and read
by the other ranks through MemFabric's global virtual addresses, through the served
allocation (``shared_host_pool.allocate_rank_pool(shape, "memfabric", view)`` ->
``memfabric_shared_pool.MemfabricGroupPool``).

Two ranks (spawned processes on devices 0 and 1, the group's broadcast a queue):

* pool level: rank 0 appends rows from its NPU (``L2G``); rank 1 reads them back into
  host memory (``G2H``) and onto its own device (``G2L``) bit for bit; both see rank
  0's pool at the same GVA;
* engine level: both ranks run the fixed decode workload of
  ``memfabric_group_worker`` on their NPU (rank 0 appends and publishes through the
  group's append order, rank 1 waits and copies its misses through the GVA path); each
  rank's attention outputs equal a one-rank engine with a private pinned pool on the
  same device;
* teardown in order (rank 1 leaves first, rank 0 frees) without errors.

Skips here (no NPU); the CPU version of the same logic over a ``memfabric_hybrid``
stand-in is ``test_memfabric_group_pool.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

pytestmark = pytest.mark.npu

SLOTS = [3, 4, 5, 100, 120]


def _expected(layer: int):
    import torch

    g = torch.Generator().manual_seed(1000 + layer)
    return torch.randn((len(SLOTS), 24), generator=g).to(torch.bfloat16)


def _rank(rank: int, queues, barrier, results):
    rp = None
    try:
        import memfabric_group_worker as w
        import torch
        import torch_npu  # noqa: F401 - registers the NPU device

        from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp

        torch.npu.set_device(rank)
        dev = f"npu:{rank}"
        rp = shp.allocate_rank_pool(w.shape(), "memfabric", view=w.group_view(rank, 2, queues, 120.0))
        pool = rp.pool
        assert pool.kind == "memfabric_gva" and rp.order is not None
        if rank == 0:  # pool level: L2G appends of the last layer's slots (the workload rewrites them)
            pool.write_rows(w.LAYERS - 1, torch.tensor(SLOTS), _expected(0).to(dev))
        barrier.wait(120)  # the append happened before the read
        same = None
        if rank == 1:
            host = pool.read_rows(w.LAYERS - 1, torch.tensor(SLOTS))
            on_dev = pool.read_rows(w.LAYERS - 1, torch.tensor(SLOTS), device=torch.device(dev)).cpu()
            same = bool(torch.equal(host, _expected(0)) and torch.equal(on_dev, _expected(0)))
        barrier.wait(120)
        out = w.workload(w.engine_for(pool, rank, rp.order, device=dev), rank, rp.order, device=dev)
        ref = w.reference_outputs(device=dev)
        results.put((rank, pool.base, same, bool(torch.equal(out.view(torch.int16), ref.view(torch.int16))), None))
        pool.close()
        rp.control.close()
        rp = None
        results.put((rank, "closed", None, None, None))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, None, None, None, f"{type(exc).__name__}: {exc}"))
    finally:
        if rp is not None:
            rp.pool.close()


def test_two_ranks_share_one_memfabric_pool_through_the_served_allocation():
    ctx = mp.get_context("spawn")
    queues, results, barrier = [ctx.Queue(), ctx.Queue()], ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_rank, args=(r, queues, barrier, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(4):
            try:
                rank, a, same, engine_same, err = results.get(timeout=600)
            except queue.Empty:
                pytest.fail(f"no result within 600 s; so far {got}")
            assert err is None, f"rank {rank}: {err}"
            got.setdefault(rank, []).append((a, same, engine_same))
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    (base0, _, eng0), (closed0, _, _) = got[0]
    (base1, same, eng1), (closed1, _, _) = got[1]
    assert base0 == base1 != 0  # one pool, one global address
    assert same is True  # G2H and G2L read rank 0's L2G append bit for bit
    assert eng0 is True and eng1 is True  # the served engine over the group pool == a private pool
    assert closed0 == closed1 == "closed"
    assert all(p.exitcode == 0 for p in procs)
