"""Fused decode operators: LIM, LIM-C8 and Copy-SFA.

Three ops of the operator ladder, each with a ``reference`` rung (a composition of
the existing reference ops, which *is* the specification) and a ``fused`` rung (this
project's AscendC kernels, ``ascendc_ops/``, loaded from the compiled extension
``sglang_ascend_offload._C_ascend``):

=================================  ==================================================  ================================================
op                                 reference composition                               fused kernel (``torch.ops.sglang_ascend_offload``)
=================================  ==================================================  ================================================
``lightning_indexer_manage``       ``lightning_indexer`` + ``residency_manage``        ``npu_fused_lightning_indexer_manage``
``quant_lightning_indexer_manage`` ``quant_lightning_indexer`` + ``residency_manage``  ``npu_fused_quant_lightning_indexer_manage``
``copy_sparse_flash_attention``    ``copy_miss_rows`` + ``sparse_mla_attention`` flat  ``npu_fused_scatter_copy_sparse_flash_attention``
=================================  ==================================================  ================================================

The separate miss copy ``copy_miss_rows`` (``ops/residency.py``) has a ``fused`` rung too,
``npu_fused_copy_miss_rows``: Copy-SFA's copy phase on its own, reading the misses from
registered host memory on the device (no host read, capturable), where the fused Copy-SFA
does not run the copy (the separate attention, the overflow area beside Copy-SFA).

The ABI follows this project's residency contract (``docs/residency_contract.md``):
state is **per row** (a row is one decode query token with its own hot buffer), not
per request. Query tokens are TND (``[T, ...]``); ``token_rows`` int32 ``[T]`` says
which residency row each query token owns (``-1``: the token is not managed, e.g.
graph padding); a row is owned by at most one token, or with ``tokens_per_row = n > 1``
(a request's speculative verify rows sharing its hot buffer) by up to ``n`` tokens, and
then the row's residency step runs once on the union of their top-k
(``ops/request_union.py``: distinct positions ascending, ``W = min(n * K, Hh)`` wide: a
union beyond ``Hh`` keeps its first ``Hh`` positions by priority and the rest overflow)
and each token reads its slots back from it (``-1`` for an overflow position). Copy-SFA
then also reads an **overflow area** (``overflow`` ``[O, D]``, the rows of the positions
that overflowed, copied there beforehand: ``sparse_decode/overflow.py``) through indices
``R * Hh + i``. Everything is documented argument by
argument in ``docs/fused_ops.md``.

LIM (one layer, one decode step)::

    topk   = lightning_indexer(query, key, weights, ...)          # int32 [T, 1, K] logical
    topk_r = scatter topk[t] into row token_rows[t]                # int32 [R, K], -1 elsewhere
    step_r = residency_manage(slot_token, slot_stamp, row_req,     # state mutated in place
                              topk_r, req_ids, stable_len, step)
    sparse_indices[t] = token_rows[t] * H + step_r.slots[token_rows[t]]   # flat hot rows, -1 kept

Copy-SFA (one layer, one decode step)::

    copy_miss_rows(host, hot, miss_tokens, miss_slots, miss_count, token_table)
    out = sparse_mla_attention(query, hot_latent, None, sparse_indices, scale,
                               query_rope=query_rope, key_rope=hot_rope, layout_kv="flat")

The fused rung is a drop-in for those two pairs: same arguments, same results
(``torch.equal`` residency state and miss lists given the same top-k; attention
within the stated tolerance; miss copies bit-exact). Its ``first fill`` vs
``steady`` branch (a row whose request changed is reset and filled from slot 0; the
others look up hits and evict LRU victims) is decided per row on the device from
``row_req`` vs ``req_ids``, and the number of rows copied from ``miss_count``, so
the wrappers below never read device data on the host and can be captured in a
graph when ``step`` is passed as a device tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from .contract import IndexerManageResult, ResidencyStep, Step, implements
from .npu_impls import fused_op, fused_op_unavailable
from .reference import lightning_indexer, quant_lightning_indexer, sparse_mla_attention
from .request_union import row_slots, union_of_rows
from .residency import copy_miss_rows, residency_manage

__all__ = [
    "lightning_indexer_manage",
    "quant_lightning_indexer_manage",
    "copy_sparse_flash_attention",
    "scatter_token_topk",
    "token_hot_indices",
    "residency_after_indexer",
    "ATTENTION_ATOL",
    "ATTENTION_RTOL",
    "LIM_KERNEL",
    "LIM_C8_KERNEL",
    "COPY_SFA_KERNEL",
    "COPY_ROWS_KERNEL",
]

#: Query tokens that may share one row in the fused kernels (``kMaxRowTokens`` of
#: ``ascendc_ops/include/fused_tiling.h``): a request's speculative verify rows.
MAX_TOKENS_PER_ROW = 14
# The other residency-shape limits of the kernels' host tiling (fused_tiling.h, tiling.cpp;
# a test holds them equal to the header and to the host tiling's verdicts).
MAX_HOT_TOKENS = 4096  # kMaxHotTokens: the residency step keeps a row's state in UB
MAX_TOP_K = 2048  # kMaxTopK
TOP_K_ALIGN_LIM = 32  # kSortGroup: LIM's sort groups
TOP_K_ALIGN_COPY_SFA = 128  # kKvTile: Copy-SFA's key tiles
LIM_POOL_BYTES = 144 * 1024  # kLimPoolBytes: the UB the residency step is carved from


def _a32(n: int) -> int:
    return (n + 31) // 32 * 32


def residency_ub_bytes(hot_tokens: int, width: int) -> int:
    """UB bytes of the kernels' residency step for ``hot_tokens`` slots and ``width``
    entries per step (``LimResidencyUbBytes`` of ``ascendc_ops/host/tiling.cpp``)."""
    table = 2
    while table < 2 * hot_tokens:
        table *= 2
    return (
        _a32(hot_tokens * 4)
        + _a32(hot_tokens * 8)
        + _a32(table * 2)
        + _a32(hot_tokens * 2)
        + 4 * _a32(width * 4)
        + _a32(_a32(width))
        + 64
    )


def union_width(hot_tokens: int, top_k: int, tokens_per_row: int = 1) -> int:
    """Entries of a row's residency step in the fused LIM: ``min(n * K, Hh)`` (the union's
    positions past ``Hh`` overflow; ``LimUnionWidth`` of ``ascendc_ops/host/tiling.cpp``)."""
    return min(int(tokens_per_row) * int(top_k), int(hot_tokens))


def fused_shape_obstacles(hot_tokens: int, top_k: int, tokens_per_row: int = 1):
    """Why the fused kernels cannot serve this residency shape, as ``(lim, copy_sfa)``
    clauses (``""``: they can): the host tiling's limits on the hot buffer, the top-k and
    the rows shared by verify tokens, checked before a server starts instead of at its
    first decode step."""
    n, lim, sfa = int(tokens_per_row), [], []
    if hot_tokens > MAX_HOT_TOKENS or hot_tokens % TOP_K_ALIGN_LIM:
        lim.append(
            f"hot_tokens {hot_tokens} is not a multiple of {TOP_K_ALIGN_LIM} up to {MAX_HOT_TOKENS} (the "
            "kernels keep a row's residency state in the vector core's buffer)"
        )
    if top_k > MAX_TOP_K or top_k % TOP_K_ALIGN_LIM:
        lim.append(f"top-k {top_k} is not a multiple of {TOP_K_ALIGN_LIM} up to {MAX_TOP_K}")
    if n > MAX_TOKENS_PER_ROW:
        lim.append(f"{n} verify rows per request share a row; the kernels take at most {MAX_TOKENS_PER_ROW}")
    elif not lim and residency_ub_bytes(hot_tokens, union_width(hot_tokens, top_k, n)) > LIM_POOL_BYTES:
        width = union_width(hot_tokens, top_k, n)
        lim.append(
            f"a step of {width} entries over {hot_tokens} slots needs "
            f"{residency_ub_bytes(hot_tokens, width)} B of the vector core's {LIM_POOL_BYTES} B buffer"
        )
    if top_k > MAX_TOP_K or top_k % TOP_K_ALIGN_COPY_SFA:
        sfa.append(f"top-k {top_k} is not a multiple of {TOP_K_ALIGN_COPY_SFA} up to {MAX_TOP_K}")
    if n > MAX_TOKENS_PER_ROW:
        sfa.append(f"{n} verify rows per request share a row; the kernel takes at most {MAX_TOKENS_PER_ROW}")
    return "; ".join(lim), "; ".join(sfa)


#: The stated tolerance of the fused attention against a separate composition (bf16
#: probabilities before P.V, another summation order): ``|fused - ref| <= ATOL + RTOL * |ref|``
#: (docs/fused_ops.md; check-kernels and the kernel qualification at startup hold it).
ATTENTION_ATOL = 2e-2
ATTENTION_RTOL = 2e-2

LIM_KERNEL = "npu_fused_lightning_indexer_manage"
LIM_C8_KERNEL = "npu_fused_quant_lightning_indexer_manage"
COPY_SFA_KERNEL = "npu_fused_scatter_copy_sparse_flash_attention"
COPY_ROWS_KERNEL = "npu_fused_copy_miss_rows"
REGISTER_HOST_KERNEL = "npu_fused_register_host_memory"

# The reference compositions call the reference rungs of their steps directly
# (``ops/reference.py``, ``ops/residency.py``): they are the specification.


# ----------------------------------------------------------------------- helpers
def _check_token_rows(token_rows: torch.Tensor, num_tokens: int, rows: int, tokens_per_row: int = 1) -> torch.Tensor:
    """Validate ``token_rows`` (int ``[T]``, values in ``[-1, R)``, each row owned by at most
    ``tokens_per_row`` tokens); int64 copy."""
    if token_rows.dim() != 1 or token_rows.shape[0] != num_tokens:
        raise ValueError(f"token_rows must be [T] = [{num_tokens}], got {tuple(token_rows.shape)}")
    if token_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_rows must be int32 (int64 accepted), got {token_rows.dtype}")
    tr = token_rows.to(torch.int64)
    bad = (tr < -1) | (tr >= rows)
    if bool(bad.any()):
        raise ValueError(f"token_rows holds values outside [-1, {rows}): {tr[bad][:8].tolist()}")
    owned = tr[tr >= 0]
    if tokens_per_row == 1 and torch.unique(owned).numel() != owned.numel():
        raise ValueError(
            "token_rows maps two query tokens to one row: a row is one query token "
            "(tokens_per_row > 1 lets a request's verify rows share one)"
        )
    if tokens_per_row > 1 and owned.numel():
        most = int(torch.bincount(owned).max())
        if most > tokens_per_row:
            raise ValueError(f"token_rows maps {most} query tokens to one row; tokens_per_row is {tokens_per_row}")
    return tr


def _check_tokens_per_row(tokens_per_row: int) -> int:
    n = int(tokens_per_row)
    if not 1 <= n <= MAX_TOKENS_PER_ROW:
        raise ValueError(f"tokens_per_row must be in 1..{MAX_TOKENS_PER_ROW}, got {n}")
    return n


def _row_form(topk: torch.Tensor, token_rows: torch.Tensor, rows: int, tokens_per_row: int):
    """Top-k of the tokens sharing each row, request-major as ``request_union`` takes it.

    Returns int32 ``[R * n, K]`` (row ``r``'s tokens, in token order, at ``r * n ..``;
    ``-1`` where a row has fewer than ``n`` tokens) and int64 ``[T]``: each token's line
    in it (``-1`` for unmanaged tokens).
    """
    n = tokens_per_row
    per_token = topk.reshape(topk.shape[0], -1).to(torch.int32)
    out = torch.full((rows * n, per_token.shape[1]), -1, dtype=torch.int32, device=per_token.device)
    line = torch.full((per_token.shape[0],), -1, dtype=torch.int64)
    seen = [0] * rows
    for t, r in enumerate(token_rows.tolist()):
        if r >= 0:
            line[t] = r * n + seen[r]
            seen[r] += 1
    managed = line >= 0
    out[line[managed].to(out.device)] = per_token[managed.to(per_token.device)]
    return out, line


def _step_value(step: Step) -> int:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"step tensor must hold one value, got shape {tuple(step.shape)}")
        step = int(step.reshape(-1)[0])
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def scatter_token_topk(topk: torch.Tensor, token_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-row top-k from per-token top-k.

    topk int32 ``[T, 1, K]`` (or ``[T, K]``); token_rows int ``[T]`` (validated,
    ``-1`` = unmanaged). Returns int32 ``[R, K]``: row ``token_rows[t]`` holds
    ``topk[t]``; rows owned by no token hold ``-1`` (no valid entry).
    """
    num_tokens = topk.shape[0]
    per_token = topk.reshape(num_tokens, -1).to(torch.int32)
    out = torch.full((rows, per_token.shape[1]), -1, dtype=torch.int32, device=per_token.device)
    tr = token_rows.to(device=per_token.device, dtype=torch.int64)
    managed = tr >= 0
    out[tr[managed]] = per_token[managed]
    return out


def token_hot_indices(slots: torch.Tensor, token_rows: torch.Tensor, hot_tokens: int) -> torch.Tensor:
    """Per-token flat hot-buffer rows from per-row slots.

    slots int32 ``[R, K]`` (``-1`` padding); token_rows int ``[T]``. Returns int32
    ``[T, 1, K]``: ``token_rows[t] * hot_tokens + slots[token_rows[t], j]``, ``-1``
    where the slot is ``-1`` or the token is unmanaged.
    """
    tr = token_rows.to(device=slots.device, dtype=torch.int64)
    managed = tr >= 0
    owner = tr.clamp(min=0)
    picked = slots[owner].to(torch.int64)  # [T, K]
    keep = (picked >= 0) & managed[:, None]
    flat = torch.where(keep, owner[:, None] * hot_tokens + picked, torch.full_like(picked, -1))
    return flat.to(torch.int32).unsqueeze(1)


def residency_after_indexer(
    topk: torch.Tensor,
    *,
    slot_token,
    slot_stamp,
    row_req,
    token_rows,
    req_ids,
    stable_len,
    step: Step,
    tokens_per_row: int = 1,
) -> IndexerManageResult:
    """LIM's residency half on a given per-token ``topk`` (int32 ``[T, 1, K]``, from any
    rung's indexer): the reference ``residency_manage`` per row (on the union of a row's
    tokens' top-k with ``tokens_per_row > 1``) and each token's flat hot rows. Arguments and
    results as :func:`lightning_indexer_manage`; the state tensors are mutated in place."""
    residency_rows, hot_tokens = slot_token.shape
    n = _check_tokens_per_row(tokens_per_row)
    tr = _check_token_rows(token_rows, topk.shape[0], residency_rows, n)
    if n > 1:
        return _manage_union(
            topk,
            tr,
            n,
            slot_token=slot_token,
            slot_stamp=slot_stamp,
            row_req=row_req,
            req_ids=req_ids,
            stable_len=stable_len,
            step=step,
        )
    topk_rows = scatter_token_topk(topk, tr, residency_rows).to(slot_token.device)
    manage = residency_manage
    res = manage(
        slot_token,
        slot_stamp,
        row_req,
        topk_rows,
        req_ids.to(slot_token.device),
        stable_len.to(slot_token.device),
        _step_value(step),
    )
    return IndexerManageResult(
        topk_indices=topk,
        sparse_indices=token_hot_indices(res.slots, tr, hot_tokens),
        residency=res,
    )


def _manage_union(
    topk: torch.Tensor, tr: torch.Tensor, n: int, *, slot_token, slot_stamp, row_req, req_ids, stable_len, step: Step
) -> IndexerManageResult:
    """LIM's residency half with up to ``n`` tokens per row: one step per row on the union
    of its tokens' top-k (``[R, min(n*K, Hh)]``: its resident part, the rest overflows),
    each token's slots read back from it (``-1`` for an overflow position)."""
    rows, hot_tokens = slot_token.shape
    lines, line_of_token = _row_form(topk, tr, rows, n)
    union = union_of_rows(lines.to(slot_token.device), n, capacity=hot_tokens)
    res = residency_manage(
        slot_token,
        slot_stamp,
        row_req,
        union.positions,
        req_ids.to(slot_token.device),
        stable_len.to(slot_token.device),
        _step_value(step),
    )
    per_line = row_slots(union, res.slots).to(torch.int64)  # [R*n, K]
    managed = line_of_token >= 0
    picked = per_line[line_of_token.clamp(min=0).to(per_line.device)]
    owner = tr.clamp(min=0).to(per_line.device)[:, None]
    keep = (picked >= 0) & managed.to(per_line.device)[:, None]
    flat = torch.where(keep, owner * hot_tokens + picked, torch.full_like(picked, -1))
    return IndexerManageResult(topk_indices=topk, sparse_indices=flat.to(torch.int32).unsqueeze(1), residency=res)


# ------------------------------------------------------------------ LIM (bf16)
@implements("lightning_indexer_manage", "reference")
def lightning_indexer_manage(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    block_table: torch.Tensor,
    token_rows: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step: Step,
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    tokens_per_row: int = 1,
) -> IndexerManageResult:
    """LIM: lightning indexer + residency manage of one layer (reference composition).

    Indexer arguments are ``lightning_indexer``'s (query ``[T, H, D]``, paged
    index-K cache ``[blocks, block_size, 1, D]``, weights ``[T, H]``, TND/PA_BSND
    metadata). Residency arguments are the contract's (``docs/residency_contract.md``):
    state ``slot_token`` int32 ``[R, Hh]``, ``slot_stamp`` int64 ``[R, Hh]``,
    ``row_req`` int64 ``[R]`` (mutated in place); ``req_ids`` int64 ``[R]``,
    ``stable_len`` int32 ``[R]``, ``step`` (int or a one-element int64 tensor), plus
    ``token_rows`` int32 ``[T]``: the row each query token owns (``-1`` = none).
    ``sparse_count`` (= K) must be ``<= Hh``. ``tokens_per_row`` = n: up to ``n`` tokens
    may own one row (a request's verify rows); then the residency outputs are
    ``[R, min(n*K, Hh)]``, over each row's union (its first ``Hh`` positions by priority
    when it holds more: the others overflow, ``-1`` in ``sparse_indices``).
    """
    indexer = lightning_indexer
    topk = indexer(
        query,
        key,
        weights,
        actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key,
        block_table=block_table,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=sparse_count,
        sparse_mode=sparse_mode,
    )
    return residency_after_indexer(
        topk,
        slot_token=slot_token,
        slot_stamp=slot_stamp,
        row_req=row_req,
        token_rows=token_rows,
        req_ids=req_ids,
        stable_len=stable_len,
        step=step,
        tokens_per_row=tokens_per_row,
    )


# -------------------------------------------------------------------- LIM-C8
@implements("quant_lightning_indexer_manage", "reference")
def quant_lightning_indexer_manage(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    query_dequant_scale: torch.Tensor,
    key_dequant_scale: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    block_table: torch.Tensor,
    token_rows: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step: Step,
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    tokens_per_row: int = 1,
) -> IndexerManageResult:
    """LIM-C8: the C8 (Hadamard-rotated int8) indexer + residency manage (reference).

    Indexer arguments are ``quant_lightning_indexer``'s (int8 query ``[T, H, D]`` and
    key ``[blocks, block_size, 1, D]``, fp16 dequant scales ``[T, H]`` and
    ``[blocks, block_size, 1]``; produce them with
    ``ops.hadamard.prepare_quant_indexer_inputs``). Residency arguments and results
    are :func:`lightning_indexer_manage`'s.
    """
    indexer = quant_lightning_indexer
    topk = indexer(
        query,
        key,
        weights,
        query_dequant_scale,
        key_dequant_scale,
        actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key,
        block_table=block_table,
        query_quant_mode=query_quant_mode,
        key_quant_mode=key_quant_mode,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=sparse_count,
        sparse_mode=sparse_mode,
    )
    return residency_after_indexer(
        topk,
        slot_token=slot_token,
        slot_stamp=slot_stamp,
        row_req=row_req,
        token_rows=token_rows,
        req_ids=req_ids,
        stable_len=stable_len,
        step=step,
        tokens_per_row=tokens_per_row,
    )


# ------------------------------------------------------------------- Copy-SFA
def _check_copy_sfa(query, query_rope, host, hot, sparse_indices, miss_count):
    """Shape checks shared by both rungs; returns (T, K, Dl, Dr)."""
    if query.dim() != 3 or query_rope is None or query_rope.dim() != 3 or query_rope.shape[:2] != query.shape[:2]:
        raise ValueError("query [T, N, Dl] and query_rope [T, N, Dr] are required and must agree on T, N")
    num_tokens, _, d_latent = query.shape
    d_rope = query_rope.shape[2]
    if hot.dim() != 3 or hot.shape[2] != d_latent + d_rope:
        raise ValueError(f"hot must be [R, Hh, Dl + Dr] = [R, Hh, {d_latent + d_rope}], got {tuple(hot.shape)}")
    if not hot.is_contiguous():
        raise ValueError("hot must be contiguous (it is attended as the flat buffer [R*Hh, D])")
    if host.dim() != 2 or host.shape[1] != hot.shape[2]:
        raise ValueError(f"host must be [S, {hot.shape[2]}] (this layer's host rows), got {tuple(host.shape)}")
    if host.dtype != hot.dtype:
        raise ValueError(f"host dtype {host.dtype} != hot dtype {hot.dtype}: miss copies are bit copies")
    if sparse_indices.shape[0] != num_tokens or sparse_indices.dim() not in (2, 3):
        raise ValueError(
            f"sparse_indices must be [T, 1, K] (or [T, K]) with T={num_tokens}, got {tuple(sparse_indices.shape)}"
        )
    if tuple(miss_count.shape) != (hot.shape[0],):
        raise ValueError(f"miss_count must be [R] = [{hot.shape[0]}], got {tuple(miss_count.shape)}")
    return num_tokens, sparse_indices.reshape(num_tokens, -1).shape[1], d_latent, d_rope


def _tokens_per_row(tokens_per_row: Optional[int], miss_tokens: torch.Tensor, k: int) -> int:
    """Tokens a row may serve: ``tokens_per_row``, or (``None``) the miss lists' width
    ``n * K`` over ``K`` (a width that is no multiple of ``K``, ``min(n * K, Hh)``, needs it
    given). The lists are ``K .. n * K`` wide."""
    width = miss_tokens.shape[-1]
    if tokens_per_row is None:
        if k <= 0 or width % k:
            raise ValueError(
                f"miss_tokens are {width} wide for K = {k}: pass tokens_per_row (lists of min(n * K, Hh) entries)"
            )
        tokens_per_row = width // k
    n = _check_tokens_per_row(tokens_per_row)
    if not k <= width <= n * k:
        raise ValueError(
            f"miss_tokens must be [R, K .. {n} x K] for {n} tokens per row, got {tuple(miss_tokens.shape)}"
        )
    return n


def _check_row_ownership(
    sparse_indices: torch.Tensor,
    token_rows: torch.Tensor,
    miss_count: torch.Tensor,
    hot_tokens: int,
    overflow_rows: int = 0,
) -> None:
    """The fused kernel's work split, made a checked precondition of the op.

    Each token copies its own row's misses before attending, so: every row with
    misses is owned by a token, and a token only attends to its own row's slots (or to
    rows of the overflow area, ``R * Hh`` on, which nothing in the launch writes).
    """
    num_tokens = token_rows.shape[0]
    idx = sparse_indices.reshape(num_tokens, -1).to(torch.int64)
    tr = token_rows.to(device=idx.device)
    valid = idx >= 0
    lo = (tr * hot_tokens)[:, None]
    hot_rows = miss_count.shape[0] * hot_tokens
    in_overflow = (idx >= hot_rows) & (idx < hot_rows + overflow_rows)
    outside = valid & ~in_overflow & ((tr[:, None] < 0) | (idx < lo) | (idx >= lo + hot_tokens))
    if bool(outside.any()):
        t = int(torch.nonzero(outside)[0, 0])
        raise ValueError(
            f"query token {t} (row {int(tr[t])}) attends to hot rows outside its own row's "
            f"slots [row*Hh, (row+1)*Hh) and the overflow area: sparse_indices must come from LIM for "
            "these token_rows"
        )
    owned = torch.zeros(miss_count.shape[0], dtype=torch.bool, device=tr.device)
    owned[tr[tr >= 0]] = True
    orphan = (miss_count.to(tr.device) > 0) & ~owned
    if bool(orphan.any()):
        raise ValueError(
            f"rows {torch.nonzero(orphan).flatten()[:8].tolist()} have misses but no query token "
            "in token_rows: every row with misses must be owned by a token"
        )


@implements("copy_sparse_flash_attention", "reference")
def copy_sparse_flash_attention(
    query: torch.Tensor,
    host: torch.Tensor,
    hot: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor,
    token_rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
    layout_query: str = "TND",
    attention_mode: int = 2,
    overflow: Optional[torch.Tensor] = None,
    tokens_per_row: Optional[int] = None,
) -> torch.Tensor:
    """Copy-SFA: copy the miss rows host -> hot buffer, then sparse MLA attention over it.

    query ``[T, N, Dl]``, query_rope ``[T, N, Dr]`` (TND); host ``[S, Dl+Dr]`` this
    layer's host rows; hot ``[R, Hh, Dl+Dr]`` this layer's hot buffer (contiguous,
    mutated: the misses land in it); sparse_indices int32 ``[T, 1, K]`` flat hot rows
    (LIM's ``sparse_indices``); token_rows int32 ``[T]``; miss_tokens / miss_slots
    int32 ``[R, W]`` (``W = K``, or ``min(n * K, Hh)`` when up to ``n`` tokens share a
    row: ``tokens_per_row``, default ``W / K``), miss_count int32 ``[R]`` (LIM's residency
    step); token_table int32 ``[R, max_ctx]`` (logical position -> host slot per row);
    overflow ``[O, Dl+Dr]`` (optional): the overflow area, read where ``sparse_indices``
    hold ``R * Hh + i`` (its row ``i``; written before the op, not by it). Returns
    ``[T, N, Dl]`` in query's dtype.

    Preconditions (checked here, assumed by the fused kernel): ``token_rows`` as in
    LIM; a token's valid indices lie in its own row's slots or the overflow area; every
    row with misses is owned by a token.
    """
    if attention_mode != 2 or layout_query != "TND":
        raise ValueError("copy_sparse_flash_attention is defined for attention_mode=2 (MLA absorb) and TND queries")
    _check_copy_sfa(query, query_rope, host, hot, sparse_indices, miss_count)
    rows, hot_tokens, dim = hot.shape
    k = sparse_indices.reshape(query.shape[0], -1).shape[1]
    tr = _check_token_rows(token_rows, query.shape[0], rows, _tokens_per_row(tokens_per_row, miss_tokens, k))
    _check_overflow(overflow, hot)
    over_rows = 0 if overflow is None else overflow.shape[0]
    _check_row_ownership(sparse_indices, tr, miss_count, hot_tokens, over_rows)

    copy = copy_miss_rows
    copy(host, hot, miss_tokens, miss_slots, miss_count, token_table)
    flat = hot.view(rows * hot_tokens, dim)
    if overflow is not None:  # the spec: one flat space, the area's rows after the hot buffer's
        flat = torch.cat([flat, overflow.to(flat.device)])
    d_latent = query.shape[2]
    attend = sparse_mla_attention
    return attend(
        query,
        flat[:, :d_latent],
        None,
        sparse_indices,
        scale_value,
        query_rope=query_rope,
        key_rope=flat[:, d_latent:],
        layout_query="TND",
        layout_kv="flat",
        attention_mode=2,
    )


def _check_overflow(overflow: Optional[torch.Tensor], hot: torch.Tensor) -> None:
    if overflow is None:
        return
    if overflow.dim() != 2 or overflow.shape[1] != hot.shape[2] or overflow.dtype != hot.dtype:
        raise ValueError(
            f"overflow must be {hot.dtype} [O, {hot.shape[2]}] (rows like the hot buffer's), got "
            f"{overflow.dtype} {tuple(overflow.shape)}"
        )
    if not overflow.is_contiguous():
        raise ValueError("overflow must be contiguous (it is read as rows after the hot buffer's)")


# ------------------------------------------------------------------ fused rung
def _i32(t: torch.Tensor, device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int32)


def _step_tensor(step: Step, device) -> torch.Tensor:
    """int64 ``[1]`` on the device. Pass a device tensor to keep a graph capture valid."""
    if isinstance(step, torch.Tensor):
        return step.reshape(1).to(device=device, dtype=torch.int64)
    if int(step) < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return torch.tensor([int(step)], dtype=torch.int64, device=device)


def _lim_result(outputs) -> IndexerManageResult:
    topk, sparse, hit_mask, slots, miss_count, miss_tokens, miss_slots = outputs
    return IndexerManageResult(
        topk_indices=topk,
        sparse_indices=sparse,
        residency=ResidencyStep(
            hit_mask=hit_mask, slots=slots, miss_count=miss_count, miss_tokens=miss_tokens, miss_slots=miss_slots
        ),
    )


def _check_state_shapes(slot_token, slot_stamp, row_req, sparse_count, tokens_per_row=1) -> None:
    if slot_token.dim() != 2 or slot_stamp.shape != slot_token.shape or tuple(row_req.shape) != (slot_token.shape[0],):
        raise ValueError(
            "residency state must be slot_token int32 [R, Hh], slot_stamp int64 [R, Hh], row_req int64 [R]"
        )
    if slot_token.dtype != torch.int32 or slot_stamp.dtype != torch.int64 or row_req.dtype != torch.int64:
        raise ValueError("residency state dtypes: slot_token int32, slot_stamp int64, row_req int64")
    if slot_token.shape[1] < sparse_count:
        raise ValueError(f"hot_tokens {slot_token.shape[1]} < sparse_count {sparse_count}")
    _check_tokens_per_row(tokens_per_row)


@implements("lightning_indexer_manage", "fused", unavailable=lambda: fused_op_unavailable(LIM_KERNEL))
def lightning_indexer_manage_fused(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query,
    actual_seq_lengths_key,
    block_table,
    token_rows,
    req_ids,
    stable_len,
    step: Step,
    slot_token,
    slot_stamp,
    row_req,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=2048,
    sparse_mode=3,
    tokens_per_row=1,
) -> IndexerManageResult:
    """AscendC LIM (``npu_fused_lightning_indexer_manage``); arguments as the reference.

    Shape checks only (no device reads): data preconditions are the caller's, as for
    the torch_npu operators.
    """
    _check_state_shapes(slot_token, slot_stamp, row_req, sparse_count, tokens_per_row)
    dev = query.device
    outputs = fused_op(LIM_KERNEL)(
        query,
        key,
        weights,
        _i32(actual_seq_lengths_query, dev),
        _i32(actual_seq_lengths_key, dev),
        _i32(block_table, dev),
        _i32(token_rows, dev),
        req_ids.to(device=dev, dtype=torch.int64),
        _i32(stable_len, dev),
        _step_tensor(step, dev),
        slot_token,
        slot_stamp,
        row_req,
        layout_query,
        layout_key,
        int(sparse_count),
        int(sparse_mode),
        int(tokens_per_row),
    )
    return _lim_result(outputs)


@implements("quant_lightning_indexer_manage", "fused", unavailable=lambda: fused_op_unavailable(LIM_C8_KERNEL))
def quant_lightning_indexer_manage_fused(
    query,
    key,
    weights,
    query_dequant_scale,
    key_dequant_scale,
    *,
    actual_seq_lengths_query,
    actual_seq_lengths_key,
    block_table,
    token_rows,
    req_ids,
    stable_len,
    step: Step,
    slot_token,
    slot_stamp,
    row_req,
    query_quant_mode=0,
    key_quant_mode=0,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=2048,
    sparse_mode=3,
    tokens_per_row=1,
) -> IndexerManageResult:
    """AscendC LIM-C8 (``npu_fused_quant_lightning_indexer_manage``); arguments as the reference.

    A ``[blocks, block_size, 1, 1]`` key scale is reshaped to ``[blocks, block_size, 1]``.
    """
    _check_state_shapes(slot_token, slot_stamp, row_req, sparse_count, tokens_per_row)
    if key_dequant_scale.dim() == 4:
        key_dequant_scale = key_dequant_scale.reshape(key_dequant_scale.shape[:3])
    dev = query.device
    outputs = fused_op(LIM_C8_KERNEL)(
        query,
        key,
        weights,
        query_dequant_scale,
        key_dequant_scale,
        _i32(actual_seq_lengths_query, dev),
        _i32(actual_seq_lengths_key, dev),
        _i32(block_table, dev),
        _i32(token_rows, dev),
        req_ids.to(device=dev, dtype=torch.int64),
        _i32(stable_len, dev),
        _step_tensor(step, dev),
        slot_token,
        slot_stamp,
        row_req,
        int(query_quant_mode),
        int(key_quant_mode),
        layout_query,
        layout_key,
        int(sparse_count),
        int(sparse_mode),
        int(tokens_per_row),
    )
    return _lim_result(outputs)


_REGISTERED_HOST: dict = {}


def register_host_memory(host: torch.Tensor, device_address: Optional[int] = None) -> int:
    """Make a host pool tensor addressable by the Copy-SFA kernel; returns its device address.

    ``device_address``: the device-side address of ``host.data_ptr()`` when the memory
    is already mapped (MemFabric); otherwise the extension registers it with
    ``aclrtHostRegister``. Idempotent per base address.
    """
    key = (host.data_ptr(), host.numel() * host.element_size())
    if key not in _REGISTERED_HOST:
        _REGISTERED_HOST[key] = int(fused_op(REGISTER_HOST_KERNEL)(host, int(device_address or 0)))
    return _REGISTERED_HOST[key]


def _copy_sfa_unavailable():
    """Copy-SFA needs its kernel and the host-memory registration it calls on first use."""
    return fused_op_unavailable(COPY_SFA_KERNEL) or fused_op_unavailable(REGISTER_HOST_KERNEL)


def _copy_rows_unavailable():
    """The miss copy needs its kernel and the host-memory registration it calls on first use."""
    return fused_op_unavailable(COPY_ROWS_KERNEL) or fused_op_unavailable(REGISTER_HOST_KERNEL)


def copy_miss_rows_rows_fused(
    host: torch.Tensor,
    hot: torch.Tensor,
    rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """AscendC miss copy (``npu_fused_copy_miss_rows``), rows form: ``hot[rows[b],
    miss_slots[b, i]] = host[token_table[rows[b], miss_tokens[b, i]]]`` for ``i <
    miss_count[b]``, only the misses, bit-exact, nothing else written; arguments as
    ``residency.copy_miss_rows_rows`` (``hot`` ``[R', H, D]``: a hot buffer or the overflow
    area). ``host`` (``[S, D]`` host rows) is read by the kernel from registered host memory
    (registered here on first eager use; under ``torch.compile`` or a graph capture it must
    already be: the engine registers its layers at build time). No host read of device
    data: capturable."""
    if host.device.type == "cpu" and not torch.compiler.is_compiling():
        register_host_memory(host)
    dev = hot.device
    fused_op(COPY_ROWS_KERNEL)(
        host,
        hot,
        _i32(rows, dev),
        _i32(miss_tokens, dev),
        _i32(miss_slots, dev),
        _i32(miss_count, dev),
        _i32(token_table, dev),
    )


@implements("copy_miss_rows", "fused", unavailable=_copy_rows_unavailable, rows_form=copy_miss_rows_rows_fused)
def copy_miss_rows_fused(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """Every row's miss copy with the AscendC kernel: the rows form over rows ``0..R-1``."""
    rows = torch.arange(hot.shape[0], dtype=torch.int32, device=hot.device)
    copy_miss_rows_rows_fused(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)


@implements("copy_sparse_flash_attention", "fused", unavailable=_copy_sfa_unavailable)
def copy_sparse_flash_attention_fused(
    query,
    host,
    hot,
    sparse_indices,
    scale_value,
    *,
    query_rope,
    token_rows,
    miss_tokens,
    miss_slots,
    miss_count,
    token_table,
    layout_query="TND",
    attention_mode=2,
    overflow=None,
    tokens_per_row=None,
) -> torch.Tensor:
    """AscendC Copy-SFA (``npu_fused_scatter_copy_sparse_flash_attention``); arguments as the reference.

    ``host`` may be a CPU tensor over registered host memory (it is registered with
    the extension on first eager use; under ``torch.compile`` it must already be) or a
    device-visible tensor.
    """
    if attention_mode != 2 or layout_query != "TND":
        raise ValueError("copy_sparse_flash_attention is defined for attention_mode=2 (MLA absorb) and TND queries")
    num_tokens, k, _, _ = _check_copy_sfa(query, query_rope, host, hot, sparse_indices, miss_count)
    n = _tokens_per_row(tokens_per_row, miss_tokens, k)
    _check_overflow(overflow, hot)
    if host.device.type == "cpu" and not torch.compiler.is_compiling():
        # Traced code cannot read an address: a compiled step relies on the registration
        # its eager steps (or the engine at build time) made; the op refuses an unregistered host.
        register_host_memory(host)
    dev = query.device
    return fused_op(COPY_SFA_KERNEL)(
        query,
        query_rope,
        host,
        hot,
        _i32(sparse_indices.reshape(num_tokens, 1, k), dev),
        _i32(token_rows, dev),
        _i32(miss_tokens, dev),
        _i32(miss_slots, dev),
        _i32(miss_count, dev),
        _i32(token_table, dev),
        float(scale_value),
        overflow,
        n,
    )
