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
from typing import Optional

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
    copy_rows / copy_pos: int64 ``[M]`` (engine row, position) pairs copied host -> hot
    buffer at identity after each layer's append: the direct entries' positions not
    resident yet (their whole context the step they turn direct, then the positions
    the step writes).
    demote_entries: int64 ``[D]`` batch entries demoted this step; demote_counts: int64
    ``[D]`` the positions ``0 .. count - 1`` each has resident (valid) at identity.
    direct_count: entries served direct (host int).

    A captured step (a device graph replays it with static shapes) splits the copies:
    ``copy_*`` then lists only the positions already in the host pool when the step
    begins (the engine copies them, every layer, before the replay), and ``step_pos``
    int64 ``[B, n]`` holds each direct entry's positions written by the step itself
    (``-1``: none), copied inside each layer's captured step after its append.
    """

    mask: torch.Tensor
    copy_rows: torch.Tensor
    copy_pos: torch.Tensor
    demote_entries: torch.Tensor
    demote_counts: torch.Tensor
    direct_count: int
    step_pos: Optional[torch.Tensor] = None
    step_copies: int = 0

    @property
    def any_direct(self) -> bool:
        return self.direct_count > 0


class DirectRows:
    """Host-side bookkeeping of the direct rows of one engine (all layers share it).

    owner int64 ``[R']``: the request id whose context the row's hot buffer holds at
    identity (``-1``: none); filled int64 ``[R']``: how many positions (``0 ..
    filled - 1``) it holds, of which those below the next step's committed length are
    still valid (later ones were candidates that may have been rejected).
    """

    def __init__(self, state_rows: int, hot_tokens: int):
        self.hot_tokens = int(hot_tokens)
        self.owner = np.full((state_rows,), -1, dtype=np.int64)
        self.filled = np.zeros((state_rows,), dtype=np.int64)
        self.demotions = 0

    def plan(self, rows: torch.Tensor, req_ids: torch.Tensor, stable_len: torch.Tensor,
             context_len: torch.Tensor, device, captured_width: int = 0) -> DirectStep:
        """The :class:`DirectStep` of a batch (``rows`` / ``req_ids`` / ``stable_len`` /
        ``context_len`` ``[B]`` as the engine holds them: padding entries on the sink row
        with owner ``-1``) and the bookkeeping update. Reads host copies only.
        ``captured_width`` ``n > 0``: the split form of a captured step, where a direct
        entry writes at most ``n`` positions in the step (a ``ValueError`` otherwise)."""
        rows_np = rows.detach().cpu().numpy().astype(np.int64)
        req_np = req_ids.detach().cpu().numpy().astype(np.int64)
        ctx = context_len.detach().cpu().numpy().astype(np.int64)
        stable = stable_len.detach().cpu().numpy().astype(np.int64)
        rewrite_from = np.maximum(np.minimum(stable, ctx - 1), 0)  # (re)written by this step
        live = req_np >= 0
        direct = live & (ctx <= self.hot_tokens)
        held = live & (self.owner[rows_np] == req_np)  # the row's buffer holds this request
        demote = held & ~direct
        resident = np.where(held, np.minimum(self.filled[rows_np], rewrite_from), 0)

        copy_rows, copy_pos = [], []
        # the copies before the step: all of them, or (captured) what the host pool holds already
        copy_end = np.maximum(resident, rewrite_from) if captured_width else ctx
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
        for b in np.flatnonzero(direct):
            copy_rows.append(np.full(copy_end[b] - resident[b], rows_np[b], dtype=np.int64))
            copy_pos.append(np.arange(resident[b], copy_end[b], dtype=np.int64))
        demote_entries = np.flatnonzero(demote)

        # bookkeeping: direct rows hold their context; every other batch row holds none
        self.owner[rows_np[live & ~direct]] = -1
        self.owner[rows_np[direct]] = req_np[direct]
        self.filled[rows_np[direct]] = ctx[direct]
        self.demotions += int(demote_entries.size)

        def cat(parts):
            return torch.from_numpy(np.concatenate(parts) if parts else np.zeros((0,), dtype=np.int64)).to(device)

        return DirectStep(
            mask=torch.from_numpy(direct).to(device), copy_rows=cat(copy_rows), copy_pos=cat(copy_pos),
            demote_entries=torch.from_numpy(demote_entries.astype(np.int64)).to(device),
            demote_counts=torch.from_numpy(resident[demote_entries].astype(np.int64)),
            direct_count=int(direct.sum()), step_pos=step_pos, step_copies=step_copies)

    def forget(self, row: Optional[int] = None) -> None:
        """Drop what a row's (or every row's) buffer holds: the next step refills it."""
        if row is None:
            self.owner[:] = -1
            self.filled[:] = 0
        else:
            self.owner[row] = -1
            self.filled[row] = 0


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
                        token_table: torch.Tensor) -> None:
    """``hot[rows[b], p] = host[token_table[rows[b], p]]`` for every ``p = step_pos[b, i] >= 0``
    (host ``[S, D]``, hot ``[R', H, D]`` with the sink row last, rows int64 ``[B]``,
    step_pos int64 ``[B, n]``). Static shapes: an unused entry rewrites the sink row's
    slot 0, which nothing reads."""
    h = hot.shape[1]
    valid = step_pos >= 0
    pos = step_pos.clamp(min=0)
    row = rows[:, None].expand_as(step_pos)
    table_row = torch.where(valid, row, torch.zeros_like(row))  # the sink row has no token-table row
    host_slots = token_table[table_row.to(token_table.device), pos.to(token_table.device)].to(torch.int64)
    sink = torch.full_like(pos, (hot.shape[0] - 1) * h)
    dst = torch.where(valid, row * h + pos, sink).reshape(-1)
    values = host.index_select(0, host_slots.reshape(-1).to(host.device)).to(hot.device)
    hot.view(-1, hot.shape[-1]).index_copy_(0, dst.to(hot.device), values)


def adoption_topk(counts: torch.Tensor, hot_tokens: int) -> torch.Tensor:
    """int32 ``[D, H]``: positions ``0 .. counts[d] - 1`` of each demoted entry, ``-1``
    after: the top-k of the manager step that adopts a demoted row's resident context."""
    cols = torch.arange(hot_tokens, dtype=torch.int64)[None, :]
    return torch.where(cols < counts[:, None], cols, torch.full_like(cols, -1)).to(torch.int32)
