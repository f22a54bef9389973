"""``lru_k2_guarded``: LRU-2 with a hard bound against exact LRU (torch reference only).

A ghost exact-LRU table runs on the same inputs; per row the policy may deviate from the
ghost's content only as far as the misses it has saved pay for (plus a small per-request
budget ``seed``), so at every step ``misses <= lru_misses + seed + (lru_misses >>
slack_shift)``. :class:`GuardedManager` has the argument; ``score_rank_guarded``
(``score_rank_guarded.py``) reuses the guard with another base policy. Extra state: the
base policy's, a ghost :class:`~sglang_ascend_offload.ops.contract.ResidencyTable` and
two int64 ``[R]`` miss counters.

Why not "never more misses than LRU" literally: for any deterministic online policy
whose cache content ever differs from LRU's, an input exists on which it has strictly
more misses (keep requesting only what LRU holds), so per-input dominance pins a policy
to LRU itself. The guard gives the closest honest thing: a bounded, configurable loss
in the worst case and the gain of the base policy where there is locality (measured in
``docs/sparse_decode.md``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.contract import ResidencyTable
from ...ops.residency import assign_victims, lookup, reset_rows, residency_manage
from .base import RankedManager, ResidencyManager, member, slot_flags
from .lru_k2 import LRU2Manager

__all__ = ["GuardedManager"]


class GuardedManager(ResidencyManager):
    """A ranked policy (LRU-2) bounded against a ghost exact-LRU table.

    Notation per row: ``C`` our resident positions, ``L`` the ghost LRU's, ``S`` this
    step's selection, ``m_C`` / ``m_L`` misses since the request took the row,
    ``phi = |L \\ C|``. Invariant: ``m_L - m_C + slack >= phi`` with
    ``slack = seed + m_L >> slack_shift`` (non-decreasing), hence
    ``m_C <= m_L + slack`` at every step.

    Each step the ghost advances to ``L'``. Our victims are taken in the base
    policy's order, except that at most ``allowance = (m_L' - m_C' + slack') - |(L' \\ S) \\ C|``
    of them may be positions that ``L'`` holds. Taking victims outside ``L'`` never
    increases ``phi`` and such victims always suffice (``|L'| <= H``), and with the
    allowance the invariant holds after the step (``docs/sparse_decode.md`` has the
    two-line proof). With ``seed = 0`` and no slack the policy's content equals the
    ghost's: it *is* LRU.
    """

    policy = "lru_k2_guarded"
    steps_ghost_lru = True

    def __init__(
        self,
        rows,
        hot_tokens,
        device=None,
        manage_op=residency_manage,
        base: Optional[RankedManager] = None,
        seed: int = 16,
        slack_shift: Optional[int] = None,
        **kwargs,
    ):
        super().__init__(rows, hot_tokens, device, manage_op, **kwargs)
        self.base = base if base is not None else self.make_base(rows, hot_tokens, device, manage_op)
        self.base.table = self.table  # one table: the base policy ranks our own slots
        self.ghost = ResidencyTable.empty(rows, hot_tokens, device)
        self.seed = int(seed)
        self.slack_shift = slack_shift
        self.ghost_misses = torch.zeros((rows,), dtype=torch.int64, device=device)
        self.own_misses = torch.zeros((rows,), dtype=torch.int64, device=device)

    @staticmethod
    def make_base(rows, hot_tokens, device, manage_op) -> RankedManager:
        """The base policy whose victim order the guard bounds (always its torch reference)."""
        return LRU2Manager(rows, hot_tokens, device, manage_op)

    def step(self, topk, req_ids, stable_len, step):
        table, ghost = self.table, self.ghost
        rows, hot = table.slot_token.shape
        if hot < topk.shape[1]:
            raise ValueError(f"hot_tokens {hot} < top_k {topk.shape[1]}")
        reset, dropped = reset_rows(table, req_ids, stable_len)
        self.base.on_reset(reset, dropped)
        self.ghost_misses.masked_fill_(reset, 0)
        self.own_misses.masked_fill_(reset, 0)
        g = self.manage_op(ghost.slot_token, ghost.slot_stamp, ghost.row_req, topk, req_ids, stable_len, step)
        look = lookup(table, topk, req_ids, stable_len)

        m_l = self.ghost_misses + g.miss_count.to(torch.int64)
        m_c = self.own_misses + look.miss.sum(dim=1)
        slack = torch.full_like(m_l, self.seed)
        if self.slack_shift is not None:
            slack = slack + (m_l >> self.slack_shift)
        ghost_sel = slot_flags(rows, hot, g.slots)
        ghost_missing = (ghost.slot_token >= 0) & ~ghost_sel & ~member(ghost.slot_token, table.slot_token)
        allowance = (m_l - m_c + slack) - ghost_missing.sum(dim=1)

        base_order = self.base.victim_order(look, topk, req_ids, stable_len, step)
        protected = member(table.slot_token, ghost.slot_token) & ~look.slot_hit
        prot_in_order = torch.gather(protected, 1, base_order)
        over = torch.cumsum(prot_in_order.to(torch.int64), dim=1) > allowance[:, None]
        group = torch.where(torch.gather(look.slot_hit, 1, base_order), 2, (prot_in_order & over).to(torch.int64))
        # stable partition of base_order by group; only the first K entries can be used
        width = min(hot, max(1, look.miss.shape[1]))
        key = group * hot + torch.arange(hot, device=group.device)
        first = torch.topk(key, width, dim=1, largest=False, sorted=True).indices
        order = torch.gather(base_order, 1, first)

        before = table.slot_stamp.clone()
        out = assign_victims(table, look, order, topk, step)
        self.base.record(look, out, before)
        self.ghost_misses.copy_(m_l)
        self.own_misses.copy_(m_c)
        return out

    def row_state(self):
        g = self.ghost
        base_extra = self.base.row_state()[3:]  # the base shares our table: its extra state only
        return (
            super().row_state()
            + base_extra
            + [(g, "slot_token"), (g, "slot_stamp"), (g, "row_req"), (self, "ghost_misses"), (self, "own_misses")]
        )

    def state(self):
        s = self.base.state()
        s.update(
            {
                "ghost_slot_token": self.ghost.slot_token,
                "ghost_slot_stamp": self.ghost.slot_stamp,
                "ghost_row_req": self.ghost.row_req,
                "ghost_misses": self.ghost_misses,
                "own_misses": self.own_misses,
            }
        )
        return s
