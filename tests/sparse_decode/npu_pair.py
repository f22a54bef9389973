"""One decode workload run by two sparse decode engines side by side: one on the NPU
(the device under test: an Ascend NPU, or in CI the stand-in of ``tests/npu_standin``)
and one on the host with ``ops="reference"`` (the specification), for the npu-marked
engine tests (``test_engine_npu_paths.py``, ``test_sync_free_npu.py``).

Shapes are the ones the NPU's operators take: latent 512 / rope 64 (torch_npu's sparse
attention), top-k 128 and hot buffers of 256 slots (the fused kernels' alignment), 16
heads. Each engine row serves one request whose context grows by one token per step;
row 1 changes request at step :data:`CHURN_STEP`. Every step each row's newest row is
appended (device -> host on the NPU engine) and each layer gets a random top-k of its
row's context and random queries; both engines get the same numbers. A score-aware
policy is handed the layer's ranking (the top-k followed by :data:`RANK_EXTRA` more
positions) on both engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.policies import needs_ranked

LAYERS, ROWS, K, HOT, LATENT, ROPE, HEADS = 2, 4, 128, 256, 512, 64, 16
MAX_CTX = 384  # host slots per row: ROWS * MAX_CTX rows per layer (a multiple of 32: 4 KiB-aligned layers)
SCALE = (LATENT + ROPE) ** -0.5
CHURN_STEP = 3
RANK_EXTRA = 8  # ranked positions beyond the top-k (score-aware policies; contexts are >= K + 13)
RESIDENCY_FIELDS = ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots")


@dataclass
class Step:
    """One step's inputs (host tensors): request ids / stable lengths ``[R]``, the rows to
    append (``host_slots [n]``, per layer ``[n, D]``), per layer top-k ``[R*n, K]``,
    queries ``[R*n, N, *]`` and the ranking ``[R*n, K + RANK_EXTRA]`` whose first ``K``
    columns are the top-k."""

    req_ids: torch.Tensor
    stable_len: torch.Tensor
    append_slots: torch.Tensor
    append_rows: List[torch.Tensor]
    topk: List[torch.Tensor]
    query: List[torch.Tensor]
    query_rope: List[torch.Tensor]
    ranked: List[torch.Tensor]


def token_table(seed: int = 0) -> torch.Tensor:
    """int32 ``[R, MAX_CTX]``: row ``r``'s positions -> a shuffled range of host slots."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([r * MAX_CTX + torch.randperm(MAX_CTX, generator=g) for r in range(ROWS)]).to(torch.int32)


def workload(steps: int, rows_per_request: int = 1, seed: int = 0) -> List[Step]:
    g = torch.Generator().manual_seed(seed)
    table = token_table(seed)
    lens = [150 + 40 * r for r in range(ROWS)]
    reqs = [10 * r for r in range(ROWS)]
    n = rows_per_request
    out = []
    for step in range(steps):
        if step == CHURN_STEP:
            reqs[1], lens[1] = reqs[1] + 1, 140  # row 1 serves a new request
        lens = [length + 1 for length in lens]
        slots = torch.tensor([int(table[r, lens[r] - 1]) for r in range(ROWS)], dtype=torch.int64)
        topk, query, rope, rows, ranked = [], [], [], [], []
        for _ in range(LAYERS):
            rows.append(torch.randn((ROWS, LATENT + ROPE), generator=g).to(torch.bfloat16))
            picks = [torch.randperm(lens[r], generator=g)[: K + RANK_EXTRA] for r in range(ROWS) for _ in range(n)]
            ranked.append(torch.stack(picks).to(torch.int32))
            topk.append(ranked[-1][:, :K].contiguous())
            query.append(torch.randn((ROWS * n, HEADS, LATENT), generator=g).to(torch.bfloat16))
            rope.append(torch.randn((ROWS * n, HEADS, ROPE), generator=g).to(torch.bfloat16))
        out.append(
            Step(
                torch.tensor(reqs, dtype=torch.int64),
                torch.tensor(lens, dtype=torch.int32),
                slots,
                rows,
                topk,
                query,
                rope,
                ranked,
            )
        )
    return out


def filled_pool(seed: int = 1) -> HostKVPool:
    """A pinned host pool holding every row's context (the prefill's KV)."""
    pool = HostKVPool.allocate(HostPoolShape(LAYERS, ROWS * MAX_CTX, LATENT, ROPE), "pinned")
    g = torch.Generator().manual_seed(seed)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g).to(torch.bfloat16))
    return pool


def engine(device: str, **config) -> SparseDecodeEngine:
    cfg = EngineConfig(LAYERS, ROWS, HOT, K, LATENT, ROPE, max_context=MAX_CTX, **config)
    return SparseDecodeEngine(cfg, filled_pool(), device=device)


def begin(eng: SparseDecodeEngine, step: Step, index: int, table: torch.Tensor) -> None:
    dev = eng.device
    eng.begin_step(step.req_ids.to(dev), table.to(dev), step.stable_len.to(dev), index, rows=torch.arange(ROWS))


@dataclass
class PairRun:
    """What :func:`run_pair` saw: per (step, layer) the largest attention difference."""

    max_attention_diff: Dict[tuple, float] = field(default_factory=dict)


def assert_layer_equal(npu, ref, res_npu, res_ref, layer: int, where: str) -> None:
    """Residency step, residency state and hot buffer of one layer: bit for bit."""
    for name in RESIDENCY_FIELDS:
        assert torch.equal(getattr(res_npu.residency, name).cpu(), getattr(res_ref.residency, name)), (where, name)
    a, b = npu.table(layer), ref.table(layer)
    for name in ("slot_token", "slot_stamp", "row_req"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name)), (where, name)
    assert torch.equal(npu.hot.layer(layer).cpu(), ref.hot.layer(layer)), (where, "hot buffer")


def run_pair(npu: SparseDecodeEngine, ref: SparseDecodeEngine, steps: List[Step], tol: float, on_layer=None) -> PairRun:
    """Both engines through ``steps``; asserts every layer step equal (attention within
    ``|a - b| <= tol + tol * |b|``, 0: bit for bit). ``on_layer(step, layer, fn)`` wraps
    the npu engine's layer step (counting, recording)."""
    table = token_table()
    seen = PairRun()
    for index, step in enumerate(steps):
        begin(npu, step, index, table)
        begin(ref, step, index, table)
        for layer in range(LAYERS):
            npu.append(layer, step.append_slots, step.append_rows[layer].to(npu.device))
            ref.append(layer, step.append_slots, step.append_rows[layer])

            dev = npu.device  # the model's inputs are on the device before the layer step
            inputs = (step.topk[layer].to(dev), step.query[layer].to(dev), step.query_rope[layer].to(dev))
            if needs_ranked(npu.config.policy):
                npu.set_ranked(layer, step.ranked[layer].to(dev))
                ref.set_ranked(layer, step.ranked[layer])

            def npu_layer(layer=layer, inputs=inputs):
                return npu.run_layer(layer, *inputs, SCALE)

            res_npu = npu_layer() if on_layer is None else on_layer(index, layer, npu_layer)
            res_ref = ref.run_layer(layer, step.topk[layer], step.query[layer], step.query_rope[layer], SCALE)
            where = f"step {index} layer {layer}"
            assert_layer_equal(npu, ref, res_npu, res_ref, layer, where)
            got, want = res_npu.output.cpu().float(), res_ref.output.float()
            diff = (got - want).abs()
            seen.max_attention_diff[(index, layer)] = float(diff.max())
            assert bool((diff <= tol + tol * want.abs()).all()), (where, float(diff.max()))
    return seen
