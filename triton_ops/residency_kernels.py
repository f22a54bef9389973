"""Triton kernels of the residency manager (exact LRU, ``docs/residency_contract.md``).

Importing this module imports ``triton`` (it defines ``@triton.jit`` functions), so it
is only imported by the launchers in :mod:`.residency`, never at package import.
Under the Triton interpreter ``TRITON_INTERPRET=1`` must be set before this import.

One step of one layer is three launches; a launch boundary is the only
synchronisation any kernel relies on (see "Portability rules" below):

=====================  =========  ==================================================
kernel                 grid       job
=====================  =========  ==================================================
``_lookup_kernel``     ``(R,)``   contract steps 1-3 + miss compaction: reset and
                                  invalidate the row's slots (written back), match
                                  the whole top-k row against every slot, mark hit
                                  slots, write ``hit_mask``, hit ``slots``,
                                  ``miss_count``, ``miss_tokens``, the top-k index of
                                  every miss and the smallest evictable stamp
``_victim_kernel``     ``(R,)``   contract step 4: walk the evictable slots group by
                                  group of equal stamp (ascending), slot order inside
                                  a group, and give the ``i``-th one to miss ``i``
                                  (``miss_slots``); ``row_req = req_ids``
``_apply_kernel``      ``(R, C)`` contract step 5: victims get their position and
                                  stamp ``2*step+1``, hit slots stamp ``2*step+2``,
                                  misses get their slot in ``slots``
=====================  =========  ==================================================

During a step ``slot_stamp`` carries a marker: after ``_lookup_kernel`` a hit slot
holds ``HIT_MARK`` (``-1``; real stamps are ``>= 0``), which is what makes it
non-evictable for ``_victim_kernel``; ``_apply_kernel`` overwrites every marker with
``2*step+2`` (each hit slot is named by exactly one hit entry).

Portability rules (upstream Triton, triton-ascend, the interpreter)
-------------------------------------------------------------------
* No program reads global memory written earlier in the same launch: a store
  followed by a load of the same address inside one program is not ordered on
  Ascend (triton-ascend issue #1416) and, across element layouts, not on GPUs
  without a barrier. Phases that need each other's results are separate launches.
  Loads of an address *before* a store to it in the same program are fine (the
  stored value depends on the loaded one).
* Programs of one launch write disjoint addresses (every slot and every top-k entry
  has exactly one writer), so no atomics are needed.
* No ``tl.sort`` (triton-ascend sorts floating-point keys only; int32/int64 keys are
  unsupported there and float32 cannot hold int32 positions exactly). Matching is a
  broadcast comparison, ordering is a scan over stamp groups.
* Every ``tl.arange`` is a power of two, every block has at most 1,048,576 elements
  (the launcher's default lookup tile is 16,384 elements), every row offset is int64, every
  load/store is masked, no autotune, only ints and tensors as arguments.
* Used primitives and their triton-ascend status: ``tl.cumsum`` on int32 (supported
  A2/A3), ``tl.max``/``tl.min``/``tl.sum`` on int32/int64, ``tl.where``,
  data-dependent ``while`` (scf.while), scattered masked stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

HIT_MARK = tl.constexpr(-1)  # stamp of a slot hit in the current step, between launches 1 and 3
I64_MAX = tl.constexpr(9223372036854775807)


@triton.jit
def _lookup_kernel(
    topk_ptr,  # int32 [R, K]
    req_ids_ptr,  # int64 [R]
    stable_len_ptr,  # int32 [R]
    row_req_ptr,  # int64 [R]  (read only here)
    slot_token_ptr,  # int32 [R, H]  (rewritten: reset / invalidated)
    slot_stamp_ptr,  # int64 [R, H]  (rewritten: reset / invalidated, HIT_MARK on hits)
    hit_mask_ptr,  # int8 [R, K]  (bool storage)
    slots_ptr,  # int32 [R, K]  hit slot or -1
    miss_count_ptr,  # int32 [R]
    miss_tokens_ptr,  # int32 [R, K]
    miss_slots_ptr,  # int32 [R, K]  all -1 here (victims come in launch 2)
    miss_entry_ptr,  # int32 [R, K]  scratch: top-k index of the i-th miss
    evict_min_ptr,  # int64 [R]  scratch: smallest evictable stamp (I64_MAX: none)
    K,
    H,
    KP: tl.constexpr,  # next power of two >= K
    BLOCK_H: tl.constexpr,  # slots per iteration; KP * BLOCK_H elements per tile
):
    row = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ids_ptr + row)
    owner = tl.load(row_req_ptr + row)
    stable = tl.load(stable_len_ptr + row)

    entry = tl.arange(0, KP)
    in_k = entry < K
    k_base = row * K
    topk = tl.load(topk_ptr + k_base + entry, mask=in_k, other=-1)
    # scalar predicates are applied as vector comparisons (the interpreter turns
    # ``vector_bool & scalar_bool`` into int32)
    valid = in_k & (topk != -1) & ((tl.zeros([KP], tl.int64) + req) != -1)

    hit_slot = tl.full([KP], -1, tl.int32)
    evict_min = tl.full([BLOCK_H], I64_MAX, tl.int64)
    h_base = row * H
    for h0 in range(0, H, BLOCK_H):
        slot = h0 + tl.arange(0, BLOCK_H)
        in_h = slot < H
        token = tl.load(slot_token_ptr + h_base + slot, mask=in_h, other=-1)
        stamp = tl.load(slot_stamp_ptr + h_base + slot, mask=in_h, other=0)
        # steps 1-2: a changed request empties the row, speculative positions empty their slot
        drop = (token >= stable) | ((tl.zeros([BLOCK_H], tl.int64) + req) != owner)
        token = tl.where(drop, -1, token)
        stamp = tl.where(drop, 0, stamp)
        # step 3: valid entries are distinct and != -1, so a match is unique and never an empty slot
        match = (topk[:, None] == token[None, :]) & valid[:, None]
        hit_slot = tl.maximum(hit_slot, tl.max(tl.where(match, slot[None, :], -1), axis=1))
        hits_of_slot = tl.max(match.to(tl.int32), axis=0)  # 0 or 1
        slot_hit = hits_of_slot > 0
        slot_free = hits_of_slot == 0
        tl.store(slot_token_ptr + h_base + slot, token, mask=in_h)
        tl.store(slot_stamp_ptr + h_base + slot, tl.where(slot_hit, HIT_MARK, stamp), mask=in_h)
        evict_min = tl.minimum(evict_min, tl.where(in_h & slot_free, stamp, I64_MAX))

    hit = hit_slot >= 0
    miss = valid & (hit_slot < 0)
    miss_i32 = miss.to(tl.int32)
    rank = tl.cumsum(miss_i32, axis=0) - 1
    miss_count = tl.sum(miss_i32, axis=0)
    tl.store(hit_mask_ptr + k_base + entry, hit.to(tl.int8), mask=in_k)
    tl.store(slots_ptr + k_base + entry, hit_slot, mask=in_k)
    # compaction: the i-th miss (top-k order) goes to column i; the tail is -1
    tl.store(miss_tokens_ptr + k_base + rank, topk, mask=miss)
    tl.store(miss_entry_ptr + k_base + rank, entry, mask=miss)
    tl.store(miss_tokens_ptr + k_base + entry, tl.full([KP], -1, tl.int32), mask=in_k & (entry >= miss_count))
    tl.store(miss_slots_ptr + k_base + entry, tl.full([KP], -1, tl.int32), mask=in_k)
    tl.store(miss_count_ptr + row, miss_count)
    tl.store(evict_min_ptr + row, tl.min(evict_min, axis=0))


@triton.jit
def _victim_kernel(
    slot_stamp_ptr,  # int64 [R, H]  (read only: HIT_MARK on hit slots)
    miss_count_ptr,  # int32 [R]
    evict_min_ptr,  # int64 [R]
    miss_slots_ptr,  # int32 [R, K]  columns < miss_count written here
    req_ids_ptr,  # int64 [R]
    row_req_ptr,  # int64 [R]  (= req_ids after the step)
    K,
    H,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h_base = row * H
    k_base = row * K
    misses = tl.load(miss_count_ptr + row)
    group = tl.load(evict_min_ptr + row)  # stamp of the oldest evictable group
    assigned = misses * 0
    # One pass over the row per group of equal stamp, oldest group first, until every
    # miss has a slot. Inside a group, slots go in ascending slot order (the cumsum).
    while (assigned < misses) & (group != I64_MAX):
        taken = assigned
        next_group = tl.full([BLOCK_H], I64_MAX, tl.int64)
        for h0 in range(0, H, BLOCK_H):
            slot = h0 + tl.arange(0, BLOCK_H)
            in_h = slot < H
            stamp = tl.load(slot_stamp_ptr + h_base + slot, mask=in_h, other=HIT_MARK)
            evictable = in_h & (stamp >= 0)
            member = evictable & (stamp == group)
            member_i32 = member.to(tl.int32)
            rank = taken + tl.cumsum(member_i32, axis=0) - 1
            tl.store(miss_slots_ptr + k_base + rank, slot, mask=member & (rank < misses))
            taken += tl.sum(member_i32, axis=0)
            next_group = tl.minimum(next_group, tl.where(evictable & (stamp > group), stamp, I64_MAX))
        assigned = tl.minimum(taken, misses)
        group = tl.min(next_group, axis=0)
    tl.store(row_req_ptr + row, tl.load(req_ids_ptr + row))


@triton.jit
def _apply_kernel(
    slot_token_ptr,  # int32 [R, H]
    slot_stamp_ptr,  # int64 [R, H]
    hit_mask_ptr,  # int8 [R, K]
    slots_ptr,  # int32 [R, K]  hits set by launch 1; misses set here
    miss_count_ptr,  # int32 [R]
    miss_tokens_ptr,  # int32 [R, K]
    miss_slots_ptr,  # int32 [R, K]
    miss_entry_ptr,  # int32 [R, K]
    stamps_ptr,  # int64 [2]: 2*step+1, 2*step+2 (device data: a captured graph replays any step)
    K,
    H,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    miss_stamp = tl.load(stamps_ptr)
    hit_stamp = tl.load(stamps_ptr + 1)
    in_k = col < K
    k_base = row * K
    h_base = row * H
    # every load first: this program stores into slots[] below
    is_hit = tl.load(hit_mask_ptr + k_base + col, mask=in_k, other=0) != 0
    hit_slot = tl.load(slots_ptr + k_base + col, mask=is_hit, other=0)
    is_miss = in_k & (col < tl.load(miss_count_ptr + row))
    victim = tl.load(miss_slots_ptr + k_base + col, mask=is_miss, other=0)
    token = tl.load(miss_tokens_ptr + k_base + col, mask=is_miss, other=-1)
    entry = tl.load(miss_entry_ptr + k_base + col, mask=is_miss, other=0)

    zero = tl.zeros([BLOCK_K], tl.int64)
    tl.store(slot_stamp_ptr + h_base + hit_slot, zero + hit_stamp, mask=is_hit)
    tl.store(slot_token_ptr + h_base + victim, token, mask=is_miss)
    tl.store(slot_stamp_ptr + h_base + victim, zero + miss_stamp, mask=is_miss)
    tl.store(slots_ptr + k_base + entry, victim, mask=is_miss)
