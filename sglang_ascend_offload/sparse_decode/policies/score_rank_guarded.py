"""``score_rank_guarded``: ``score_rank`` bounded against a ghost LRU, with the guard of
``lru_k2_guarded`` (:class:`~.guarded.GuardedManager`: at every step ``misses <=
lru_misses + seed + (lru_misses >> slack_shift)``).

Implementations, chosen per manager by ``impl``: ``"torch"`` (the guard over the torch
``score_rank`` reference) or ``"kernel"``, the score-aware CPU kernel of
:mod:`..score_kernel` with the guard inside it, stepping the same state tensors in
place (table, ghost table and both miss counters), bit for bit with the reference.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import RankedManager
from .guarded import GuardedManager
from .score_rank import ScoreRankManager, load_score_kernel, score_kernel_step_rows

__all__ = ["ScoreGuardedManager"]


class ScoreGuardedManager(GuardedManager):
    """``score_rank`` bounded against a ghost LRU (the guard of :class:`GuardedManager`)."""

    policy = "score_rank_guarded"
    needs_ranked: ClassVar[bool] = True
    has_cpu_kernel: ClassVar[bool] = True

    @staticmethod
    def make_base(rows, hot_tokens, device, manage_op) -> RankedManager:
        return ScoreRankManager(rows, hot_tokens, device, manage_op)

    def load_kernel(self) -> None:
        load_score_kernel()

    def set_ranked(self, ranked: torch.Tensor) -> None:
        """As :meth:`ScoreRankManager.set_ranked` (the base policy keeps it)."""
        self.base.set_ranked(ranked)

    def ranked_for(self, topk: torch.Tensor) -> torch.Tensor:
        return self.base.ranked_for(topk)

    def step(self, topk, req_ids, stable_len, step):
        if self.impl == "kernel":
            return self.step_rows(self.all_rows(), topk, req_ids, stable_len, step)
        return super().step(topk, req_ids, stable_len, step)

    def kernel_step_rows(self, rows, topk, req_ids, stable_len, step):
        g = self.ghost
        guard = (g.slot_token, g.slot_stamp, g.row_req, self.ghost_misses, self.own_misses)
        return score_kernel_step_rows(self, rows, topk, req_ids, stable_len, step, guard, self.seed, self.slack_shift)
