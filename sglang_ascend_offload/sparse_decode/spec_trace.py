"""Speculative (MTP) decode traces: rounds of ``n`` verify rows per request.

With NextN / MTP and ``d`` draft tokens, each decode round of a request with
committed length ``L`` verifies ``n = d + 1`` query rows at positions ``L .. L+n-1``
(the last accepted token and the drafts). Row ``j`` attends the KV ``[0, L+j]`` (KV
length ``L + j + 1``) and selects its top-k there; the round then commits ``a``
tokens (``1 <= a <= n``: the accepted drafts plus the target's own token), so the
next round starts at ``L + a``. Positions ``>= L`` hold this round's candidates and
are rewritten when they are rejected.

A :class:`SpecTrace` is recorded from a served NextN / MTP model (``record_trace`` on a
server with speculative decoding: each verify round's rows as the target selected
them, drafts and all, ``sglang_plugin/observability/trace_recorder.py``), or derived
from an ordinary decode :class:`~.trace.Trace` (synthetic or recorded): the selection
of verify row ``j`` at position ``p`` is the base trace's selection for the query at
``p`` (the step whose ``seq_len`` is ``p + 1``), so rows of one round overlap as
adjacent decode steps do (a derived round's drafts are the tokens the model went on
to decode, a recorded round's are the draft model's guesses). Derived acceptance is a
seeded chain: each draft is accepted with probability ``accept_rate`` while every
draft before it was (real MTP's pattern: acceptance falls along the chain).

Arrays (``R`` rounds, ``G`` request rows, ``n`` verify rows per request):

* ``topk`` int32 ``[R, layers, G*n, K]`` (row ``g*n + j``; ``-1`` padding);
* ``committed`` int32 ``[R, G]`` committed length ``L`` at the round (0 idle);
* ``req_ids`` int64 ``[R, G]`` (``-1`` idle);
* ``accepted`` int32 ``[R, G]`` tokens the round commits (0 idle; 0 too for a recorded
  request's last round, whose outcome the recording did not see).

File format (``.npz``, a public contract like the decode trace's; :func:`save_spec_trace`,
:func:`load_spec_trace`): the four arrays above, ``rows_per_request`` (0-d int32) and an
optional ``meta`` (0-d str, JSON). Rules (:func:`validate_spec_trace`): shapes agree, a
live request's rows select positions ``< committed + j + 1`` (row ``j`` sees ``0 .. L +
j``), distinct per row; an idle request (``req_id -1``) has committed 0, accepted 0
and only padding; ``0 <= accepted <= rows_per_request``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple, Union

import numpy as np

from .trace import Trace, TraceError

__all__ = [
    "SpecTrace",
    "speculative_from_trace",
    "accept_lengths",
    "union_sizes",
    "union_sizes_by_layer",
    "save_spec_trace",
    "load_spec_trace",
    "validate_spec_trace",
    "is_spec_trace",
]


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


def _union_counts(spec: SpecTrace) -> np.ndarray:
    """int64 ``[R, layers, G]``: distinct positions of each request's union."""
    n, k = spec.rows_per_request, spec.top_k
    grouped = spec.topk.reshape(spec.rounds, spec.layers, spec.requests, n * k).astype(np.int64)
    grouped = np.where(grouped >= 0, grouped, -1)
    ordered = np.sort(grouped, axis=-1)
    distinct = (ordered >= 0) & np.concatenate(
        [np.ones(ordered.shape[:-1] + (1,), dtype=bool), ordered[..., 1:] != ordered[..., :-1]], axis=-1
    )
    return distinct.sum(axis=-1)


def union_sizes(spec: SpecTrace) -> np.ndarray:
    """int64 ``[samples]``: distinct positions of the union of a request's verify rows'
    top-k, per live (round, layer, request): what one shared hot buffer must hold in
    that round (at most ``rows_per_request x top_k``)."""
    live = spec.req_ids >= 0  # [R, G]
    return _union_counts(spec).transpose(0, 2, 1)[live].reshape(-1)


def union_sizes_by_layer(spec: SpecTrace) -> List[np.ndarray]:
    """:func:`union_sizes` per layer: ``layers`` arrays int64 ``[live (round, request)]``."""
    live = spec.req_ids >= 0
    counts = _union_counts(spec)
    return [counts[:, layer, :][live] for layer in range(spec.layers)]


# ------------------------------------------------------------------ the file
SPEC_KEYS = {"topk": (np.int32, 4), "committed": (np.int32, 2), "req_ids": (np.int64, 2), "accepted": (np.int32, 2)}


def validate_spec_trace(spec: SpecTrace) -> List[str]:
    """Every problem of a speculative trace, as sentences (empty = valid)."""
    arrays = {"topk": spec.topk, "committed": spec.committed, "req_ids": spec.req_ids, "accepted": spec.accepted}
    problems = [
        f"{name} must be {np.dtype(dtype).name} with {ndim} dimensions, got {a.dtype} {a.shape}"
        for name, (dtype, ndim) in SPEC_KEYS.items()
        for a in [arrays[name]]
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim
    ]
    n = int(spec.rows_per_request)
    if n < 1:
        problems.append(f"rows_per_request must be >= 1, got {n}")
    if problems:
        return problems
    rounds, layers, rows, k = spec.topk.shape
    g = spec.committed.shape
    if rows != g[1] * n or spec.req_ids.shape != g or spec.accepted.shape != g or g[0] != rounds:
        return [
            f"shapes disagree: topk {spec.topk.shape} must be [rounds, layers, G x {n}, K] with committed, "
            f"req_ids and accepted [rounds, G], got {g}, {spec.req_ids.shape}, {spec.accepted.shape}"
        ]
    idle = spec.req_ids == -1
    if (spec.req_ids < -1).any():
        problems.append("req_ids < -1 (only -1 marks an idle request)")
    if (idle & ((spec.committed != 0) | (spec.accepted != 0))).any():
        problems.append("an idle request (req_id -1) with committed or accepted != 0")
    if ((spec.accepted < 0) | (spec.accepted > n)).any():
        problems.append(f"accepted outside 0 .. rows_per_request {n}")
    if (spec.topk < -1).any():
        problems.append("top-k entries < -1 (only -1 marks padding)")
    row_idle = np.repeat(idle, n, axis=1)[:, None, :, None]
    if (row_idle & (spec.topk != -1)).any():
        problems.append("top-k entries in an idle request's rows (must be -1)")
    visible = (np.repeat(spec.committed, n, axis=1) + np.tile(np.arange(1, n + 1), g[1]))[:, None, :, None]
    if (~row_idle & (spec.topk >= visible)).any():
        problems.append("a verify row selects a position it cannot see (row j sees positions < committed + j + 1)")
    srt = np.sort(spec.topk, axis=-1)
    if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
        problems.append("a row selects a position twice")
    return problems


def save_spec_trace(spec: SpecTrace, path: Union[str, Path], meta: str = "") -> None:
    """Validate and write ``spec`` (compressed ``.npz``, the format of the module docstring)."""
    problems = validate_spec_trace(spec)
    if problems:
        raise TraceError(problems, "speculative trace to save")
    np.savez_compressed(
        Path(path),
        topk=spec.topk,
        committed=spec.committed,
        req_ids=spec.req_ids,
        accepted=spec.accepted,
        rows_per_request=np.array(spec.rows_per_request, dtype=np.int32),
        meta=np.array(meta or spec.source),
    )


def is_spec_trace(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a speculative trace (an ``.npz`` holding ``committed``)."""
    try:
        with np.load(Path(path), allow_pickle=False) as npz:
            return "committed" in npz.files
    except (OSError, ValueError):
        return False


def load_spec_trace(path: Union[str, Path]) -> SpecTrace:
    """Load and validate a speculative trace; :class:`~.trace.TraceError` lists every problem."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as exc:
        raise TraceError([f"cannot read {path} as .npz: {exc}"], str(path)) from exc
    missing = [key for key in (*SPEC_KEYS, "rows_per_request") if key not in data]
    if missing:
        raise TraceError([f"missing array {key!r}" for key in missing], str(path))
    spec = SpecTrace(
        topk=data["topk"],
        committed=data["committed"],
        req_ids=data["req_ids"],
        accepted=data["accepted"],
        rows_per_request=int(data["rows_per_request"]),
        source=str(data["meta"]) if "meta" in data else str(path),
    )
    problems = validate_spec_trace(spec)
    if problems:
        raise TraceError(problems, str(path))
    return spec
