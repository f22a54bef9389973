"""Process body of the 2-process TP-shared host pool test (importable for spawn).

Both ranks run the same deterministic decode workload through their own engine.
TP rank 0 creates the shared pool, appends every step's new rows (after a short
random delay, so a reader that did not wait would see missing rows) and publishes
them on the gate; TP rank 1 attaches to the same memory, appends nothing, waits on
the gate and gathers its misses from rows only rank 0 wrote. Each rank sends its
attention outputs back; the test compares them bit for bit.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape

LAYERS, ROWS, K, HOT, LATENT, ROPE, HEADS = 2, 2, 4, 8, 16, 8, 2
CTX = 64
STEPS = 24


def shape() -> HostPoolShape:
    return HostPoolShape(LAYERS, ROWS * CTX, LATENT, ROPE)


def rank_main(rank: int, path: str, gate, created, finished, results) -> None:
    try:
        torch.set_num_threads(1)
        if rank == 0:
            pool = HostKVPool.create_shared(shape(), path)
            created.set()
        else:
            if not created.wait(60):
                raise TimeoutError("rank 0 never created the pool")
            pool = HostKVPool.attach_shared(shape(), path)
        engine = SparseDecodeEngine(
            EngineConfig(LAYERS, ROWS, HOT, K, LATENT, ROPE, policy="lru", ops="reference"),
            pool,
            device="cpu",
            tp_rank=rank,
            gate=gate,
            gate_timeout_s=60,
        )
        rng = np.random.default_rng(7)  # same workload on both ranks
        gen = torch.Generator().manual_seed(7)
        table = torch.arange(ROWS * CTX, dtype=torch.int32).view(ROWS, CTX).flip(1).contiguous()
        outputs = []
        for step in range(STEPS):
            seq = 8 + step  # positions 0..seq-1; the newest one is appended this step
            engine.begin_step(torch.tensor([100, 101]), table, torch.full((ROWS,), seq, dtype=torch.int32), step)
            new_pos = list(range(0, seq)) if step == 0 else [seq - 1]
            slots = table[:, new_pos].reshape(-1).to(torch.int64)
            for layer in range(LAYERS):
                rows = torch.randn((slots.numel(), LATENT + ROPE), generator=gen).to(torch.bfloat16)
                if rank == 0:
                    time.sleep(float(rng.random()) * 0.01)
                else:
                    rng.random()
                engine.append(layer, slots, rows)  # a no-op on rank 1
                topk = np.stack(
                    [np.concatenate([[seq - 1], rng.choice(seq - 1, K - 1, replace=False)]) for _ in range(ROWS)]
                ).astype(np.int32)
                q = torch.randn((ROWS, HEADS, LATENT), generator=gen).to(torch.bfloat16)
                qr = torch.randn((ROWS, HEADS, ROPE), generator=gen).to(torch.bfloat16)
                res = engine.run_layer(layer, torch.from_numpy(topk), q, qr, 0.25)
                outputs.append(res.output.clone())
        stats = engine.stats().total
        results.put((rank, torch.stack(outputs).view(torch.int16).numpy(), stats.misses, stats.d2h_bytes, None))
        if rank == 0:
            finished.wait(60)  # the creator removes the file once rank 1 is done with it
            pool.close()
        else:
            finished.set()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, None, 0, 0, repr(exc)))
