"""Input generators and the comparison helper for the Triton residency tests.

Everything is small (a few rows, tens of slots) because kernels run through the
Triton interpreter on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from sglang_ascend_offload.ops.contract import ResidencyTable
from sglang_ascend_offload.ops.residency import residency_manage as reference_manage
from sglang_ascend_offload.triton_ops.residency import ResidencyKernelConfig, launch_residency_manage

STEP_FIELDS = ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots")

# Tiles so small that every kernel takes several blocks even on these shapes:
# lookup tiles [next_pow2(K), 1..2], victim blocks of 4 slots, apply blocks of 4 columns.
TINY = ResidencyKernelConfig(lookup_tile=16, max_lookup_block_h=2, victim_block=4, apply_block=4)
DEFAULT = ResidencyKernelConfig()


@dataclass
class StepInput:
    """One step's inputs (contract dtypes)."""

    topk: torch.Tensor  # int32 [R, K]
    req_ids: torch.Tensor  # int64 [R]
    stable_len: torch.Tensor  # int32 [R]
    step: int


def step_input(topk, req_ids, stable_len, step: int) -> StepInput:
    return StepInput(
        torch.as_tensor(topk, dtype=torch.int32),
        torch.as_tensor(req_ids, dtype=torch.int64),
        torch.as_tensor(stable_len, dtype=torch.int32),
        step,
    )


def run_both(
    ref: ResidencyTable, tri: ResidencyTable, inp: StepInput, config: ResidencyKernelConfig = DEFAULT, where: str = ""
):
    """One step on both implementations; asserts identical outputs and state."""
    want = reference_manage(
        ref.slot_token, ref.slot_stamp, ref.row_req, inp.topk, inp.req_ids, inp.stable_len, inp.step
    )
    got = launch_residency_manage(
        tri.slot_token, tri.slot_stamp, tri.row_req, inp.topk, inp.req_ids, inp.stable_len, inp.step, config
    )
    for name in STEP_FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where} {name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"{where} {name} differs:\nreference {a}\ntriton    {b}"
    for name in ("slot_token", "slot_stamp", "row_req"):
        a, b = getattr(ref, name), getattr(tri, name)
        assert torch.equal(a, b), f"{where} state {name} differs:\nreference {a}\ntriton    {b}"
    return want


def random_topk(
    gen: torch.Generator,
    rows: int,
    k: int,
    lo: int,
    hi: int,
    fill: Optional[List[int]] = None,
    shuffle_padding: bool = True,
) -> torch.Tensor:
    """int32 ``[rows, k]``: per row ``fill[r]`` distinct positions from ``[lo, hi)``, rest ``-1``.

    With ``shuffle_padding`` the ``-1`` entries are interleaved with the real ones.
    """
    out = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(rows):
        n = int(torch.randint(0, k + 1, (1,), generator=gen)) if fill is None else fill[r]
        n = min(n, k, hi - lo)
        picks = lo + torch.randperm(hi - lo, generator=gen)[:n]
        row = torch.cat([picks.to(torch.int32), torch.full((k - n,), -1, dtype=torch.int32)])
        if shuffle_padding:
            row = row[torch.randperm(k, generator=gen)]
        out[r] = row
    return out


def drifting_trace(
    gen: torch.Generator,
    rows: int,
    k: int,
    steps: int,
    *,
    churn: float = 0.15,
    idle: float = 0.1,
    spec: float = 0.3,
    window: int = 3,
):
    """A multi-step trace with locality (hits), request churn, idle rows, speculative tails.

    Each row's context grows by one position per step; the top-k mixes positions
    from the previous selection (hits) with fresh ones, ``-1`` padding when the
    context is short. ``stable_len`` sometimes trails the context by a few positions
    (MTP draft tokens), and the top-k then includes some of those positions.
    """
    req = torch.arange(rows, dtype=torch.int64)
    ctx = torch.randint(k // 2, 2 * k, (rows,), generator=gen)
    prev = [torch.empty(0, dtype=torch.int64) for _ in range(rows)]
    next_req = rows
    for step in range(steps):
        topk = torch.full((rows, k), -1, dtype=torch.int32)
        stable = ctx.clone()
        req_now = req.clone()
        for r in range(rows):
            u = float(torch.rand((), generator=gen))
            if u < churn:  # a new request takes the row
                req[r] = next_req
                next_req += 1
                ctx[r] = int(torch.randint(1, 2 * k, (1,), generator=gen))
                prev[r] = torch.empty(0, dtype=torch.int64)
            req_now[r] = req[r]
            if float(torch.rand((), generator=gen)) < idle:
                req_now[r] = -1
            if float(torch.rand((), generator=gen)) < spec:
                stable[r] = max(0, int(ctx[r]) - int(torch.randint(1, window + 1, (1,), generator=gen)))
            n = min(k, int(ctx[r]))
            keep = prev[r][torch.randperm(prev[r].numel(), generator=gen)[: (n * 2) // 3]]
            keep = keep[keep < ctx[r]]
            fresh_pool = torch.randperm(int(ctx[r]), generator=gen)
            fresh = fresh_pool[~torch.isin(fresh_pool, keep)][: n - keep.numel()]
            sel = torch.cat([keep, fresh])
            row = torch.cat([sel.to(torch.int32), torch.full((k - sel.numel(),), -1, dtype=torch.int32)])
            topk[r] = row[torch.randperm(k, generator=gen)]
            prev[r] = sel
            ctx[r] += 1
        yield step_input(topk, req_now, stable.to(torch.int32), step)


def random_state(gen: torch.Generator, rows: int, hot: int, max_pos: int, stamp_values: int) -> ResidencyTable:
    """A valid arbitrary state: distinct positions per row, stamps from a small set
    (many ties), ``0`` exactly on empty slots, some rows unowned. Most rows are
    (nearly) full, so victims come from several stamp groups, not from empty slots."""
    table = ResidencyTable.empty(rows, hot)
    for r in range(rows):
        low = 0 if r == 0 else hot - 2
        filled = int(torch.randint(low, hot + 1, (1,), generator=gen))
        slots = torch.randperm(hot, generator=gen)[:filled]
        table.slot_token[r, slots] = torch.randperm(max_pos, generator=gen)[:filled].to(torch.int32)
        table.slot_stamp[r, slots] = torch.randint(1, stamp_values + 1, (filled,), generator=gen)
        table.row_req[r] = r if r < rows - 1 else -1  # the last row gets reset
    return table
