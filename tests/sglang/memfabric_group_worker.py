"""Process body of the MemFabric group host pool tests (importable for spawn).

Each rank installs the ``memfabric_hybrid`` stand-in (``fake_memfabric``), makes the
platform report an NPU, and opens its host pool through the served code path
(``mem_cache.pool_host.shared.allocate_rank_pool(shape, "memfabric", view=...)``) with a
:class:`GroupView` whose broadcast is a queue per rank (with a deadline). Then every
rank runs the same deterministic decode workload through its own
:class:`SparseDecodeEngine`: rank 0 appends each layer's new rows (after a random
delay, so a reader that did not wait would read missing rows) and publishes them as
``HostMainKVPool.set_kv_buffer`` does; the other ranks count the append, wait on the
gate and copy their misses from rank 0's memory through global addresses.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Dict, List, Optional

import numpy as np
import torch

LAYERS, ROWS, K, HOT, LATENT, ROPE, HEADS = 2, 2, 4, 8, 16, 8, 2
CTX = 64
STEPS = 12


class NoViewPool:
    """A :class:`HostKVPool` behind the host-rows interface without its tensor view
    (``tensor_backed = False``, ``layer()`` fails): what the engine and the pool see of
    the MemFabric group pool, in one process. Counts ``gather_into`` calls."""

    kind, tensor_backed = "no_view", False

    def __init__(self, pool):
        self._pool, self.shape, self.gathers = pool, pool.shape, 0

    def write_rows(self, layer, host_slots, rows):
        return self._pool.write_rows(layer, host_slots, rows)

    def read_rows(self, layer, host_slots):
        return self._pool.read_rows(layer, host_slots)

    def gather_into(self, layer, host_slots, dst, dst_rows=None):
        self.gathers += 1
        return self._pool.gather_into(layer, host_slots, dst, dst_rows)

    def layer(self, layer):
        raise AssertionError("a pool without a tensor view was indexed as a tensor")


def shape():
    from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape

    return HostPoolShape(LAYERS, ROWS * CTX, LATENT, ROPE)


def engine_for(pool, rank: int, order=None, device: str = "cpu"):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host.shared import EngineGate
    from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine

    gate = EngineGate(order) if order is not None and rank > 0 else None
    return SparseDecodeEngine(
        EngineConfig(LAYERS, ROWS, HOT, K, LATENT, ROPE, policy="lru", ops="reference"),
        pool,
        device=device,
        tp_rank=rank,
        gate=gate,
    )


def workload(engine, rank: int, order=None, die_after_step: Optional[int] = None, device: str = "cpu") -> torch.Tensor:
    """Outputs ``[STEPS * LAYERS, ROWS, HEADS, LATENT]`` (on the host) of the fixed
    workload; rows and queries are made on the host and moved to ``device``."""
    rng = np.random.default_rng(7)  # the same on every rank
    gen = torch.Generator().manual_seed(7)
    table = torch.arange(ROWS * CTX, dtype=torch.int32).view(ROWS, CTX).flip(1).contiguous()
    outputs = []
    for step in range(STEPS):
        if die_after_step is not None and step > die_after_step and rank == 0:
            os._exit(19)  # rank 0 dies mid-decode
        seq = 8 + step
        engine.begin_step(torch.tensor([100, 101]), table, torch.full((ROWS,), seq, dtype=torch.int32), step)
        new_pos = list(range(0, seq)) if step == 0 else [seq - 1]
        slots = table[:, new_pos].reshape(-1).to(torch.int64)
        for layer in range(LAYERS):
            rows = torch.randn((slots.numel(), LATENT + ROPE), generator=gen).to(torch.bfloat16)
            delay = float(rng.random()) * 0.01
            if rank == 0 and order is not None:
                time.sleep(delay)
            engine.append(layer, slots, rows.to(device))  # a no-op on ranks > 0
            if order is not None:
                order.appended(layer)  # what set_kv_buffer does after the append
            topk = np.stack(
                [np.concatenate([[seq - 1], rng.choice(seq - 1, K - 1, replace=False)]) for _ in range(ROWS)]
            ).astype(np.int32)
            q = torch.randn((ROWS, HEADS, LATENT), generator=gen).to(torch.bfloat16)
            qr = torch.randn((ROWS, HEADS, ROPE), generator=gen).to(torch.bfloat16)
            res = engine.run_layer(layer, torch.from_numpy(topk), q.to(device), qr.to(device), 0.25)
            outputs.append(res.output.to("cpu", copy=True))
    return torch.stack(outputs)


def reference_outputs(device: str = "cpu") -> torch.Tensor:
    """The workload on one rank with a private tensor pool."""
    from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool

    return workload(engine_for(HostKVPool.allocate(shape(), "pinned"), 0, device=device), 0, device=device)


def group_view(rank: int, size: int, queues, deadline_s: float):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host.shared import GroupView

    def broadcast(obj):
        if rank == 0:
            for q in queues[1:]:
                q.put(obj)
            return obj
        try:
            return queues[rank].get(timeout=deadline_s)
        except queue.Empty:
            raise TimeoutError(f"TP rank {rank}: no broadcast from TP rank 0 within {deadline_s:g} s") from None

    def no_barrier():
        raise AssertionError("the MemFabric group path must not use a torch barrier")

    return GroupView(rank=rank, size=size, group=0, groups=1, broadcast_object=broadcast, barrier=no_barrier)


def rank_main(rank: int, size: int, env: Dict[str, str], queues, results, die_after_step: Optional[int] = None):
    """Open the group pool through the served code, run the workload, close; report
    ``(rank, outputs as int16 numpy | None, info dict, error | None)``."""
    info: Dict[str, object] = {"pid": os.getpid()}
    t0 = time.monotonic()
    try:
        os.environ.update(env)
        torch.set_num_threads(1)
        import fake_memfabric

        fake_memfabric.install()
        from sglang_ascend_offload import platform

        platform.device_kind = lambda: "npu"  # the stand-in world: an NPU whose "device" tensors are CPU tensors
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp

        rp = shp.allocate_rank_pool(shape(), "memfabric", view=group_view(rank, size, queues, 30.0))
        info.update(kind=rp.pool.kind, base=rp.pool.base, tensor_backed=rp.pool.tensor_backed)
        out = workload(engine_for(rp.pool, rank, rp.order), rank, rp.order, die_after_step)
        info.update(waits=rp.order.waits)
        rp.pool.close()
        rp.control.close()
        info["seconds"] = time.monotonic() - t0
        results.put((rank, out.view(torch.int16).numpy(), info, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        info["seconds"] = time.monotonic() - t0
        results.put((rank, None, info, f"{type(exc).__name__}: {exc}"))


def run_group(size: int, env: Dict[str, str], timeout_s: float = 120.0, die_after_step: Optional[int] = None):
    """Spawn ``size`` ranks; returns ``({rank: (outputs, info, error)}, exit codes)``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(size)]
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, env, queues, results, die_after_step)) for r in range(size)]
    for p in procs:
        p.start()
    got: Dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < size and time.monotonic() < deadline:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            try:
                rank, out, info, err = results.get(timeout=0.5)
            except queue.Empty:
                continue
            got[rank] = (out, info, err)
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    codes: List[Optional[int]] = [p.exitcode for p in procs]
    return got, codes
