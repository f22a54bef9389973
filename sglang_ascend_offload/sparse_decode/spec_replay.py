"""Replay a speculative trace through the engine in the per-row or per-request design.

* ``per_row``: each verify row is an engine row of its own (``g*n + j``) with its own
  hot buffer of ``hot_tokens`` slots and its own residency (the design before a
  request's rows shared one);
* ``per_request``: the request is the engine row (``rows_per_request = n``); its
  rows share one hot buffer and residency, looked up with the union of their top-k.

Both use the request's committed length as every row's stable prefix. Each round the
verify forward's candidate rows (positions ``L .. L+n-1``) are written to the host
pool with fresh content (a rejected position is rewritten next round), through the
engine's append. After every layer step the replay checks, bit for bit, that every
occupied slot holds its host row and that each row's attention equals the same op
over the full host KV with its logical top-k (which also proves every remapped index).

:func:`opt_misses` is Belady's optimum for the same lookups and capacity: a lookup of
a candidate position that the round rejects is a distinct item (its content is
discarded), one it accepts is the position itself (the content stays).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from ..ops.contract import ResidencyTable
from .belady import belady_misses
from .engine import EngineConfig, SparseDecodeEngine
from .host_pool import HostKVPool, HostPoolShape
from .policies import DEFAULT_POLICY, needs_ranked
from .replay import _SlotAllocator
from .spec_trace import SpecTrace
from .stats import DecodeStats
from .verify import full_kv_attention, resident_mismatches

__all__ = ["DESIGNS", "SpecReplayResult", "replay_speculative", "opt_misses"]

DESIGNS = ("per_row", "per_request")
_MAX_FAILURES = 10


@dataclass
class SpecReplayResult:
    design: str
    hot_tokens: int
    stats: DecodeStats
    rounds: int
    verified: bool
    checks: int
    failures: List[str] = field(default_factory=list)
    wall_s: float = 0.0


def _engine_rows(design: str, active: np.ndarray, n: int) -> np.ndarray:
    if design == "per_request":
        return active.astype(np.int64)
    return (active[:, None] * n + np.arange(n)[None, :]).reshape(-1).astype(np.int64)


def replay_speculative(
    spec: SpecTrace,
    design: str,
    hot_tokens: int,
    *,
    policy: str = DEFAULT_POLICY,
    ops: str = "auto",
    heads: int = 4,
    latent_dim: int = 512,
    rope_dim: int = 64,
    seed: int = 0,
    verify: bool = True,
    progress: Optional[Callable[[int, int], None]] = None,
) -> SpecReplayResult:
    """Replay ``spec`` in ``design`` (see the module docstring) with random KV content."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    if needs_ranked(policy):
        raise ValueError(f"policy {policy!r} needs a ranking; speculative traces carry top-k only")
    t0 = time.perf_counter()
    n, g, layers, k = spec.rows_per_request, spec.requests, spec.layers, spec.top_k
    per_request = design == "per_request"
    engine_rows = g if per_request else g * n
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    max_ctx = spec.max_context
    live_tokens = int(np.where(spec.req_ids >= 0, spec.committed + n, 0).sum(axis=1).max(initial=1))
    capacity = max(1, live_tokens)
    pool = HostKVPool.allocate(HostPoolShape(layers, capacity, latent_dim, rope_dim), "pinned")
    cfg = EngineConfig(
        layers=layers,
        rows=engine_rows,
        hot_tokens=hot_tokens,
        top_k=k,
        latent_dim=latent_dim,
        rope_dim=rope_dim,
        policy=policy,
        ops=ops,
        max_context=max_ctx,
        rows_per_request=n if per_request else 1,
    )
    engine = SparseDecodeEngine(cfg, pool)
    row_dim = cfg.row_dim
    scale = 1.0 / float(row_dim) ** 0.5
    alloc = _SlotAllocator(capacity, rng)
    table = torch.zeros((engine_rows, max_ctx), dtype=torch.int32)
    seen: Dict[int, bool] = {}
    failures: List[str] = []
    checks = 0
    rounds = 0

    def rand_rows(count: int) -> torch.Tensor:
        return torch.randn((layers, count, row_dim), generator=gen).to(cfg.dtype)

    for r in range(spec.rounds):
        active = np.flatnonzero(spec.req_ids[r] >= 0)
        alloc.release_missing({int(spec.req_ids[r, i]) for i in active})
        for req in [q for q in seen if q not in alloc.tables]:
            del seen[req]
        if active.size == 0:
            continue
        rounds += 1
        candidate_slots = _grow_round(spec, r, active, design, alloc, seen, pool, table, rand_rows)
        rows = torch.from_numpy(_engine_rows(design, active, n))
        reqs = torch.from_numpy(spec.req_ids[r, active].astype(np.int64))
        stable = torch.from_numpy(spec.committed[r, active].astype(np.int32))
        if not per_request:
            reqs, stable = reqs.repeat_interleave(n), stable.repeat_interleave(n)
        engine.begin_step(reqs, table, stable, step=r, rows=rows)
        query_rows = torch.from_numpy(_engine_rows("per_row", active, n))
        row_table = table.index_select(0, query_rows // n if per_request else query_rows)
        new_rows = rand_rows(len(candidate_slots))
        cand = torch.tensor(candidate_slots, dtype=torch.int64)
        for layer in range(layers):
            engine.append(layer, cand, new_rows[layer])
            topk = torch.from_numpy(spec.topk[r, layer][query_rows.numpy()])
            query = torch.randn((topk.shape[0], heads, latent_dim), generator=gen).to(cfg.dtype)
            query_rope = torch.randn((topk.shape[0], heads, rope_dim), generator=gen).to(cfg.dtype)
            result = engine.run_layer(layer, topk, query, query_rope, scale)
            if not verify:
                continue
            checks += 1
            for problem in _verify_round_layer(
                engine, pool, layer, rows, table, row_table, topk, result, query, query_rope, scale
            ):
                _fail(failures, f"round {r} layer {layer}: {problem}")
        if progress is not None:
            progress(r + 1, spec.rounds)
    return SpecReplayResult(
        design=design,
        hot_tokens=hot_tokens,
        stats=engine.stats(),
        rounds=rounds,
        verified=verify and not failures,
        checks=checks,
        failures=failures,
        wall_s=time.perf_counter() - t0,
    )


def _fail(failures: List[str], msg: str) -> None:
    if len(failures) < _MAX_FAILURES:
        failures.append(msg)


def _lookup_items(spec: SpecTrace) -> np.ndarray:
    """int64 ``[R, layers, G*n, K]``: each row entry as a cache item for the optimum:
    the position, or a fresh id for a candidate position the round rejects."""
    n = spec.rows_per_request
    committed = np.repeat(spec.committed, n, axis=1)[:, None, :, None]
    kept = np.repeat(spec.committed + spec.accepted, n, axis=1)[:, None, :, None]
    items = spec.topk.astype(np.int64)
    rejected = (items >= committed) & (items >= kept)
    fresh = (np.int64(1) << 32) + np.arange(items.size, dtype=np.int64).reshape(items.shape)
    return np.where(rejected, fresh, items)


def opt_misses(spec: SpecTrace, design: str, hot_tokens: int) -> int:
    """Belady's misses for ``design`` at ``hot_tokens`` slots per engine row."""
    items = _lookup_items(spec)
    n = spec.rows_per_request
    if design == "per_row":
        return belady_misses(items, np.repeat(spec.req_ids, n, axis=1), hot_tokens)
    rounds, layers, _, k = items.shape
    g = spec.requests
    union = np.full((rounds, layers, g, n * k), -1, dtype=np.int64)
    for layer in range(layers):
        for r in range(rounds):
            grouped = items[r, layer].reshape(g, n * k)
            for i in range(g):
                u = np.unique(grouped[i][grouped[i] >= 0])
                union[r, layer, i, : u.size] = u
    return belady_misses(union, spec.req_ids, hot_tokens)


def _grow_round(
    spec: SpecTrace,
    r: int,
    active: np.ndarray,
    design: str,
    alloc: "_SlotAllocator",
    seen: Dict[int, bool],
    pool: HostKVPool,
    table: torch.Tensor,
    rand_rows: Callable[[int], torch.Tensor],
) -> List[int]:
    """Round ``r``'s requests grow by their ``n`` candidate tokens (a new request's prompt
    is written to the host pool as prefill would) and their engine rows of ``table`` get
    their host slots. Returns the candidate slots appended this round, in request order."""
    n = spec.rows_per_request
    candidate_slots: List[int] = []
    for i in active:
        req, length = int(spec.req_ids[r, i]), int(spec.committed[r, i])
        alloc.grow(req, length + n)
        slots = alloc.tables[req]
        if req not in seen and length > 0:  # the prompt arrives by prefill
            prompt = torch.tensor(slots[:length], dtype=torch.int64)
            for layer, data in enumerate(rand_rows(prompt.numel())):
                pool.write_rows(layer, prompt, data)
        seen[req] = True
        candidate_slots.extend(slots[length : length + n])
        own = torch.tensor(slots, dtype=torch.int32)
        for row in _engine_rows(design, np.array([i]), n):
            table[row].zero_()
            table[row, : own.numel()] = own
    return candidate_slots


def _verify_round_layer(
    engine: SparseDecodeEngine,
    pool: HostKVPool,
    layer: int,
    rows: torch.Tensor,
    table: torch.Tensor,
    row_table: torch.Tensor,
    topk: torch.Tensor,
    result,
    query: torch.Tensor,
    query_rope: torch.Tensor,
    scale: float,
) -> List[str]:
    """What is wrong with one layer step of the engine ``rows``: resident slots that differ
    from their host rows, an output that differs from the full-KV reference bit for bit."""
    problems = []
    full = engine.table(layer)  # the rows stepped now (others may name released host slots)
    state = ResidencyTable(full.slot_token[rows], full.slot_stamp[rows], full.row_req[rows])
    bad = resident_mismatches(state, engine.hot.layer(layer)[rows], pool.layer(layer), table[rows])
    if bad:
        problems.append(f"{bad} resident slots differ from their host rows")
    ref = full_kv_attention(engine._attention_op, pool, layer, topk, row_table, query, query_rope, scale)
    if not torch.equal(result.output.cpu(), ref):
        problems.append("attention differs from the full-KV reference")
    return problems
