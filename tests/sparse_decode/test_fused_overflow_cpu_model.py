"""The fused ops serve verify rounds whose union exceeds the hot buffer, on CPU (issue 50).

Four verify rows per request over plain decode's ``2 x top-k`` hot slots (top-k 128, 256
slots, 8 index heads of 128, latent 512 + rope 64: shapes the kernels take), the step a
captured decode layer runs: LIM with ``tokens_per_row = 4`` (its residency step keeps a
row's first ``min(4 x K, Hh) = Hh`` union positions by priority, within its UB limit),
then ``engine.decode_layer_step(residency=..., copy_attention=<Copy-SFA>,
overflow_view=...)``: the positions past the buffer are copied into the overflow area
beside the kernel, which reads them as its ``overflow`` operand. The fused rung is the
AscendC kernels on their functional model, against the same step with the separate ops
(reference indexer, the layer's manager over the union's resident part, reference copies
and attention over one flat view of the hot buffer and the area), over steps with churn
and a padding entry:

* top-k, the per-request residency step, the hot buffer and the overflow area: bit-exact;
* attention: within the fused tolerance of the separate ops' (which equal attention over
  the full KV bit for bit: ``tests/sparse_decode/test_overflow.py``), and of the full KV;
* rounds did overflow (the union's positions past 256 exist and are read from the area).

The eager engine (``SparseDecodeEngine.run_layer``, the served eager path) with the fused
Copy-SFA counts the same residency and overflow as ``ops="reference"`` and attends within
the fused tolerance of the full KV.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from sglang_ascend_offload.ops import ascendc_cpu_ops, fused, registry
from sglang_ascend_offload.ops.request_union import union_of_rows
from sglang_ascend_offload.sparse_decode import fused_indexer, overflow
from sglang_ascend_offload.sparse_decode.engine import decode_layer_step
from sglang_ascend_offload.sparse_decode.policies import make_manager
from sglang_ascend_offload.sparse_decode.sizing import overflow_slots

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ to build the AscendC functional model"
)

N, K, HOT, PAGE, IH, ID, HEADS, DL, DR = 4, 128, 256, 64, 8, 128, 8, 512, 64
X = overflow_slots(K, HOT, N)  # overflow rows per engine row: 4 x 128 - 256
ROWS = 3  # two engine rows + the sink
SINK = ROWS - 1
MAX_CTX = 1024
TOL = 2e-2


@pytest.fixture(scope="module")
def fused_cpu():
    registry.select("copy_sparse_flash_attention", "fused")
    assert ascendc_cpu_ops.registered()
    yield
    ascendc_cpu_ops.unregister()


class _World:
    """Host pool, index-K cache and token tables (row ``r``: position ``p`` -> host row ``r *
    MAX_CTX + p``); queries drawn per token, so a request's four rows select different positions."""

    def __init__(self, seed: int):
        g = self.g = torch.Generator().manual_seed(seed)
        self.host = torch.randn(ROWS * MAX_CTX, DL + DR, generator=g).to(torch.bfloat16)
        fused.register_host_memory(self.host)
        pages = ROWS * MAX_CTX // PAGE
        self.key = (torch.randint(-4, 5, (pages, PAGE, 1, ID), generator=g).float() / 4).to(torch.bfloat16)
        self.table = (torch.arange(ROWS)[:, None] * MAX_CTX + torch.arange(MAX_CTX)[None, :]).to(torch.int32)
        self.blocks = (torch.arange(ROWS)[:, None] * (MAX_CTX // PAGE) + torch.arange(MAX_CTX // PAGE)[None, :]).to(
            torch.int32
        )

    def step_inputs(self, rows, owners, lens):
        b, g = len(rows), self.g
        query = (torch.randint(-4, 5, (b * N, IH, ID), generator=g).float() / 4).to(torch.bfloat16)
        weights = (torch.randint(-4, 9, (b * N, IH), generator=g).float() / 8).to(torch.bfloat16)
        meta = dict(
            actual_seq_lengths_query=torch.arange(N, b * N + 1, N, dtype=torch.int32),
            actual_seq_lengths_key=torch.tensor([lens[i] + N for i in range(b)], dtype=torch.int32),
            block_table=self.blocks[torch.tensor(rows)],
            sparse_count=K,
        )
        return dict(
            rows=torch.tensor(rows, dtype=torch.int64),
            req_ids=torch.tensor(owners, dtype=torch.int64),
            stable=torch.tensor(lens, dtype=torch.int32),
            index=(query, self.key, weights),
            meta=meta,
            q_lat=(torch.randn(b * N, HEADS, DL, generator=g) * 0.5).to(torch.bfloat16),
            q_rope=(torch.randn(b * N, HEADS, DR, generator=g) * 0.5).to(torch.bfloat16),
        )


class _Buffers:
    """One hot buffer and overflow area in one allocation, as the engine's ``HotBuffers``."""

    def __init__(self):
        self.storage = torch.zeros(ROWS * HOT + ROWS * X, DL + DR, dtype=torch.bfloat16)
        self.hot = self.storage[: ROWS * HOT].view(ROWS, HOT, DL + DR)
        self.area = self.storage[ROWS * HOT :].view(ROWS, X, DL + DR)

    def view(self):
        return overflow.OverflowView(area=self.area, kv=self.storage, base=ROWS * HOT)


def _layer_step(manager, buf, world, s, step, topk, **fused_kwargs):
    return decode_layer_step(
        manager,
        s["rows"],
        topk,
        s["req_ids"],
        s["stable"],
        step,
        world.host,
        buf.hot,
        world.table,
        s["q_lat"],
        s["q_rope"],
        DL**-0.5,
        DL,
        rows_per_request=N,
        overflow_view=buf.view(),
        **fused_kwargs,
    )


def _fused_stage(manager, buf, world, s, step):
    lim = registry.select("lightning_indexer_manage", "fused").fn
    copy_sfa = registry.select("copy_sparse_flash_attention", "fused").fn
    args = fused_indexer.residency_args(manager, s["rows"], s["req_ids"], s["stable"], step, s["q_lat"].shape[0], N)
    result = lim(*s["index"], **s["meta"], **args.as_kwargs())
    topk = result.topk_indices.reshape(-1, K)
    out, res = _layer_step(manager, buf, world, s, step, topk, residency=result.residency, copy_attention=copy_sfa)
    return out, res, topk


def _separate_stage(manager, buf, world, s, step):
    topk = registry.select("lightning_indexer", "reference").fn(*s["index"], **s["meta"]).reshape(-1, K)
    out, res = _layer_step(manager, buf, world, s, step, topk)
    return out, res, topk


def _full_kv(world, s, topk):
    rows = s["rows"].repeat_interleave(N)
    host_rows = torch.where(topk >= 0, world.table[rows.clamp(max=ROWS - 1)].gather(1, topk.clamp(min=0).long()), -1)
    host = world.host
    return registry.select("sparse_mla_attention", "reference").fn(
        s["q_lat"],
        host[:, :DL],
        None,
        host_rows.unsqueeze(1),
        DL**-0.5,
        query_rope=s["q_rope"],
        key_rope=host[:, DL:],
        layout_query="TND",
        layout_kv="flat",
    )


def test_fused_ops_serve_rounds_beyond_the_hot_buffer(fused_cpu):
    assert X == 256 and fused.fused_shape_obstacles(HOT, K, N) == ("", "")
    world = _World(seed=5)
    m_fused = make_manager("lru", ROWS, HOT, "cpu", manage_impl="torch")
    m_sep = make_manager("lru", ROWS, HOT, "cpu", manage_impl="torch")
    b_fused, b_sep = _Buffers(), _Buffers()
    owners, lens = {0: 7, 1: 8}, {0: 400, 1: 700}
    overflowed = 0
    for step, batch in enumerate([[0, 1], [1, 0], [0, 1], [1, 0]]):
        if step == 2:
            owners[0], lens[0] = 9, 260  # churn: row 0 serves a new request
        for r in batch:
            lens[r] += 2  # two tokens accepted per round
        rows = batch + [SINK]  # a padding entry on the sink row
        s = world.step_inputs(rows, [owners[r] for r in batch] + [-1], [lens[r] for r in batch] + [0])
        out_f, res_f, topk_f = _fused_stage(m_fused, b_fused, world, s, step)
        out_s, res_s, topk_s = _separate_stage(m_sep, b_sep, world, s, step)
        live = s["req_ids"] >= 0
        live_rows = live.repeat_interleave(N)
        assert torch.equal(topk_f[live_rows], topk_s[live_rows]), step
        assert res_f.slots.shape == (len(rows), HOT)  # the step's width: min(n x K, Hh)
        for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
            assert torch.equal(getattr(res_f, name)[live], getattr(res_s, name)[live]), (step, name)
        for r in batch:
            assert torch.equal(b_fused.hot[r].view(torch.int16), b_sep.hot[r].view(torch.int16)), (step, r)
            assert torch.equal(b_fused.area[r].view(torch.int16), b_sep.area[r].view(torch.int16)), (step, r)
        full = _full_kv(world, s, topk_s)
        for got in (out_f, out_s):
            err = (got[live_rows].float() - full[live_rows].float()).abs()
            assert bool((err <= TOL + TOL * full[live_rows].float().abs()).all()), (step, float(err.max()))
        assert torch.equal(out_s[live_rows], full[live_rows])  # the separate ops: bit for bit
        union = union_of_rows(topk_s[live_rows], N, capacity=HOT)
        overflowed += int(union.overflow_count.sum())
    assert overflowed > 0, "no round overflowed: the test would not see the overflow path"


def _engine_run(ops: str, steps: int = 3):
    """The eager engine (``run_layer``) with 4 verify rows over 256 slots, ``ops`` reference or
    fused (the fused Copy-SFA on the functional model, the separate indexer's top-k given):
    ``(outputs, full-KV references, stats)`` of every step."""
    from sglang_ascend_offload.sparse_decode import op_selection
    from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
    from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
    from sglang_ascend_offload.sparse_decode.verify import full_kv_attention

    g = torch.Generator().manual_seed(11)
    rows = op_selection.fused_host_pool_rows(2 * MAX_CTX, (DL + DR) * 2)
    pool = HostKVPool.allocate(HostPoolShape(1, rows, DL, DR), "pinned")
    pool.write_rows(0, torch.arange(rows), torch.randn((rows, DL + DR), generator=g).bfloat16())
    cfg = EngineConfig(
        layers=1, rows=2, hot_tokens=HOT, top_k=K, latent_dim=DL, rope_dim=DR, ops=ops, rows_per_request=N
    )
    engine = SparseDecodeEngine(cfg, pool, device="cpu")
    table = (torch.arange(2)[:, None] * MAX_CTX + torch.arange(MAX_CTX)[None, :]).to(torch.int32)
    outs, refs = [], []
    for step in range(steps):
        lens = torch.tensor([500 + 3 * step, 700 + 2 * step], dtype=torch.int32)
        engine.begin_step(torch.tensor([5, 6]), table, lens, step=step, rows=torch.arange(2, dtype=torch.int64))
        topk = torch.stack(
            [torch.randperm(int(lens[r]) + j + 1, generator=g)[:K] for r in range(2) for j in range(N)]
        ).to(torch.int32)
        q = (torch.randn((2 * N, HEADS, DL), generator=g) * 0.5).bfloat16()
        qr = (torch.randn((2 * N, HEADS, DR), generator=g) * 0.5).bfloat16()
        outs.append(engine.run_layer(0, topk, q, qr, DL**-0.5).output)
        refs.append(
            full_kv_attention(engine.attention_op, pool, 0, topk, table.repeat_interleave(N, 0), q, qr, DL**-0.5)
        )
    return outs, refs, engine.stats().total, engine


def test_the_eager_engine_serves_overflow_through_the_fused_copy_sfa(fused_cpu):
    """``SparseDecodeEngine.run_layer`` with the fused Copy-SFA (the served eager path): the
    same residency and overflow counts as ``ops="reference"``, attention within the fused
    tolerance of the full KV (which the reference run equals bit for bit)."""
    outs_f, refs, got, engine = _engine_run("fused")
    assert engine.copy_sfa_op is not None  # the plan ran the fused Copy-SFA
    outs_r, refs_r, want, _ = _engine_run("reference")
    assert all(torch.equal(o, r) for o, r in zip(outs_r, refs_r))
    for o, r in zip(outs_f, refs):
        err = (o.float() - r.float()).abs()
        assert bool((err <= TOL + TOL * r.float().abs()).all()), float(err.max())
    for name in ("selected", "hits", "misses", "overflow_rounds", "overflow_positions"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.overflow_rounds > 0 and got.overflow_positions > 0
