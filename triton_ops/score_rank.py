"""Launcher of the ``score_rank`` residency kernels (Triton rung of the score-aware policy).

:func:`score_rank_manage` takes the LRU op's arguments plus ``ranked`` and returns the
same :class:`~sglang_ascend_offload.ops.contract.ResidencyStep` as the torch
reference (:class:`~sglang_ascend_offload.sparse_decode.policies.ScoreRankManager`),
bit for bit, state included. Four launches (:mod:`.score_rank_kernels`), no host read
of device data (a 0-d step tensor is allowed: graph capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ascend_offload.ops.contract import ResidencyStep

from . import _launch
from .residency import DEFAULT_CONFIG, ResidencyKernelConfig, _check_state, _input

__all__ = ["ScoreRankKernelConfig", "score_rank_manage"]

_MAX_STEP = (1 << 31) - 2  # stamps 2*step+2 < 2**32: the packed key stays exact


@dataclass(frozen=True)
class ScoreRankKernelConfig:
    """Tile sizes (powers of two); results never depend on them.

    residency: the LRU kernels' tiles. rank_tile: elements of one ``[BLOCK_D, BLOCK_H]``
    comparison tile of ``_rank_key_kernel``; rank_block_d: ranked columns per tile.
    """

    residency: ResidencyKernelConfig = DEFAULT_CONFIG
    rank_tile: int = 16384
    rank_block_d: int = 256

    def __post_init__(self):
        _launch.check_pow2("rank_tile", self.rank_tile)
        _launch.check_pow2("rank_block_d", self.rank_block_d)

    def blocks(self, depth: int, hot: int):
        bd = max(1, min(self.rank_block_d, _launch.next_pow2(depth)))
        bh = max(1, min(self.rank_tile // bd, _launch.next_pow2(hot)))
        return bd, bh


DEFAULT_SCORE_CONFIG = ScoreRankKernelConfig()


def score_rank_manage(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step,
    ranked: torch.Tensor,
    config: ScoreRankKernelConfig = DEFAULT_SCORE_CONFIG,
) -> ResidencyStep:
    """One ``score_rank`` step of one layer on Triton kernels.

    State (mutated in place) and ``topk`` / ``req_ids`` / ``stable_len`` / ``step`` as
    in :func:`.residency.residency_manage`; ``ranked`` int32 ``[R, D]`` (``D >= K``,
    ``-1`` padding): the rows' positions in descending indexer-score order.
    """
    from . import residency_kernels as lru
    from . import score_rank_kernels as kern

    rows, hot = _check_state(slot_token, slot_stamp, row_req)
    device = slot_token.device
    topk = _input("topk", topk, torch.int32, device, (rows, None))
    k = topk.shape[1]
    ranked = _input("ranked", ranked, torch.int32, device, (rows, None))
    depth = ranked.shape[1]
    req_ids = _input("req_ids", req_ids, torch.int64, device, (rows,))
    stable_len = _input("stable_len", stable_len, torch.int32, device, (rows,))
    if hot < k:
        raise ValueError(f"hot_tokens {hot} < top_k {k}: the hot buffer must hold at least one top-k selection per row")
    if depth < k:
        raise ValueError(f"ranked depth {depth} < top_k {k}: ranked starts with the step's top-k")
    if isinstance(step, torch.Tensor):
        stamps = step.reshape(1).to(device=device, dtype=torch.int64) * 2 + torch.arange(
            1, 3, dtype=torch.int64, device=device
        )
    else:
        step = int(step)
        if not 0 <= step <= _MAX_STEP:
            raise ValueError(f"step={step}: must be in 0..{_MAX_STEP} (stamps are packed into 32 bits)")
        stamps = torch.tensor([2 * step + 1, 2 * step + 2], dtype=torch.int64).to(device, non_blocking=True)
    reason = _launch.device_unusable(device)
    if reason is not None:
        raise RuntimeError(f"score_rank (triton): {reason}")

    out = ResidencyStep(
        hit_mask=torch.empty((rows, k), dtype=torch.bool, device=device),
        slots=torch.empty((rows, k), dtype=torch.int32, device=device),
        miss_count=torch.empty((rows,), dtype=torch.int32, device=device),
        miss_tokens=torch.empty((rows, k), dtype=torch.int32, device=device),
        miss_slots=torch.empty((rows, k), dtype=torch.int32, device=device),
    )
    if rows == 0:
        return out
    cfg = config.residency
    miss_entry = torch.empty((rows, k), dtype=torch.int32, device=device)
    stamp_min = torch.empty((rows,), dtype=torch.int64, device=device)
    key = torch.empty((rows, hot), dtype=torch.int64, device=device)
    key_min = torch.empty((rows,), dtype=torch.int64, device=device)
    block_h = cfg.lookup_block_h(k, hot)
    if _launch.next_pow2(k) * block_h > _launch.MAX_BLOCK_ELEMS:
        raise ValueError(f"top_k {k}: lookup tile exceeds Triton's {_launch.MAX_BLOCK_ELEMS}-element block limit")
    lru._lookup_kernel[(rows,)](
        topk,
        req_ids,
        stable_len,
        row_req,
        slot_token,
        slot_stamp,
        out.hit_mask.view(torch.int8),
        out.slots,
        out.miss_count,
        out.miss_tokens,
        out.miss_slots,
        miss_entry,
        stamp_min,
        k,
        hot,
        KP=_launch.next_pow2(k),
        BLOCK_H=block_h,
    )
    bd, bh = config.blocks(depth, hot)
    kern._rank_key_kernel[(rows,)](
        slot_token, slot_stamp, ranked, stable_len, key, key_min, depth, hot, BLOCK_D=bd, BLOCK_H=bh
    )
    lru._victim_kernel[(rows,)](
        key, out.miss_count, key_min, out.miss_slots, req_ids, row_req, k, hot, BLOCK_H=cfg.victim_block_h(hot)
    )
    if k > 0:
        block_k = cfg.apply_block_k(k)
        lru._apply_kernel[(rows, _launch.cdiv(k, block_k))](
            slot_token,
            slot_stamp,
            out.hit_mask.view(torch.int8),
            out.slots,
            out.miss_count,
            out.miss_tokens,
            out.miss_slots,
            miss_entry,
            stamps,
            k,
            hot,
            BLOCK_K=block_k,
        )
    return out
