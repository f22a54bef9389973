"""Decode rows that churn between requests: the row model of the fused-op scenarios.

One home for the part the kernel functional check (:mod:`.functional`) and the fused-op
tests (``tests/ops/fused_scenario.py``) share: ``rows`` decode rows; each step a row
may start a request (unless it stays idle), end its request (churn, or the request
reached ``max_len``) and start another or go idle, or grow by one token. Every request
owns fixed index-K cache blocks and fixed host-pool slots (one per position), so the
same positions come back across steps (hits) while new ones keep arriving (misses).

The callers draw their own values (indexer keys and queries, host rows) from the same
generator; the row model draws only at the documented points, in this order:
construction (block and host-slot permutations), :meth:`DecodeRows.advance` (one draw
per row, one more when a row's request ends, plus :meth:`new_request`'s draws),
:meth:`DecodeRows.token_order` (one permutation), :meth:`DecodeRows.row_state` (one
draw per active row: is its last position still speculative?).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

__all__ = ["RowRequest", "StepLayout", "DecodeRows"]


@dataclass
class RowRequest:
    """A request on a decode row: ``length`` positions, its index-K ``blocks`` in order,
    ``host_slots`` int32 ``[max_len]`` (the host-pool slot of each position) and whatever
    the caller drew for it (``extra``)."""

    rid: int
    length: int
    blocks: List[int]
    host_slots: torch.Tensor
    extra: Any = None


@dataclass
class StepLayout:
    """TND layout of one step's query tokens: one token per active row in ``order``, then
    ``padding`` tokens of no row.

    token_rows int32 ``[T]`` (``-1`` for padding); block_table int32 ``[B, max_blocks]``;
    kv_len int32 ``[B]``; cu int32 ``[B]`` cumulative query lengths (``B = max(1, active)``;
    with no active row one empty request).
    """

    token_rows: torch.Tensor
    block_table: torch.Tensor
    kv_len: torch.Tensor
    cu: torch.Tensor


class DecodeRows:
    """``rows`` decode rows over ``n_blocks`` index-K blocks and ``host_slots`` host slots.

    draw_length(gen) -> int: a new request's length; draw_extra(gen) (optional): drawn
    after it, kept in :attr:`RowRequest.extra`; first_rid: the first request id is
    ``first_rid + 1``.
    """

    def __init__(
        self,
        gen: torch.Generator,
        *,
        rows: int,
        max_len: int,
        block_size: int,
        n_blocks: int,
        host_slots: int,
        churn: float,
        idle: float,
        spec: float,
        draw_length: Callable[[torch.Generator], int],
        draw_extra: Optional[Callable[[torch.Generator], Any]] = None,
        first_rid: int = 0,
    ):
        self.gen = gen
        self.num_rows, self.max_len, self.block_size = rows, max_len, block_size
        self.blocks_per_request = -(-max_len // block_size)
        self.churn, self.idle, self.spec = churn, idle, spec
        self.draw_length, self.draw_extra = draw_length, draw_extra
        self.free_blocks = torch.randperm(n_blocks, generator=gen).tolist()
        self.free_host = torch.randperm(host_slots, generator=gen).tolist()
        self.rows: List[Optional[RowRequest]] = [None] * rows
        self.next_rid = first_rid

    def rand(self) -> float:
        return float(torch.rand((), generator=self.gen))

    def new_request(self) -> RowRequest:
        blocks = [self.free_blocks.pop() for _ in range(self.blocks_per_request)]
        slots = torch.tensor([self.free_host.pop() for _ in range(self.max_len)], dtype=torch.int32)
        length = int(self.draw_length(self.gen))
        extra = self.draw_extra(self.gen) if self.draw_extra is not None else None
        self.next_rid += 1
        return RowRequest(self.next_rid, length, blocks, slots, extra)

    def release(self, req: RowRequest) -> None:
        self.free_blocks.extend(req.blocks)
        self.free_host.extend(req.host_slots.tolist())

    def advance(self) -> None:
        """Move every row one step on (module docstring)."""
        for r in range(self.num_rows):
            req = self.rows[r]
            u = self.rand()
            if req is None:
                if u > self.idle:
                    self.rows[r] = self.new_request()
            elif u < self.churn or req.length >= self.max_len:
                self.release(req)
                self.rows[r] = None if self.rand() < self.idle else self.new_request()
            else:
                req.length += 1

    def token_order(self) -> List[int]:
        """The active rows in a random order: the rows of the step's query tokens."""
        active = [r for r in range(self.num_rows) if self.rows[r] is not None]
        return [active[i] for i in torch.randperm(len(active), generator=self.gen).tolist()]

    def layout(self, order: List[int], padding_tokens: int) -> StepLayout:
        """The step's token layout for ``order`` (no draws)."""
        n_real = len(order)
        b = max(n_real, 1)
        block_table = torch.zeros(b, self.blocks_per_request, dtype=torch.int32)
        kv_len = torch.zeros(b, dtype=torch.int32)
        for t, r in enumerate(order):
            block_table[t] = torch.tensor(self.rows[r].blocks, dtype=torch.int32)
            kv_len[t] = self.rows[r].length
        cu = torch.arange(1, b + 1, dtype=torch.int32) if n_real else torch.zeros(1, dtype=torch.int32)
        token_rows = torch.tensor(order + [-1] * padding_tokens, dtype=torch.int32)
        return StepLayout(token_rows=token_rows, block_table=block_table, kv_len=kv_len, cu=cu)

    def row_state(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(req_ids int64 [R] (-1 idle), stable_len int32 [R], token_table int32 [R, max_len])``;
        a row's last position stays speculative (outside ``stable_len``) with probability ``spec``."""
        req_ids = torch.full((self.num_rows,), -1, dtype=torch.int64)
        stable = torch.zeros(self.num_rows, dtype=torch.int32)
        token_table = torch.zeros(self.num_rows, self.max_len, dtype=torch.int32)
        for r in range(self.num_rows):
            req = self.rows[r]
            if req is None:
                continue
            req_ids[r] = req.rid
            stable[r] = req.length - (1 if self.rand() < self.spec else 0)
            token_table[r] = req.host_slots
        return req_ids, stable, token_table
