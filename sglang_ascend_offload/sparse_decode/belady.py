"""Belady-optimal residency (the lower bound on misses) for a recorded trace.

With a per-row capacity of ``H`` slots and a selection ``S_t`` (``|S_t| <= K <= H``)
that must be resident at step ``t``, evicting among the non-selected slots the ones
whose next use (within the same request, in the same row) is farthest in the future
is optimal: the classic exchange argument for Belady's rule applies unchanged,
because a selected position is needed now and is never a candidate.

:class:`BeladyManager` is that rule expressed as a replacement policy on the shared
mechanism of ``residency.py`` (so it obeys the same invariants); it needs the
future, which :func:`next_use_table` computes from a whole trace. It is an offline
yardstick only, never a serving policy.
"""

from __future__ import annotations

import numpy as np
import torch

from ..ops.contract import INT64_MAX, Lookup, ResidencyStep
from .policies import RankedManager

__all__ = ["NEVER", "next_use_table", "BeladyManager", "belady_misses"]

# "Not used again in this request": larger than any step, smaller than the key of
# an empty slot (which is always evicted first).
NEVER = np.int64(1) << 40


def next_use_table(topk: np.ndarray, req_ids: np.ndarray) -> np.ndarray:
    """int64 ``[steps, layers, rows, k]``: next step at which the same row selects the
    same position for the same request, :data:`NEVER` if none; ``-1`` for padding.

    ``topk`` int32 ``[steps, layers, rows, k]``, ``req_ids`` int64 ``[steps, rows]``.
    """
    steps, layers, rows, k = topk.shape
    step_ix, layer_ix, row_ix, _ = np.indices(topk.shape, sparse=False).reshape(4, -1)
    tok = topk.reshape(-1).astype(np.int64)
    req = req_ids[step_ix, row_ix]
    valid = tok >= 0
    order = np.lexsort((step_ix, tok, req, row_ix, layer_ix))
    order = order[valid[order]]
    same = np.ones(order.size, dtype=bool)
    same[-1:] = False
    if order.size > 1:
        a, b = order[:-1], order[1:]
        same[:-1] = (layer_ix[a] == layer_ix[b]) & (row_ix[a] == row_ix[b]) & (req[a] == req[b]) & (tok[a] == tok[b])
    nxt = np.full(order.size, NEVER, dtype=np.int64)
    if order.size > 1:
        nxt[:-1] = np.where(same[:-1], step_ix[order[1:]], NEVER)
    out = np.full(tok.size, -1, dtype=np.int64)
    out[order] = nxt
    return out.reshape(steps, layers, rows, k)


class BeladyManager(RankedManager):
    """Farthest-next-use eviction; call :meth:`set_next_use` before every :meth:`step`.

    Extra state: ``slot_next`` int64 ``[R,H]``, next use of each slot's position.
    """

    policy = "belady"

    def __init__(self, rows, hot_tokens, device=None, **kwargs):
        super().__init__(rows, hot_tokens, device, **kwargs)
        self.slot_next = torch.full((rows, hot_tokens), INT64_MAX, dtype=torch.int64, device=device)
        self._next_use = None

    def set_next_use(self, next_use: torch.Tensor) -> None:
        """int64 ``[R,K]`` next use of each entry of the coming step's top-k."""
        self._next_use = next_use

    def row_state(self):
        return super().row_state() + [(self, "slot_next")]

    def on_reset(self, reset, dropped):
        self.slot_next.masked_fill_(reset[:, None] | dropped, INT64_MAX)

    def victim_order(self, look: Lookup, topk, req_ids, stable_len, step):
        empty = self.table.slot_token < 0
        key = torch.where(empty, torch.full_like(self.slot_next, -INT64_MAX), -self.slot_next)
        key = key.masked_fill(look.slot_hit, INT64_MAX)
        return torch.sort(key, dim=1, stable=True).indices

    def record(self, look: Lookup, out: ResidencyStep, stamp_before):
        if self._next_use is None:
            raise RuntimeError("BeladyManager.step needs set_next_use() first")
        rows, hot = self.slot_next.shape
        col = torch.where(out.slots >= 0, out.slots.to(torch.int64), torch.full_like(out.slots, hot, dtype=torch.int64))
        ext = torch.cat([self.slot_next, self.slot_next.new_full((rows, 1), INT64_MAX)], dim=1)
        ext.scatter_(1, col, self._next_use.to(torch.int64))
        self.slot_next.copy_(ext[:, :hot])
        self._next_use = None


def belady_misses(topk: np.ndarray, req_ids: np.ndarray, hot: int, next_use: np.ndarray = None) -> int:
    """Belady's misses at capacity ``hot`` by a direct per-row simulation (a heap of next
    uses per row; no torch): the same count as :class:`BeladyManager` (tested), much
    faster, for sizing sweeps. ``topk`` int32 ``[steps, layers, rows, k]``, ``req_ids``
    int64 ``[steps, rows]``; ``next_use`` from :func:`next_use_table` if already known.

    Ties in the eviction order never change the count: positions never used again are
    interchangeable, and of two positions next used at the same step, whichever goes
    costs one miss there. A selection of more than ``hot`` positions (a verify round's
    union beyond its request's buffer, served through the overflow area) misses every
    position not cached and keeps, of the selection, the ``hot`` next used soonest.
    """
    import heapq

    steps, layers, rows, k = topk.shape
    nxt = next_use_table(topk, req_ids) if next_use is None else next_use
    misses = 0
    for layer in range(layers):
        for r in range(rows):
            cache: dict = {}
            heap: list = []
            owner = -1
            for t in range(steps):
                req = int(req_ids[t, r])
                if req != owner:
                    cache, heap, owner = {}, [], req
                if req == -1:
                    continue
                sel = topk[t, layer, r]
                valid = sel >= 0
                pos = sel[valid].tolist()
                nu = nxt[t, layer, r][valid].tolist()
                chosen = set(pos)
                new = [(p, n) for p, n in zip(pos, nu) if p not in cache]
                misses += len(new)
                for p, n in zip(pos, nu):
                    if p in cache:
                        cache[p] = n
                        heapq.heappush(heap, (-n, p))
                for p, n in new:
                    cache[p] = n
                    heapq.heappush(heap, (-n, p))
                over = len(cache) - hot
                aside = []  # chosen positions, farthest next use first
                while over > 0 and heap:
                    neg, p = heapq.heappop(heap)
                    if cache.get(p) != -neg:
                        continue  # stale entry
                    if p in chosen:
                        aside.append((neg, p))
                        continue
                    del cache[p]
                    over -= 1
                for neg, p in aside:  # a selection larger than the buffer: keep its nearest next uses
                    if over > 0:
                        del cache[p]
                        over -= 1
                    else:
                        heapq.heappush(heap, (neg, p))
    return misses
