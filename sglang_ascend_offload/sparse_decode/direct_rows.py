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
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np
import torch

__all__ = ["DirectRows", "DirectStep", "RESIDENCY_MODES", "context_lengths"]

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
    needed (host ints).

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

    @property
    def any_direct(self) -> bool:
        return self.direct_count > 0


class DirectRows:
    """Host-side bookkeeping of the direct rows of one engine (all layers share it).

    Per head row ``h`` (the engine row of a direct request): owner (request id, ``-1``
    none), filled (positions ``0 .. filled - 1`` resident), stable (its committed length
    at its last step: resident positions at or past it were candidates), span (the
    hot-buffer rows holding its context, ``h`` first). ``lender[r]``: the head whose
    span holds row ``r`` (``-1``: not lent).

    **Room from idle request slots.** A direct request whose context outgrows its own
    buffer borrows the buffers of request slots SGLang has free (``free_rows``, taken
    from the end of its free list, the last it hands out), up to ``max_span`` rows. It
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

    def _grow(self, head: int, need: int, borrowable: List[int]) -> bool:
        """Extend ``head``'s span to ``need`` rows from ``borrowable`` (popped from its end)."""
        span = self.span.setdefault(head, [head])
        if need > self.max_span or need - len(span) > len(borrowable):
            return False
        while len(span) < need:
            r = borrowable.pop()
            self.lender[r] = head
            span.append(r)
            self.lent_total += 1
        return True

    def plan(self, rows: torch.Tensor, req_ids: torch.Tensor, stable_len: torch.Tensor,
             context_len: torch.Tensor, device, captured_width: int = 0,
             free_rows: Optional[Callable[[], Iterable[int]]] = None) -> DirectStep:
        """The :class:`DirectStep` of a batch (``rows`` / ``req_ids`` / ``stable_len`` /
        ``context_len`` ``[B]`` as the engine holds them: padding entries on the sink row
        with owner ``-1``) and the bookkeeping update. Reads host copies only.
        ``captured_width`` ``n > 0``: the split form of a captured step, where a direct
        entry writes at most ``n`` positions in the step (a ``ValueError`` otherwise).
        ``free_rows``: returns the request slots free now (called only where spans exist
        or a context outgrows its own buffer; ``None``: none can be borrowed)."""
        h = self.hot_tokens
        lent_before = self.lent_total
        rows_np = rows.detach().cpu().numpy().astype(np.int64)
        req_np = req_ids.detach().cpu().numpy().astype(np.int64)
        ctx = context_len.detach().cpu().numpy().astype(np.int64)
        stable = stable_len.detach().cpu().numpy().astype(np.int64)
        rewrite_from = np.maximum(np.minimum(stable, ctx - 1), 0)  # (re)written by this step
        live = req_np >= 0
        # the free rows, read only where spans exist or a context outgrows its own buffer
        wants_room = bool((self.lender >= 0).any()) or bool((live & (ctx > h)).any())
        free = [int(r) for r in free_rows() if 0 <= r < self.sink] if free_rows is not None and wants_room else []
        free_set = set(free)

        # requests that finished (their head row is free again) give their spans back
        for head in [x for x in self.span if x in free_set]:
            self._release(head)
            self.retired.pop(head, None)
        demote: List[int] = []  # heads demoted this step
        reclaimed = 0
        # a live batch row lent to another request's span: that request is demoted (pressure)
        for r in rows_np[live]:
            head = int(self.lender[r])
            if head >= 0 and head not in demote:
                demote.append(head)
                reclaimed += 1
        borrowable = [r for r in free if self.lender[r] < 0 and r != self.sink]

        direct = np.zeros(rows_np.shape, dtype=bool)
        resident = np.zeros(rows_np.shape, dtype=np.int64)
        for b in np.flatnonzero(live):
            r, q = int(rows_np[b]), int(req_np[b])
            if r in demote:
                continue  # its span is needed by another request: demoted below
            held = self.owner[r] == q
            if self.retired.get(r) == q:
                continue  # demoted earlier: stays under the residency
            if not held:
                if r in self.span:
                    self._release(r)  # the row's previous request is gone
                self.retired.pop(r, None)
            need = -(-int(ctx[b]) // h)
            if need <= len(self.span.setdefault(r, [r])) or self._grow(r, need, borrowable):
                direct[b] = True
                resident[b] = min(int(self.filled[r]), int(rewrite_from[b])) if held else 0
            elif held:
                demote.append(r)

        # demotions: keep the most recent resident positions, give the span back
        d_heads, d_req, d_stable, d_pos, d_src = [], [], [], [], []
        for head in demote:
            valid = int(min(self.filled[head], self.stable[head]))
            keep = np.arange(max(0, valid - h), valid, dtype=np.int64)
            pos_row = np.full((h,), -1, dtype=np.int64)
            src_row = np.full((h,), -1, dtype=np.int64)
            pos_row[: keep.size] = keep
            src_row[: keep.size] = self._position_rows(head, keep)
            d_heads.append(head)
            d_req.append(int(self.owner[head]))
            d_stable.append(valid)
            d_pos.append(pos_row)
            d_src.append(src_row)
            self.retired[head] = int(self.owner[head])
            self._release(head)
        self.demotions += len(demote)

        # copies into the direct entries' spans
        copy_end = np.maximum(resident, rewrite_from) if captured_width else ctx
        copy_rows, copy_pos, copy_dst = [], [], []
        for b in np.flatnonzero(direct):
            r = int(rows_np[b])
            pos = np.arange(resident[b], copy_end[b], dtype=np.int64)
            copy_rows.append(np.full(pos.size, r, dtype=np.int64))
            copy_pos.append(pos)
            copy_dst.append(self._position_rows(r, pos))
            self.owner[r], self.filled[r], self.stable[r] = req_np[b], ctx[b], stable[b]
        for b in np.flatnonzero(live & ~direct):  # a managed request's row holds no direct context
            r = int(rows_np[b])
            if r in self.span:
                self._release(r)
            self.owner[r] = -1

        width = self.max_span
        span_np = np.repeat(rows_np[:, None], width, axis=1)
        for b in np.flatnonzero(direct):
            span = self.span.get(int(rows_np[b]), [int(rows_np[b])])
            span_np[b, : len(span)] = span
        step_pos, step_copies = None, 0
        if captured_width:
            wide = direct & (ctx - rewrite_from > captured_width)
            if wide.any():
                raise ValueError(f"a captured step writes at most {captured_width} positions per entry; entries "
                                 f"{np.flatnonzero(wide).tolist()} write {(ctx - rewrite_from)[wide].tolist()}")
            cols = np.arange(captured_width, dtype=np.int64)[None, :]
            pos = rewrite_from[:, None] + cols
            step_np = np.where(direct[:, None] & (pos < ctx[:, None]), pos, -1)
            step_pos = torch.from_numpy(step_np).to(device)
            step_copies = int((step_np >= 0).sum())

        def cat(parts):
            return torch.from_numpy(np.concatenate(parts) if parts else np.zeros((0,), dtype=np.int64)).to(device)

        def stack(parts, cols):
            return torch.from_numpy(np.stack(parts) if parts else np.zeros((0, cols), dtype=np.int64))

        return DirectStep(
            mask=torch.from_numpy(direct).to(device), span_rows=torch.from_numpy(span_np).to(device),
            copy_rows=cat(copy_rows), copy_pos=cat(copy_pos), copy_dst=cat(copy_dst),
            demote_heads=torch.tensor(d_heads, dtype=torch.int64), demote_req=torch.tensor(d_req, dtype=torch.int64),
            demote_stable=torch.tensor(d_stable, dtype=torch.int64), demote_pos=stack(d_pos, h).to(torch.int32),
            demote_src=stack(d_src, h), direct_count=int(direct.sum()), step_pos=step_pos,
            step_copies=step_copies, lent_rows=int((self.lender >= 0).sum()), lent_now=self.lent_total - lent_before,
            reclaimed=reclaimed)

    def forget(self) -> None:
        """Drop what every row holds: the next step refills the direct requests."""
        for head in list(self.span):
            self._release(head)
        self.owner[:] = -1
        self.filled[:] = 0
        self.retired.clear()


def span_width(table_width: int, hot_tokens: int) -> int:
    """Columns of :attr:`DirectStep.span_rows`: the hot buffers a context as long as the
    token table allows spans."""
    return max(1, -(-int(table_width) // int(hot_tokens)))


def direct_flat(span_rows: torch.Tensor, positions: torch.Tensor, hot_tokens: int,
                rows_per_request: int = 1) -> torch.Tensor:
    """Flat hot-buffer rows (int32, like ``positions`` ``[B*n, K]``; ``-1`` stays ``-1``) of
    direct entries' positions through their spans (``span_rows`` ``[B, S]``). Static shapes."""
    spans = span_rows.repeat_interleave(int(rows_per_request), 0) if rows_per_request > 1 else span_rows
    pos = positions.to(torch.int64)
    col = (pos.clamp(min=0) // hot_tokens).clamp(max=spans.shape[1] - 1)
    flat = spans.gather(1, col) * hot_tokens + pos.clamp(min=0) % hot_tokens
    return torch.where(pos >= 0, flat, torch.full_like(flat, -1)).to(torch.int32)


def masked_step(mask: torch.Tensor, topk: torch.Tensor, req_ids: torch.Tensor, rows_per_request: int):
    """What the residency manager sees of a step with direct entries (``mask`` bool
    ``[B]``): ``(query_mask [B*n], topk [B*n, K], req_ids [B])`` with the direct
    entries idle (no owner, no selection). Static shapes."""
    n = int(rows_per_request)
    query_mask = mask.repeat_interleave(n) if n > 1 else mask
    managed = torch.where(query_mask[:, None], torch.full_like(topk, -1), topk)
    owners = torch.where(mask, torch.full_like(req_ids, -1), req_ids)
    return query_mask, managed, owners


def copy_step_positions(host: torch.Tensor, hot: torch.Tensor, rows: torch.Tensor, step_pos: torch.Tensor,
                        token_table: torch.Tensor, span_rows: torch.Tensor) -> None:
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
    flat = span_rows.gather(1, col) * h + pos % h
    sink = torch.full_like(pos, (hot.shape[0] - 1) * h)
    dst = torch.where(valid, flat, sink).reshape(-1)
    values = host.index_select(0, host_slots.reshape(-1).to(host.device)).to(hot.device)
    hot.view(-1, hot.shape[-1]).index_copy_(0, dst.to(hot.device), values)
