"""Speculative (MTP) decode traces: rounds of ``n`` verify rows per request.

With NextN / MTP and ``d`` draft tokens, each decode round of a request with
committed length ``L`` verifies ``n = d + 1`` query rows at positions ``L .. L+n-1``
(the last accepted token and the drafts). Row ``j`` attends the KV ``[0, L+j]`` (KV
length ``L + j + 1``) and selects its top-k there; the round then commits ``a``
tokens (``1 <= a <= n``: the accepted drafts plus the target's own token), so the
next round starts at ``L + a``. Positions ``>= L`` hold this round's candidates and
are rewritten when they are rejected.

A :class:`SpecTrace` is derived from an ordinary decode :class:`~.trace.Trace`
(synthetic or recorded): the selection of verify row ``j`` at position ``p`` is the
base trace's selection for the query at ``p`` (the step whose ``seq_len`` is
``p + 1``), so rows of one round overlap as adjacent decode steps do. Acceptance is a
seeded chain: each draft is accepted with probability ``accept_rate`` while every
draft before it was (real MTP's pattern: acceptance falls along the chain).

Arrays (``R`` rounds, ``G`` request rows, ``n`` verify rows per request):

* ``topk`` int32 ``[R, layers, G*n, K]`` (row ``g*n + j``; ``-1`` padding);
* ``committed`` int32 ``[R, G]`` committed length ``L`` at the round (0 idle);
* ``req_ids`` int64 ``[R, G]`` (``-1`` idle);
* ``accepted`` int32 ``[R, G]`` tokens the round commits (0 idle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from .trace import Trace

__all__ = ["SpecTrace", "speculative_from_trace", "accept_lengths", "union_sizes"]


@dataclass
class SpecTrace:
    topk: np.ndarray
    committed: np.ndarray
    req_ids: np.ndarray
    accepted: np.ndarray
    rows_per_request: int
    source: str = ""

    @property
    def rounds(self) -> int:
        return int(self.topk.shape[0])

    @property
    def layers(self) -> int:
        return int(self.topk.shape[1])

    @property
    def requests(self) -> int:
        """Request rows ``G`` (concurrent requests)."""
        return int(self.committed.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk.shape[3])

    @property
    def max_context(self) -> int:
        live = self.req_ids >= 0
        return int((self.committed + self.rows_per_request)[live].max()) if live.any() else 1


def accept_lengths(rng: np.random.Generator, count: int, rows_per_request: int, accept_rate: float) -> np.ndarray:
    """int32 ``[count]``: tokens committed per round, ``1 + `` the accepted prefix of
    ``rows_per_request - 1`` drafts, each accepted with ``accept_rate`` given the ones before."""
    drafts = rows_per_request - 1
    if drafts == 0:
        return np.ones(count, dtype=np.int32)
    ok = rng.random((count, drafts)) < accept_rate
    prefix = np.cumprod(ok, axis=1).sum(axis=1)
    return (1 + prefix).astype(np.int32)


def _segments(trace: Trace, row: int) -> List[Tuple[int, Dict[int, int]]]:
    """The requests of base row ``row`` in order: ``(req_id, {query position: step})``."""
    out: List[Tuple[int, Dict[int, int]]] = []
    current = -1
    for t in range(trace.steps):
        req = int(trace.req_ids[t, row])
        if req == -1:
            current = -1
            continue
        if req != current:
            out.append((req, {}))
            current = req
        out[-1][1][int(trace.seq_lens[t, row]) - 1] = t
    return out


def speculative_from_trace(
    trace: Trace, rows_per_request: int, accept_rate: float = 0.8, seed: int = 0, source: str = ""
) -> SpecTrace:
    """Rounds of ``rows_per_request`` verify rows over ``trace``'s decode positions.

    Each base row is a request row; its requests run one after another. A request ends
    when the base trace has no selection for some position of its next round.
    """
    n = int(rows_per_request)
    if n < 1:
        raise ValueError(f"rows_per_request must be >= 1, got {n}")
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
    rng = np.random.default_rng(seed)
    plans: List[List[Tuple[int, int, List[int], int]]] = []  # per row: (req, L, steps of rows, accepted)
    for row in range(trace.rows):
        plan = []
        for req, at in _segments(trace, row):
            if not at:
                continue
            length = min(at)  # committed length before the first decode query
            while all((length + j) in at for j in range(n)):
                a = int(accept_lengths(rng, 1, n, accept_rate)[0])
                plan.append((req, length, [at[length + j] for j in range(n)], a))
                length += a
        plans.append(plan)
    rounds = max((len(p) for p in plans), default=0)
    g, layers, k = trace.rows, trace.layers, trace.top_k
    topk = np.full((rounds, layers, g * n, k), -1, dtype=np.int32)
    committed = np.zeros((rounds, g), dtype=np.int32)
    req_ids = np.full((rounds, g), -1, dtype=np.int64)
    accepted = np.zeros((rounds, g), dtype=np.int32)
    for row, plan in enumerate(plans):
        for i, (req, length, steps, a) in enumerate(plan):
            committed[i, row], req_ids[i, row], accepted[i, row] = length, req, a
            for j, t in enumerate(steps):
                topk[i, :, row * n + j] = trace.topk[t, :, row]
    return SpecTrace(
        topk=topk, committed=committed, req_ids=req_ids, accepted=accepted, rows_per_request=n, source=source
    )


def union_sizes(spec: SpecTrace) -> np.ndarray:
    """int64 ``[samples]``: distinct positions of the union of a request's verify rows'
    top-k, per live (round, layer, request): what one shared hot buffer must hold in
    that round (at most ``rows_per_request x top_k``)."""
    n, k = spec.rows_per_request, spec.top_k
    live = spec.req_ids >= 0  # [R, G]
    grouped = spec.topk.reshape(spec.rounds, spec.layers, spec.requests, n * k).astype(np.int64)
    grouped = np.where(grouped >= 0, grouped, -1)
    ordered = np.sort(grouped, axis=-1)
    distinct = (ordered >= 0) & np.concatenate(
        [np.ones(ordered.shape[:-1] + (1,), dtype=bool), ordered[..., 1:] != ordered[..., :-1]], axis=-1
    )
    counts = distinct.sum(axis=-1)  # [R, layers, G]
    return counts.transpose(0, 2, 1)[live].reshape(-1)
