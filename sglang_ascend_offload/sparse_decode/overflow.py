"""The overflow area: the positions a request's hot buffer cannot hold this round.

With speculative verify rows a request's ``n`` rows share one hot buffer of ``H`` slots
per layer, sized as plain decode's (``2 x top-k``), while the union of their top-k may
reach ``n x K``. A round whose union holds more than ``H`` positions cannot keep them
all resident whatever the policy (every slot the union does not select is already
evictable). Such a round is still served exactly:

1. the union is split (``ops/request_union.union_of_rows`` with ``capacity = H``): the
   first ``H`` positions by priority (best column over the rows, then position) are the
   **resident part**, stepped by the residency manager as any union (``W = H`` entries,
   so every policy and implementation runs unchanged); the others (at most
   ``n x K - H``) are the round's **overflow positions**, device data with a count;
2. :func:`copy_lists` writes them as miss lists into the request's rows of the
   **overflow area** (engine row ``r`` owns area rows ``r*X .. r*X + X - 1``), and the
   engine's own copy stage (the plan's ``copy_miss_rows``, whatever its rung) copies
   them host -> area after the step's appends, fresh every round they overflow;
3. :func:`flat_indices` points each overflow entry of a query row at its area row, in
   the same flat index space as the resident entries (``HotBuffers.attention_flat``),
   so one sparse attention reads both, bit for bit the rows attention over the full KV
   gathers. The fused Copy-SFA reads the area as its own ``overflow`` operand instead
   (rows ``R' * H`` on, :func:`beside_copy_sfa`); the copy runs beside it, before it.

Why an area and not a direct gather of the overflowing request's whole top-k: it copies
only what did not fit (a few positions beyond ``H``, instead of ``n x K``), the resident
part keeps its hits, and the residency state advances as in any round.

Why one area for all layers, sized for every request: a layer's overflow is read only
by that layer's attention, and layers run one after another on one stream, so the next
layer's copy into the area is ordered after the previous layer's attention (a copy that
overlapped attention across layers would need two areas). Sizing it for every request at
its worst case (``n x K - H`` rows each) costs one layer's worth, ``(R + 1) x X x D x 2``
bytes (DeepSeek-V3.2 at MTP-3: 4,096 rows x 1,152 B = 4.5 MiB per request, against
274.5 MiB of hot buffer over 61 layers), and needs no bound on how many requests overflow
at once, so no second fallback: nothing can ever be dropped.

Nothing here reads device data on the host: whether a request overflows is its
``overflow_count``, the copy of a row without overflow is a no-op of the copy stage,
shapes are static; the step compiles and captures as before. Counted per layer:
``overflow_rounds`` (requests whose round overflowed) and ``overflow_positions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..ops.contract import ResidencyStep
from ..ops.request_union import RequestUnion

__all__ = ["OverflowView", "beside_copy_sfa", "copy_lists", "flat_indices", "counts", "serve"]


@dataclass
class OverflowView:
    """The overflow area as one layer step reads it.

    area: ``[R', X, D]`` device rows (``HotBuffers.overflow``; ``X`` per engine row).
    kv: ``[S, D]`` the flat view the layer's attention reads (``HotBuffers.attention_flat``;
    ``None`` for the fused Copy-SFA, which reads the area as its own operand).
    base: the flat index of the area's first row (in ``kv``, or after the hot buffer's rows).
    counters: int64 ``[2]`` device view ``(overflow_rounds, overflow_positions)`` of the
    layer's statistics, added to in place (``None``: not counted).
    """

    area: torch.Tensor
    kv: Optional[torch.Tensor]
    base: int
    counters: Optional[torch.Tensor] = None

    @property
    def slots(self) -> int:
        return int(self.area.shape[1])


def beside_copy_sfa(view: OverflowView, hot: torch.Tensor) -> OverflowView:
    """``view`` as the fused Copy-SFA reads the area: its own ``overflow`` operand, rows
    ``R' * H + i`` after the layer's hot buffer ``hot`` ``[R', H, D]`` (the op's ABI,
    ``ops/fused.py``)."""
    return OverflowView(area=view.area, kv=None, base=hot.shape[0] * hot.shape[1], counters=view.counters)


def copy_lists(union: RequestUnion) -> ResidencyStep:
    """The round's overflow positions as miss lists for the copy stage: ``miss_tokens``
    = ``union.overflow`` int32 ``[G, X']``, ``miss_slots`` = ``0 .. X'-1`` (the request's
    area rows in order), ``miss_count`` = ``union.overflow_count``. ``hit_mask`` / ``slots``
    are all-False / the slots (no lookup happens)."""
    positions = union.overflow
    slots = torch.arange(positions.shape[1], dtype=torch.int32, device=positions.device).expand_as(positions)
    slots = torch.where(positions >= 0, slots, torch.full_like(slots, -1))
    return ResidencyStep(
        hit_mask=torch.zeros(positions.shape, dtype=torch.bool, device=positions.device),
        slots=slots,
        miss_count=union.overflow_count,
        miss_tokens=positions,
        miss_slots=slots.contiguous(),
    )


def flat_indices(
    flat: torch.Tensor, union: RequestUnion, token_rows: torch.Tensor, area_slots: int, base: int
) -> torch.Tensor:
    """``flat`` int32 ``[G*n, 1, K]`` (the resident entries' rows, ``-1`` elsewhere) with
    each overflow entry pointed at its area row ``base + token_rows * X + column``
    (``token_rows`` int64 ``[G*n]`` the query rows' engine rows, ``X = area_slots``)."""
    over = union.overflow_entries
    rows = base + token_rows.to(flat.device, torch.int64)[:, None] * area_slots + union.overflow_columns
    return torch.where(over[:, None, :], rows.to(torch.int32)[:, None, :], flat)


def counts(union: RequestUnion) -> torch.Tensor:
    """int64 ``[2]`` device counts of a layer step: requests that overflowed, overflow positions."""
    per_request = union.overflow_count.to(torch.int64)
    return torch.stack([(per_request > 0).sum(), per_request.sum()])


def serve(
    view: OverflowView,
    union: Optional[RequestUnion],
    token_rows: torch.Tensor,
    flat: torch.Tensor,
    copy: Callable[[torch.Tensor, ResidencyStep], None],
) -> torch.Tensor:
    """Serve a layer step's overflow: copy its positions into the area with ``copy(area,
    lists)`` (the engine's copy stage of the batch rows), count them, and return ``flat``
    with the overflow entries pointed at the area (:func:`flat_indices`). A union that
    cannot overflow (``union.overflow is None``) returns ``flat`` unchanged."""
    if union is None or union.overflow is None:
        return flat
    if union.overflow.shape[1] > view.slots:
        raise ValueError(
            f"a round may overflow by {union.overflow.shape[1]} positions per request; the area has "
            f"{view.slots} rows per engine row (sizing.overflow_slots)"
        )
    copy(view.area, copy_lists(union))
    if view.counters is not None:
        view.counters += counts(union)
    return flat_indices(flat, union, token_rows, view.slots, view.base)
