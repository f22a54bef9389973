"""A literal, loop-by-loop Python model of docs/residency_contract.md (tests only).

Independent of the vectorised implementation: plain lists, one row and one entry at
a time, exactly in the words of the contract. Used to check the reference manager
(and, through the registry, every other rung) state and outputs bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple


@dataclass
class RowModel:
    hot: int
    token: List[int] = field(default_factory=list)
    stamp: List[int] = field(default_factory=list)
    req: int = -1

    def __post_init__(self):
        self.token = [-1] * self.hot
        self.stamp = [0] * self.hot


def model_step(
    row: RowModel, topk: List[int], req: int, stable: int, step: int
) -> Tuple[List[bool], List[int], List[int], List[int]]:
    """One contract step of one row: (hit_mask, slots, miss_tokens, miss_slots)."""
    k = len(topk)
    if req != row.req:  # 1. reset
        row.token = [-1] * row.hot
        row.stamp = [0] * row.hot
        row.req = req
    for s in range(row.hot):  # 2. invalidate speculative content
        if row.token[s] >= stable:
            row.token[s] = -1
            row.stamp[s] = 0
    hit = [False] * k
    slots = [-1] * k
    hit_slots = set()
    for j, pos in enumerate(topk):  # 3. lookup
        if pos == -1 or req == -1:
            continue
        if pos < stable and pos in row.token:
            s = row.token.index(pos)
            hit[j] = True
            slots[j] = s
            hit_slots.add(s)
    evictable = sorted((row.stamp[s], s) for s in range(row.hot) if s not in hit_slots)  # 4. victims
    miss_tokens, miss_slots = [], []
    i = 0
    for j, pos in enumerate(topk):
        if pos == -1 or req == -1 or hit[j]:
            continue
        s = evictable[i][1]
        i += 1
        slots[j] = s
        miss_tokens.append(pos)
        miss_slots.append(s)
    for pos, s in zip(miss_tokens, miss_slots):  # 5. update
        row.token[s] = pos
        row.stamp[s] = 2 * step + 1
    for s in hit_slots:
        row.stamp[s] = 2 * step + 2
    pad = [-1] * (k - len(miss_tokens))
    return hit, slots, miss_tokens + pad, miss_slots + pad
