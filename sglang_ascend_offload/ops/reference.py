"""Reference implementations (plain torch, any device): the specification of each op.

Every other rung (``triton``, ``npu``, ``fused``) is tested against these functions on
the same inputs. Argument names and layouts mirror the torch_npu operators
(``npu_lightning_indexer``, ``npu_quant_lightning_indexer``,
``npu_sparse_flash_attention``); deviations are listed in ``docs/operators.md``.

Ops registered here (rung ``reference``):

* ``lightning_indexer``        logical top-k positions per query token (bf16/fp32 keys)
* ``quant_lightning_indexer``  the same over int8 Hadamard-rotated query/key + fp16 scales
* ``sparse_mla_attention``     absorbed-MLA attention over gathered top-k latent rows
* ``gather_rows`` / ``scatter_rows``  bit-exact row copies

Shared conventions
------------------
TND query layout: query tokens of all requests are concatenated, ``[T, ...]``;
``actual_seq_lengths_query`` (int32 ``[B]``) holds *cumulative* token counts (request
``b`` owns tokens ``cu[b-1] .. cu[b]-1``); tokens past ``cu[-1]`` are padding and
produce ``-1`` indices / zero attention output. ``actual_seq_lengths_key`` /
``actual_seq_lengths_kv`` (int32 ``[B]``) hold each request's KV length (not
cumulative). Query token ``i`` of request ``b`` sits at position
``kv_len[b] - q_len[b] + i``; under ``sparse_mode=3`` (right-down causal) it sees
positions ``0 .. position``; under ``sparse_mode=0`` it sees ``0 .. kv_len[b]-1``.

PA_BSND: a paged cache ``[blocks, block_size, 1, D]``; logical position ``p`` of
request ``b`` lives at block ``block_table[b, p // block_size]``, offset
``p % block_size``.

Metadata tensors are read on the host (small ``.tolist()`` syncs): this rung is the
specification and the CPU path, not the fast path on a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .contract import implements

# Memory bounds. The indexer walks the context in chunks of INDEXER_CONTEXT_CHUNK
# positions, and query tokens in groups sized so that one step's float32 working set
# (gathered keys + per-head logits) stays under INDEXER_SCORE_BUDGET elements
# (64 MiB). Attention groups query tokens the same way under ATTENTION_BUDGET.
# Group sizes depend only on shapes, never on data, so results never depend on them
# (the indexer merges chunks exactly; attention computes each token independently).
INDEXER_CONTEXT_CHUNK = 4096
INDEXER_SCORE_BUDGET = 1 << 24
ATTENTION_BUDGET = 1 << 24

SUPPORTED_SPARSE_MODES = (0, 3)
INT8_SQUARE = 127 * 127  # largest |q_int8 * k_int8| term of an int8 dot product


# --------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class TokenLayout:
    """Where each TND query token belongs.

    request:  int64 [T]  request index of the token; -1 for padding tokens
    position: int64 [T]  the token's own position in its request's KV sequence
    visible:  int64 [T]  number of KV positions it may attend to (0 for padding)
    kv_len:   int64 [B]  KV length per request
    """

    request: torch.Tensor
    position: torch.Tensor
    visible: torch.Tensor
    kv_len: torch.Tensor


def token_layout(
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    num_tokens: int,
    sparse_mode: int,
    device: torch.device,
) -> TokenLayout:
    """Validate TND metadata and map every query token to (request, position, visible)."""
    if sparse_mode not in SUPPORTED_SPARSE_MODES:
        raise ValueError(f"sparse_mode={sparse_mode}: supported modes are {SUPPORTED_SPARSE_MODES}")
    if actual_seq_lengths_query is None or actual_seq_lengths_key is None:
        raise ValueError("TND layout needs actual_seq_lengths_query and actual_seq_lengths_key/kv")
    cu = [int(v) for v in actual_seq_lengths_query.reshape(-1).tolist()]
    kv = [int(v) for v in actual_seq_lengths_key.reshape(-1).tolist()]
    if len(cu) != len(kv):
        raise ValueError(f"{len(cu)} cumulative query lengths but {len(kv)} key lengths")
    starts = [0] + cu[:-1]
    q_lens = [end - start for start, end in zip(starts, cu)]
    if any(n < 0 for n in q_lens):
        raise ValueError(f"actual_seq_lengths_query must be non-decreasing cumulative counts: {cu}")
    if cu and cu[-1] > num_tokens:
        raise ValueError(f"actual_seq_lengths_query ends at {cu[-1]} but there are {num_tokens} tokens")
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv)):
        if kv_len < q_len:
            raise ValueError(f"request {b}: kv length {kv_len} < query length {q_len}")

    request = torch.full((num_tokens,), -1, dtype=torch.int64)
    position = torch.zeros(num_tokens, dtype=torch.int64)
    visible = torch.zeros(num_tokens, dtype=torch.int64)
    if cu and cu[-1] > 0:
        n_real = cu[-1]
        q_len_t = torch.tensor(q_lens, dtype=torch.int64)
        kv_t = torch.tensor(kv, dtype=torch.int64)
        req = torch.repeat_interleave(torch.arange(len(cu), dtype=torch.int64), q_len_t)
        offset = torch.arange(n_real, dtype=torch.int64) - torch.tensor(starts)[req]
        pos = kv_t[req] - q_len_t[req] + offset
        request[:n_real] = req
        position[:n_real] = pos
        visible[:n_real] = pos + 1 if sparse_mode == 3 else kv_t[req]
    return TokenLayout(
        request=request.to(device),
        position=position.to(device),
        visible=visible.to(device),
        kv_len=torch.tensor(kv, dtype=torch.int64, device=device),
    )


def paged_rows(
    block_table: torch.Tensor, request: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat row numbers (into ``cache.reshape(-1, D)``) of logical ``positions``.

    request: int64 [n] (>= 0); positions: int64 [n, m] (valid positions only).
    """
    blocks = block_table[request.unsqueeze(1), torch.div(positions, block_size, rounding_mode="floor")]
    return blocks.to(torch.int64) * block_size + positions % block_size


def _check_paged(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"{name} must be PA_BSND [blocks, block_size, 1, D], got {tuple(cache.shape)}")


# ----------------------------------------------------------------------- the indexer
# score_fn(token_ids int64 [n], rows int64 [n, c]) -> float32 [n, H, c]: the per-head
# q.k logits of those tokens against those flat key rows (before ReLU and weights).
ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _indexer_topk(
    score_fn: ScoreFn,
    weights: torch.Tensor,
    layout: TokenLayout,
    block_table: torch.Tensor,
    block_size: int,
    head_dim: int,
    sparse_count: int,
) -> torch.Tensor:
    """Top-``sparse_count`` logical positions per token, chunked over context length.

    Scores ``sum_h w[t,h] * relu(logit[t,h,s])`` in float32; descending by score, ties
    to the lower position; ``-1`` where fewer positions are visible. Each chunk's
    candidates are merged into the running best with a *stable* descending sort of
    ``[running best, chunk]``: every running entry has a lower position than every
    chunk entry and equal running scores are already in position order, so stability
    yields the lower-position tie-break exactly, independent of the chunk size.
    """
    device = weights.device
    num_tokens, num_heads = weights.shape
    k = sparse_count
    best_score = torch.full((num_tokens, k), float("-inf"), dtype=torch.float32, device=device)
    best_pos = torch.full((num_tokens, k), -1, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return best_pos.to(torch.int32).unsqueeze(1)
    w32 = weights.to(torch.float32)
    visible = layout.visible
    max_visible = int(visible.max())
    for c0 in range(0, max_visible, INDEXER_CONTEXT_CHUNK):
        width = min(INDEXER_CONTEXT_CHUNK, max_visible - c0)
        chunk_pos = torch.arange(c0, c0 + width, dtype=torch.int64, device=device)
        active = torch.nonzero(visible > c0).flatten()  # tokens that see part of this chunk
        group = max(1, INDEXER_SCORE_BUDGET // (width * (num_heads + head_dim)))
        for g0 in range(0, active.numel(), group):
            tok = active[g0 : g0 + group]
            vis = visible[tok].unsqueeze(1)
            seen = chunk_pos.unsqueeze(0) < vis  # [n, width]
            safe_pos = torch.minimum(chunk_pos.unsqueeze(0), vis - 1)
            rows = paged_rows(block_table, layout.request[tok], safe_pos, block_size)
            logits = score_fn(tok, rows)  # [n, H, width]
            score = (torch.relu(logits) * w32[tok].unsqueeze(2)).sum(dim=1)
            score = score.masked_fill(~seen, float("-inf"))
            cand_score = torch.cat((best_score[tok], score), dim=1)
            cand_pos = torch.cat((best_pos[tok], chunk_pos.expand(tok.numel(), width)), dim=1)
            order = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :k]
            best_score[tok] = torch.gather(cand_score, 1, order)
            best_pos[tok] = torch.gather(cand_pos, 1, order)
    best_pos = torch.where(torch.isneginf(best_score), torch.full_like(best_pos, -1), best_pos)
    return best_pos.to(torch.int32).unsqueeze(1)


def _indexer_common_checks(query, key, weights, block_table, layout_query, layout_key, sparse_count):
    if layout_query != "TND" or layout_key != "PA_BSND":
        raise ValueError(
            f"layout_query={layout_query!r}, layout_key={layout_key!r}: the reference indexer "
            "implements layout_query='TND' with layout_key='PA_BSND' (what SGLang's NPU path uses)"
        )
    if query.dim() != 3:
        raise ValueError(f"query must be TND [T, H, D], got {tuple(query.shape)}")
    _check_paged("key", key)
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"query head dim {query.shape[-1]} != key head dim {key.shape[-1]}")
    if tuple(weights.shape) != tuple(query.shape[:2]):
        raise ValueError(f"weights must be [T, H] = {tuple(query.shape[:2])}, got {tuple(weights.shape)}")
    if block_table is None or block_table.dim() != 2:
        raise ValueError("PA_BSND needs a 2-D block_table [B, max_blocks]")
    if sparse_count < 1:
        raise ValueError(f"sparse_count must be >= 1, got {sparse_count}")


@implements("lightning_indexer", "reference")
def lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    block_table: torch.Tensor,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
) -> torch.Tensor:
    """DSA lightning indexer: logical top-k KV positions per query token.

    query   [T, H, D] bf16/fp16/fp32 (TND); key [blocks, block_size, 1, D] (PA_BSND
    index-K cache, same family of dtypes); weights [T, H]; actual_seq_lengths_query
    int32 [B] cumulative; actual_seq_lengths_key int32 [B] per-request KV length;
    block_table int32 [B, max_blocks].

    Returns int32 ``[T, 1, sparse_count]``: positions inside the request
    (``0..kv_len-1``) ordered by ``score[s] = sum_h w[t,h] * relu(q[t,h]·k[s])``
    (float32) descending, ties to the lower position, ``-1``-padded when fewer than
    ``sparse_count`` positions are visible (see the module docstring for visibility).
    """
    _indexer_common_checks(query, key, weights, block_table, layout_query, layout_key, sparse_count)
    device = query.device
    layout = token_layout(actual_seq_lengths_query, actual_seq_lengths_key, query.shape[0], sparse_mode, device)
    q32 = query.to(torch.float32)
    key_flat = key.reshape(-1, key.shape[-1])

    def score_fn(tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        keys = key_flat[rows].to(torch.float32)  # [n, c, D]
        return torch.bmm(q32[tok], keys.transpose(1, 2))

    return _indexer_topk(score_fn, weights, layout, block_table.to(device), key.shape[1], key.shape[-1], sparse_count)


@implements("quant_lightning_indexer", "reference")
def quant_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    query_dequant_scale: torch.Tensor,
    key_dequant_scale: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    block_table: torch.Tensor,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
) -> torch.Tensor:
    """C8 lightning indexer (LIM-C8 scoring): int8 query/key with fp16 dequant scales.

    query int8 [T, H, D]; key int8 [blocks, block_size, 1, D]; weights [T, H];
    query_dequant_scale [T, H] (fp16; fp32 accepted); key_dequant_scale
    [blocks, block_size, 1] (``[..., 1, 1]`` accepted). Produce them with
    :func:`sglang_ascend_offload.ops.hadamard.prepare_quant_indexer_inputs`.

    The per-head logit is ``(sq[t,h] * sk[s]) * (q_int8[t,h] · k_int8[s])``: the dot
    of the dequantised vectors, with the integer dot computed exactly (float32 is exact
    for ``D * 127**2 < 2**24``, i.e. ``D <= 1040``). Everything else (visibility,
    ordering, ties, ``-1`` padding, output ``[T, 1, sparse_count]`` int32) is
    :func:`lightning_indexer`.
    """
    if query_quant_mode != 0 or key_quant_mode != 0:
        raise ValueError("only per-token(-head) quantisation (quant mode 0) is defined")
    if query.dtype != torch.int8 or key.dtype != torch.int8:
        raise ValueError(f"query/key must be int8, got {query.dtype} / {key.dtype}")
    _indexer_common_checks(query, key, weights, block_table, layout_query, layout_key, sparse_count)
    if query.shape[-1] * INT8_SQUARE >= 1 << 24:
        raise ValueError(f"head dim {query.shape[-1]} too large for exact float32 int8 dots")
    if tuple(query_dequant_scale.shape) != tuple(query.shape[:2]):
        raise ValueError(f"query_dequant_scale must be [T, H], got {tuple(query_dequant_scale.shape)}")
    key_scale = key_dequant_scale.reshape(-1)
    if key_scale.numel() != key.shape[0] * key.shape[1]:
        raise ValueError(
            f"key_dequant_scale must be [blocks, block_size, 1] = {tuple(key.shape[:3])}, "
            f"got {tuple(key_dequant_scale.shape)}"
        )
    device = query.device
    layout = token_layout(actual_seq_lengths_query, actual_seq_lengths_key, query.shape[0], sparse_mode, device)
    q_int = query.to(torch.float32)
    q_scale = query_dequant_scale.to(torch.float32)
    k_scale = key_scale.to(torch.float32)
    key_flat = key.reshape(-1, key.shape[-1])

    def score_fn(tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        dots = torch.bmm(q_int[tok], key_flat[rows].to(torch.float32).transpose(1, 2))  # exact
        return dots * (q_scale[tok].unsqueeze(2) * k_scale[rows].unsqueeze(1))

    return _indexer_topk(score_fn, weights, layout, block_table.to(device), key.shape[1], key.shape[-1], sparse_count)


def indexer_scores_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    block_table: torch.Tensor,
    sparse_mode: int = 3,
) -> torch.Tensor:
    """Dense float32 indexer scores ``[T, max_kv_len]`` (``-inf`` where not visible).

    For tests and diagnostics on small inputs (memory is ``T * max_kv_len``).
    """
    device = query.device
    layout = token_layout(actual_seq_lengths_query, actual_seq_lengths_key, query.shape[0], sparse_mode, device)
    width = int(layout.kv_len.max()) if layout.kv_len.numel() else 0
    out = torch.full((query.shape[0], width), float("-inf"), dtype=torch.float32, device=device)
    real = torch.nonzero(layout.visible > 0).flatten()
    if width == 0 or real.numel() == 0:
        return out
    pos = torch.arange(width, dtype=torch.int64, device=device).unsqueeze(0)
    vis = layout.visible[real].unsqueeze(1)
    rows = paged_rows(block_table.to(device), layout.request[real], torch.minimum(pos, vis - 1), key.shape[1])
    keys = key.reshape(-1, key.shape[-1])[rows].to(torch.float32)
    logits = torch.bmm(query[real].to(torch.float32), keys.transpose(1, 2))
    score = (torch.relu(logits) * weights[real].to(torch.float32).unsqueeze(2)).sum(dim=1)
    out[real] = score.masked_fill(pos >= vis, float("-inf"))
    return out


# ------------------------------------------------------------------ sparse attention
def _as_rows(name: str, cache: torch.Tensor) -> torch.Tensor:
    """Flat ``[S, D]`` view of a flat (``[S, D]`` / ``[S, 1, D]``) or paged cache."""
    if cache.dim() == 2:
        return cache
    if cache.dim() == 3 and cache.shape[1] == 1:
        return cache.reshape(cache.shape[0], cache.shape[2])
    if cache.dim() == 4 and cache.shape[2] == 1:
        return cache.reshape(-1, cache.shape[3])
    raise ValueError(f"{name}: expected [S, D], [S, 1, D] or [blocks, block_size, 1, D], got {tuple(cache.shape)}")


@implements("sparse_mla_attention", "reference")
def sparse_mla_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: Optional[torch.Tensor],
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    block_table: Optional[torch.Tensor] = None,
    actual_seq_lengths_query: Optional[torch.Tensor] = None,
    actual_seq_lengths_kv: Optional[torch.Tensor] = None,
    query_rope: Optional[torch.Tensor] = None,
    key_rope: Optional[torch.Tensor] = None,
    sparse_block_size: int = 1,
    layout_query: str = "TND",
    layout_kv: str = "PA_BSND",
    sparse_mode: int = 3,
    attention_mode: int = 2,
) -> torch.Tensor:
    """Sparse flash attention over the MLA latent cache in absorb mode.

    query [T, N, Dl], query_rope [T, N, Dr] (TND). ``value`` must be ``None`` or
    ``key`` itself: in absorbed MLA the latent rows are both keys and values.
    sparse_indices int32/int64 [T, 1, K] (or [T, K]); negative entries are ignored.

    layout_kv="PA_BSND": key [blocks, block_size, 1, Dl], key_rope [blocks,
    block_size, 1, Dr]; indices are logical positions in the token's request, mapped
    through ``block_table`` (needs ``actual_seq_lengths_query`` cumulative and
    ``actual_seq_lengths_kv`` per-request lengths); entries beyond what the token may
    see (``> position`` under ``sparse_mode=3``, ``>= kv_len`` under 0) are ignored.
    layout_kv="flat" (this project's extension, used for hot buffers): key [S, Dl]
    (or [S, 1, Dl]), key_rope [S, Dr]; indices are row numbers; ``>= S`` is an error.

    Per token: gather the K rows (ignored entries become zero rows), logits
    ``(q·k_latent + q_rope·k_rope) * scale_value`` in float32, softmax over the valid
    entries, ``out = p @ k_latent``, cast to ``query.dtype``; a token with no valid
    entry outputs zeros. Shapes of every step depend only on (T, N, K, Dl, Dr), and a
    token's result depends only on its gathered rows in index order, so gathering the
    same rows from different buffers gives bit-identical outputs.
    """
    _check_absorb_args(
        query,
        query_rope,
        key,
        key_rope,
        value,
        attention_mode=attention_mode,
        sparse_block_size=sparse_block_size,
        layout_query=layout_query,
    )
    num_tokens = query.shape[0]
    indices = sparse_indices.reshape(num_tokens, -1).to(device=query.device, dtype=torch.int64)
    latent, rope = _latent_and_rope_rows(query, query_rope, key, key_rope)

    if layout_kv == "PA_BSND":
        _check_paged("key", key)
        _check_paged("key_rope", key_rope)
        if block_table is None:
            raise ValueError("layout_kv='PA_BSND' needs block_table")
        layout = token_layout(actual_seq_lengths_query, actual_seq_lengths_kv, num_tokens, sparse_mode, query.device)
        valid = (indices >= 0) & (indices < layout.visible.unsqueeze(1))
        safe = torch.where(valid, indices, torch.zeros_like(indices))
        if not bool((layout.visible > 0).any()):
            return torch.zeros_like(query)  # only padding tokens (or nothing visible)
        req = layout.request.clamp(min=0)
        rows = paged_rows(block_table.to(query.device), req, safe, key.shape[1])
    elif layout_kv == "flat":
        # Checked in CPU eager runs only: on a device (or while tracing for a graph) the
        # check would be a host read of device data; an out-of-range row then fails in
        # the gather itself.
        if (
            indices.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and bool((indices >= latent.shape[0]).any())
        ):
            raise ValueError(f"sparse_indices hold rows >= {latent.shape[0]} (the buffer's row count)")
        valid = indices >= 0
        rows = torch.where(valid, indices, torch.zeros_like(indices))
    else:
        raise ValueError(f"layout_kv={layout_kv!r}: expected 'PA_BSND' or 'flat'")
    return _attend_gathered(query, query_rope, latent, rope, rows, valid, float(scale_value))


def _check_absorb_args(
    query, query_rope, key, key_rope, value, *, attention_mode: int, sparse_block_size: int, layout_query: str
) -> None:
    """The argument combinations :func:`sparse_mla_attention` defines (``ValueError`` otherwise)."""
    if attention_mode != 2:
        raise ValueError("only attention_mode=2 (MLA absorb) is defined")
    if sparse_block_size != 1:
        raise ValueError("only sparse_block_size=1 (token-level indices) is defined")
    if layout_query != "TND":
        raise ValueError(f"layout_query={layout_query!r}: only 'TND' is implemented")
    if query_rope is None or key_rope is None:
        raise ValueError("attention_mode=2 needs query_rope and key_rope")
    if value is not None and not (value is key or (value.data_ptr() == key.data_ptr() and value.shape == key.shape)):
        raise ValueError("value must be None or the key latent itself (absorbed MLA)")
    if query.dim() != 3 or query_rope.dim() != 3 or query_rope.shape[:2] != query.shape[:2]:
        raise ValueError(
            f"query [T,N,Dl] / query_rope [T,N,Dr] mismatch: {tuple(query.shape)} / {tuple(query_rope.shape)}"
        )


def _latent_and_rope_rows(query, query_rope, key, key_rope) -> Tuple[torch.Tensor, torch.Tensor]:
    """``key`` / ``key_rope`` as ``[S, Dl]`` / ``[S, Dr]`` row views, checked against the query."""
    latent = _as_rows("key", key)
    rope = _as_rows("key_rope", key_rope)
    if latent.shape[0] != rope.shape[0]:
        raise ValueError(f"key has {latent.shape[0]} rows but key_rope has {rope.shape[0]}")
    if latent.shape[1] != query.shape[2] or rope.shape[1] != query_rope.shape[2]:
        raise ValueError("head dims of key/key_rope do not match query/query_rope")
    return latent, rope


def _attend_gathered(
    query: torch.Tensor,
    query_rope: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each token over its gathered rows (see :func:`sparse_mla_attention`).

    rows int64 [T, K] (flat row numbers, in range), valid bool [T, K].
    """
    num_tokens, num_heads, d_latent = query.shape
    k = rows.shape[1]
    out = torch.zeros_like(query)
    if num_tokens == 0 or k == 0:
        return out
    d_rope = rope.shape[1]
    per_token = k * (d_latent + d_rope) + num_heads * (2 * k + d_latent)
    group = max(1, ATTENTION_BUDGET // per_token)
    for t0 in range(0, num_tokens, group):
        t1 = min(num_tokens, t0 + group)
        keep = valid[t0:t1].unsqueeze(2)  # [n, K, 1]
        lat = latent[rows[t0:t1]].to(torch.float32).masked_fill(~keep, 0.0)  # [n, K, Dl]
        rop = rope[rows[t0:t1]].to(torch.float32).masked_fill(~keep, 0.0)  # [n, K, Dr]
        logits = torch.bmm(query[t0:t1].to(torch.float32), lat.transpose(1, 2))
        logits = logits + torch.bmm(query_rope[t0:t1].to(torch.float32), rop.transpose(1, 2))
        logits = (logits * scale).masked_fill(~keep.transpose(1, 2), float("-inf"))  # [n, N, K]
        peak = logits.amax(dim=2, keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        probs = torch.exp(logits - peak)
        denom = probs.sum(dim=2, keepdim=True)
        weighted = torch.bmm(probs, lat)  # [n, N, Dl]
        safe_denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        result = torch.where(denom > 0, weighted / safe_denom, torch.zeros_like(weighted))
        out[t0:t1] = result.to(query.dtype)
    return out


# ------------------------------------------------------------------------ row copies
@implements("gather_rows", "reference")
def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` along dim 0: src [S, ...], index int32/int64 [n] -> [n, ...].

    Bit-exact copy on ``src``'s device (``index`` is moved there).
    """
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
    return src[index.to(device=src.device, dtype=torch.int64)]


@implements("scatter_rows", "reference")
def scatter_rows(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``dst[index] = rows`` in place along dim 0; returns ``dst``.

    dst [M, ...], index int32/int64 [n] (unique; with duplicates which row lands is
    unspecified), rows [n, ...] of dst's dtype (no implicit casts; moved to dst's
    device). Bit-exact.
    """
    if index.dim() != 1 or rows.shape[0] != index.shape[0] or rows.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"scatter_rows: index {tuple(index.shape)}, rows {tuple(rows.shape)}, dst {tuple(dst.shape)} do not fit"
        )
    if rows.dtype != dst.dtype:
        raise ValueError(f"scatter_rows: rows dtype {rows.dtype} != dst dtype {dst.dtype}")
    dst[index.to(device=dst.device, dtype=torch.int64)] = rows.to(dst.device)
    return dst
