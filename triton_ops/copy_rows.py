"""Launcher of the miss-row copy kernel: op ``copy_miss_rows``, rung ``triton``.

:func:`copy_miss_rows` takes exactly the reference's arguments
(:func:`sglang_ascend_offload.ops.residency.copy_miss_rows`) and, like it,
returns ``None`` after writing ``hot[r, miss_slots[r,i], :] =
host[token_table[r, miss_tokens[r,i]], :]`` for every ``i < miss_count[r]``.

The kernel reads ``host`` through a device pointer, so ``host`` must be addressable
by the device that runs the kernel: device memory, or host memory mapped into the
device's address space (CUDA pinned memory through unified addressing; on Ascend,
memory allocated through ``memfabric_hybrid`` / SVM). Plain pageable host memory
with a device ``hot`` is refused with an error (use ``ops=reference`` or ``npu``).
One launch per call, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _launch

__all__ = ["CopyKernelConfig", "copy_miss_rows", "launch_copy_miss_rows"]


@dataclass(frozen=True)
class CopyKernelConfig:
    """Tile sizes (powers of two): ``block_i`` misses x ``block_d`` elements per tile.

    validate: check indices on the host first and raise like the reference does on
        out-of-range entries (one device sync; tests and benchmarks). Without it, the
        kernel skips such entries instead of reading out of bounds.
    """

    block_i: int = 16
    block_d: int = 256
    validate: bool = False

    def __post_init__(self):
        _launch.check_pow2("block_i", self.block_i)
        _launch.check_pow2("block_d", self.block_d)

    def block_d_for(self, d: int) -> int:
        return max(1, min(self.block_d, _launch.next_pow2(d)))


DEFAULT_CONFIG = CopyKernelConfig()


def copy_miss_rows(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """Copy the miss rows of one layer from ``host`` ``[S, D]`` into ``hot`` ``[R, H, D]``.

    miss_tokens / miss_slots int32 ``[R, K]``, miss_count int32 ``[R]``, token_table
    int32 ``[R, max_ctx]``. Bit-exact; returns nothing.
    """
    launch_copy_miss_rows(host, hot, miss_tokens, miss_slots, miss_count, token_table)


def launch_copy_miss_rows(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
    config: CopyKernelConfig = DEFAULT_CONFIG,
) -> None:
    """:func:`copy_miss_rows` with explicit tile sizes and optional index validation."""
    if hot.dim() != 3 or not hot.is_contiguous():
        raise ValueError(f"hot must be a contiguous [R, H, D] tensor, got shape {tuple(hot.shape)}")
    rows, hot_tokens, dim = hot.shape
    if host.dim() != 2 or host.shape[1] != dim or host.stride(1) != 1:
        raise ValueError(
            f"host must be [S, {dim}] with unit column stride, got shape {tuple(host.shape)} strides {host.stride()}"
        )
    if host.dtype != hot.dtype:
        raise ValueError(f"host dtype {host.dtype} != hot dtype {hot.dtype} (the copy is bit-exact, no casts)")
    device = hot.device
    _check_host_addressable(host, device)
    reason = _launch.device_unusable(device)
    if reason is not None:
        raise RuntimeError(f"copy_miss_rows (triton): {reason}")
    if miss_tokens.shape != miss_slots.shape or miss_tokens.dim() != 2 or miss_tokens.shape[0] != rows:
        raise ValueError(
            f"miss_tokens {tuple(miss_tokens.shape)} / miss_slots {tuple(miss_slots.shape)} must both be [R={rows}, K]"
        )
    if token_table.dim() != 2 or token_table.shape[0] != rows:
        raise ValueError(f"token_table must be [R={rows}, max_ctx], got {tuple(token_table.shape)}")
    k = miss_tokens.shape[1]
    tokens = miss_tokens.to(device=device, dtype=torch.int32).contiguous()
    slots = miss_slots.to(device=device, dtype=torch.int32).contiguous()
    count = miss_count.to(device=device, dtype=torch.int32).contiguous()
    table = token_table.to(device=device, dtype=torch.int32)
    if table.stride(1) != 1:
        table = table.contiguous()
    if config.validate:
        _validate(host, hot, tokens, slots, count, table)
    if rows == 0 or k == 0 or dim == 0:
        return

    from .copy_kernels import _copy_miss_rows_kernel  # imports triton

    _copy_miss_rows_kernel[(rows, _launch.cdiv(k, config.block_i))](
        _launch.int_view(host),
        _launch.int_view(hot),
        tokens,
        slots,
        count,
        table,
        k,
        hot_tokens,
        dim,
        host.shape[0],
        host.stride(0),
        table.shape[1],
        table.stride(0),
        BLOCK_I=config.block_i,
        BLOCK_D=config.block_d_for(dim),
    )


def _check_host_addressable(host: torch.Tensor, device: torch.device) -> None:
    if host.device == device:
        return
    if host.device.type == "cpu" and host.is_pinned():
        return  # mapped into the device address space (CUDA unified addressing)
    raise ValueError(
        f"copy_miss_rows (triton) reads host rows through a device pointer, but host is on {host.device} "
        f"{'(pageable)' if host.device.type == 'cpu' else ''} and hot on {device}: allocate the host pool "
        "pinned / device-registered, or use ops=reference (index_copy_) or ops=npu"
    )


def _validate(host, hot, tokens, slots, count, table) -> None:
    """Raise on entries the reference would reject (one host sync)."""
    k = tokens.shape[1]
    take = torch.arange(k, device=tokens.device)[None, :] < count[:, None].to(torch.int64)
    if bool((count < 0).any()) or bool((count > k).any()):
        raise ValueError(f"miss_count must lie in [0, {k}]")
    tok = tokens[take].to(torch.int64)
    slot = slots[take].to(torch.int64)
    if tok.numel() == 0:
        return
    if bool((tok < 0).any()) or bool((tok >= table.shape[1]).any()):
        raise IndexError(f"miss_tokens outside [0, {table.shape[1]}) (token_table width)")
    if bool((slot < 0).any()) or bool((slot >= hot.shape[1]).any()):
        raise IndexError(f"miss_slots outside [0, {hot.shape[1]})")
    rows_of = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(tokens)[take]
    host_rows = table[rows_of, tok].to(torch.int64)
    if bool((host_rows < 0).any()) or bool((host_rows >= host.shape[0]).any()):
        raise IndexError(f"token_table maps a miss to a host row outside [0, {host.shape[0]})")
