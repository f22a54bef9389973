"""Triton kernel of the miss-row copy (op ``copy_miss_rows``, rung ``triton``).

Importing this module imports ``triton``; only :mod:`.copy_rows` imports it.

``_copy_miss_rows_kernel``, grid ``(R, cdiv(K, BLOCK_I))``: program ``(r, c)`` takes
miss columns ``c*BLOCK_I ..`` of row ``r`` that are ``< miss_count[r]``, looks up the
host row of each miss (``token_table[r, miss_tokens[r, i]]``) and copies it, in
``BLOCK_D``-wide chunks, to ``hot[r, miss_slots[r, i], :]``. Gather (host side) and
scatter (hot side) are one fused pass: each miss row is read once from the source
and written once to its slot, with no staging buffer.

Elements travel as integers of the same width (the launcher passes integer views),
so the copy is bit-exact for every dtype. Offsets are int64. Entries whose position
or host row falls outside ``token_table`` / ``host`` are skipped rather than read out
of bounds; the launcher checks them beforehand when asked to (``validate=True``).
Programs write disjoint hot rows (a row's miss slots are distinct) and read nothing
any program writes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_miss_rows_kernel(
    host_ptr,  # [S, D] integer view, row stride host_stride
    hot_ptr,  # [R, H, D] integer view, contiguous
    miss_tokens_ptr,  # int32 [R, K]
    miss_slots_ptr,  # int32 [R, K]
    miss_count_ptr,  # int32 [R]
    token_table_ptr,  # int32 [R, max_ctx] (row stride table_stride)
    K,
    H,
    D,
    host_rows,
    host_stride,
    max_ctx,
    table_stride,
    BLOCK_I: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    k_base = row * K
    todo = (col < K) & (col < tl.load(miss_count_ptr + row))
    token = tl.load(miss_tokens_ptr + k_base + col, mask=todo, other=0).to(tl.int64)
    slot = tl.load(miss_slots_ptr + k_base + col, mask=todo, other=0).to(tl.int64)
    todo = todo & (token >= 0) & (token < max_ctx) & (slot >= 0) & (slot < H)
    host_row = tl.load(token_table_ptr + row * table_stride + token, mask=todo, other=0).to(tl.int64)
    todo = todo & (host_row >= 0) & (host_row < host_rows)
    src = host_row * host_stride
    dst = (row * H + slot) * D
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = todo[:, None] & (d < D)[None, :]
        values = tl.load(host_ptr + src[:, None] + d[None, :], mask=m, other=0)
        tl.store(hot_ptr + dst[:, None] + d[None, :], values, mask=m)
