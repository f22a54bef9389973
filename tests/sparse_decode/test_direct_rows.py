"""``residency: adaptive``: requests that fit their hot buffer are served from it directly.

The same random workload (request churn, idle rows, speculative suffixes rewritten every
step, contexts that start below the hot buffer and grow past it) runs through an
``always`` engine and an ``adaptive`` one fed identical inputs. Every attention output
must be bit-identical between them and to full-KV attention; direct entries must do no
residency lookups; a demoted row must keep every resident position as a hit (its buffer
moved on the device, nothing re-read from the host) and satisfy the LRU state's
invariant that each resident slot holds its host row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_mutations import registration_left_as_found

from sglang_ascend_offload.ops import registry
from sglang_ascend_offload.ops.contract import ResidencyTable
from sglang_ascend_offload.sparse_decode.direct_rows import DirectRows, direct_flat
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.op_selection import OpSelectionError, select_ops
from sglang_ascend_offload.sparse_decode.verify import full_kv_attention, resident_mismatches

from .test_engine_equivalence import (
    HEADS,
    HOT,
    LATENT,
    LAYERS,
    MAX_CTX,
    ROPE,
    ROWS,
    SCALE,
    K,
    Workload,
    copy_sfa_stand_in,
)


def _engine(
    residency: str,
    impl: str,
    host_tokens: int,
    ops: str = "reference",
    device: str = "cpu",
    fused_copy_sfa: bool = True,
) -> SparseDecodeEngine:
    pool = HostKVPool.allocate(HostPoolShape(LAYERS, host_tokens, LATENT, ROPE), "pinned")
    fused = {"fused_lim": False, "fused_copy_sfa": fused_copy_sfa} if ops in ("fused", "auto") else {}
    return SparseDecodeEngine(
        EngineConfig(
            LAYERS,
            ROWS,
            HOT,
            K,
            LATENT,
            ROPE,
            policy="lru",
            ops=ops,
            manage_impl=impl,
            max_context=MAX_CTX,
            residency=residency,
            **fused,
        ),
        pool,
        device=device,
    )


@pytest.mark.parametrize(
    "impl,ops,borrow",
    [
        ("kernel", "reference", False),
        ("kernel", "reference", True),
        ("torch", "reference", True),
        ("torch", "fused", True),
    ],
)
def test_adaptive_equals_always_and_full_kv(impl, ops, borrow, monkeypatch):
    calls = copy_sfa_stand_in(monkeypatch) if ops == "fused" else None
    run_adaptive_against_always(impl, ops, borrow=borrow)
    if calls is not None:
        assert len(calls) == STEPS * LAYERS  # every layer step went through the fused op


STEPS = 400


def run_adaptive_against_always(
    impl: str, ops: str, device: str = "cpu", fused_copy_sfa: bool = True, borrow: bool = False, steps: int = STEPS
) -> None:
    """The module docstring's comparison over ``steps`` steps, the engines on ``device``
    (the ``always`` engine on the ``reference`` rung there). ``borrow``: the idle rows
    are free, so direct requests span them and are demoted when a new request needs one."""
    host_tokens = ROWS * MAX_CTX + 8
    always = _engine("always", impl, host_tokens, device=device)
    adaptive = _engine("adaptive", impl, host_tokens, ops, device=device, fused_copy_sfa=fused_copy_sfa)
    attention = registry.select("sparse_mla_attention", "reference")
    gen = torch.Generator().manual_seed(5)
    work = Workload(31, host_tokens)
    written = {}
    direct_seen = demoted_rows = spanned = reclaimed = 0
    for step in range(steps):
        req_ids, seq_lens, stable = work.step()
        table = torch.zeros((ROWS, MAX_CTX), dtype=torch.int32)
        for r, req in enumerate(req_ids.tolist()):
            if req != -1:
                table[r] = torch.tensor(work.reqs[req]["slots"], dtype=torch.int32)
        live = [r for r in range(ROWS) if req_ids[r] != -1]
        work.rng.shuffle(live)
        batch = live + [-1]  # one padding entry on the sink row
        rows_t = torch.tensor(batch, dtype=torch.int64)
        b_req = torch.tensor([int(req_ids[r]) if r >= 0 else -1 for r in batch])
        b_stable = torch.tensor([int(stable[r]) if r >= 0 else 0 for r in batch], dtype=torch.int32)
        b_ctx = torch.tensor([int(seq_lens[r]) if r >= 0 else 0 for r in batch], dtype=torch.int64)
        idle = [r for r in range(ROWS) if req_ids[r] == -1]
        always.begin_step(b_req, table, b_stable, step=step, rows=rows_t, context_len=b_ctx)
        adaptive.begin_step(
            b_req,
            table,
            b_stable,
            step=step,
            rows=rows_t,
            context_len=b_ctx,
            free_rows=(lambda: idle) if borrow else None,
        )
        plan = adaptive._direct_step
        direct = plan.mask.tolist()
        writes = []
        for req in {int(req_ids[r]) for r in live}:
            st = work.reqs[req]
            lo = min(written.get(req, 0), st["stable"])
            writes += st["slots"][lo : st["seq_len"]]
            written[req] = st["seq_len"]
        idx = torch.tensor(writes, dtype=torch.int64)
        for layer in range(LAYERS):
            if writes:
                new = torch.randn((len(writes), LATENT + ROPE), generator=gen).to(torch.bfloat16)
                always.append(layer, idx, new)
                adaptive.append(layer, idx, new)
            topk = np.full((len(batch), K), -1, dtype=np.int32)
            for i, r in enumerate(batch):
                if r >= 0:
                    topk[i] = work.topk(int(seq_lens[r]))
            q = torch.randn((len(batch), HEADS, LATENT), generator=gen).to(torch.bfloat16)
            qr = torch.randn((len(batch), HEADS, ROPE), generator=gen).to(torch.bfloat16)
            ref_out = always.run_layer(layer, torch.from_numpy(topk), q.to(device), qr.to(device), SCALE).output.cpu()
            res = adaptive.run_layer(layer, torch.from_numpy(topk), q.to(device), qr.to(device), SCALE)
            out = res.output.cpu()
            assert torch.equal(out, ref_out), f"step {step} layer {layer}: adaptive != always"
            real = torch.tensor(live, dtype=torch.int64)
            if live:
                ref = full_kv_attention(
                    attention, adaptive.pool, layer, torch.from_numpy(topk[:-1]), table[real], q[:-1], qr[:-1], SCALE
                )
                assert torch.equal(out[:-1], ref), f"step {step} layer {layer}: != full-KV attention"
            hot = adaptive.hot.layer(layer).cpu()
            host = adaptive.pool.layer(layer)
            miss_count, hit_mask = res.residency.miss_count.cpu(), res.residency.hit_mask.cpu()
            flat_all = res.flat_indices.cpu()
            for i, r in enumerate(batch):
                if r < 0:
                    continue
                if direct[i]:
                    # no residency work: the manager saw an idle row; positions read through the span
                    assert int(miss_count[i]) == 0 and not bool(hit_mask[i].any())
                    n = int(b_ctx[i])
                    where = direct_flat(plan.span_rows[i : i + 1].cpu(), torch.arange(n)[None, :], HOT)[0].long()
                    flat_hot = hot.reshape(-1, hot.shape[-1])
                    assert torch.equal(flat_hot[where], host[table[r, :n].long()]), f"step {step} row {r}: span"
                    sel = torch.from_numpy(topk[i])
                    flat = flat_all[i, 0]
                    assert torch.equal(flat[sel >= 0], where[sel[sel >= 0].long()].to(flat.dtype))
                    spanned += int(where.max()) >= (r + 1) * HOT or int(where.min()) < r * HOT
            t = adaptive.table(layer)
            t = ResidencyTable(t.slot_token.cpu(), t.slot_stamp.cpu(), t.row_req.cpu())
            managed = [r for i, r in enumerate(batch) if r >= 0 and not direct[i]]
            if managed:
                m = torch.tensor(managed)
                stepped = ResidencyTable(t.slot_token[m], t.slot_stamp[m], t.row_req[m])
                assert resident_mismatches(stepped, hot[m], host, table[m]) == 0
        direct_seen += plan.direct_count
        demoted_rows += plan.demote_heads.numel()
        reclaimed += plan.reclaimed
    stats = adaptive.stats().total
    assert direct_seen > steps // 4 and demoted_rows > 5, (direct_seen, demoted_rows)
    if borrow and adaptive.copy_sfa_op is None:  # spans over idle rows were read, new requests took some back
        assert spanned > 0 and reclaimed > 0, (spanned, reclaimed)
    elif borrow:  # the fused Copy-SFA reads each token's own row only: no spans
        assert spanned == 0 and reclaimed == 0
    assert stats.demotions == LAYERS * demoted_rows and stats.direct_rows == LAYERS * direct_seen
    # direct entries do no lookups: fewer selected entries than the always engine
    assert stats.selected < always.stats().total.selected
    assert stats.hits + stats.misses == stats.selected


def test_demotion_moves_the_buffer_on_the_device_only():
    """A request grows from 3 positions past the hot buffer one decode step at a time:
    direct while it fits, then demoted; its first managed step hits every resident
    position it selects and the host pool is not read for them (no misses but the new)."""
    host_tokens = 64
    eng = _engine("adaptive", "kernel", host_tokens)
    table = torch.arange(ROWS * MAX_CTX, dtype=torch.int32).remainder(host_tokens).reshape(ROWS, MAX_CTX)
    table[1] = torch.arange(MAX_CTX, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    pool = eng.pool
    for layer in range(LAYERS):
        pool.write_rows(layer, torch.arange(3), torch.randn((3, LATENT + ROPE), generator=gen).to(torch.bfloat16))
    rows = torch.tensor([1])
    for step, length in enumerate(range(4, HOT + 3)):
        eng.begin_step(torch.tensor([7]), table, torch.tensor([length], dtype=torch.int32), step=step, rows=rows)
        d = eng._direct_step
        for layer in range(LAYERS):
            eng.append(
                layer, torch.tensor([length - 1]), torch.randn((1, LATENT + ROPE), generator=gen).to(torch.bfloat16)
            )
            # select the most recent K positions (all resident but the new one once demoted)
            sel = torch.arange(max(0, length - K), length, dtype=torch.int32)
            topk = torch.full((1, K), -1, dtype=torch.int32)
            topk[0, : sel.numel()] = sel
            q = torch.randn((1, HEADS, LATENT), generator=gen).to(torch.bfloat16)
            qr = torch.randn((1, HEADS, ROPE), generator=gen).to(torch.bfloat16)
            res = eng.run_layer(layer, topk, q, qr, SCALE)
            if length <= HOT:
                assert bool(d.mask[0]) and int(res.residency.miss_count[0]) == 0
            else:
                assert not bool(d.mask[0])
                if length == HOT + 1:  # the demotion step: every position but the new one hits
                    assert d.demote_heads.tolist() == [1] and int((d.demote_pos[0] >= 0).sum()) == HOT
                    assert int(res.residency.miss_count[0]) == 1
                    assert int(res.residency.hit_mask[0].sum()) == K - 1
            t = eng.table(layer)
            if length > HOT:
                st = ResidencyTable(t.slot_token[1:2], t.slot_stamp[1:2], t.row_req[1:2])
                assert resident_mismatches(st, eng.hot.layer(layer)[1:2], pool.layer(layer), table[1:2]) == 0
    assert eng.stats().total.demotions == LAYERS


def test_plan_spans_free_rows_and_gives_them_back_under_pressure():
    d = DirectRows(state_rows=6, hot_tokens=8)  # rows 0-4, sink 5
    d.max_span = 4

    def plan(rows, req, ctx, free):
        t = torch.tensor
        return d.plan(t(rows), t(req), t(ctx, dtype=torch.int32), t(ctx), "cpu", free_rows=lambda: free)

    # row 0 fits its own buffer; row 1 (10 positions) borrows the front of the free list
    # (SGLang hands slots out from its tail), 4
    p = plan([0, 1], [10, 11], [7, 10], [4, 3, 2])
    assert p.mask.tolist() == [True, True] and p.span_rows[1, :2].tolist() == [1, 4]
    assert p.copy_pos.tolist() == list(range(7)) + list(range(10))
    assert p.copy_dst.tolist()[-2:] == [4 * 8, 4 * 8 + 1] and p.lent_rows == 1
    # a new request on row 4: request 11 is demoted (pressure) and keeps its last 8 positions
    p = plan([0, 1, 4], [10, 11, 12], [8, 11, 3], [3, 2])
    assert p.reclaimed == 1 and p.demote_heads.tolist() == [1] and p.mask.tolist() == [True, False, True]
    assert p.demote_pos[0].tolist() == list(range(2, 10))
    assert p.demote_src[0].tolist() == [8 + i for i in range(2, 8)] + [32, 33]
    assert p.copy_pos.tolist() == [7, 0, 1, 2] and p.copy_dst.tolist() == [7, 32, 33, 34]
    # once demoted, a request stays under the residency
    p = plan([1], [11], [12], [3, 2])
    assert p.mask.tolist() == [False] and p.demote_heads.numel() == 0
    # request 11 finished (row 1 free): row 0 grows over two free rows, taken from the front of the list
    p = plan([0], [10], [17], [3, 2, 1])
    assert p.mask.tolist() == [True] and p.span_rows[0, :3].tolist() == [0, 3, 2]
    # no room to grow (and the span limit): demoted
    p = plan([0], [10], [33], [1])
    assert p.mask.tolist() == [False] and p.demote_heads.tolist() == [0]
    assert p.demote_pos[0].tolist() == list(range(9, 17)) and p.lent_rows == 0


def test_a_finished_requests_borrowed_rows_are_lendable_the_step_its_row_is_reused():
    """Request 10 on row 5 spans rows 1-3 and finishes; SGLang hands row 5 to request 12
    (its row was never in a free list the engine saw). The same step request 11 (first in
    the batch) grows: it must get 10's rows back, and nobody is demoted."""
    d = DirectRows(state_rows=8, hot_tokens=8)  # rows 0-6, sink 7
    d.max_span = 8

    def plan(rows, req, ctx, free):
        t = torch.tensor
        return d.plan(t(rows), t(req), t(ctx, dtype=torch.int32), t(ctx), "cpu", free_rows=lambda: list(free))

    p = plan([5, 6], [10, 11], [30, 8], [1, 2, 3, 4])
    assert p.span_rows[0, :4].tolist() == [5, 1, 2, 3] and p.mask.tolist() == [True, True]
    p = plan([6, 5], [11, 12], [30, 3], [1, 2, 3, 4])  # 10 finished, 12 took row 5; 11 needs 3 rows
    assert p.mask.tolist() == [True, True] and p.demote_heads.numel() == 0 and p.reclaimed == 0
    assert p.span_rows[0, :4].tolist() == [6, 1, 2, 3] and d.demotions == 0


def test_hold_demotes_the_direct_requests_and_admits_none():
    """The test switch (``DirectRows.hold``): while it holds, direct requests are demoted
    in place at their next step and new ones start under the residency; afterwards new
    requests are direct again and the demoted ones stay managed."""
    d = DirectRows(state_rows=6, hot_tokens=8)
    d.max_span = 4
    holding = [False]
    d.hold = lambda: holding[0]

    def plan(rows, req, ctx, free=(4, 3, 2)):
        t = torch.tensor
        return d.plan(t(rows), t(req), t(ctx, dtype=torch.int32), t(ctx), "cpu", free_rows=lambda: list(free))

    p = plan([0, 1], [10, 11], [5, 12])
    assert p.mask.tolist() == [True, True] and p.span_rows[1, :2].tolist() == [1, 4]
    holding[0] = True
    p = plan([0, 1, 2], [10, 11, 12], [6, 13, 3])
    assert p.mask.tolist() == [False, False, False] and p.demote_heads.tolist() == [0, 1]
    assert p.reclaimed == 0 and p.demote_pos[1].tolist() == list(range(4, 12))
    assert p.demote_src[1].tolist() == [8 + i for i in range(4, 8)] + [32 + i for i in range(4)]
    holding[0] = False
    p = plan([0, 1, 2, 3], [10, 11, 12, 13], [7, 14, 4, 2])
    assert p.mask.tolist() == [False, False, False, True] and p.demote_heads.numel() == 0
    assert d.demotions == 2


def test_adaptive_refusals_name_the_fix():
    with pytest.raises(ValueError, match="policy 'lru_k2_guarded' is not lru"):
        EngineConfig(LAYERS, ROWS, HOT, K, LATENT, ROPE, policy="lru_k2_guarded", residency="adaptive")
    with pytest.raises(ValueError, match="residency must be one of"):
        EngineConfig(LAYERS, ROWS, HOT, K, LATENT, ROPE, residency="sometimes")
    pool = HostKVPool.allocate(HostPoolShape(LAYERS, 64, LATENT, ROPE), "pinned")
    # (asking whether the fused LIM can run here registers the functional-model ops: not left behind)
    with registration_left_as_found(), pytest.raises(OpSelectionError, match=r"fused_not_wired.*residency 'adaptive'"):
        SparseDecodeEngine(
            EngineConfig(
                LAYERS,
                ROWS,
                HOT,
                K,
                LATENT,
                ROPE,
                ops="fused",
                residency="adaptive",
                caller_runs_indexer=True,
                manage_impl="torch",
                fused_lim=True,
                fused_copy_sfa=False,
            ),
            pool,
            device="cpu",
        )
    # the default fused rung opts out of the fused indexer (logged) and keeps the fused Copy-SFA
    plan = select_ops("npu", ops="auto", residency="adaptive", available=lambda op: None)
    assert not plan.indexer.fused and "residency 'adaptive'" in plan.indexer.reason
    assert plan.attention.fused and not plan.problems


def _served_like_steps(seed: int, steps: int):
    """Decode steps as a server runs them: each request's prompt is in the host pool
    before its first decode step, every step appends one token per request, requests
    finish and rows are reused (the last row never gets a request: it is free to lend). Yields ``(rows, req_ids,
    stable [B], new host slots [B],
    table)`` with ``stable`` = the length including the token being decoded."""
    rng = np.random.default_rng(seed)
    table = torch.zeros((ROWS, MAX_CTX), dtype=torch.int32)
    length, left, owner, next_req = [0] * ROWS, [0] * ROWS, [-1] * ROWS, 0
    prompts = []  # (row, host slots of the prompt) to write before the step
    for _ in range(steps):
        prompts.clear()
        for r in range(ROWS):
            if owner[r] >= 0 and left[r] == 0:
                owner[r] = -1
            if owner[r] < 0 and r < ROWS - 1 and rng.random() < 0.7:  # the last row stays free (spans use it)
                # host slots: the row's own range, in a new order
                table[r] = torch.from_numpy(r * MAX_CTX + rng.permutation(MAX_CTX)).to(torch.int32)
                length[r] = int(rng.integers(1, 14))  # prompt, below or above the 10 hot slots
                left[r] = int(rng.integers(2, MAX_CTX - 4 - length[r]))
                owner[r], next_req = next_req, next_req + 1
                prompts.append((r, table[r, : length[r]].long()))
        live = [r for r in range(ROWS) if owner[r] >= 0]
        rng.shuffle(live)
        for r in live:
            length[r] += 1
            left[r] -= 1
        new_slots = torch.tensor([int(table[r, length[r] - 1]) for r in live], dtype=torch.int64)
        yield (
            torch.tensor(live + [-1]),
            torch.tensor([owner[r] for r in live] + [-1]),
            torch.tensor([length[r] for r in live] + [0], dtype=torch.int32),
            new_slots,
            table.clone(),
            prompts,
        )


COMPILED_TOL = 2e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_captured_step_equals_the_eager_step(compiled):
    """The captured form (copies split around the step, ``decode_layer_step`` with the
    direct plan, optionally ``torch.compile(fullgraph=True)``) gives the eager engine's
    residency state and hot buffers bit for bit, and its outputs (bit for bit uncompiled,
    within the compiled attention's tolerance compiled)."""
    from sglang_ascend_offload.sparse_decode.engine import decode_layer_step

    host_tokens = ROWS * MAX_CTX
    eager, captured = _engine("adaptive", "kernel", host_tokens), _engine("adaptive", "kernel", host_tokens)
    attention = registry.select("sparse_mla_attention", "reference")
    layer_step = torch.compile(decode_layer_step, fullgraph=True, dynamic=False) if compiled else decode_layer_step
    gen = torch.Generator().manual_seed(3)
    direct_steps = demotions = spanned = 0
    for step, (rows, req_ids, stable, new_slots, table, prompts) in enumerate(_served_like_steps(11, 60)):
        for layer in range(LAYERS):
            for _, slots in prompts:  # the prefill wrote the prompt before the first decode step
                kv = torch.randn((slots.numel(), LATENT + ROPE), generator=gen).to(torch.bfloat16)
                eager.pool.write_rows(layer, slots, kv)
                captured.pool.write_rows(layer, slots, kv)
        free = [r for r in range(ROWS) if r not in rows.tolist()]
        eager.begin_step(req_ids, table, stable, step=step, rows=rows, free_rows=lambda: free)
        captured.begin_step(req_ids, table, stable, step=step, rows=rows, captured=True, free_rows=lambda: free)
        d = captured.direct_step
        assert torch.equal(d.mask, eager.direct_step.mask)
        direct_steps += d.direct_count
        demotions += d.demote_heads.numel()
        spanned += int(((d.span_rows[:, 1] != captured.batch_rows) & d.mask).sum())
        b = rows.numel()
        for layer in range(LAYERS):
            new = torch.randn((b - 1, LATENT + ROPE), generator=gen).to(torch.bfloat16)
            eager.append(layer, new_slots, new)
            captured.append(layer, new_slots, new)
            topk = torch.full((b, K), -1, dtype=torch.int32)
            for i in range(b - 1):
                n = int(stable[i])
                sel = torch.randperm(n, generator=gen)[:K]
                topk[i, : sel.numel()] = sel.to(torch.int32)
            q = torch.randn((b, HEADS, LATENT), generator=gen).to(torch.bfloat16)
            qr = torch.randn((b, HEADS, ROPE), generator=gen).to(torch.bfloat16)
            want = eager.run_layer(layer, topk, q, qr, SCALE).output
            got, _ = layer_step(
                captured.managers[layer],
                captured.batch_rows,
                topk,
                captured._req_ids,
                captured._stable_len,
                torch.tensor(step),
                captured.pool.layer(layer),
                captured.hot.storage(layer),
                table,
                q,
                qr,
                SCALE,
                LATENT,
                attention=attention,
                direct=(d.mask, d.step_pos, d.span_rows),
            )
            if compiled:  # inductor may fuse the attention's float arithmetic differently (test_sync_free.TOL)
                diff = (got.float() - want.float()).abs()
                assert bool((diff <= COMPILED_TOL + COMPILED_TOL * want.float().abs()).all()), (step, layer)
            else:
                assert torch.equal(got, want), f"step {step} layer {layer}"
            real = slice(0, ROWS)
            assert torch.equal(captured.hot.storage(layer)[real], eager.hot.storage(layer)[real])
            for name in ("slot_token", "slot_stamp", "row_req"):
                assert torch.equal(getattr(captured.table(layer), name), getattr(eager.table(layer), name))
    assert direct_steps > 20 and demotions > 2 and spanned > 0, (direct_steps, demotions, spanned)


def test_verify_rows_adaptive_equals_always():
    """Two verify rows per request (``rows_per_request = 2``): each round appends the two
    candidates after the committed length ``L`` (rewriting the last round's rejected
    ones) and accepts one or two. ``adaptive`` (with spans over free rows) equals
    ``always`` bit for bit, direct requests reading their candidates through their spans."""
    n, rows, hot, k = 2, 4, 12, 5
    host_tokens = rows * MAX_CTX

    def engine(residency):
        pool = HostKVPool.allocate(HostPoolShape(LAYERS, host_tokens, LATENT, ROPE), "pinned")
        return SparseDecodeEngine(
            EngineConfig(
                LAYERS,
                rows,
                hot,
                k,
                LATENT,
                ROPE,
                policy="lru",
                ops="reference",
                manage_impl="torch",
                rows_per_request=n,
                residency=residency,
            ),
            pool,
            device="cpu",
        )

    always, adaptive = engine("always"), engine("adaptive")
    rng = np.random.default_rng(4)
    gen = torch.Generator().manual_seed(4)
    table = torch.from_numpy(np.arange(rows * MAX_CTX).reshape(rows, MAX_CTX)).to(torch.int32)
    committed = {0: 5, 2: 9}  # row -> L; rows 1 and 3 are free
    direct_seen = spanned = 0
    for step in range(17):  # contexts stay within the token table (48)
        live = sorted(committed)
        free = [r for r in range(rows) if r not in committed]
        b_rows = torch.tensor(live)
        req = torch.tensor([100 + r for r in live])
        stable = torch.tensor([committed[r] for r in live], dtype=torch.int32)
        always.begin_step(req, table, stable, step=step, rows=b_rows)
        adaptive.begin_step(req, table, stable, step=step, rows=b_rows, free_rows=lambda: free)
        d = adaptive.direct_step
        direct_seen += d.direct_count
        spanned += int(((d.span_rows[:, 1] != b_rows) & d.mask).sum())
        for layer in range(LAYERS):
            slots = torch.cat([table[r, committed[r] : committed[r] + n].long() for r in live])
            kv = torch.randn((slots.numel(), LATENT + ROPE), generator=gen).to(torch.bfloat16)
            always.append(layer, slots, kv)
            adaptive.append(layer, slots, kv)
            topk = torch.full((len(live) * n, k), -1, dtype=torch.int32)
            for i, r in enumerate(live):
                for j in range(n):
                    visible = committed[r] + j + 1
                    sel = torch.randperm(visible, generator=gen)[:k]
                    topk[i * n + j, : sel.numel()] = sel.to(torch.int32)
            q = torch.randn((len(live) * n, HEADS, LATENT), generator=gen).to(torch.bfloat16)
            qr = torch.randn((len(live) * n, HEADS, ROPE), generator=gen).to(torch.bfloat16)
            want = always.run_layer(layer, topk, q, qr, SCALE).output
            got = adaptive.run_layer(layer, topk, q, qr, SCALE).output
            assert torch.equal(got, want), f"step {step} layer {layer}"
        for r in live:
            committed[r] += int(rng.integers(1, n + 1))
    assert direct_seen > 10 and spanned > 0 and adaptive.stats().total.demotions > 0


def _plan_fields(p) -> dict:
    """Every field of a :class:`DirectStep` as host values (for comparing two plans)."""
    out = {}
    for name in (
        "mask",
        "span_rows",
        "copy_rows",
        "copy_pos",
        "copy_dst",
        "demote_heads",
        "demote_req",
        "demote_stable",
        "demote_pos",
        "demote_src",
        "step_pos",
    ):
        t = getattr(p, name)
        out[name] = None if t is None else t.cpu().tolist()
    for name in ("direct_count", "step_copies", "lent_rows", "lent_now", "reclaimed", "all_direct"):
        out[name] = getattr(p, name)
    return out


@pytest.mark.parametrize("captured", [0, 2])
def test_steady_state_plan_equals_the_full_plan(captured):
    """The steady-state shortcut of ``DirectRows.plan`` (the same batch as the last step,
    every entry direct and within its span) gives the full plan's step and bookkeeping,
    over a workload with long steady stretches broken by arrivals, finishes, a request
    out of the batch for a while (its span's rows must not be lent), span growth, the
    hold switch and demotions."""
    import numpy as np

    from sglang_ascend_offload.sparse_decode import direct_rows as dr

    rows_n, hot = 10, 8
    fast, full = dr.DirectRows(rows_n + 1, hot), dr.DirectRows(rows_n + 1, hot)
    fast.max_span = full.max_span = 4
    rng = np.random.default_rng(11)
    owner, length = {}, {}
    next_req, shortcuts, holding, away = 100, 0, [False], set()
    fast.hold = full.hold = lambda: holding[0]
    for step in range(600):
        if rng.random() < 0.04 or not owner:  # an arrival on a free row
            free = [r for r in range(rows_n) if r not in owner and fast.lender[r] < 0]
            if free:
                r = int(rng.choice(free))
                owner[r], length[r], next_req = next_req, int(rng.integers(1, 20)), next_req + 1
        if owner and rng.random() < 0.03:  # a finish
            del owner[int(rng.choice(list(owner)))]
        if owner and rng.random() < 0.02:  # a request leaves the batch for a while (e.g. retracted)
            away.add(int(rng.choice(list(owner))))
        if away and rng.random() < 0.1:
            away.pop()
        holding[0] = rng.random() < 0.01
        batch = sorted(r for r in owner if r not in away)
        for r in batch:  # a captured step writes its width; an eager one sometimes jumps (a radix hit)
            length[r] += captured or (1 if rng.random() < 0.97 else 3)
        free_now = [r for r in range(rows_n) if r not in owner]
        rows = torch.tensor(batch + [-1], dtype=torch.int64)
        rows = torch.where(rows < 0, torch.full_like(rows, rows_n), rows)
        req = torch.tensor([owner[r] for r in batch] + [-1], dtype=torch.int64)
        ctx = torch.tensor([length[r] for r in batch] + [0], dtype=torch.int64)
        stable = torch.clamp(ctx - (captured or 1), min=0).to(torch.int32)
        was_steady = fast._steady is not None and fast._steady.holds(
            dr._Batch.of(rows, req, stable, ctx), fast.max_span
        )
        a = fast.plan(rows, req, stable, ctx, "cpu", captured_width=captured, free_rows=lambda: free_now)
        full._steady = None  # the full plan every step
        b = full.plan(rows, req, stable, ctx, "cpu", captured_width=captured, free_rows=lambda: free_now)
        shortcuts += was_steady and not holding[0]
        assert _plan_fields(a) == _plan_fields(b), f"step {step}"
        # the remap through the step's position map (a steady step reuses the last one's)
        pos = torch.from_numpy(rng.integers(0, np.maximum(ctx.numpy(), 1)[:, None], (ctx.numel(), 6)))
        pos = torch.where(a.mask[:, None], pos, torch.full_like(pos, -1)).to(torch.int32)
        assert torch.equal(a.flat_rows(pos, hot), dr.direct_flat(a.span_rows, pos, hot)), f"step {step}"
        for name in ("owner", "filled", "stable", "lender"):
            assert np.array_equal(getattr(fast, name), getattr(full, name)), f"step {step}: {name}"
        assert fast.span == full.span and fast.retired == full.retired and fast.demotions == full.demotions
        for r in [r for r in owner if fast.retired.get(r) == owner[r]]:  # demoted: the test keeps it short
            del owner[r]
    assert shortcuts > 200 and fast.demotions > 3, (shortcuts, fast.demotions)


@pytest.mark.parametrize("n", [1, 3])
def test_position_map_gather_equals_direct_flat(n):
    """The eager step's remap (one gather from the step's position map) gives
    :func:`direct_flat` bit for bit for every position a span covers, ``-1`` included."""
    from sglang_ascend_offload.sparse_decode.direct_rows import DirectStep

    gen = torch.Generator().manual_seed(2)
    hot, spans, entries = 8, 5, 4
    span_rows = torch.randint(0, 30, (entries, spans), generator=gen)
    positions = torch.randint(-1, hot * spans, (entries * n, 16), generator=gen, dtype=torch.int32)
    positions[:, -1] = -1  # unused top-k entries
    none = torch.zeros((0,), dtype=torch.int64)
    step = DirectStep(
        mask=torch.ones(entries, dtype=torch.bool),
        span_rows=span_rows,
        copy_rows=none,
        copy_pos=none,
        copy_dst=none,
        demote_heads=none,
        demote_req=none,
        demote_stable=none,
        demote_pos=none,
        demote_src=none,
        direct_count=entries,
    )
    for _ in range(2):  # the map is built once and reused (every layer of the step)
        got = step.flat_rows(positions, hot, n)
        assert got.dtype == torch.int32 and torch.equal(got, direct_flat(span_rows, positions, hot, n))
    assert bool((positions == -1).any())
