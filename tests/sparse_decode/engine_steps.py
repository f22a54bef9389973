"""A few decode steps of a sparse decode engine over a filled host pool (shared by the
"ops that ran == plan" tests on CPU and on the npu stand-in). A policy that reads the
indexer's ranking (``score_rank*``) is handed one every layer step: the top-k followed by
:data:`RANK_EXTRA` more positions."""

from __future__ import annotations

import torch

from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.policies import needs_ranked

#: small shapes (the hot buffer's rows a multiple of 16: the npu attention rung's flat layout)
SMALL = dict(rows=3, top_k=8, hot=16, latent=16, rope=8, heads=2, max_ctx=64, steps=6, layers=2)
#: the shapes torch_npu's attention takes (latent 512, rope 64; 16-row blocks), few steps
NPU = dict(rows=3, top_k=16, hot=32, latent=512, rope=64, heads=2, max_ctx=128, steps=4, layers=2)
#: the shapes the fused kernels take (ops/fused.py), few steps: the functional model is slow
FUSED = dict(rows=2, top_k=128, hot=256, latent=512, rope=64, heads=16, max_ctx=512, steps=3, layers=1)
#: ranked positions beyond the top-k handed to a score-aware policy
RANK_EXTRA = 8


def run_steps(
    ops: str,
    manage_impl: str,
    dims: dict,
    seed: int = 0,
    captured: bool = False,
    device: str = "cpu",
    before_layer=None,
    **config,
):
    """An engine of ``dims`` on ``device`` over a filled host pool, ``steps`` decode steps
    of every row (contexts growing, random distinct top-k), eager (``run_layer``) or in the
    captured form a decode graph records (``captured_layer_step``); returns
    ``(engine, outputs)``, the outputs ``[rows, heads, latent]`` per layer step on the host.
    ``before_layer(engine, step, layer)`` runs before each layer step; ``config``: more
    :class:`EngineConfig` fields (``verify_sample_rate``, ...)."""
    rows, k, hot, ctx, layers = dims["rows"], dims["top_k"], dims["hot"], dims["max_ctx"], dims["layers"]
    latent, rope, heads = dims["latent"], dims["rope"], dims["heads"]
    pool = HostKVPool.allocate(HostPoolShape(layers, rows * ctx, latent, rope), "pinned")
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(rows * ctx, dtype=torch.int64)
    for layer in range(layers):
        pool.write_rows(layer, slots, torch.randn(rows * ctx, latent + rope, generator=gen).to(torch.bfloat16))
    cfg = EngineConfig(layers, rows, hot, k, latent, rope, ops=ops, manage_impl=manage_impl, max_context=ctx, **config)
    engine = SparseDecodeEngine(cfg, pool, device=device)
    table = slots.to(torch.int32).view(rows, ctx).to(device)  # row r, position p -> host slot r * ctx + p
    req_ids, batch_rows = torch.arange(rows, device=device), torch.arange(rows, device=device)
    outputs = []
    ranked_policy = needs_ranked(cfg.policy)
    for step in range(dims["steps"]):
        length = ctx // 2 + step
        stable = torch.full((rows,), length, dtype=torch.int32, device=device)
        engine.begin_step(req_ids, table, stable, rows=batch_rows, captured=captured)
        for layer in range(layers):
            ranked = torch.stack([torch.randperm(length, generator=gen)[: k + RANK_EXTRA] for _ in range(rows)])
            topk = ranked[:, :k].to(torch.int32)
            if ranked_policy:
                engine.set_ranked(layer, ranked.to(torch.int32))
            query = torch.randn(rows, heads, latent, generator=gen).to(torch.bfloat16).to(device)
            query_rope = torch.randn(rows, heads, rope, generator=gen).to(torch.bfloat16).to(device)
            topk = topk.to(device)
            if before_layer is not None:
                before_layer(engine, step, layer)
            if captured:
                host = pool.layer(layer)
                step_t = torch.tensor(engine.step_index, device=device)
                out, _ = engine.captured_layer_step(
                    layer, batch_rows, topk, req_ids, stable, step_t, host, table, query, query_rope, 0.1
                )
            else:
                out = engine.run_layer(layer, topk, query, query_rope, 0.1).output
            outputs.append(out.cpu())
    return engine, outputs
