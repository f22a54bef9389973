"""``score_rank`` and ``score_rank_smooth``: score-aware eviction from the indexer's own ranking.

Besides the top-k the step supplies ``ranked`` int32 ``[R, D]`` (``D >= K``), the row's
positions in descending indexer-score order (:meth:`ScoreRankManager.set_ranked`, the
trace's ``ranked`` array). Among the non-hit slots, victims go by their position's
current rank: positions not in the first ``D`` (and empty slots) first, then the lowest
ranked; ties (all unranked ones) by recency ``(slot_stamp, slot)``. With ``D == K`` it
*is* LRU. No persistent state beyond the contract's: the ranks are this step's.
``score_rank_smooth`` evicts by a per-slot exponential average of the rank instead
(:class:`SmoothScoreRankManager`).

Implementations of ``score_rank``, chosen per manager by ``impl``: ``"torch"`` (the
reference below; on the Triton rung the four-launch kernel of
``triton_ops/score_rank.py``) or ``"kernel"``, the compiled CPU kernel of
:mod:`..score_kernel`, stepping the same state tensors in place (so :meth:`state` is
the reference's, bit for bit). The kernel is never built behind the caller's back: a
missing library raises
:class:`~sglang_ascend_offload.sparse_decode.score_kernel.ScoreKernelUnavailable`
naming ``scripts/setup_cpu_env.sh``. ``score_rank_smooth`` has no kernel.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from ...ops.contract import INT64_MAX, ResidencyStep
from ...ops.residency import find_slots, residency_manage
from .base import STAMP_BITS, RankedManager, slot_flags

__all__ = ["RankedInputError", "slot_ranks", "ScoreRankManager", "SmoothScoreRankManager"]


class RankedInputError(ValueError):
    """A score-aware policy stepped without the indexer's ranking (``ranked``)."""


def slot_ranks(slot_token: torch.Tensor, ranked: torch.Tensor, stable_len: torch.Tensor) -> torch.Tensor:
    """int64 ``[R,H]``: rank (column of ``ranked``) of each slot's position, ``D`` when the
    position is not in the row's first ``D`` ranked positions (or the slot is empty).

    ``slot_token`` int32 ``[R,H]`` (unique per row, ``-1`` empty), ``ranked`` int ``[R,D]``
    (``-1`` padding), ``stable_len`` int ``[R]`` (ranked positions ``>= stable_len`` are
    ignored: such slots were emptied). Static shapes, no host read.
    """
    rows, hot = slot_token.shape
    depth = ranked.shape[1]
    pos = ranked.to(torch.int64)
    pos = torch.where(pos < stable_len.to(torch.int64)[:, None], pos, torch.full_like(pos, -1))
    found = find_slots(slot_token, pos)  # [R,D] slot holding ranked[r,j], -1 if none
    col = torch.where(found >= 0, found, torch.full_like(found, hot))
    out = torch.full((rows, hot + 1), depth, dtype=torch.int64, device=slot_token.device)
    out.scatter_(1, col, torch.arange(depth, dtype=torch.int64, device=slot_token.device).expand(rows, depth))
    return out[:, :hot]


def load_score_kernel() -> None:
    """Load the score-aware CPU kernel; ``ScoreKernelUnavailable`` (naming the setup script)
    when it is not built. Never builds: the library comes from ``scripts/setup_cpu_env.sh``."""
    from ..score_kernel import library

    library()


def score_kernel_step_rows(
    manager, rows, topk, req_ids, stable_len, step, guard=None, seed: int = 0, slack_shift: Optional[int] = None
) -> ResidencyStep:
    """One step of ``manager``'s rows on the score-aware CPU kernel, in place on its table
    (and on ``guard``, the guarded policy's ghost table and counters)."""
    from ..score_kernel import score_rank_manage_rows

    t = manager.table
    out = score_rank_manage_rows(
        t.slot_token,
        t.slot_stamp,
        t.row_req,
        rows.to(torch.int64).contiguous(),
        topk.to(torch.int32).contiguous(),
        req_ids.to(torch.int64).contiguous(),
        stable_len.to(torch.int32).contiguous(),
        manager.ranked_for(topk).to(torch.int32).contiguous(),
        int(step),
        guard,
        seed,
        slack_shift,
    )
    return ResidencyStep(*out)


class ScoreRankManager(RankedManager):
    """Score-aware victims (see module docstring). Call :meth:`set_ranked` with the
    step's ranking before :meth:`step` / :meth:`step_rows` (a static buffer updated in
    place also works: the tensor is read at every step).

    ``smooth_shift`` (class attribute; ``None`` = off): keep per slot an exponential
    average of its rank (fixed point, ``avg += (rank - avg) >> smooth_shift`` each
    step, a fill starts at its rank) and evict by that average instead of the current
    rank: one noisy step below the cut does not doom a position that ranked well for
    a while. Extra state ``slot_rank_avg`` int64 ``[R,H]`` when on.
    """

    policy = "score_rank"
    needs_ranked: ClassVar[bool] = True
    has_cpu_kernel: ClassVar[bool] = True
    has_triton_kernel: ClassVar[bool] = True
    smooth_shift: ClassVar[Optional[int]] = None
    _FIX = 4  # fixed-point fraction bits of the rank average

    def __init__(self, rows, hot_tokens, device=None, manage_op=residency_manage, **kwargs):
        super().__init__(rows, hot_tokens, device, manage_op, **kwargs)
        self._ranked: Optional[torch.Tensor] = None
        self.rank_avg = torch.zeros((rows, hot_tokens), dtype=torch.int64, device=device)

    def load_kernel(self) -> None:
        load_score_kernel()

    def set_ranked(self, ranked: torch.Tensor) -> None:
        """int32 ``[B, D]`` (``D >= K``) positions in descending score order for the rows of
        the coming step (the ``[B]`` rows of :meth:`step_rows`, or all rows)."""
        self._ranked = ranked

    def ranked_for(self, topk: torch.Tensor) -> torch.Tensor:
        """The ranking set for this step, checked against ``topk`` ``[B, K]``;
        :class:`RankedInputError` when none was set or its shape is not ``[B, D >= K]``."""
        r = self._ranked
        if r is None:
            raise RankedInputError(
                f"policy {self.policy!r} needs the indexer's ranking (ranked [rows, D >= top-k]) every step: "
                "replay a trace that has a 'ranked' array (record it with record_trace_rank_depth > 0, or "
                "synthesise one with rank_depth > 0), or choose a policy that needs only the top-k (lru, lru_k2, "
                "lru_k2_guarded)"
            )
        if r.dim() != 2 or r.shape[0] != topk.shape[0] or r.shape[1] < topk.shape[1]:
            raise RankedInputError(
                f"ranked has shape {tuple(r.shape)}; expected [{topk.shape[0]}, D >= {topk.shape[1]}]"
            )
        return r

    def row_state(self):
        extra = [(self, "rank_avg")] if self.smooth_shift is not None else []
        return super().row_state() + extra

    def step(self, topk, req_ids, stable_len, step):
        """The CPU kernel with ``impl="kernel"``; else on the Triton rung (``manage_op`` of
        rung ``triton``) the four-launch kernel of ``triton_ops/score_rank.py``
        (bit-identical); else the torch reference."""
        if self.impl == "kernel":
            return self.step_rows(self.all_rows(), topk, req_ids, stable_len, step)
        if getattr(self.manage_op, "rung", "reference") == "triton" and self.smooth_shift is None:
            from ...triton_ops.score_rank import score_rank_manage

            t = self.table
            return score_rank_manage(
                t.slot_token, t.slot_stamp, t.row_req, topk, req_ids, stable_len, step, self.ranked_for(topk)
            )
        return super().step(topk, req_ids, stable_len, step)

    def kernel_step_rows(self, rows, topk, req_ids, stable_len, step):
        return score_kernel_step_rows(self, rows, topk, req_ids, stable_len, step)

    def on_reset(self, reset, dropped):
        pass

    def victim_order(self, look, topk, req_ids, stable_len, step):
        ranked = self.ranked_for(topk)
        rank = slot_ranks(self.table.slot_token, ranked, stable_len)
        depth = ranked.shape[1]
        if self.smooth_shift is not None:
            fixed = rank << self._FIX
            avg = self.rank_avg + ((fixed - self.rank_avg) >> self.smooth_shift)
            rank = (avg + (1 << self._FIX) - 1) >> self._FIX
            self.rank_avg = avg
        # unranked (rank D) first, then the lowest ranked; ties by (stamp, slot)
        key = ((depth - rank) << STAMP_BITS) | self.table.slot_stamp
        key = key.masked_fill(look.slot_hit, INT64_MAX)
        return torch.sort(key, dim=1, stable=True).indices

    def record(self, look, out, stamp_before):
        if self.smooth_shift is None:
            return
        rows, hot = self.rank_avg.shape
        filled = slot_flags(rows, hot, out.miss_slots)
        # a fill starts its average at its current rank (the position is in the top-k)
        ranked = self._ranked
        fresh = slot_ranks(self.table.slot_token, ranked, torch.full_like(self.table.row_req, 1 << 30)) << self._FIX
        self.rank_avg = torch.where(filled, fresh, self.rank_avg)
        self.rank_avg.masked_fill_(self.table.slot_token < 0, ranked.shape[1] << self._FIX)

    def state(self):
        s = super().state()
        if self.smooth_shift is not None:
            s["slot_rank_avg"] = self.rank_avg
        return s


class SmoothScoreRankManager(ScoreRankManager):
    """``score_rank`` evicting by the exponential average of the rank (``smooth_shift = 1``);
    torch only (the CPU kernel implements the plain rank)."""

    policy = "score_rank_smooth"
    has_cpu_kernel: ClassVar[bool] = False
    has_triton_kernel: ClassVar[bool] = False
    smooth_shift: ClassVar[Optional[int]] = 1
