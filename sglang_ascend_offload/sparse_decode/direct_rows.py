"""Direct rows: requests served from their own hot buffer with no residency work.

With ``residency = "adaptive"`` (:class:`~.engine.EngineConfig`) a request whose whole
context fits its hot buffer (``context_len <= hot_tokens``) is **direct**: position
``p`` of its context sits in slot ``p`` of its engine row's hot buffer (identity
placement). Its step needs no residency lookup and copies no misses: its top-k
positions *are* its slots. The rows that move host -> device are the request's
context once, the step it turns direct (its prompt and any cached prefix), and each
step's new tokens after they are appended to the host pool. The host pool holds the
whole context as with ``always``, so nothing is lost and the attention reads the same
rows in the same order (bit-identical outputs).

The step a direct request's context outgrows its hot buffer it is **demoted in
place**: one step of the layer's residency manager takes its resident positions as
misses, and the buffer rows are permuted on the device to the slots the manager
assigned (no host read). From then on it is an offloaded request like any other. A
request whose context never fit (a long prompt) is offloaded from its first step. A
request never turns direct again (its context only grows); a new request on the row
starts over.

Positions of a step: the caller states each request's ``context_len`` (the positions
its query rows may read); by default ``stable_len`` for one query row per request (a
decode step's committed length counts the token being decoded) and ``stable_len + n``
for ``n`` verify rows (the committed length plus this step's candidates). Positions
from ``min(stable_len, context_len - 1)`` on are (re)written this step before the
attention: the new token, candidates, any speculative suffix. A direct request's
positions that are not resident yet (all of them the step it turns direct) are copied
into its buffer after each layer's append, so the copy reads what the step wrote.

This module keeps the host-side bookkeeping (which request each row's buffer holds
at identity, and how far) and turns one step's batch into a :class:`DirectStep`: the
device-side row mode (``mask``) and the copy lists. It reads only host metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..ops.contract import ResidencyStep

__all__ = ["DirectRows", "DirectStep", "RESIDENCY_MODES", "context_lengths", "position_map"]

#: ``always``: every request's main KV is read through the residency (hot buffer + LRU);
#: ``adaptive``: requests whose context fits their hot buffer are direct (this module)
RESIDENCY_MODES = ("always", "adaptive")


def context_lengths(stable_len: np.ndarray, rows_per_request: int) -> np.ndarray:
    """The default positions a step reads per request: ``stable_len`` for one query row
    per request, ``stable_len + n`` for ``n`` verify rows (int64)."""
    n = int(rows_per_request)
    return stable_len.astype(np.int64) + (n if n > 1 else 0)


@dataclass
class DirectStep:
    """One step's direct-row work (built on the host at the step's start).

    mask: bool ``[B]`` on the engine device, entry ``b`` is direct this step.
    span_rows: int64 ``[B, S]``: the hot-buffer rows of each entry's span, its own row
    first (position ``p`` of a direct entry lives in row ``span_rows[b, p // H]``, slot
    ``p % H``); unused columns repeat the entry's own row. ``S`` is fixed per engine.
    copy_rows / copy_pos / copy_dst: int64 ``[M]``: token-table row, position and flat
    hot-buffer destination of the host -> device copies of the direct entries' positions
    not resident yet (their whole context the step they turn direct, then the positions
    the step writes), after each layer's append.
    demote_heads: int64 ``[D]`` engine rows whose request is demoted this step (in the
    batch or not: a request whose borrowed row a new request now needs);
    demote_req / demote_stable: int64 ``[D]`` their request and committed length;
    demote_pos: int32 ``[D, H]`` the positions each keeps (its most recent ``<= H``
    resident ones, ``-1`` after) and demote_src int64 ``[D, H]`` their flat hot-buffer
    rows now.
    direct_count: entries served direct; lent_rows: rows lent to spans after the step;
    lent_now: rows newly lent this step; reclaimed: demotions because a lent row was
    needed (host ints). all_direct: every batch entry is direct (no padding entry): the
    eager step can skip the residency manager.

    A captured step (a device graph replays it with static shapes) splits the copies:
    ``copy_*`` then lists only the positions already in the host pool when the step
    begins (the engine copies them, every layer, before the replay), and ``step_pos``
    int64 ``[B, n]`` holds each direct entry's positions written by the step itself
    (``-1``: none), copied inside each layer's captured step after its append.
    """

    mask: torch.Tensor
    span_rows: torch.Tensor
    copy_rows: torch.Tensor
    copy_pos: torch.Tensor
    copy_dst: torch.Tensor
    demote_heads: torch.Tensor
    demote_req: torch.Tensor
    demote_stable: torch.Tensor
    demote_pos: torch.Tensor
    demote_src: torch.Tensor
    direct_count: int
    step_pos: Optional[torch.Tensor] = None
    step_copies: int = 0
    lent_rows: int = 0
    lent_now: int = 0
    reclaimed: int = 0
    all_direct: bool = False
    copy_host: Optional[torch.Tensor] = None  # host slots of the copies (the engine looks them up once)
    # position_map of the step and its rows_per_request (built by the first layer; a steady
    # step takes the previous step's, as its spans are the same)
    _flat_map: Optional[Tuple[int, torch.Tensor]] = None

    @property
    def any_direct(self) -> bool:
        return self.direct_count > 0

    def flat_rows(self, positions: torch.Tensor, hot_tokens: int, rows_per_request: int = 1) -> torch.Tensor:
        """:func:`direct_flat` of ``positions`` int ``[B*n, K]`` for an eager step: one gather
        from the step's :func:`position_map`, built once and shared by every layer. Equal to
        :func:`direct_flat` for every position a direct entry reads (below its span's end);
        a managed entry's larger positions give some row of its last span column, as there
        (a mixed step discards them)."""
        if self._flat_map is None or self._flat_map[0] != rows_per_request:
            self._flat_map = (rows_per_request, position_map(self.span_rows, hot_tokens, rows_per_request))
        flat_map = self._flat_map[1]
        index = (positions.to(torch.int64) + 1).clamp_(max=flat_map.shape[1] - 1)
        return flat_map.gather(1, index)


class DirectRows:
    """Host-side bookkeeping of the direct rows of one engine (all layers share it).

    Per head row ``h`` (the engine row of a direct request): owner (request id, ``-1``
    none), filled (positions ``0 .. filled - 1`` resident), stable (its committed length
    at its last step: resident positions at or past it were candidates), span (the
    hot-buffer rows holding its context, ``h`` first). ``lender[r]``: the head whose
    span holds row ``r`` (``-1``: not lent).

    **Room from idle request slots.** A direct request whose context outgrows its own
    buffer borrows the buffers of request slots SGLang has free (``free_rows``, taken
    from the front of its free list: SGLang hands slots out from the tail, so the front
    is what it hands out last), up to ``max_span`` rows. It
    is demoted when no free slot is left to grow into, and when a new request needs a
    slot it borrowed (*pressure*: the device room of idle slots is gone). A demoted
    request keeps its most recent ``H`` positions in its own buffer and continues under
    the residency; it does not return to direct (that would re-copy its context).
    """

    def __init__(self, state_rows: int, hot_tokens: int):
        self.hot_tokens = int(hot_tokens)
        self.sink = state_rows - 1
        self.owner = np.full((state_rows,), -1, dtype=np.int64)
        self.filled = np.zeros((state_rows,), dtype=np.int64)
        self.stable = np.zeros((state_rows,), dtype=np.int64)
        self.lender = np.full((state_rows,), -1, dtype=np.int64)
        self.span: Dict[int, List[int]] = {}
        self.retired: Dict[int, int] = {}  # head row -> request demoted there (stays managed)
        self.max_span = 1
        self.demotions = 0
        self.lent_total = 0  # rows lent so far
        # when set and returning True, no request is direct this step: the direct ones are
        # demoted in place, new ones start under the residency (tests force demotion with it)
        self.hold: Optional[Callable[[], bool]] = None
        # the steady state: the last step's batch when every live entry of it was direct
        # with nothing lent to a row outside it (:meth:`_steady_step`); None otherwise
        self._steady: Optional[_Steady] = None
        none = torch.zeros((0,), dtype=torch.int64)
        self._no_demotion = dict(
            demote_heads=none,
            demote_req=none,
            demote_stable=none,
            demote_pos=torch.zeros((0, self.hot_tokens), dtype=torch.int32),
            demote_src=torch.zeros((0, self.hot_tokens), dtype=torch.int64),
        )

    # ------------------------------------------------------------------ spans
    def _release(self, head: int) -> None:
        for r in self.span.pop(head, [])[1:]:
            self.lender[r] = -1
        self.owner[head] = -1
        self.filled[head] = 0

    def _position_rows(self, head: int, positions: np.ndarray) -> np.ndarray:
        """Flat hot-buffer rows of ``positions`` of ``head``'s span."""
        span = np.asarray(self.span[head], dtype=np.int64)
        return span[positions // self.hot_tokens] * self.hot_tokens + positions % self.hot_tokens

    def _grow(self, head: int, need: int, lendable: "_Lendable") -> bool:
        """Extend ``head``'s span to ``need`` rows taken from ``lendable``."""
        span = self.span.setdefault(head, [head])
        if need > self.max_span:
            return False
        rows = lendable.take(need - len(span))
        if rows is None:
            return False
        for r in rows:
            self.lender[r] = head
            span.append(r)
        self.lent_total += len(rows)
        return True

    def plan(
        self,
        rows: torch.Tensor,
        req_ids: torch.Tensor,
        stable_len: torch.Tensor,
        context_len,
        device,
        captured_width: int = 0,
        free_rows: Optional[Callable[[], Sequence[int]]] = None,
    ) -> DirectStep:
        """The :class:`DirectStep` of a batch (``rows`` / ``req_ids`` / ``stable_len`` /
        ``context_len`` ``[B]`` as the engine holds them: padding entries on the sink row
        with owner ``-1``; ``context_len`` a tensor or an int64 array) and the bookkeeping
        update. Reads host copies only.
        ``captured_width`` ``n > 0``: the split form of a captured step, where a direct
        entry writes at most ``n`` positions in the step (a ``ValueError`` otherwise).
        ``free_rows``: returns SGLang's list of free request slots (read, never copied,
        unless a span grows; ``None``: none can be borrowed)."""
        lent_before = self.lent_total
        b = _Batch.of(rows, req_ids, stable_len, context_len)
        held_back = self.hold is not None and self.hold()
        on_device = torch.device(device).type != "cpu"

        def dev(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return t.to(device) if on_device else t

        steady = self._steady
        if not held_back and steady is not None and steady.holds(b, self.max_span):
            return self._steady_step(b, steady, captured_width, dev)
        self._steady = None
        free = free_rows() if free_rows is not None else ()
        demote, reclaimed = self._reclaim(b, free)
        direct, resident = self._choose(b, demote, _Lendable(free, self.lender, self.sink), held_back)
        demoted = self._demote(demote)
        span_table = self._span_table(b, direct)
        copies = self._copies(b, direct, resident, captured_width, span_table)
        step_pos, step_copies = _step_positions(b, direct, captured_width)
        n_direct = int(direct.sum())
        lent_rows = int((self.lender >= 0).sum())
        step = DirectStep(
            mask=dev(direct),
            span_rows=dev(span_table),
            copy_rows=dev(copies[0]),
            copy_pos=dev(copies[1]),
            copy_dst=dev(copies[2]),
            **demoted,
            direct_count=n_direct,
            step_pos=None if step_pos is None else dev(step_pos),
            step_copies=step_copies,
            lent_rows=lent_rows,
            lent_now=self.lent_total - lent_before,
            reclaimed=reclaimed,
            all_direct=bool(n_direct == b.rows.size),
        )
        self._steady = _Steady.after(self, b, direct, span_table, step)
        return step

    def _steady_step(self, b: "_Batch", steady: "_Steady", captured_width: int, dev) -> DirectStep:
        """:meth:`plan` of a step in the steady state (:class:`_Steady`): the same
        :class:`DirectStep` the full plan gives, without its reclaim / choose / demote scans.
        Every live entry is direct and held, no span grows or is released, nothing is lent
        or demoted; only the copies of the positions each entry has not got yet are new."""
        direct = b.live
        rows = b.rows[direct]
        resident = np.zeros(b.rows.shape, dtype=np.int64)
        resident[direct] = np.minimum(self.filled[rows], b.rewrite_from[direct])
        copies = self._copies(b, direct, resident, captured_width, steady.span_table)
        step_pos, step_copies = _step_positions(b, direct, captured_width)
        last = steady.last
        step = DirectStep(
            mask=last.mask,
            span_rows=last.span_rows,
            copy_rows=dev(copies[0]),
            copy_pos=dev(copies[1]),
            copy_dst=dev(copies[2]),
            **self._no_demotion,
            direct_count=last.direct_count,
            step_pos=None if step_pos is None else dev(step_pos),
            step_copies=step_copies,
            lent_rows=last.lent_rows,
            lent_now=0,
            reclaimed=0,
            all_direct=last.all_direct,
            _flat_map=last._flat_map,
        )
        steady.last = step
        return step

    def _reclaim(self, b: "_Batch", free: Sequence[int]) -> Tuple[List[int], int]:
        """Give back the borrowed rows of finished requests, then list the direct requests
        whose lent row a live batch entry now holds (pressure). A request is finished when
        its row holds another request in this batch, or is not in the batch and is free
        (``free`` is scanned only for those, which hold borrowed rows: few). Done first,
        so a finished request's rows are lendable again and never count as pressure."""
        batch_req = dict(zip(b.rows[b.live].tolist(), b.req[b.live].tolist()))
        for head in [x for x, span in self.span.items() if len(span) > 1]:
            req = batch_req.get(head)
            if (req is not None and req != self.owner[head]) or (req is None and head in free):
                self._release(head)
                self.retired.pop(head, None)
        heads = self.lender[b.rows[b.live]]
        demote = list(dict.fromkeys(int(h) for h in heads[heads >= 0]))
        return demote, len(demote)

    def _choose(
        self, b: "_Batch", demote: List[int], lendable: "_Lendable", held_back: bool
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Which live entries are direct this step (growing spans from ``lendable``), and
        the positions each already holds; entries that must leave are added to ``demote``.
        ``held_back``: the test switch (:attr:`hold`) holds this step."""
        direct = np.zeros(b.rows.shape, dtype=bool)
        resident = np.zeros(b.rows.shape, dtype=np.int64)
        for i in np.flatnonzero(b.live):
            r, q = int(b.rows[i]), int(b.req[i])
            if r in demote or self.retired.get(r) == q:
                continue  # demoted now (its span is needed), or earlier: under the residency
            held = self.owner[r] == q
            if not held:
                if r in self.span:
                    self._release(r)  # the row's previous request is gone
                self.retired.pop(r, None)
            if held_back:
                if held:
                    demote.append(r)
                continue
            need = -(-int(b.ctx[i]) // self.hot_tokens)
            if need <= len(self.span.setdefault(r, [r])) or self._grow(r, need, lendable):
                direct[i] = True
                resident[i] = min(int(self.filled[r]), int(b.rewrite_from[i])) if held else 0
            elif held:
                demote.append(r)
        for i in np.flatnonzero(b.live & ~direct):  # a managed request stays managed
            r = int(b.rows[i])
            if r in self.span and r not in demote:
                self._release(r)
            if r not in demote:
                self.owner[r] = -1
                self.retired[r] = int(b.req[i])
        return direct, resident

    def _demote(self, demote: List[int]) -> Dict[str, torch.Tensor]:
        """The ``demote_*`` fields: each demoted request keeps its most recent resident
        positions (at most ``H``); its span goes back."""
        h = self.hot_tokens
        heads, reqs, stables, pos, src = [], [], [], [], []
        for head in demote:
            valid = int(min(self.filled[head], self.stable[head]))
            keep = np.arange(max(0, valid - h), valid, dtype=np.int64)
            pos_row, src_row = np.full((h,), -1, dtype=np.int64), np.full((h,), -1, dtype=np.int64)
            pos_row[: keep.size], src_row[: keep.size] = keep, self._position_rows(head, keep)
            heads.append(head)
            reqs.append(int(self.owner[head]))
            stables.append(valid)
            pos.append(pos_row)
            src.append(src_row)
            self.retired[head] = int(self.owner[head])
            self._release(head)
        self.demotions += len(demote)
        if not heads:
            return self._no_demotion
        return dict(
            demote_heads=torch.tensor(heads, dtype=torch.int64),
            demote_req=torch.tensor(reqs, dtype=torch.int64),
            demote_stable=torch.tensor(stables, dtype=torch.int64),
            demote_pos=torch.from_numpy(np.stack(pos)).to(torch.int32),
            demote_src=torch.from_numpy(np.stack(src)),
        )

    def _copies(
        self, b: "_Batch", direct: np.ndarray, resident: np.ndarray, captured_width: int, span_table: np.ndarray
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, positions, flat destinations)`` of the host -> span copies (entry by
        entry, positions ascending; destinations through the step's ``span_table``), and the
        direct requests' bookkeeping update."""
        copy_end = np.maximum(resident, b.rewrite_from) if captured_width else b.ctx
        entries = np.flatnonzero(direct)
        start = resident[entries]
        counts = np.maximum(copy_end[entries] - start, 0)
        if (counts == 1).all():  # the usual decode step: each entry's new token
            entry, pos = entries, start
        else:
            entry = np.repeat(entries, counts)
            pos = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(start - (np.cumsum(counts) - counts), counts)
        h = self.hot_tokens
        dst = span_table[entry, pos // h] * h + pos % h
        heads = b.rows[entries]
        self.owner[heads], self.filled[heads], self.stable[heads] = b.req[entries], b.ctx[entries], b.stable[entries]
        return b.rows[entry], pos, dst

    def _span_table(self, b: "_Batch", direct: np.ndarray) -> np.ndarray:
        """int64 ``[B, max_span]``: each direct entry's span, its own row elsewhere."""
        table = np.repeat(b.rows[:, None], self.max_span, axis=1)
        for i in np.flatnonzero(direct):
            span = self.span.get(int(b.rows[i]), [int(b.rows[i])])
            table[i, : len(span)] = span
        return table


@dataclass
class _Steady:
    """A batch whose next steps need no planning beyond their copies: after a step in
    which every live entry was direct (held at identity, nothing demoted), the same
    batch (rows and requests, in order) at the next step is direct again as long as each
    context still fits its span (``capacity``), provided no row lent to a span belongs to
    a request outside the batch (that request could finish, and only the full plan looks
    for that in SGLang's free list). No live entry's row is lent then: the full plan
    demoted any span holding one, and spans borrow only SGLang's free slots. Its steps
    reuse the mask, span table, counts and position map of the newest one (``last``). Any
    other step runs the full plan, which sets or clears this state again."""

    rows: bytes
    req: bytes
    max_span: int
    capacity: np.ndarray  # int64 [B]: positions each entry's span holds (0 for padding)
    span_table: np.ndarray  # int64 [B, max_span]: the host copy of last.span_rows
    last: DirectStep  # the newest step of this state (nothing writes its tensors)

    @classmethod
    def after(
        cls, rows: "DirectRows", b: "_Batch", direct: np.ndarray, span_table: np.ndarray, step: DirectStep
    ) -> Optional["_Steady"]:
        """The steady state after a fully planned ``step``, or ``None`` if it was not one."""
        if not np.array_equal(direct, b.live):
            return None
        heads = set(b.rows[direct].tolist())
        if any(len(span) > 1 and head not in heads for head, span in rows.span.items()):
            return None
        capacity = np.zeros(b.rows.shape, dtype=np.int64)
        capacity[direct] = [len(rows.span[r]) * rows.hot_tokens for r in b.rows[direct].tolist()]
        return cls(b.rows.tobytes(), b.req.tobytes(), rows.max_span, capacity, span_table, step)

    def holds(self, b: "_Batch", max_span: int) -> bool:
        """Whether the step of batch ``b`` is in this steady state."""
        return (
            max_span == self.max_span
            and b.rows.tobytes() == self.rows
            and b.req.tobytes() == self.req
            and bool((b.ctx <= self.capacity).all())
        )


class _Lendable:
    """The free request slots a span may borrow, in lending order (the front of SGLang's
    free list first), read from ``free`` the first time a span grows in a step: most
    steps grow nothing and never pay for the scan of a list as long as the request slots.
    Skips the sink row, rows out of range and rows lent already."""

    def __init__(self, free: Sequence[int], lender: np.ndarray, sink: int):
        self._free, self._lender, self._sink = free, lender, sink
        self._rows: Optional[List[int]] = None

    def take(self, count: int) -> Optional[List[int]]:
        """``count`` rows to lend (removed from this step's supply), or ``None`` (and none
        taken) when fewer are free."""
        if self._rows is None:
            free = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
            free = free[(free >= 0) & (free < self._sink)]
            self._rows = free[self._lender[free] < 0].tolist()[::-1]  # popped from the end
        if count > len(self._rows):
            return None
        return [self._rows.pop() for _ in range(count)]


@dataclass
class _Batch:
    """Host copies of a step's batch (int64 ``[B]``) and what follows from them."""

    rows: np.ndarray
    req: np.ndarray
    stable: np.ndarray
    ctx: np.ndarray
    rewrite_from: np.ndarray  # positions from here on are (re)written by the step
    live: np.ndarray

    @classmethod
    def of(cls, rows, req_ids, stable_len, context_len) -> "_Batch":
        def host(t):  # a new array: nothing here aliases the caller's tensors
            return (t if isinstance(t, np.ndarray) else t.detach().cpu().numpy()).astype(np.int64)

        req, stable, ctx = host(req_ids), host(stable_len), host(context_len)
        return cls(host(rows), req, stable, ctx, np.maximum(np.minimum(stable, ctx - 1), 0), req >= 0)


def _step_positions(b: _Batch, direct: np.ndarray, width: int) -> Tuple[Optional[np.ndarray], int]:
    """A captured step's ``step_pos`` ``[B, width]`` (the positions each direct entry writes
    in the step, ``-1`` padded) and their count; ``(None, 0)`` for an eager step."""
    if not width:
        return None, 0
    wide = direct & (b.ctx - b.rewrite_from > width)
    if wide.any():
        raise ValueError(
            f"a captured step writes at most {width} positions per entry; entries "
            f"{np.flatnonzero(wide).tolist()} write {(b.ctx - b.rewrite_from)[wide].tolist()}"
        )
    pos = b.rewrite_from[:, None] + np.arange(width, dtype=np.int64)[None, :]
    step = np.where(direct[:, None] & (pos < b.ctx[:, None]), pos, -1)
    return step, int((step >= 0).sum())


def empty_step(batch: int, width: int, device) -> ResidencyStep:
    """A residency step that selected nothing (``[batch, width]``; what a batch of direct
    entries reports)."""
    none = torch.full((batch, width), -1, dtype=torch.int32, device=device)
    return ResidencyStep(
        hit_mask=torch.zeros((batch, width), dtype=torch.bool, device=device),
        slots=none,
        miss_count=torch.zeros((batch,), dtype=torch.int32, device=device),
        miss_tokens=none,
        miss_slots=none,
    )


def span_width(table_width: int, hot_tokens: int) -> int:
    """Columns of :attr:`DirectStep.span_rows`: the hot buffers a context as long as the
    token table allows spans."""
    return max(1, -(-int(table_width) // int(hot_tokens)))


def direct_flat(
    span_rows: torch.Tensor, positions: torch.Tensor, hot_tokens: int, rows_per_request: int = 1
) -> torch.Tensor:
    """Flat hot-buffer rows (int32, like ``positions`` ``[B*n, K]``; ``-1`` stays ``-1``) of
    direct entries' positions through their spans (``span_rows`` ``[B, S]``). Static shapes."""
    spans = span_rows.repeat_interleave(int(rows_per_request), 0) if rows_per_request > 1 else span_rows
    pos = positions.to(torch.int64)
    col = (pos.clamp(min=0) // hot_tokens).clamp(max=spans.shape[1] - 1)
    flat = spans.gather(1, col) * hot_tokens + pos.clamp(min=0) % hot_tokens
    return torch.where(pos >= 0, flat, torch.full_like(flat, -1)).to(torch.int32)


def position_map(span_rows: torch.Tensor, hot_tokens: int, rows_per_request: int = 1) -> torch.Tensor:
    """int32 ``[B*n, S*H + 1]``: column ``p + 1`` of query row ``i`` holds the flat
    hot-buffer row of position ``p`` through the span of its entry (``span_rows``
    ``[B, S]``, ``n`` query rows per entry), column 0 holds ``-1``. So a gather at
    ``positions + 1`` is :func:`direct_flat` (``-1`` stays ``-1``) for every position below
    ``S*H``, which covers every span (:meth:`DirectStep.flat_rows`)."""
    h = int(hot_tokens)
    spans = span_rows.repeat_interleave(int(rows_per_request), 0) if rows_per_request > 1 else span_rows
    flat = (spans[:, :, None] * h + torch.arange(h, device=spans.device)).reshape(spans.shape[0], -1)
    return torch.cat((flat.new_full((flat.shape[0], 1), -1), flat), dim=1).to(torch.int32)


def masked_step(mask: torch.Tensor, topk: torch.Tensor, req_ids: torch.Tensor, rows_per_request: int):
    """What the residency manager sees of a step with direct entries (``mask`` bool
    ``[B]``): ``(query_mask [B*n], topk [B*n, K], req_ids [B])`` with the direct
    entries idle (no owner, no selection). Static shapes."""
    n = int(rows_per_request)
    query_mask = mask.repeat_interleave(n) if n > 1 else mask
    managed = torch.where(query_mask[:, None], torch.full_like(topk, -1), topk)
    owners = torch.where(mask, torch.full_like(req_ids, -1), req_ids)
    return query_mask, managed, owners


def copy_step_positions(
    host: torch.Tensor,
    hot: torch.Tensor,
    rows: torch.Tensor,
    step_pos: torch.Tensor,
    token_table: torch.Tensor,
    span_rows: torch.Tensor,
) -> None:
    """``hot[flat(p)] = host[token_table[rows[b], p]]`` for every ``p = step_pos[b, i] >= 0``
    (host ``[S, D]``, hot ``[R', H, D]`` with the sink row last, rows int64 ``[B]``,
    step_pos int64 ``[B, n]``, ``flat`` through the entry's span ``span_rows`` ``[B, S]``).
    Static shapes: an unused entry rewrites the sink row's slot 0, which nothing reads."""
    h = hot.shape[1]
    valid = step_pos >= 0
    pos = step_pos.clamp(min=0)
    row = rows[:, None].expand_as(step_pos)
    table_row = torch.where(valid, row, torch.zeros_like(row))  # the sink row has no token-table row
    host_slots = token_table[table_row.to(token_table.device), pos.to(token_table.device)].to(torch.int64)
    col = (pos // h).clamp(max=span_rows.shape[1] - 1)
    dst_row = torch.where(valid, span_rows.gather(1, col), torch.full_like(pos, hot.shape[0] - 1))
    dst_slot = torch.where(valid, pos % h, torch.zeros_like(pos))
    values = host.index_select(0, host_slots.reshape(-1).to(host.device)).to(hot.device)
    hot.index_put_((dst_row.reshape(-1).to(hot.device), dst_slot.reshape(-1).to(hot.device)), values)
