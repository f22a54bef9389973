"""Plain-torch stand-ins for the CPU kernels SGLang 0.5.23's EAGLE (NextN / MTP) path
calls under ``is_cpu()`` (``kernels/ops/speculative/{cache_locs,eagle,spec_tree}.py``).

Semantics are those of SGLang's Triton kernels of the same purpose, for the chain
that ``--speculative-eagle-topk 1`` builds (the only tree shape the
``ascend_offload`` backend serves; the tree kernels raise for ``topk > 1``). Small
host loops over the batch: these run once per decode round, not per layer.
"""

from __future__ import annotations

import torch

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
]


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """``out_cache_loc[i*w:(i+1)*w] = req_to_token[req_pool_indices[i], seq_lens[i]:seq_lens[i]+w]``
    with ``w = topk * num_cols``: the draft slots already reserved after each request's
    committed length, request-major."""
    del pool_len
    w = topk * num_cols
    for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * w : (i + 1) * w] = req_to_token[row, start : start + w].to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``out_cache_loc`` = the concatenation over requests ``i`` of
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``."""
    del pool_len
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            out_cache_loc[at : at + n] = req_to_token[row, start:end].to(out_cache_loc.dtype)
        at += max(n, 0)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """``bonus_tokens[i]`` = the last accepted token of request ``i``
    (``accept_tokens.flat[i * accept_stride + accept_lens[i] - 1]``)."""
    flat = accept_tokens.reshape(-1)
    idx = torch.arange(accept_lens.shape[0], device=flat.device) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(flat[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """The slots of the accepted rows, compacted in order: for every entry ``p`` of
    ``accept_index`` (flattened) that is not ``-1``, ``out_cache_loc[accept_index[p]]``
    goes to the next position of ``accept_out_cache_loc``."""
    idx = accept_index.reshape(-1).to(torch.int64)
    kept = idx[idx != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def _require_chain(topk: int) -> None:
    if topk != 1:
        raise NotImplementedError(
            f"the CPU stand-in builds and verifies EAGLE chains only (--speculative-eagle-topk 1), got topk={topk}"
        )


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: int,
) -> None:
    """The verify chain of ``n = num_verify_tokens`` rows per request (topk 1):
    row ``j`` is at position ``seq_lens[b] + j``, follows row ``j - 1`` and sees the
    committed prefix plus rows ``0..j``. Outputs: ``positions [B*n]``,
    ``retrieve_index [B, n]`` (``b*n + j``), ``retrieve_next_token [B, n]`` (``j + 1``,
    ``-1`` last), ``retrieve_next_sibling`` (all ``-1``) and ``tree_mask`` in mode 0
    (full: per request an ``n x (seq_len + n)`` block after the blocks of the requests
    before it; prefix columns are left as the caller initialised them) or mode 1
    (``n x n`` per request)."""
    del parent_list, top_scores_index, spec_steps
    _require_chain(topk)
    n = int(num_verify_tokens)
    lens = [int(v) for v in seq_lens.tolist()]
    bs = len(lens)
    ar = torch.arange(n, dtype=torch.int64)
    causal = ar[None, :] <= ar[:, None]  # [n, n]: row j sees rows 0..j
    for b, length in enumerate(lens):
        positions[b * n : (b + 1) * n] = (length + ar).to(positions.dtype)
        retrieve_index[b] = (b * n + ar).to(retrieve_index.dtype)
        nxt = torch.cat([ar[1:], torch.tensor([-1])])
        retrieve_next_token[b] = nxt.to(retrieve_next_token.dtype)
        retrieve_next_sibling[b] = -1
    flat = tree_mask.reshape(-1)
    if int(tree_mask_mode) == 0:
        offset = 0
        for length in lens:
            block = flat[offset : offset + n * (length + n)].view(n, length + n)
            block[:, length:] = causal.to(flat.dtype)
            offset += n * (length + n)
    elif int(tree_mask_mode) == 1:
        flat[: bs * n * n] = causal.reshape(-1).repeat(bs).to(flat.dtype)
    else:
        raise NotImplementedError(
            f"tree mask mode {int(tree_mask_mode)} (bit-packed) is not provided by the CPU stand-in"
        )


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy acceptance along each request's chain: draft ``j`` (``candidates[b, j]``)
    is accepted while it equals the target's prediction after the last accepted row.
    ``accept_index[b, 0..a]`` = the accepted rows (flat ``b*n + j``; the rest left as
    given), ``accept_token_num[b] = a`` (drafts accepted), ``predicts[row]`` = the
    target's token after every accepted row (the last one is the bonus token)."""
    del retrive_next_sibling
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1)
    cand = candidates.reshape(bs, n)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted = 0
        cur = 0
        for _ in range(1, steps):
            cur = int(retrive_next_token[b, cur])
            if cur < 0:
                break
            token = target[last]
            if int(cand[b, cur]) != int(token):
                break
            predicts[last] = token
            accepted += 1
            last = int(retrive_index[b, cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = target[last]
