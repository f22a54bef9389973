"""Bit-exact equivalence of the offloaded engine with full-KV sparse attention.

Over >= 2,000 decode steps with random KV, request churn, idle rows, variable
lengths (including contexts shorter than top-k, i.e. padded selections), several
layers, two rows sharing one request (MTP-like) and speculative suffixes whose host
rows are rewritten every step, every attention output of the engine ``torch.equal`` s
the reference sparse attention over the full host KV with logical indices, and at
every step the only hot-buffer rows that change are the misses' (so H2D bytes ==
misses x row bytes), each resident slot holds its host row, and for LRU the misses
equal a literal model of the contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sglang_ascend_offload.ops import registry
from sglang_ascend_offload.ops.contract import ResidencyTable
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.policies import DEFAULT_POLICY
from sglang_ascend_offload.sparse_decode.verify import full_kv_attention, resident_mismatches

from .contract_model import RowModel, model_step

LAYERS, ROWS, K, HOT = 2, 4, 6, 10
LATENT, ROPE, HEADS = 16, 8, 2
MAX_CTX = 48
SCALE = 0.25


@dataclass(frozen=True)
class Dims:
    """Shapes of a workload run: the CPU tests' by default. ``first_len``: a new request
    starts with 1 .. ``first_len - 1`` tokens."""

    layers: int = LAYERS
    rows: int = ROWS
    k: int = K
    hot: int = HOT
    latent: int = LATENT
    rope: int = ROPE
    heads: int = HEADS
    max_ctx: int = MAX_CTX
    first_len: int = 20
    scale: float = SCALE


CPU_DIMS = Dims()


def pool_tokens(dims: Dims) -> int:
    """Host pool rows of a run: every row's whole context plus a few spare."""
    return dims.rows * dims.max_ctx + 8


class Workload:
    """Random requests in rows 0..rows-1; rows 2 and 3 sometimes share a request."""

    def __init__(self, seed: int, host_tokens: int, dims: Dims = CPU_DIMS):
        self.dims = dims
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(host_tokens))
        self.next_req = 0
        self.reqs = {}  # req -> dict(slots, seq_len, stable, left)
        self.row_req = [-1] * dims.rows
        self.idle = [0] * dims.rows

    def _new_request(self, length: int) -> int:
        req = self.next_req
        self.next_req += 1
        self.reqs[req] = {
            "slots": [self.free.pop() for _ in range(self.dims.max_ctx)],
            "seq_len": length,
            "stable": length,
            "left": int(self.rng.integers(5, 60)),
            "fresh": True,
        }
        return req

    def step(self):
        """Advance one decode step: returns (req_ids, seq_lens, stable_lens, rewrite) per row."""
        rng, rows = self.rng, self.dims.rows
        for r in range(rows):
            req = self.row_req[r]
            if req != -1 and (self.reqs[req]["left"] <= 0 or self.reqs[req]["seq_len"] >= self.dims.max_ctx - 3):
                self.row_req[r] = -1
                self.idle[r] = int(rng.integers(0, 3))
        live = set(self.row_req)
        for req in [q for q in self.reqs if q not in live]:
            self.free.extend(self.reqs.pop(req)["slots"])
        for r in range(rows):
            if self.row_req[r] == -1:
                if self.idle[r] > 0:
                    self.idle[r] -= 1
                    continue
                if r == 3 and self.row_req[2] != -1 and rng.random() < 0.5:
                    self.row_req[3] = self.row_req[2]  # a second query token of row 2's request
                else:
                    self.row_req[r] = self._new_request(int(rng.integers(1, self.dims.first_len)))
        for req, st in self.reqs.items():
            if st["fresh"]:
                st["fresh"] = False
            else:
                st["seq_len"] += 1
            st["left"] -= 1
            spec = int(rng.integers(0, 3))  # trailing positions still speculative
            st["stable"] = max(st["stable"], st["seq_len"] - spec)
        req_ids = np.array(self.row_req, dtype=np.int64)
        seq_lens = np.zeros(rows, dtype=np.int32)
        stable = np.zeros(rows, dtype=np.int32)
        for r, req in enumerate(self.row_req):
            if req != -1:
                seq_lens[r] = self.reqs[req]["seq_len"]
                stable[r] = min(self.reqs[req]["stable"], seq_lens[r])
        return req_ids, seq_lens, stable

    def topk(self, seq_len: int) -> np.ndarray:
        out = np.full(self.dims.k, -1, dtype=np.int32)
        if seq_len <= 0:
            return out
        n = min(self.dims.k, seq_len)
        # recent positions most of the time, the rest uniform: hits, misses and churn
        recent = np.arange(max(0, seq_len - 3), seq_len)
        pool = np.setdiff1d(np.arange(seq_len), recent)
        extra = self.rng.choice(pool, size=max(0, min(n - recent.size, pool.size)), replace=False)
        sel = np.concatenate([recent, extra])[:n]
        out[:n] = self.rng.permutation(sel)
        return self.rng.permutation(out)


def begin_workload_step(engine, work: Workload, written: dict, step: int):
    """Advance ``work`` one step and start it in ``engine``: ``(req_ids, seq_lens,
    stable, token table [rows, max_ctx], host slots written this step)`` (new positions
    and every speculative position are rewritten; ``written`` tracks what is there)."""
    req_ids, seq_lens, stable = work.step()
    table = torch.zeros((work.dims.rows, work.dims.max_ctx), dtype=torch.int32)
    for r, req in enumerate(req_ids.tolist()):
        if req != -1:
            table[r] = torch.tensor(work.reqs[req]["slots"], dtype=torch.int32)
    engine.begin_step(torch.from_numpy(req_ids), table, torch.from_numpy(stable), step=step)
    writes = []
    for req, st in work.reqs.items():
        lo = min(written.get(req, 0), st["stable"])
        writes += st["slots"][lo : st["seq_len"]]
        written[req] = st["seq_len"]
    return req_ids, seq_lens, stable, table, writes


def layer_inputs(work: Workload, gen: torch.Generator, seq_lens, req_ids):
    """One layer's ``(topk int32 [rows, k] numpy, query, query_rope)`` (bf16, CPU)."""
    d = work.dims
    topk = np.stack([work.topk(int(n)) for n in seq_lens])
    topk[req_ids == -1] = -1
    q = torch.randn((d.rows, d.heads, d.latent), generator=gen).to(torch.bfloat16)
    qr = torch.randn((d.rows, d.heads, d.rope), generator=gen).to(torch.bfloat16)
    return topk, q, qr


def run_against_full_kv(
    policy: str,
    steps: int,
    seed: int,
    ops: str = "reference",
    dims: Dims = CPU_DIMS,
    device: str = "cpu",
    attention_tol: float = 0.0,
):
    """The engine on ``device`` against full-KV attention on the CPU. Outputs
    ``torch.equal`` (``attention_tol`` 0) or within ``attention_tol`` (absolute and
    relative: a fused kernel's own accumulation order); hot-buffer rows, miss lists and
    byte counts are exact either way."""
    d = dims
    host_tokens = pool_tokens(d)
    pool = HostKVPool.allocate(HostPoolShape(d.layers, host_tokens, d.latent, d.rope), "pinned")
    engine = SparseDecodeEngine(
        EngineConfig(d.layers, d.rows, d.hot, d.k, d.latent, d.rope, policy=policy, ops=ops), pool, device=device
    )
    attention = registry.select("sparse_mla_attention", "reference")
    gen = torch.Generator().manual_seed(seed)
    work = Workload(seed, host_tokens, d)
    models = [[RowModel(d.hot) for _ in range(d.rows)] for _ in range(d.layers)]
    written = {}  # req -> positions already in the host pool
    row_bytes = (d.latent + d.rope) * 2
    total_misses = 0
    for step in range(steps):
        req_ids, seq_lens, stable, table, writes = begin_workload_step(engine, work, written, step)
        idx = torch.tensor(writes, dtype=torch.int64)
        before = engine.stats()
        for layer in range(d.layers):
            if writes:
                engine.append(
                    layer, idx, torch.randn((len(writes), d.latent + d.rope), generator=gen).to(torch.bfloat16)
                )
            topk, q, qr = layer_inputs(work, gen, seq_lens, req_ids)
            hot_before = engine.hot.layer(layer).cpu().clone()
            res = engine.run_layer(layer, torch.from_numpy(topk), q.to(device), qr.to(device), d.scale)
            state = engine.table(layer)
            state = ResidencyTable(state.slot_token.cpu(), state.slot_stamp.cpu(), state.row_req.cpu())
            hot_after = engine.hot.layer(layer).cpu()
            miss_count, miss_slots, miss_tokens = (
                res.residency.miss_count.cpu(),
                res.residency.miss_slots.cpu(),
                res.residency.miss_tokens.cpu(),
            )

            ref = full_kv_attention(attention, pool, layer, torch.from_numpy(topk), table, q, qr, d.scale)
            out = res.output.cpu()
            if attention_tol:
                torch.testing.assert_close(
                    out.float(),
                    ref.float(),
                    atol=attention_tol,
                    rtol=attention_tol,
                    msg=lambda m: f"step {step} layer {layer}: {m}",
                )
            else:
                assert torch.equal(out, ref), f"step {step} layer {layer}: output != full-KV reference"
            assert resident_mismatches(state, hot_after, pool.layer(layer), table) == 0
            changed = torch.zeros((d.rows, d.hot), dtype=torch.bool)
            for r in range(d.rows):
                n = int(miss_count[r])
                changed[r, miss_slots[r, :n].long()] = True
                host_rows = pool.layer(layer)[table[r, miss_tokens[r, :n].long()].long()]
                assert torch.equal(hot_after[r, miss_slots[r, :n].long()], host_rows)
            assert torch.equal(hot_after[~changed], hot_before[~changed]), "a non-miss row moved"
            if policy == "lru":
                for r in range(d.rows):
                    _, _, mt, _ = model_step(models[layer][r], topk[r].tolist(), int(req_ids[r]), int(stable[r]), step)
                    assert int(miss_count[r]) == sum(1 for x in mt if x != -1)
        after = engine.stats()
        step_misses = after.total.misses - before.total.misses
        assert after.total.h2d_bytes - before.total.h2d_bytes == step_misses * row_bytes
        assert after.total.d2h_bytes - before.total.d2h_bytes == d.layers * len(writes) * row_bytes
        total_misses += step_misses
    stats = engine.stats()
    assert stats.total.hits + stats.total.misses == stats.total.selected
    assert 0 < stats.total.misses < stats.total.selected  # both hits and misses were exercised
    return stats


@pytest.mark.parametrize("policy,steps", [(DEFAULT_POLICY, 2000), ("lru_k2_guarded", 500)])
def test_engine_equals_full_kv_attention(policy, steps):
    stats = run_against_full_kv(policy, steps, seed=1234)
    assert stats.steps == steps


STAND_IN_STEPS, STAND_IN_SEED = 120, 99  # shared with the NPU twin (test_engine_fused_npu.py)


def copy_sfa_stand_in(monkeypatch) -> list:
    """Make the reference composition the (usable) ``fused`` Copy-SFA rung for this test,
    without registering the functional-model ops; returns the list each call appends to."""
    from sglang_ascend_offload.ops import ascendc_cpu_ops
    from sglang_ascend_offload.ops.contract import OpImpl
    from sglang_ascend_offload.ops.registry import _REGISTRY

    monkeypatch.setattr(ascendc_cpu_ops, "ensure_for_choice", lambda choice: None)
    ref = registry.implementations("copy_sparse_flash_attention")["reference"]
    calls = []

    def fused_stand_in(*args, **kwargs):
        calls.append(1)
        return ref.fn(*args, **kwargs)

    monkeypatch.setitem(
        _REGISTRY.impls,
        ("copy_sparse_flash_attention", "fused"),
        OpImpl("copy_sparse_flash_attention", "fused", fused_stand_in, lambda: None),
    )
    copy = registry.implementations("copy_miss_rows")["reference"]  # ops=fused's separate miss copy
    monkeypatch.setitem(_REGISTRY.impls, ("copy_miss_rows", "fused"), dataclasses.replace(copy, rung="fused"))
    return calls


def test_engine_fused_copy_sfa_path_equals_full_kv(monkeypatch):
    """With ops=fused the engine hands copy + attention to the Copy-SFA op.

    A stand-in ``fused`` rung (the reference composition, declared usable) takes the
    AscendC rung's place, and ``ops=fused`` does not register the functional-model ops
    here; the engine's fused branch must then give the same bit-exact results as the
    separate copy + attention path. The real operator: on an Ascend NPU
    ``test_engine_fused_npu.py``, on CPU's functional model ``test_engine_fused_cpu_model.py``.
    """
    calls = copy_sfa_stand_in(monkeypatch)
    stats = run_against_full_kv("lru", STAND_IN_STEPS, seed=STAND_IN_SEED, ops="fused")
    assert stats.steps == STAND_IN_STEPS and len(calls) == STAND_IN_STEPS * LAYERS


def _run_rows_form(policy: str, manage_impl: str, steps: int, seed: int):
    """The rows form: each step's batch is the live rows in a shuffled order plus one
    padding entry (engine row -1 -> the sink row). Outputs equal full-KV attention in
    batch order, the padding entry attends nothing, rows outside the batch keep their
    state and hot rows, and the engine counts exactly ``B`` rows per layer step."""
    host_tokens = ROWS * MAX_CTX + 8
    pool = HostKVPool.allocate(HostPoolShape(LAYERS, host_tokens, LATENT, ROPE), "pinned")
    engine = SparseDecodeEngine(
        EngineConfig(
            LAYERS,
            ROWS,
            HOT,
            K,
            LATENT,
            ROPE,
            policy=policy,
            ops="reference",
            manage_impl=manage_impl,
            max_context=MAX_CTX,
        ),
        pool,
        device="cpu",
    )
    assert engine.uses_cpu_kernel == (manage_impl == "kernel")
    attention = registry.select("sparse_mla_attention", "reference")
    gen = torch.Generator().manual_seed(seed)
    work = Workload(seed, host_tokens)
    written = {}
    rows_counted = 0
    for step in range(steps):
        req_ids, seq_lens, stable = work.step()
        table = torch.zeros((ROWS, MAX_CTX), dtype=torch.int32)
        for r, req in enumerate(req_ids.tolist()):
            if req != -1:
                table[r] = torch.tensor(work.reqs[req]["slots"], dtype=torch.int32)
        # some requests skip a step (all their rows together, as MTP rows of one request do)
        skip = {int(q) for q in set(req_ids.tolist()) if q != -1 and work.rng.random() < 0.2}
        live = [r for r in range(ROWS) if req_ids[r] != -1 and int(req_ids[r]) not in skip]
        work.rng.shuffle(live)
        batch = live + [-1]
        b = len(batch)
        rows_t = torch.tensor(batch, dtype=torch.int64)
        b_req = torch.tensor([int(req_ids[r]) if r >= 0 else 7 for r in batch])  # padding req ignored
        b_stable = torch.tensor([int(stable[r]) if r >= 0 else 5 for r in batch], dtype=torch.int32)
        engine.begin_step(b_req, table, b_stable, step=step, rows=rows_t)
        writes = []  # a request's KV is written only in steps whose batch has it (as in serving)
        for req in {int(req_ids[r]) for r in live}:
            st = work.reqs[req]
            lo = min(written.get(req, 0), st["stable"])
            writes += st["slots"][lo : st["seq_len"]]
            written[req] = st["seq_len"]
        idx = torch.tensor(writes, dtype=torch.int64)
        for layer in range(LAYERS):
            if writes:
                engine.append(layer, idx, torch.randn((len(writes), LATENT + ROPE), generator=gen).to(torch.bfloat16))
            topk = np.full((b, K), -1, dtype=np.int32)
            for i, r in enumerate(batch):
                if r >= 0:
                    topk[i] = work.topk(int(seq_lens[r]))
            topk[-1, 0] = 0  # a padding entry's selection is ignored
            q = torch.randn((b, HEADS, LATENT), generator=gen).to(torch.bfloat16)
            qr = torch.randn((b, HEADS, ROPE), generator=gen).to(torch.bfloat16)
            state_before = engine.table(layer).clone()
            hot_before = engine.hot.layer(layer).clone()
            res = engine.run_layer(layer, torch.from_numpy(topk), q, qr, SCALE)
            assert res.output.shape == (b, HEADS, LATENT)
            real = torch.tensor(live, dtype=torch.int64)
            if live:
                ref = full_kv_attention(
                    attention, pool, layer, torch.from_numpy(topk[:-1]), table[real], q[:-1], qr[:-1], SCALE
                )
                assert torch.equal(res.output[:-1], ref), f"step {step} layer {layer}"
            assert bool((res.output[-1] == 0).all()) and int(res.residency.miss_count[-1]) == 0
            # rows that skipped the step may still hold speculative positions rewritten
            # since (they are invalidated when the row is next stepped): check the batch rows
            t = engine.table(layer)
            stepped = ResidencyTable(t.slot_token[real], t.slot_stamp[real], t.row_req[real])
            assert resident_mismatches(stepped, engine.hot.layer(layer)[real], pool.layer(layer), table[real]) == 0
            others = [r for r in range(ROWS) if r not in live]
            after = engine.table(layer)
            for name in ("slot_token", "slot_stamp", "row_req"):
                assert torch.equal(getattr(after, name)[others], getattr(state_before, name)[others])
            assert torch.equal(engine.hot.layer(layer)[others], hot_before[others])
            sink = engine.managers[layer].table
            assert bool((sink.slot_token[engine.sink_row] == -1).all())
            rows_counted += b
    stats = engine.stats()
    assert stats.total.rows == rows_counted  # work counted in batch rows, not engine rows
    assert 0 < stats.total.misses < stats.total.selected
    return stats


@pytest.mark.parametrize("policy,impl", [("lru", "kernel"), ("lru", "torch"), ("lru_k2_guarded", "torch")])
def test_engine_rows_form_equals_full_kv_attention(policy, impl):
    assert _run_rows_form(policy, impl, 100, seed=77).steps == 100


def test_rows_form_kernel_and_torch_give_identical_misses():
    a = _run_rows_form("lru", "kernel", 60, seed=5)
    b = _run_rows_form("lru", "torch", 60, seed=5)
    assert [c.misses for c in a.per_layer] == [c.misses for c in b.per_layer]
