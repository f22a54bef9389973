"""One residency per request: the union of a request's query rows' top-k.

With speculative decoding (NextN / MTP) a request has ``n`` query rows per decode
round (the verify rows: the last accepted token and ``n - 1`` drafts). They select
nearly the same positions, so they share one hot buffer and one residency state per
layer: the residency manager runs once per request on the **union** of its rows'
top-k, where a position selected by several rows is one lookup (one hit, or one miss
copied once), and each row's remapped indices are read back from the union's slots in
the order of its own top-k.

The functions here are the whole difference between the per-row and the per-request
design; every residency policy and implementation (torch reference, CPU kernel,
Triton) runs unchanged on the union, so the contract's rules carry over: a slot that
any row of the request selects this round is a hit or a fill, never a victim, and a
position at or beyond the committed length is never a hit.

Shapes (``G`` requests, ``n`` rows per request, ``K`` top-k, ``D`` ranking depth):

* row form: int32 ``[G * n, K]``, request-major (rows ``g * n .. g * n + n - 1`` are
  request ``g``'s), ``-1`` padding anywhere;
* union: int32 ``[G, W]``, the request's distinct (resident) positions ascending, then
  ``-1`` padding (a suffix); ``W = n * K`` without overflow;
* ranking: int32 ``[G * n, D]`` per row in, ``[G, n * D]`` per request out.

**Overflow** (``capacity``: the request's hot slots ``H`` when ``H < n * K``). A round
whose union holds more than ``H`` positions cannot keep them all resident, however the
slots are chosen (every slot the union does not select is evictable, so ``H`` is the
most one round can hold). The union is then split:

* the **resident part**, ``W = min(n * K, H)`` positions, is what the residency step sees
  (so ``W <= H`` and every policy and implementation runs unchanged): the union's
  positions in priority order, the first ``W`` of them, where the priority of a position
  is the best (lowest) column it has in any of the request's rows, ties by position
  (the order :func:`merge_ranked` gives: a position some row ranks high comes first);
* the **overflow**, the rest (at most ``n * K - H`` positions), which is served for this
  round only from a separate area (``sparse_decode/overflow.py``): never resident,
  never a hit, gathered from the host pool every round it overflows.

With ``capacity >= n * K`` (or ``None``) there is no overflow and the union is exactly
the one without a capacity. Whether a request overflows is data on the device (its
``overflow_count``), never a host branch.

All functions have static output shapes and read nothing on the host, so they trace
under ``torch.compile(fullgraph=True)`` and capture in a device graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["RequestUnion", "union_of_rows", "row_slots", "merge_ranked"]

_INT32_MAX = torch.iinfo(torch.int32).max


@dataclass
class RequestUnion:
    """The union of one round's top-k per request, and how each row reads it back.

    positions: int32 ``[G, W]``: the resident part, distinct valid positions ascending,
               ``-1`` suffix (``W = n*K``, or ``min(n*K, capacity)``).
    columns:   int64 ``[G*n, K]``: column of ``positions[g]`` holding row entry
               ``(g*n + i, j)``; ``0`` where the entry is not resident (mask with ``resident``).
    valid:     bool ``[G*n, K]``: the row entry is a real position.
    resident:  bool ``[G*n, K]``: the entry's position is in ``positions`` (``valid``
               without overflow; ``None`` means ``valid``).
    overflow:  int32 ``[G, X]``: the positions that did not fit, ascending, ``-1`` suffix
               (``X = n*K - W``; ``None`` without a capacity below ``n*K``).
    overflow_columns: int64 ``[G*n, K]``: column of ``overflow[g]`` holding the entry;
               ``0`` where the entry is not an overflow entry (``valid & ~resident``).
    overflow_count: int32 ``[G]``: overflow positions per request (device data).
    """

    positions: torch.Tensor
    columns: torch.Tensor
    valid: torch.Tensor
    resident: Optional[torch.Tensor] = None
    overflow: Optional[torch.Tensor] = None
    overflow_columns: Optional[torch.Tensor] = None
    overflow_count: Optional[torch.Tensor] = None

    @property
    def rows_per_request(self) -> int:
        return self.columns.shape[0] // self.positions.shape[0]

    @property
    def resident_entries(self) -> torch.Tensor:
        """bool ``[G*n, K]``: entries read from the hot buffer."""
        return self.valid if self.resident is None else self.resident

    @property
    def overflow_slots(self) -> int:
        """``X``: overflow columns per request (0: this union cannot overflow)."""
        return 0 if self.overflow is None else int(self.overflow.shape[1])

    @property
    def overflow_entries(self) -> torch.Tensor:
        """bool ``[G*n, K]``: entries served from the overflow area this round."""
        if self.resident is None:
            return torch.zeros_like(self.valid)
        return self.valid & ~self.resident


def _sorted_distinct(values: torch.Tensor) -> torch.Tensor:
    """int32 ``[G, M]``: each row's distinct non-negative values ascending, ``-1`` suffix."""
    big = torch.where(values >= 0, values, torch.full_like(values, _INT32_MAX))
    ordered, _ = torch.sort(big, dim=1)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    ordered = torch.where(repeat, torch.full_like(ordered, _INT32_MAX), ordered)
    ordered, _ = torch.sort(ordered, dim=1)
    return torch.where(ordered == _INT32_MAX, torch.full_like(ordered, -1), ordered)


def union_of_rows(topk: torch.Tensor, rows_per_request: int, capacity: Optional[int] = None) -> RequestUnion:
    """The per-request union of row-form ``topk`` int32 ``[G*n, K]`` (``n`` =
    ``rows_per_request``; each row's valid entries distinct, ``-1`` padding).

    With ``n == 1`` the union holds the row's own positions (sorted), so a request's
    lookups are exactly its row's; the order of the union's entries only decides which
    miss takes which victim slot. ``capacity`` (the request's hot slots, ``>= K``): with
    ``capacity < n * K`` the union keeps its first ``capacity`` positions by priority and
    the rest overflow (module docstring); else there is no overflow.
    """
    n = int(rows_per_request)
    if topk.dim() != 2 or n < 1 or topk.shape[0] % n:
        raise ValueError(f"topk must be [G * {n}, K], got {tuple(topk.shape)}")
    g, k = topk.shape[0] // n, topk.shape[1]
    if capacity is not None and int(capacity) < k:
        raise ValueError(f"capacity {capacity} < top-k {k}: one row's selection must fit a request's hot buffer")
    topk = topk.to(torch.int32)
    valid = topk >= 0
    if capacity is None or int(capacity) >= n * k:
        positions = _sorted_distinct(topk.reshape(g, n * k))
        return RequestUnion(positions=positions, columns=_columns_in(positions, topk, valid, n), valid=valid)
    resident_pos, overflow_pos = _split_by_priority(topk.reshape(g, n * k), k, int(capacity))
    columns = _columns_in(resident_pos, topk, valid, n)
    resident = valid & (torch.gather(resident_pos, 1, columns.reshape(g, n * k)).reshape(g * n, k) == topk)
    columns = torch.where(resident, columns, torch.zeros_like(columns))
    over = valid & ~resident
    overflow_columns = _columns_in(overflow_pos, topk, over, n)
    return RequestUnion(
        positions=resident_pos,
        columns=columns,
        valid=valid,
        resident=resident,
        overflow=overflow_pos,
        overflow_columns=overflow_columns,
        overflow_count=(overflow_pos >= 0).sum(dim=1, dtype=torch.int32),
    )


def _columns_in(seq: torch.Tensor, topk: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[G*n, K]``: column of each masked row entry in its request's ascending
    ``seq`` int32 ``[G, M]`` (``-1`` suffix); ``0`` elsewhere (and where ``M == 0``)."""
    g, m = seq.shape
    k = topk.shape[1]
    if m == 0:
        return torch.zeros((g * n, k), dtype=torch.int64, device=topk.device)
    # the -1 suffix sorts last as INT32_MAX, so the sequence is ascending
    keys = torch.where(seq >= 0, seq, torch.full_like(seq, _INT32_MAX))
    probe = torch.where(mask, topk, torch.zeros_like(topk)).reshape(g, n * k)
    columns = torch.searchsorted(keys.contiguous(), probe.contiguous()).clamp_max(m - 1).reshape(g * n, k)
    return torch.where(mask, columns, torch.zeros_like(columns))


def _split_by_priority(flat: torch.Tensor, k: int, capacity: int):
    """``(resident [G, capacity], overflow [G, n*K - capacity])`` int32, each ascending
    with a ``-1`` suffix, from a request's entries ``flat`` int32 ``[G, n*K]`` (row-major,
    ``-1`` padding): distinct positions ordered by (best column over the rows, position),
    the first ``capacity`` resident, the rest overflow."""
    g, width = flat.shape
    never = torch.iinfo(torch.int64).max
    column = torch.arange(k, dtype=torch.int64, device=flat.device).repeat(width // k).expand(g, -1)
    pos = flat.to(torch.int64)
    # each position's best column: sort by (position, column), the first of a run wins
    by_position, _ = torch.sort(torch.where(pos >= 0, (pos << 20) | column, torch.full_like(pos, never)), dim=1)
    p = by_position >> 20
    first = torch.ones_like(by_position, dtype=torch.bool)
    first[:, 1:] = p[:, 1:] != p[:, :-1]
    keep = first & (by_position != never)
    best = by_position & ((1 << 20) - 1)
    by_priority, _ = torch.sort(torch.where(keep, (best << 32) | p, torch.full_like(p, never)), dim=1)
    ranked = torch.where(by_priority == never, torch.full_like(by_priority, -1), by_priority & ((1 << 32) - 1))
    return _ascending(ranked[:, :capacity]), _ascending(ranked[:, capacity:])


def _ascending(positions: torch.Tensor) -> torch.Tensor:
    """int32 ``[G, M]``: ``positions`` (int64, ``-1`` padding, distinct) ascending, ``-1`` suffix."""
    big = torch.where(positions >= 0, positions, torch.full_like(positions, _INT32_MAX))
    ordered, _ = torch.sort(big, dim=1)
    return torch.where(ordered == _INT32_MAX, torch.full_like(ordered, -1), ordered).to(torch.int32)


def row_slots(union: RequestUnion, slots: torch.Tensor) -> torch.Tensor:
    """Each row's remapped top-k: int32 ``[G*n, K]`` slots of the request's hot buffer,
    in the row's own top-k order, ``-1`` for padding and for overflow entries; ``slots``
    int32 ``[G, W]`` is the residency step's remap of ``union.positions``."""
    n = union.rows_per_request
    g = union.positions.shape[0]
    k = union.columns.shape[1]
    per_row = torch.gather(slots, 1, union.columns.reshape(g, n * k)).reshape(g * n, k)
    return torch.where(union.resident_entries, per_row, torch.full_like(per_row, -1))


def merge_ranked(ranked: torch.Tensor, rows_per_request: int) -> torch.Tensor:
    """A request's ranking from its rows' rankings: int32 ``[G, n*D]`` from ``[G*n, D]``.

    Each distinct position takes its best (lowest) column over the request's rows and
    the positions are ordered by that column, ties by position; ``-1`` suffix. A
    position in some row's top-k (column ``< K``) therefore comes before every position
    that no row selects, so the first entries are the union as a set, as a score
    policy's ``ranked`` input requires.
    """
    n = int(rows_per_request)
    if ranked.dim() != 2 or n < 1 or ranked.shape[0] % n:
        raise ValueError(f"ranked must be [G * {n}, D], got {tuple(ranked.shape)}")
    g, d = ranked.shape[0] // n, ranked.shape[1]
    ranked = ranked.to(torch.int64).reshape(g, n * d)
    column = torch.arange(d, dtype=torch.int64, device=ranked.device).repeat(n).expand(g, -1)
    invalid = ranked < 0
    never = torch.iinfo(torch.int64).max
    # Best column of each position: sort by (position, column); the first of a run wins.
    by_position = torch.where(invalid, torch.full_like(ranked, never), (ranked << 20) | column)
    by_position, _ = torch.sort(by_position, dim=1)
    pos = by_position >> 20
    first = torch.ones_like(by_position, dtype=torch.bool)
    first[:, 1:] = pos[:, 1:] != pos[:, :-1]
    keep = first & (by_position != never)
    # Then order the kept positions by (column, position).
    col = by_position & ((1 << 20) - 1)
    by_column = torch.where(keep, (col << 32) | pos, torch.full_like(by_position, never))
    by_column, _ = torch.sort(by_column, dim=1)
    out = torch.where(by_column == never, torch.full_like(by_column, -1), by_column & ((1 << 32) - 1))
    return out.to(torch.int32)
