"""Launcher of the residency kernels: op ``residency_manage``, rung ``triton``.

:func:`residency_manage` takes exactly the arguments of the reference
(:func:`sglang_ascend_offload.ops.residency.residency_manage`) and returns
the same :class:`~sglang_ascend_offload.ops.contract.ResidencyStep`;
state and outputs are identical to the reference's, bit for bit.

All state stays on the device of ``slot_token``: the three state tensors are updated
in place by the kernels, and the step never syncs with the host (no ``.item()``,
no data-dependent shapes). Per call: three launches (see
:mod:`.residency_kernels`), five output tensors and two scratch tensors
(``int32 [R, K]`` miss-to-entry map, ``int64 [R]`` oldest evictable stamp), all
``torch.empty`` (every element is written by a kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ascend_offload.ops.contract import INT64_MAX, ResidencyStep

from . import _launch

__all__ = ["ResidencyKernelConfig", "residency_manage", "launch_residency_manage"]


@dataclass(frozen=True)
class ResidencyKernelConfig:
    """Tile sizes (powers of two). Results never depend on them, only speed does.

    lookup_tile: elements of one comparison tile of ``_lookup_kernel``
        (``next_pow2(K) x BLOCK_H``); ``BLOCK_H = lookup_tile // next_pow2(K)``
        clamped to ``[1, max_lookup_block_h]`` and to ``next_pow2(H)``.
    victim_block: slots per iteration of ``_victim_kernel``.
    apply_block: top-k columns per program of ``_apply_kernel``.
    """

    lookup_tile: int = 16384
    max_lookup_block_h: int = 256
    victim_block: int = 1024
    apply_block: int = 256

    def __post_init__(self):
        for name in ("lookup_tile", "max_lookup_block_h", "victim_block", "apply_block"):
            _launch.check_pow2(name, getattr(self, name))

    def lookup_block_h(self, k: int, h: int) -> int:
        block = max(1, self.lookup_tile // _launch.next_pow2(k))
        return max(1, min(block, self.max_lookup_block_h, _launch.next_pow2(h)))

    def victim_block_h(self, h: int) -> int:
        return max(1, min(self.victim_block, _launch.next_pow2(h)))

    def apply_block_k(self, k: int) -> int:
        return max(1, min(self.apply_block, _launch.next_pow2(k)))


DEFAULT_CONFIG = ResidencyKernelConfig()


def residency_manage(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step: int,
) -> ResidencyStep:
    """One exact-LRU step of one layer on the Triton kernels (same contract as the reference).

    slot_token int32 ``[R,H]``, slot_stamp int64 ``[R,H]``, row_req int64 ``[R]``:
    the layer's state, contiguous, on one device, mutated in place. topk int32
    ``[R,K]`` (``-1`` padding), req_ids int64 ``[R]``, stable_len int32 ``[R]``
    (other integer dtypes are converted), ``0 <= step`` (an int, or a 0-d int64 tensor:
    the form a captured device graph replays with a new step), ``H >= K``.
    """
    return launch_residency_manage(slot_token, slot_stamp, row_req, topk, req_ids, stable_len, step)


def launch_residency_manage(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step: int,
    config: ResidencyKernelConfig = DEFAULT_CONFIG,
) -> ResidencyStep:
    """:func:`residency_manage` with explicit tile sizes (tests use tiny tiles to
    exercise every chunking path on small shapes)."""
    rows, hot = _check_state(slot_token, slot_stamp, row_req)
    device = slot_token.device
    topk = _input("topk", topk, torch.int32, device, (rows, None))
    k = topk.shape[1]
    req_ids = _input("req_ids", req_ids, torch.int64, device, (rows,))
    stable_len = _input("stable_len", stable_len, torch.int32, device, (rows,))
    if hot < k:
        raise ValueError(f"hot_tokens {hot} < top_k {k}: the hot buffer must hold at least one top-k selection per row")
    if isinstance(step, torch.Tensor):  # device-side step: nothing read on the host (graph capture)
        stamps = step.reshape(1).to(device=device, dtype=torch.int64) * 2 + torch.arange(
            1, 3, dtype=torch.int64, device=device
        )
    else:
        step = int(step)
        if step < 0 or 2 * step + 2 > INT64_MAX:
            raise ValueError(f"step={step}: must satisfy 0 <= step and 2*step+2 <= int64 max")
        stamps = torch.tensor([2 * step + 1, 2 * step + 2], dtype=torch.int64).to(device, non_blocking=True)
    reason = _launch.device_unusable(device)
    if reason is not None:
        raise RuntimeError(f"residency_manage (triton): {reason}")

    hit_mask = torch.empty((rows, k), dtype=torch.bool, device=device)
    slots = torch.empty((rows, k), dtype=torch.int32, device=device)
    miss_count = torch.empty((rows,), dtype=torch.int32, device=device)
    miss_tokens = torch.empty((rows, k), dtype=torch.int32, device=device)
    miss_slots = torch.empty((rows, k), dtype=torch.int32, device=device)
    out = ResidencyStep(
        hit_mask=hit_mask, slots=slots, miss_count=miss_count, miss_tokens=miss_tokens, miss_slots=miss_slots
    )
    if rows == 0:
        return out
    miss_entry = torch.empty((rows, k), dtype=torch.int32, device=device)
    evict_min = torch.empty((rows,), dtype=torch.int64, device=device)

    block_h = config.lookup_block_h(k, hot)
    if _launch.next_pow2(k) * block_h > _launch.MAX_BLOCK_ELEMS:
        raise ValueError(
            f"top_k {k}: the lookup tile [{_launch.next_pow2(k)}, {block_h}] exceeds Triton's "
            f"{_launch.MAX_BLOCK_ELEMS}-element block limit"
        )

    from . import residency_kernels as kern  # imports triton

    kern._lookup_kernel[(rows,)](
        topk,
        req_ids,
        stable_len,
        row_req,
        slot_token,
        slot_stamp,
        hit_mask.view(torch.int8),
        slots,
        miss_count,
        miss_tokens,
        miss_slots,
        miss_entry,
        evict_min,
        k,
        hot,
        KP=_launch.next_pow2(k),
        BLOCK_H=block_h,
    )
    kern._victim_kernel[(rows,)](
        slot_stamp,
        miss_count,
        evict_min,
        miss_slots,
        req_ids,
        row_req,
        k,
        hot,
        BLOCK_H=config.victim_block_h(hot),
    )
    if k > 0:
        block_k = config.apply_block_k(k)
        kern._apply_kernel[(rows, _launch.cdiv(k, block_k))](
            slot_token,
            slot_stamp,
            hit_mask.view(torch.int8),
            slots,
            miss_count,
            miss_tokens,
            miss_slots,
            miss_entry,
            stamps,
            k,
            hot,
            BLOCK_K=block_k,
        )
    return out


# ---------------------------------------------------------------------------- checks
def _check_state(slot_token: torch.Tensor, slot_stamp: torch.Tensor, row_req: torch.Tensor):
    """State is mutated in place: exact dtypes, contiguous, one device, or an error."""
    for name, t, dtype, dim in (
        ("slot_token", slot_token, torch.int32, 2),
        ("slot_stamp", slot_stamp, torch.int64, 2),
        ("row_req", row_req, torch.int64, 1),
    ):
        if t.dtype != dtype or t.dim() != dim or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dim}-D {dtype} tensor (it is updated in place), "
                f"got {t.dtype} shape {tuple(t.shape)} contiguous={t.is_contiguous()}"
            )
    if slot_stamp.shape != slot_token.shape or row_req.shape[0] != slot_token.shape[0]:
        raise ValueError(
            f"state shapes disagree: slot_token {tuple(slot_token.shape)}, "
            f"slot_stamp {tuple(slot_stamp.shape)}, row_req {tuple(row_req.shape)}"
        )
    if not (slot_token.device == slot_stamp.device == row_req.device):
        raise ValueError("slot_token, slot_stamp and row_req must be on one device")
    return slot_token.shape


def _input(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, shape) -> torch.Tensor:
    """An input as a contiguous tensor of ``dtype`` on ``device`` (converted if needed)."""
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple('*' if s is None else s for s in shape)}")
    if t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    return t.to(device=device, dtype=dtype).contiguous()
