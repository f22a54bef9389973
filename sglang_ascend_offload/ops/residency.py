"""Residency ops, rung ``reference``: ``residency_manage`` and ``copy_miss_rows``.

The residency manager is the reference (torch, vectorised) implementation of the contract.

This module *is* the specification written down in ``docs/residency_contract.md``:
per decode step, layer and decode row it classifies the row's top-k logical
positions into hits (already in the row's hot buffer) and misses (to be copied from
the host pool), assigns victim slots to the misses, and updates recency. The Triton
kernels (``ops=triton``) must reproduce :func:`residency_manage` bit for bit.

State of one layer (device tensors, mutated in place by every call):

=============  ==============  ====================================================
``slot_token``  int32 ``[R,H]``  logical position held by each slot, ``-1`` = empty
``slot_stamp``  int64 ``[R,H]``  recency, larger = more recent, ``0`` for empty
``row_req``     int64 ``[R]``    request owning the row's content, ``-1`` = none
=============  ==============  ====================================================

Inputs of one step: ``topk`` int32 ``[R,K]`` (``-1`` padding, valid entries of a row
distinct), ``req_ids`` int64 ``[R]`` (``-1`` idle), ``stable_len`` int32 ``[R]``
(positions ``>= stable_len`` are never hits), ``step`` (int, monotone, ``>= 0``).
Outputs: :class:`~sglang_ascend_offload.ops.contract.ResidencyStep` (the types live in
``ops/contract.py``; this module implements them).

Exact LRU (``policy="lru"``), per row:

1. reset the row when ``req_ids[r] != row_req[r]`` (idle rows too; an idle row's
   top-k entries are all treated as padding);
2. empty every slot holding a position ``>= stable_len[r]``;
3. entry ``j`` is a hit when a slot holds ``topk[r,j]`` (and it is ``< stable_len``);
4. evictable slots = slots not hit this step, ordered by ``(slot_stamp, slot)``;
   the ``i``-th miss in top-k order takes the ``i``-th evictable slot;
5. filled slots get stamp ``2*step+1``, hit slots ``2*step+2``.

Nothing here loops over tokens in Python: each step is a fixed number of torch
operations over ``[R,H]`` / ``[R,K]`` tensors (a per-row sort + binary search for the
lookup, one partial ``topk`` of width ``K`` for the victim order, gathers and
scatters). Every shape follows from the input shapes and nothing reads device data
on the host (no ``.item()``, ``nonzero``, boolean-mask indexing), so the step is
capturable in a device graph and traceable by ``torch.compile(fullgraph=True)``;
``step`` may be an int or a 0-d int64 tensor (the graph form). This rung is the
specification; the CPU serving path is the kernel of ``cpu_kernel.py`` (tested
against it), the Triton kernels are the device path.

The sub-steps (:func:`reset_rows`, :func:`lookup`, :func:`assign_victims`) are public
so replacement policies other than LRU (``sparse_decode/policies/``) reuse the exact
same mechanism and only supply a different victim order.

The miss copy (:func:`copy_miss_rows`, op ``copy_miss_rows``) writes, for every row
``r`` and ``i < miss_count[r]``, ``hot[r, miss_slots[r,i]] = host[token_table[r,
miss_tokens[r,i]]]`` and nothing else; :func:`copy_miss_rows_rows` is its static-shape
rows form (the engine's graph-capturable path).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .contract import INT64_MAX, Lookup, ResidencyStep, ResidencyTable, implements

__all__ = [
    "residency_manage",
    "copy_miss_rows",
    "copy_miss_rows_rows",
    "reset_rows",
    "lookup",
    "lru_victim_order",
    "position_map",
    "find_slots",
    "assign_victims",
]


# ------------------------------------------------------------------------- sub-steps
def reset_rows(
    table: ResidencyTable, req_ids: torch.Tensor, stable_len: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Contract steps 1-2, in place.

    Returns ``(reset [R] bool, dropped [R,H] bool)``: rows reset because their
    request changed, and slots emptied because they held a speculative position.
    """
    reset = req_ids.to(torch.int64) != table.row_req
    table.slot_token.masked_fill_(reset[:, None], -1)
    table.slot_stamp.masked_fill_(reset[:, None], 0)
    table.row_req.copy_(req_ids.to(torch.int64))
    dropped = table.slot_token >= stable_len.to(torch.int32)[:, None]
    table.slot_token.masked_fill_(dropped, -1)
    table.slot_stamp.masked_fill_(dropped, 0)
    return reset, dropped


def lookup(
    table: ResidencyTable,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    max_position: Optional[int] = None,
) -> Lookup:
    """Contract step 3 (after :func:`reset_rows`): which entries are resident, where.

    Finds each top-k entry among the row's slots with :func:`find_slots` (a dense
    position map when ``max_position`` bounds every position and the map is small
    enough, else a per-row sort and binary search); static shapes either way.
    """
    rows, hot = table.slot_token.shape
    topk64 = topk.to(torch.int64)
    valid = (topk64 != -1) & (req_ids.to(torch.int64) != -1)[:, None]
    found_slot = find_slots(table.slot_token, topk64, max_position)
    hit = valid & (found_slot >= 0) & (topk64 < stable_len.to(torch.int64)[:, None])
    hit_slot = torch.where(hit, found_slot, torch.zeros_like(found_slot))
    slot_hit = _scatter_flags(rows, hot, hit_slot, hit, table.slot_token.device)
    return Lookup(valid=valid, hit=hit, hit_slot=hit_slot, slot_hit=slot_hit)


#: Largest dense position map (elements) :func:`find_slots` builds; beyond it (very
#: long contexts, positions near the int32 limit) it searches sorted rows instead.
DENSE_MAP_LIMIT = 1 << 24


def find_slots(slot_token: torch.Tensor, positions: torch.Tensor, max_position: Optional[int] = None) -> torch.Tensor:
    """int64 ``[R, K]``: the slot of row ``r`` holding ``positions[r, k]``, ``-1`` if none
    (or if the position is negative). ``slot_token`` int ``[R, H]`` with unique
    non-negative entries per row (``-1`` = empty).

    ``max_position`` (static): a bound of every position in both arguments. With it,
    and while the map has at most :data:`DENSE_MAP_LIMIT` elements, a dense map
    (:func:`position_map`); else a per-row sort and binary search (memory bounded
    whatever the positions). Both give the same answer; neither reads data on the host.
    """
    rows, hot = slot_token.shape
    pos = positions.to(torch.int64)
    if pos.numel() == 0 or rows == 0:
        return torch.full(pos.shape, -1, dtype=torch.int64, device=pos.device)
    if max_position is not None and rows * (max_position + 2) <= DENSE_MAP_LIMIT:
        slot_of = position_map(slot_token, max_position + 2)
        found = torch.gather(slot_of, 1, pos.clamp(min=0, max=max_position + 1)).to(torch.int64)
    else:
        keys, order = torch.sort(slot_token.to(torch.int64), dim=1)
        at = torch.searchsorted(keys, pos.contiguous()).clamp(max=max(hot - 1, 0))
        hit = torch.gather(keys, 1, at) == pos
        found = torch.where(hit, torch.gather(order, 1, at), torch.full_like(pos, -1))
    return torch.where(pos >= 0, found, torch.full_like(found, -1))


def position_map(slot_token: torch.Tensor, width: int) -> torch.Tensor:
    """int32 ``[R, width]``: slot holding each position (``-1`` = none); every held
    position must be ``< width - 1`` (the last column is scratch); positions unique
    per row (empty = ``-1``)."""
    rows, hot = slot_token.shape
    tok = slot_token.to(torch.int64)
    slot_of = torch.full((rows, width), -1, dtype=torch.int32, device=slot_token.device)
    col = torch.where(tok >= 0, tok, torch.full_like(tok, width - 1))  # empties -> a scratch column
    slot_of.scatter_(1, col, torch.arange(hot, dtype=torch.int32, device=tok.device).expand(rows, hot))
    slot_of[:, width - 1] = -1
    return slot_of


def lru_victim_order(table: ResidencyTable, look: Lookup) -> torch.Tensor:
    """Contract step 4: int64 ``[R, W]``, the first ``W`` evictable slots of each row by
    ``(stamp, slot)`` ascending, ``W = max(1, K)`` (a row never has more misses; a
    static width, so no host read of the miss counts).

    ``stamp * H + slot`` is a unique key per slot, so a partial ``topk`` gives the
    exact order; hit slots carry ``INT64_MAX`` and can never come first (a row has
    at least as many evictable slots as misses because ``H >= K``).
    """
    hot = table.hot_tokens
    width = min(hot, max(1, look.miss.shape[1]))
    slot = torch.arange(hot, device=table.slot_stamp.device)
    key = (table.slot_stamp * hot + slot).masked_fill(look.slot_hit, INT64_MAX)
    return torch.topk(key, width, dim=1, largest=False, sorted=True).indices


def _stamp_like(like: torch.Tensor, step, add: int) -> torch.Tensor:
    """``2*step + add`` broadcast to ``like`` (``step`` an int or a 0-d tensor; no host read)."""
    if isinstance(step, torch.Tensor):
        return torch.zeros_like(like) + (2 * step.to(like.device, torch.int64) + add)
    return torch.full_like(like, 2 * int(step) + add)


def assign_victims(
    table: ResidencyTable, look: Lookup, victim_order: torch.Tensor, topk: torch.Tensor, step
) -> ResidencyStep:
    """Contract steps 4-5 given a victim order; updates ``table`` in place.

    ``victim_order`` int64 ``[R, W]``: each row's evictable (non-hit) slots in eviction
    order, at least as many as the row has misses (``W <= H``; a full permutation
    with the hit slots last also works). The ``i``-th miss (top-k order) takes
    ``victim_order[r, i]``.
    """
    rows, hot = table.slot_token.shape
    k = topk.shape[1]
    device = table.slot_token.device
    topk64 = topk.to(torch.int64)
    miss = look.miss
    rank = torch.cumsum(miss.to(torch.int64), dim=1) - 1
    victim = torch.gather(victim_order, 1, rank.clamp(min=0))

    # Slot state: misses fill their victims, hits refresh their stamp. A dummy
    # column ``hot`` absorbs the writes of entries that are neither.
    fill_col = torch.where(miss, victim, torch.full_like(victim, hot))
    hit_col = torch.where(look.hit, look.hit_slot, torch.full_like(victim, hot))
    tok_ext = torch.cat([table.slot_token, table.slot_token.new_full((rows, 1), -1)], dim=1)
    tok_ext.scatter_(1, fill_col, topk.to(torch.int32))
    stamp_ext = torch.cat([table.slot_stamp, table.slot_stamp.new_zeros((rows, 1))], dim=1)
    stamp_ext.scatter_(1, fill_col, _stamp_like(fill_col, step, 1))
    stamp_ext.scatter_(1, hit_col, _stamp_like(hit_col, step, 2))
    table.slot_token.copy_(tok_ext[:, :hot])
    table.slot_stamp.copy_(stamp_ext[:, :hot])

    slots = torch.where(look.hit, look.hit_slot, torch.where(miss, victim, torch.full_like(victim, -1)))
    miss_col = torch.where(miss, rank, torch.full_like(rank, k))
    miss_tokens = torch.full((rows, k + 1), -1, dtype=torch.int64, device=device)
    miss_tokens.scatter_(1, miss_col, topk64)
    miss_slots = torch.full((rows, k + 1), -1, dtype=torch.int64, device=device)
    miss_slots.scatter_(1, miss_col, victim)
    return ResidencyStep(
        hit_mask=look.hit.clone(),
        slots=slots.to(torch.int32),
        miss_count=miss.sum(dim=1, dtype=torch.int32),
        miss_tokens=miss_tokens[:, :k].to(torch.int32),
        miss_slots=miss_slots[:, :k].to(torch.int32),
    )


def _scatter_flags(rows: int, hot: int, col: torch.Tensor, mask: torch.Tensor, device) -> torch.Tensor:
    """bool ``[rows, hot]`` with ``True`` at ``(r, col[r,j])`` wherever ``mask[r,j]``."""
    ext = torch.zeros((rows, hot + 1), dtype=torch.bool, device=device)
    ext.scatter_(1, torch.where(mask, col, torch.full_like(col, hot)), True)
    return ext[:, :hot]


# --------------------------------------------------------------------- the contract op
@implements("residency_manage", "reference")
def residency_manage(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step,
) -> ResidencyStep:
    """One exact-LRU step of one layer (op ``residency_manage``, rung ``reference``).

    Mutates ``slot_token`` / ``slot_stamp`` / ``row_req`` in place (the state of
    :class:`~sglang_ascend_offload.ops.contract.ResidencyTable`) and returns the :class:`ResidencyStep` outputs.
    Requires ``H >= K`` and ``step >= 0`` (an int, or a 0-d int64 tensor).
    """
    if slot_token.shape[1] < topk.shape[1]:
        raise ValueError(
            f"hot_tokens {slot_token.shape[1]} < top_k {topk.shape[1]}: "
            "the hot buffer must hold at least one top-k selection per row"
        )
    table = ResidencyTable(slot_token, slot_stamp, row_req)
    reset_rows(table, req_ids, stable_len)
    look = lookup(table, topk, req_ids, stable_len)
    return assign_victims(table, look, lru_victim_order(table, look), topk, step)


# ------------------------------------------------------------------ the miss copy
def copy_miss_rows_rows(
    host: torch.Tensor,
    hot: torch.Tensor,
    rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """Rows form of :func:`copy_miss_rows`, static shapes and no host read (torch).

    hot ``[R', H, D]`` (all engine rows); rows int64 ``[B]`` the engine row of each
    batch entry (real rows distinct); miss lists ``[B, K]`` / ``[B]`` in batch order;
    token_table int32 ``[T, max_ctx]`` indexed by engine row (rows ``>= T`` may only
    name entries without misses, e.g. a padding sink row). Writes, for ``i <
    miss_count[b]``, ``hot[rows[b], miss_slots[b,i]] = host[token_table[rows[b],
    miss_tokens[b,i]]]``; nothing else changes value. Every one of the ``B*K`` entries is
    written (static shape): an entry past ``miss_count`` rewrites the row's last miss
    with the same bytes, a row without misses rewrites its slot 0 with its own
    content. Cost ``O(B*K*D)`` whatever the misses: the graph-capturable form; the
    CPU kernel and the Triton kernel copy only the misses.
    """
    b, k = miss_tokens.shape
    _, hot_tokens, dim = hot.shape
    ctrl = token_table.device
    count = miss_count.to(ctrl, torch.int64)
    rows_c = rows.to(ctrl, torch.int64)
    entry = torch.minimum(torch.arange(k, device=ctrl)[None, :], (count - 1).clamp(min=0)[:, None])
    tokens = miss_tokens.to(ctrl, torch.int64).gather(1, entry).clamp(min=0)
    slots = miss_slots.to(ctrl, torch.int64).gather(1, entry).clamp(min=0)
    table_rows = rows_c.clamp(max=token_table.shape[0] - 1)
    host_slots = token_table[table_rows[:, None], tokens].to(torch.int64)
    has = (count > 0)[:, None].expand(b, k).reshape(-1, 1)
    dest = (rows_c[:, None] * hot_tokens + slots).reshape(-1)
    flat = hot.view(-1, dim)
    dest_dev = dest.to(hot.device)
    staged = host.index_select(0, host_slots.reshape(-1).to(host.device)).to(hot.device, non_blocking=True)
    values = torch.where(has.to(hot.device), staged, flat.index_select(0, dest_dev))
    flat.index_copy_(0, dest_dev, values)


@implements("copy_miss_rows", "reference", rows_form=copy_miss_rows_rows)
def copy_miss_rows(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """Copy the miss rows of one layer from the host pool into the hot buffer.

    host: ``[S, D]`` host rows of this layer (indexed by host slot).
    hot: ``[R, H, D]`` contiguous hot buffer of this layer (device).
    miss_tokens / miss_slots: int32 ``[R, K]`` from the residency step.
    miss_count: int32 ``[R]``. token_table: int32 ``[R, max_ctx]``, logical
    position -> host slot of each row. Bit-exact; returns nothing.
    """
    rows, hot_tokens, dim = hot.shape
    k = miss_tokens.shape[1]
    ctrl = token_table.device
    count = miss_count.to(ctrl, torch.int64)
    take = torch.arange(k, device=ctrl)[None, :] < count[:, None]
    row_of = torch.arange(rows, device=ctrl)[:, None].expand(rows, k)[take]
    tokens = miss_tokens.to(ctrl, torch.int64)[take]
    slots = miss_slots.to(ctrl, torch.int64)[take]
    host_slots = token_table[row_of, tokens].to(torch.int64)
    staged = host.index_select(0, host_slots.to(host.device))
    dest = (row_of * hot_tokens + slots).to(hot.device)
    hot.view(rows * hot_tokens, dim).index_copy_(0, dest, staged.to(hot.device, non_blocking=True))
