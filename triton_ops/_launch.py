"""Small launcher helpers shared by the Triton ops (no triton import here).

Block sizes are powers of two (upstream Triton requires it for ``tl.arange``) and
every tile stays far below Triton's 1,048,576-element block limit and an Ascend
vector core's 192 KiB unified buffer.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

MAX_BLOCK_ELEMS = 1 << 20  # TRITON_MAX_TENSOR_NUMEL


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(0, int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two ``<= max(n, 1)``."""
    return 1 << (max(1, int(n)).bit_length() - 1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_pow2(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two (tl.arange requires it on upstream Triton)")


def device_unusable(device: torch.device) -> Optional[str]:
    """Why Triton cannot run kernels on tensors of ``device``, or ``None``."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "tensors are on the CPU: set TRITON_INTERPRET=1 to run Triton kernels on CPU "
            "through the interpreter (slow; correctness only)"
        )
    return None


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as an integer tensor of the same element size (bit-exact copies).

    Copy kernels move raw bits: bf16/fp16 travel as int16, fp32 as int32, fp64 as
    int64, 1-byte types as int8. This also keeps dtypes the interpreter (numpy) has
    no type for (bf16, fp8) out of the kernel.
    """
    by_size = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = t.element_size()
    if size not in by_size:
        raise ValueError(f"copy kernels move 1/2/4/8-byte elements, got {t.dtype}")
    return t if t.dtype == by_size[size] else t.view(by_size[size])
