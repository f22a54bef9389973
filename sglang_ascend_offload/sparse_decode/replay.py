"""Replay a trace: through the real engine with data (verified), or residency only.

:func:`replay_trace` drives :class:`~.engine.SparseDecodeEngine` step by step with
random KV content: it allocates host slots per request (shuffled, like a real
allocator's), writes each new request's prompt rows into the host pool (prefill,
not decode traffic), appends each step's new-token rows through the engine (the
D2H path), runs every layer with random queries and, after every layer step,
checks that (1) every occupied slot holds exactly its host row, (2) every remapped
slot holds its logical position, (3) the attention output ``torch.equal`` s the
same op over the full host KV with logical indices (within
:data:`FUSED_ATTENTION_TOL` when the engine's plan runs the fused Copy-SFA).

:func:`simulate_policy` runs only the residency decisions (no KV data) of a policy,
the top-k-sized device cache (``hot_tokens = top_k``) or Belady's optimum over a
trace; it is what the side-by-side columns of ``bench decode`` use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..ops.contract import ResidencyTable
from ..ops.residency import residency_manage
from .belady import BeladyManager, next_use_table
from .engine import EngineConfig, PhaseTimes, SparseDecodeEngine
from .host_pool import HostKVPool, HostPoolShape
from .op_selection import fused_host_pool_rows
from .policies import DEFAULT_POLICY, RankedInputError, make_manager, needs_ranked
from .stats import DecodeStats
from .trace import Trace
from .verify import full_kv_attention, remap_mismatches, resident_mismatches

__all__ = [
    "ReplayOptions",
    "ReplayResult",
    "replay_trace",
    "simulate_policy",
    "SimResult",
    "host_tokens_needed",
    "compact_trace",
    "step_schedule",
    "check_ranked",
]

_MAX_FAILURES = 10


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay: hot-buffer size, policy, op ladder, attention heads, data seed."""

    hot_tokens: int
    policy: str = DEFAULT_POLICY
    ops: str = "auto"
    heads: int = 8
    latent_dim: int = 512
    rope_dim: int = 64
    seed: int = 0
    verify: bool = True
    #: the engine's ``fused_copy_sfa`` (``None``: the operator plan's default for ``ops``)
    fused_copy_sfa: Optional[bool] = None


#: A fused Copy-SFA step's output against the full-KV reference: ``|got - ref| <= tol +
#: tol * |ref|`` (the kernel accumulates in its own order, docs/fused_ops.md); the separate
#: operators are compared bit for bit.
FUSED_ATTENTION_TOL = 2e-2


@dataclass
class ReplayResult:
    stats: DecodeStats
    verified: bool
    checks: int
    failures: List[str]
    times: PhaseTimes
    wall_s: float
    prefill_bytes: int
    host_tokens: int


def host_tokens_needed(trace: Trace) -> int:
    """Host slots the replay needs: max over steps of the active requests' lengths."""
    need = 0
    for t in range(trace.steps):
        lens: Dict[int, int] = {}
        for req, n in zip(trace.req_ids[t].tolist(), trace.seq_lens[t].tolist()):
            if req != -1:
                lens[req] = max(lens.get(req, 0), n)
        need = max(need, sum(lens.values()))
    return max(need, 1)


class _SlotAllocator:
    """Host slots per request from a shuffled free list (the pool never picks ids)."""

    def __init__(self, capacity: int, rng: np.random.Generator):
        self.free = list(rng.permutation(capacity).tolist())
        self.tables: Dict[int, List[int]] = {}

    def grow(self, req: int, length: int) -> List[int]:
        """Extend ``req``'s table to ``length``; returns the new host slots."""
        table = self.tables.setdefault(req, [])
        need = length - len(table)
        if need > len(self.free):
            raise RuntimeError(f"host pool exhausted: request {req} needs {need} more slots")
        new = [self.free.pop() for _ in range(max(0, need))]
        table.extend(new)
        return new

    def release_missing(self, present: set) -> None:
        for req in [r for r in self.tables if r not in present]:
            self.free.extend(self.tables.pop(req))


def replay_trace(
    trace: Trace, opts: ReplayOptions, progress: Optional[Callable[[int, int], None]] = None
) -> ReplayResult:
    """Replay ``trace`` through the engine with verification (see module docstring).

    Idle work is skipped (:func:`compact_trace`, :func:`step_schedule`): the engine
    steps only the rows active now or at the step before, in its rows form.
    """
    check_ranked(trace, opts.policy)
    t_start = time.perf_counter()
    total_steps = trace.steps
    original_step = _kept(trace)[0]  # progress is reported in the trace's own steps
    trace = compact_trace(trace)
    schedule = step_schedule(trace)
    wants_ranked = needs_ranked(opts.policy)
    rows, layers = trace.rows, trace.layers
    gen = torch.Generator().manual_seed(opts.seed)
    rng = np.random.default_rng(opts.seed)
    engine, pool = _build_engine(trace, opts)
    cfg, capacity = engine.config, pool.shape.tokens
    row_dim = cfg.row_dim
    scale = 1.0 / float(row_dim) ** 0.5
    alloc = _SlotAllocator(capacity, rng)
    max_ctx = max(1, int(trace.seq_lens.max()))
    token_table = torch.zeros((rows, max_ctx), dtype=torch.int32)
    written: Dict[int, int] = {}
    failures: List[str] = []
    checks = 0
    prefill_bytes = 0

    def rand_rows(n: int) -> torch.Tensor:
        return torch.randn((layers, n, row_dim), generator=gen).to(cfg.dtype)

    for t in range(trace.steps):
        req_ids = trace.req_ids[t]
        seq_lens = trace.seq_lens[t]
        targets: Dict[int, int] = {}
        for req, n in zip(req_ids.tolist(), seq_lens.tolist()):
            if req != -1:
                targets[req] = max(targets.get(req, 0), n)
        append_slots, prompt_bytes = _grow_requests(targets, alloc, written, pool, rand_rows)
        prefill_bytes += prompt_bytes
        _fill_token_table(token_table, req_ids, alloc)

        sel_np = schedule[t]
        if sel_np.size == 0:  # nothing was or is active (a leading idle step)
            if progress is not None:
                progress(total_steps if t == trace.steps - 1 else int(original_step[t]) + 1, total_steps)
            continue
        sel = torch.from_numpy(sel_np)
        engine.begin_step(
            torch.from_numpy(req_ids[sel_np].astype(np.int64)),
            token_table,
            torch.from_numpy(seq_lens[sel_np].astype(np.int32)),
            step=t,
            rows=sel,
        )
        sel_table = token_table.index_select(0, sel)
        new_rows = rand_rows(len(append_slots))
        append_idx = torch.tensor(append_slots, dtype=torch.int64)
        for layer in range(layers):
            if append_slots:
                engine.append(layer, append_idx, new_rows[layer])
            topk = torch.from_numpy(trace.topk[t, layer][sel_np].astype(np.int32))
            if wants_ranked:
                engine.managers[layer].set_ranked(torch.from_numpy(trace.ranked[t, layer][sel_np]))
            b = sel_np.size
            query = torch.randn((b, opts.heads, opts.latent_dim), generator=gen).to(cfg.dtype)
            query_rope = torch.randn((b, opts.heads, opts.rope_dim), generator=gen).to(cfg.dtype)
            # the model's queries live on the engine's device (a device op refuses host tensors)
            result = engine.run_layer(layer, topk, query.to(engine.device), query_rope.to(engine.device), scale)
            if not opts.verify:
                continue
            checks += 1
            for problem in _verify_layer(engine, pool, layer, sel, sel_table, topk, result, query, query_rope, scale):
                _fail(failures, f"step {t} layer {layer}: {problem}")
        if progress is not None:
            progress(total_steps if t == trace.steps - 1 else int(original_step[t]) + 1, total_steps)
    return ReplayResult(
        stats=engine.stats(),
        verified=opts.verify and not failures,
        checks=checks,
        failures=failures,
        times=engine.times,
        wall_s=time.perf_counter() - t_start,
        prefill_bytes=prefill_bytes,
        host_tokens=capacity,
    )


def _build_engine(trace: Trace, opts: ReplayOptions) -> Tuple[SparseDecodeEngine, HostKVPool]:
    """The engine for ``trace`` under ``opts`` over a pinned host pool holding every token the
    trace ever has live (rows per layer a multiple of the fused Copy-SFA's host alignment,
    whichever path runs)."""
    row_bytes = HostPoolShape(1, 1, opts.latent_dim, opts.rope_dim).row_bytes
    capacity = fused_host_pool_rows(host_tokens_needed(trace), row_bytes)
    pool = HostKVPool.allocate(HostPoolShape(trace.layers, capacity, opts.latent_dim, opts.rope_dim), "pinned")
    cfg = EngineConfig(
        layers=trace.layers,
        rows=trace.rows,
        hot_tokens=opts.hot_tokens,
        top_k=trace.top_k,
        latent_dim=opts.latent_dim,
        rope_dim=opts.rope_dim,
        policy=opts.policy,
        ops=opts.ops,
        fused_copy_sfa=opts.fused_copy_sfa,
    )
    return SparseDecodeEngine(cfg, pool, timing=True), pool


def _grow_requests(
    targets: Dict[int, int],
    alloc: "_SlotAllocator",
    written: Dict[int, int],
    pool: HostKVPool,
    rand_rows: Callable[[int], torch.Tensor],
) -> Tuple[List[int], int]:
    """Bring each live request to its length in ``targets`` (request -> tokens): release
    the gone ones, write a new request's prompt into the host pool as prefill would.
    Returns ``(host slots this step appends, prompt bytes written)``."""
    alloc.release_missing(set(targets))
    for req in [r for r in written if r not in targets]:
        del written[req]
    append_slots: List[int] = []
    prompt_bytes = 0
    for req, n in targets.items():
        first = req not in written
        old = written.get(req, 0)
        alloc.grow(req, n)
        if first and n > 1:  # the prompt arrives by prefill / P-D transfer, not by decode
            prompt = torch.tensor(alloc.tables[req][: n - 1], dtype=torch.int64)
            for layer, data in enumerate(rand_rows(prompt.numel())):
                pool.write_rows(layer, prompt, data)
            prompt_bytes += pool.shape.layers * prompt.numel() * pool.shape.row_bytes
            old = n - 1
        append_slots.extend(alloc.tables[req][old:n])
        written[req] = n
    return append_slots, prompt_bytes


def _fill_token_table(token_table: torch.Tensor, req_ids: np.ndarray, alloc: "_SlotAllocator") -> None:
    """Row ``r`` of ``token_table`` holds the host slots of the request on trace row ``r``."""
    token_table.zero_()
    for r, req in enumerate(req_ids.tolist()):
        if req != -1:
            tab = alloc.tables[req]
            token_table[r, : len(tab)] = torch.tensor(tab, dtype=torch.int32)


def _verify_layer(
    engine: SparseDecodeEngine,
    pool: HostKVPool,
    layer: int,
    sel: torch.Tensor,
    sel_table: torch.Tensor,
    topk: torch.Tensor,
    result,
    query: torch.Tensor,
    query_rope: torch.Tensor,
    scale: float,
) -> List[str]:
    """What is wrong with one layer step of the rows ``sel``: resident slots that differ
    from their host rows, remapped entries off their position, an attention output that
    differs from the full-KV reference (bit for bit)."""
    problems = []
    full = engine.table(layer)
    dev_sel = sel.to(full.slot_token.device)
    table = ResidencyTable(
        full.slot_token.index_select(0, dev_sel),
        full.slot_stamp.index_select(0, dev_sel),
        full.row_req.index_select(0, dev_sel),
    )
    hot_rows = engine.hot.layer(layer).index_select(0, sel.to(engine.hot.layer(layer).device))
    bad = resident_mismatches(table, hot_rows, pool.layer(layer), sel_table)
    if bad:
        problems.append(f"{bad} resident slots differ from their host rows")
    bad = remap_mismatches(table, topk.to(table.slot_token.device), result.residency)
    if bad:
        problems.append(f"{bad} remapped entries do not hold their position")
    ref = full_kv_attention(
        engine._attention_op, pool, layer, topk, sel_table, query, query_rope, scale, device=engine.device
    ).cpu()
    got = result.output.cpu()
    if engine.plan.attention.fused:
        err = (got.float() - ref.float()).abs()
        if got.shape != ref.shape or bool((err > FUSED_ATTENTION_TOL * (1 + ref.float().abs())).any()):
            problems.append(
                f"fused attention output off the full-KV reference by more than {FUSED_ATTENTION_TOL} "
                f"(max abs err {float(err.max()) if err.numel() else 0.0:.3g})"
            )
    elif not torch.equal(got, ref):
        problems.append("attention output differs from the full-KV reference")
    return problems


def _fail(failures: List[str], msg: str) -> None:
    if len(failures) < _MAX_FAILURES:
        failures.append(msg)
    elif len(failures) == _MAX_FAILURES:
        failures.append("... (further failures not listed)")


# --------------------------------------------------------------- residency only
@dataclass
class SimResult:
    """Misses per layer of one residency strategy over a trace."""

    name: str
    hot_tokens: int
    misses_per_layer: List[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def misses(self) -> int:
        return int(sum(self.misses_per_layer))


def check_ranked(trace: Trace, policy: str) -> None:
    """A clear error when ``policy`` needs the indexer's ranking and ``trace`` has none."""
    if policy != "belady" and needs_ranked(policy) and trace.ranked is None:
        raise RankedInputError(
            f"policy {policy!r} needs the trace's 'ranked' array (positions in indexer-score order) and this "
            "trace has none: record with record_trace_rank_depth > 0 in --sparse-decode-offload-config, "
            "synthesise with --rank-depth, or pick a policy that needs only the top-k"
        )


def _kept(trace: Trace):
    """``(steps, rows)`` int arrays that :func:`compact_trace` keeps."""
    active = trace.req_ids != -1  # [steps, rows]
    keep_rows = np.flatnonzero(active.any(axis=0))
    if keep_rows.size == 0:
        keep_rows = np.arange(1)
    any_active = active.any(axis=1)
    prev_active = np.concatenate([[True], any_active[:-1]])
    return np.flatnonzero(any_active | prev_active), keep_rows  # first idle step of every run


def compact_trace(trace: Trace) -> Trace:
    """The same residency problem without idle work: rows never active are dropped and
    every run of all-idle steps becomes one idle step (one idle step already resets
    every row; stamps only need to be monotone). Every policy's misses are unchanged
    (tested). Returns ``trace`` itself when there is nothing to drop."""
    keep_steps, keep_rows = _kept(trace)
    if keep_rows.size == trace.rows and keep_steps.size == trace.steps:
        return trace
    ix = np.ix_(keep_steps, np.arange(trace.layers), keep_rows)
    ranked = None if trace.ranked is None else trace.ranked[ix]
    return Trace(
        trace.topk[ix],
        trace.seq_lens[np.ix_(keep_steps, keep_rows)],
        trace.req_ids[np.ix_(keep_steps, keep_rows)],
        trace.meta,
        ranked,
    )


def step_schedule(trace: Trace) -> List[np.ndarray]:
    """int64 ``[B_t]`` rows to step at each step: rows active now or at the step before
    (a row going idle must see its idle step, which resets it). Other rows are idle
    at both steps, already reset: stepping them changes nothing."""
    active = trace.req_ids != -1
    before = np.concatenate([np.zeros((1, trace.rows), dtype=bool), active[:-1]], axis=0)
    return [np.flatnonzero(a | b).astype(np.int64) for a, b in zip(active, before)]


def simulate_policy(
    trace: Trace,
    policy: str,
    hot_tokens: int,
    manage_op=residency_manage,
    compact: bool = True,
    manage_impl: str = "torch",
) -> SimResult:
    """Residency decisions only. ``policy`` is a policy name or ``"belady"`` (optimum).

    Steps only the rows of :func:`step_schedule` (rows form) of :func:`compact_trace`
    (``compact=False``: every row of every step, the plain definition).
    ``manage_impl``: as in :func:`~.policies.make_manager` (``auto``: the CPU kernel
    for ``lru``, bit-identical and much faster).
    """
    check_ranked(trace, policy)
    t0 = time.perf_counter()
    if compact:
        trace = compact_trace(trace)
    rows, layers = trace.rows, trace.layers
    if policy == "belady":
        managers = [BeladyManager(rows, hot_tokens) for _ in range(layers)]
        nxt = torch.from_numpy(next_use_table(trace.topk, trace.req_ids))
    else:
        max_pos = int(trace.seq_lens.max()) + 1 if trace.seq_lens.size else 1
        managers = [
            make_manager(policy, rows, hot_tokens, None, manage_op, manage_impl=manage_impl, max_positions=max_pos)
            for _ in range(layers)
        ]
        nxt = None
    ranked_all = torch.from_numpy(trace.ranked) if needs_ranked(policy) and policy != "belady" else None
    misses = torch.zeros(layers, dtype=torch.int64)
    topk_all = torch.from_numpy(trace.topk)
    req_all = torch.from_numpy(trace.req_ids.astype(np.int64))
    len_all = torch.from_numpy(trace.seq_lens.astype(np.int32))
    schedule = step_schedule(trace) if compact else [np.arange(rows, dtype=np.int64)] * trace.steps
    for t in range(trace.steps):
        sel = torch.from_numpy(schedule[t])
        if sel.numel() == 0:
            continue
        full = sel.numel() == rows
        req, lens = (req_all[t], len_all[t]) if full else (req_all[t, sel], len_all[t, sel])
        for layer, mgr in enumerate(managers):
            topk = topk_all[t, layer] if full else topk_all[t, layer, sel]
            if nxt is not None:
                mgr.set_next_use(nxt[t, layer] if full else nxt[t, layer, sel])
            if ranked_all is not None:
                mgr.set_ranked(ranked_all[t, layer] if full else ranked_all[t, layer, sel])
            res = mgr.step(topk, req, lens, t) if full else mgr.step_rows(sel, topk, req, lens, t)
            misses[layer] += res.miss_count.sum()
    return SimResult(policy, hot_tokens, misses.tolist(), time.perf_counter() - t0)
