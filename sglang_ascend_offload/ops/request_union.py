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
* union: int32 ``[G, n * K]``, the request's distinct positions ascending, then ``-1``
  padding (a suffix);
* ranking: int32 ``[G * n, D]`` per row in, ``[G, n * D]`` per request out.

All functions have static output shapes and read nothing on the host, so they trace
under ``torch.compile(fullgraph=True)`` and capture in a device graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RequestUnion", "union_of_rows", "row_slots", "merge_ranked"]

_INT32_MAX = torch.iinfo(torch.int32).max


@dataclass
class RequestUnion:
    """The union of one round's top-k per request, and how each row reads it back.

    positions: int32 ``[G, n*K]``: distinct valid positions, ascending, ``-1`` suffix.
    columns:   int64 ``[G*n, K]``: column of ``positions[g]`` holding row entry
               ``(g*n + i, j)``; ``0`` where the entry is padding (mask with ``valid``).
    valid:     bool ``[G*n, K]``: the row entry is a real position.
    """

    positions: torch.Tensor
    columns: torch.Tensor
    valid: torch.Tensor

    @property
    def rows_per_request(self) -> int:
        return self.columns.shape[0] // self.positions.shape[0]


def _sorted_distinct(values: torch.Tensor) -> torch.Tensor:
    """int32 ``[G, M]``: each row's distinct non-negative values ascending, ``-1`` suffix."""
    big = torch.where(values >= 0, values, torch.full_like(values, _INT32_MAX))
    ordered, _ = torch.sort(big, dim=1)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    ordered = torch.where(repeat, torch.full_like(ordered, _INT32_MAX), ordered)
    ordered, _ = torch.sort(ordered, dim=1)
    return torch.where(ordered == _INT32_MAX, torch.full_like(ordered, -1), ordered)


def union_of_rows(topk: torch.Tensor, rows_per_request: int) -> RequestUnion:
    """The per-request union of row-form ``topk`` int32 ``[G*n, K]`` (``n`` =
    ``rows_per_request``; each row's valid entries distinct, ``-1`` padding).

    With ``n == 1`` the union holds the row's own positions (sorted), so a request's
    lookups are exactly its row's; the order of the union's entries only decides which
    miss takes which victim slot.
    """
    n = int(rows_per_request)
    if topk.dim() != 2 or n < 1 or topk.shape[0] % n:
        raise ValueError(f"topk must be [G * {n}, K], got {tuple(topk.shape)}")
    g, k = topk.shape[0] // n, topk.shape[1]
    topk = topk.to(torch.int32)
    positions = _sorted_distinct(topk.reshape(g, n * k))
    valid = topk >= 0
    # Look each row entry up in its request's sorted union (the -1 suffix sorts last
    # as INT32_MAX, so the sequence is ascending).
    seq = torch.where(positions >= 0, positions, torch.full_like(positions, _INT32_MAX))
    probe = torch.where(valid, topk, torch.zeros_like(topk)).reshape(g, n * k)
    columns = torch.searchsorted(seq.contiguous(), probe.contiguous()).clamp_max(n * k - 1)
    columns = torch.where(valid, columns.reshape(g * n, k), torch.zeros_like(columns.reshape(g * n, k)))
    return RequestUnion(positions=positions, columns=columns, valid=valid)


def row_slots(union: RequestUnion, slots: torch.Tensor) -> torch.Tensor:
    """Each row's remapped top-k: int32 ``[G*n, K]`` slots of the request's hot buffer,
    in the row's own top-k order, ``-1`` for padding; ``slots`` int32 ``[G, n*K]`` is
    the residency step's remap of ``union.positions``."""
    n = union.rows_per_request
    g = union.positions.shape[0]
    k = union.columns.shape[1]
    per_row = torch.gather(slots, 1, union.columns.reshape(g, n * k)).reshape(g * n, k)
    return torch.where(union.valid, per_row, torch.full_like(per_row, -1))


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
