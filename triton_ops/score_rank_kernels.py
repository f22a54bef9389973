"""Triton kernel of the score-aware residency policy ``score_rank`` (``sparse_decode/policies/score_rank.py``).

Imports ``triton``; only :mod:`.score_rank` imports it. One step of ``score_rank`` is
four launches, three of them the LRU kernels of :mod:`.residency_kernels` unchanged:

=====================  =========  ==================================================
kernel                 grid       job
=====================  =========  ==================================================
``_lookup_kernel``     ``(R,)``   (LRU's) reset, invalidation, hits (``HIT_MARK``),
                                  miss compaction
``_rank_key_kernel``   ``(R,)``   this file: each slot's eviction key
                                  ``((D - rank) << 32) | stamp`` (``rank = D`` when
                                  the slot's position is not among the row's ``D``
                                  ranked positions below ``stable_len``, or the slot
                                  is empty), ``HIT_MARK`` for hit slots, into a
                                  scratch ``[R, H]``; and the smallest evictable key
``_victim_kernel``     ``(R,)``   (LRU's) run on the scratch keys instead of the
                                  stamps: groups of equal key ascending, slot order
                                  inside a group; ``i``-th miss takes ``i``-th victim
``_apply_kernel``      ``(R, C)`` (LRU's) fill victims, stamp hits and fills
=====================  =========  ==================================================

The order equals the reference's stable sort of the same key (ties by slot). Same
portability rules as :mod:`.residency_kernels`: no reads of addresses written in the
same launch, broadcast comparison instead of ``tl.sort``, power-of-two aranges,
masked loads and stores, int64 row offsets. Stamps must be ``< 2**32`` (the
policy's step bound) for the packed key to be exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

HIT_MARK = tl.constexpr(-1)
I64_MAX = tl.constexpr(9223372036854775807)


@triton.jit
def _rank_key_kernel(
    slot_token_ptr,  # int32 [R, H]  (after _lookup_kernel: reset / invalidated)
    slot_stamp_ptr,  # int64 [R, H]  (HIT_MARK on hit slots)
    ranked_ptr,  # int32 [R, D]  positions in descending score order, -1 padding
    stable_len_ptr,  # int32 [R]
    key_ptr,  # int64 [R, H]  out: eviction key, HIT_MARK on hit slots
    key_min_ptr,  # int64 [R]  out: smallest evictable key (I64_MAX: none)
    D,
    H,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    stable = tl.load(stable_len_ptr + row)
    h_base = row * H
    d_base = row * D
    key_min = tl.full([BLOCK_H], I64_MAX, tl.int64)
    for h0 in range(0, H, BLOCK_H):
        slot = h0 + tl.arange(0, BLOCK_H)
        in_h = slot < H
        token = tl.load(slot_token_ptr + h_base + slot, mask=in_h, other=-1)
        stamp = tl.load(slot_stamp_ptr + h_base + slot, mask=in_h, other=HIT_MARK)
        rank = tl.full([BLOCK_H], 0, tl.int64) + D
        for d0 in range(0, D, BLOCK_D):
            col = d0 + tl.arange(0, BLOCK_D)
            in_d = col < D
            pos = tl.load(ranked_ptr + d_base + col, mask=in_d, other=-1)
            ok = in_d & (pos >= 0) & (pos < stable)
            match = (pos[:, None] == token[None, :]) & ok[:, None]
            cand = tl.where(match, col.to(tl.int64)[:, None], D)
            rank = tl.minimum(rank, tl.min(cand, axis=0))
        hit = stamp == HIT_MARK
        key = tl.where(hit, HIT_MARK, ((D - rank) << 32) | stamp)
        tl.store(key_ptr + h_base + slot, key, mask=in_h)
        key_min = tl.minimum(key_min, tl.where(in_h & ~hit, key, I64_MAX))
    tl.store(key_min_ptr + row, tl.min(key_min, axis=0))
