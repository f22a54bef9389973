"""Verify rows through the fused ops as a captured decode layer step runs them, on CPU.

A speculative verify step gives each request ``n`` query rows that share its engine row.
With the fused indexer the layer step is: LIM with ``tokens_per_row = n`` over the step's
all-rows residency arguments (``fused_indexer.residency_args``), then
``engine.decode_layer_step(residency=..., copy_attention=<Copy-SFA>)`` (what the CPU and
device graph steps run). Here the fused rung is the AscendC kernels on their functional
model, at the shapes they take (latent 512, rope 64, top-k 128, two verify rows, 256 hot
slots, 8 index heads of 128), against the same step with the separate ops (the reference
indexer's top-k stepped by the layer's manager, reference miss copy and attention), over
four steps with two requests, a padding entry, churn and a row shared by both verify rows:

* the per-request residency step and each verify row's slots: bit-exact;
* the hot buffer after the step: bit-exact;
* attention: within the fused tolerance (``2e-2``, absolute and relative);
* ``torch.compile(fullgraph=True)`` of the whole fused stage (LIM, then the layer step)
  equals eager: outputs, residency state and hot buffer.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from sglang_ascend_offload.ops import ascendc_cpu_ops, fused, registry
from sglang_ascend_offload.sparse_decode import fused_indexer
from sglang_ascend_offload.sparse_decode.engine import decode_layer_step
from sglang_ascend_offload.sparse_decode.policies import make_manager

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ to build the AscendC functional model"
)

N, K, HOT, PAGE, IH, ID, HEADS, DL, DR = 2, 128, 256, 64, 8, 128, 8, 512, 64
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
    """Host pool, index-K cache and token tables of two requests (``req_to_token``-like:
    row ``r`` maps position ``p`` to host row ``r * MAX_CTX + p``)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.host = torch.randn(ROWS * MAX_CTX, DL + DR, generator=g).to(torch.bfloat16)
        fused.register_host_memory(self.host)
        pages = ROWS * MAX_CTX // PAGE
        # index K on the exact-arithmetic grid: both rungs' scores and ties agree exactly
        self.key = (torch.randint(-4, 5, (pages, PAGE, 1, ID), generator=g).float() / 4).to(torch.bfloat16)
        self.table = (torch.arange(ROWS)[:, None] * MAX_CTX + torch.arange(MAX_CTX)[None, :]).to(torch.int32)
        self.blocks = (torch.arange(ROWS)[:, None] * (MAX_CTX // PAGE) + torch.arange(MAX_CTX // PAGE)[None, :]).to(
            torch.int32
        )

    def step_inputs(self, rows, owners, lens):
        """One verify step: ``rows`` entries (engine rows, the sink for padding), ``n`` query
        tokens each; committed lengths ``lens`` (drafts at ``L .. L + n - 1``)."""
        b = len(rows)
        g = self.g
        query = (torch.randint(-4, 5, (b * N, IH, ID), generator=g).float() / 4).to(torch.bfloat16)
        weights = (torch.randint(-4, 9, (b * N, IH), generator=g).float() / 8).to(torch.bfloat16)
        q_lat = (torch.randn(b * N, HEADS, DL, generator=g) * 0.5).to(torch.bfloat16)
        q_rope = (torch.randn(b * N, HEADS, DR, generator=g) * 0.5).to(torch.bfloat16)
        seq = torch.tensor([lens[i] + N for i in range(b)], dtype=torch.int32)
        meta = dict(
            actual_seq_lengths_query=torch.arange(N, b * N + 1, N, dtype=torch.int32),
            actual_seq_lengths_key=seq,
            block_table=self.blocks[torch.tensor(rows)],
            sparse_count=K,
        )
        return dict(
            rows=torch.tensor(rows, dtype=torch.int64),
            req_ids=torch.tensor(owners, dtype=torch.int64),
            stable=torch.tensor(lens, dtype=torch.int32),
            index=(query, self.key, weights),
            meta=meta,
            q_lat=q_lat,
            q_rope=q_rope,
        )


def _fused_stage(manager, hot, world, s, step):
    lim = registry.select("lightning_indexer_manage", "fused").fn
    copy_sfa = registry.select("copy_sparse_flash_attention", "fused").fn
    args = fused_indexer.residency_args(manager, s["rows"], s["req_ids"], s["stable"], step, s["q_lat"].shape[0], N)
    result = lim(*s["index"], **s["meta"], **args.as_kwargs())
    topk = result.topk_indices.reshape(-1, K)
    out, res = decode_layer_step(
        manager,
        s["rows"],
        topk,
        s["req_ids"],
        s["stable"],
        step,
        world.host,
        hot,
        world.table,
        s["q_lat"],
        s["q_rope"],
        DL**-0.5,
        DL,
        rows_per_request=N,
        residency=result.residency,
        copy_attention=copy_sfa,
    )
    return out, res, topk


def _separate_stage(manager, hot, world, s, step):
    topk = registry.select("lightning_indexer", "reference").fn(*s["index"], **s["meta"]).reshape(-1, K)
    out, res = decode_layer_step(
        manager,
        s["rows"],
        topk,
        s["req_ids"],
        s["stable"],
        step,
        world.host,
        hot,
        world.table,
        s["q_lat"],
        s["q_rope"],
        DL**-0.5,
        DL,
        rows_per_request=N,
    )
    return out, res, topk


def test_fused_verify_rows_equal_the_separate_ops_and_compile(fused_cpu):
    world = _World(seed=3)
    m_fused = make_manager("lru", ROWS, HOT, "cpu", manage_impl="torch")
    m_sep = make_manager("lru", ROWS, HOT, "cpu", manage_impl="torch")
    hot_fused = torch.zeros(ROWS, HOT, DL + DR, dtype=torch.bfloat16)
    hot_sep = hot_fused.clone()
    owners, lens = {0: 7, 1: 8}, {0: 300, 1: 520}
    schedule = [[0, 1], [1, 0], [0, 1], [1, 0]]
    hits = misses = 0
    for step, batch in enumerate(schedule):
        if step == 2:
            owners[0], lens[0] = 9, 180  # churn: row 0 serves a new request
        for r in batch:
            lens[r] += 1  # one accepted token per round
        rows = batch + [SINK]  # a padding entry on the sink row
        s = world.step_inputs(rows, [owners[r] for r in batch] + [-1], [lens[r] for r in batch] + [0])
        out_f, res_f, topk_f = _fused_stage(m_fused, hot_fused, world, s, step)
        out_s, res_s, topk_s = _separate_stage(m_sep, hot_sep, world, s, step)
        live = s["req_ids"] >= 0
        live_rows = live.repeat_interleave(N)
        assert torch.equal(topk_f[live_rows], topk_s[live_rows]), step
        assert res_f.slots.shape == (len(rows), N * K)
        for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
            assert torch.equal(getattr(res_f, name)[live], getattr(res_s, name)[live]), (step, name)
        for r in batch:
            assert torch.equal(hot_fused[r].view(torch.int16), hot_sep[r].view(torch.int16)), (step, r)
        err = (out_f[live_rows].float() - out_s[live_rows].float()).abs()
        assert bool((err <= TOL + TOL * out_s[live_rows].float().abs()).all()), float(err.max())
        hits += int(res_f.hit_mask[live].sum())
        misses += int(res_f.miss_count[live].sum())
    assert hits > 0 and misses > 0

    # the fused stage under torch.compile (fullgraph; the model ops have fake kernels)
    s = world.step_inputs([1, 0, SINK], [owners[1], owners[0], -1], [lens[1] + 1, lens[0] + 1, 0])
    step = torch.tensor([len(schedule)], dtype=torch.int64)
    m_c = make_manager("lru", ROWS, HOT, "cpu", manage_impl="torch")
    for name in ("slot_token", "slot_stamp", "row_req"):
        getattr(m_c.table, name).copy_(getattr(m_fused.table, name))
    hot_c = hot_fused.clone()

    def stage(hot):
        out, res, _ = _fused_stage(m_c, hot, world, s, step)
        return out, res.slots, res.miss_count

    eager_state = [getattr(m_fused.table, n).clone() for n in ("slot_token", "slot_stamp", "row_req")]
    out_e, res_e, _ = _fused_stage(m_fused, hot_fused, world, s, step)
    out_c, slots_c, count_c = torch.compile(stage, fullgraph=True, backend="aot_eager")(hot_c)
    assert torch.equal(out_c.view(torch.int16), out_e.view(torch.int16))
    assert torch.equal(slots_c, res_e.slots) and torch.equal(count_c, res_e.miss_count)
    assert torch.equal(hot_c.view(torch.int16), hot_fused.view(torch.int16))
    for name in ("slot_token", "slot_stamp", "row_req"):
        assert torch.equal(getattr(m_c.table, name), getattr(m_fused.table, name)), name
    assert not torch.equal(m_fused.table.slot_stamp, eager_state[1])  # the step did stamp the state
