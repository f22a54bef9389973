"""``lru_k2``: LRU-2 victims (torch reference only).

Evict first the slots whose *second most recent* use is oldest (slots used once have
none and go first), ties by last use, then slot. Protects tokens that keep coming back
(heavy hitters, the recent window) from one-off noise. Extra state: ``slot_prev_stamp``
int64 ``[R,H]``, the stamp a slot had before its last hit (``0``: used once).
"""

from __future__ import annotations

import torch

from ...ops.contract import INT64_MAX
from ...ops.residency import residency_manage
from .base import STAMP_BITS, RankedManager, slot_flags

__all__ = ["LRU2Manager"]


class LRU2Manager(RankedManager):
    """LRU-2 (see module docstring). Extra state ``slot_prev_stamp`` int64 ``[R,H]``."""

    policy = "lru_k2"

    def __init__(self, rows, hot_tokens, device=None, manage_op=residency_manage, **kwargs):
        super().__init__(rows, hot_tokens, device, manage_op, **kwargs)
        self.prev_stamp = torch.zeros((rows, hot_tokens), dtype=torch.int64, device=device)

    def row_state(self):
        return super().row_state() + [(self, "prev_stamp")]

    def on_reset(self, reset, dropped):
        self.prev_stamp.masked_fill_(reset[:, None] | dropped, 0)

    def victim_order(self, look, topk, req_ids, stable_len, step):
        key = (self.prev_stamp << STAMP_BITS) | self.table.slot_stamp
        key = key.masked_fill(look.slot_hit, INT64_MAX)
        return torch.sort(key, dim=1, stable=True).indices

    def record(self, look, out, stamp_before):
        rows, hot = self.prev_stamp.shape
        filled = slot_flags(rows, hot, out.miss_slots)
        self.prev_stamp = torch.where(look.slot_hit, stamp_before, self.prev_stamp)
        self.prev_stamp.masked_fill_(filled, 0)

    def state(self):
        s = super().state()
        s["slot_prev_stamp"] = self.prev_stamp
        return s
