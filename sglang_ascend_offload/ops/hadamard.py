"""Hadamard rotation and int8 quantisation for the C8 lightning indexer (LIM-C8).

The C8 indexer stores index keys (and quantises index queries) as int8 with one
fp16 dequantisation scale per token (per token *and head* for the query). Before
quantising, vectors are rotated by the normalised Walsh-Hadamard transform: the
rotation is orthonormal, so dot products are unchanged, but it spreads outlier
coordinates over all dimensions, which shrinks ``amax`` and therefore the int8 step.

Conventions (shared with the NPU path, see ``docs/operators.md``):

* ``hadamard_rotate(x) == x @ hadamard_matrix(D)`` for the Sylvester-ordered
  Hadamard matrix divided by ``sqrt(D)`` (symmetric, so left/right multiplication
  agree); ``D`` must be a power of two. Computed in float32, returned as float32.
* symmetric per-row quantisation over the last dim: ``scale = fp16(amax / 127)``,
  ``q = clamp(round(x / scale), -127, 127)`` as int8, ``x ~= q * scale``; rows that
  are all zero (or whose scale underflows fp16) quantise to ``q = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

INT8_QMAX = 127


def _check_power_of_two(dim: int) -> None:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two last dim, got {dim}")


def hadamard_matrix(
    dim: int, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix ``[dim, dim]`` (orthonormal, symmetric)."""
    _check_power_of_two(dim)
    mat = torch.ones(1, 1, dtype=torch.float64)
    while mat.shape[0] < dim:
        mat = torch.cat((torch.cat((mat, mat), 1), torch.cat((mat, -mat), 1)), 0)
    return (mat / math.sqrt(dim)).to(dtype=dtype, device=device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform over the last dim (float32 result).

    Fast O(D log D) butterflies; equal (up to float rounding) to
    ``x.float() @ hadamard_matrix(D)``. Any leading shape, any float dtype.
    """
    dim = x.shape[-1]
    _check_power_of_two(dim)
    y = x.to(torch.float32).reshape(-1, dim)
    half = 1
    while half < dim:
        pairs = y.view(-1, dim // (2 * half), 2, half)
        lo, hi = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((lo + hi, lo - hi), dim=2).reshape(-1, dim)
        half *= 2
    return (y * (1.0 / math.sqrt(dim))).reshape(x.shape)


def quantize_per_token_int8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantisation of each last-dim row.

    Returns ``(values int8 [..., D], scales fp16 [...])`` with
    ``x ~= values.float() * scales.float()[..., None]`` and per-element error at most
    ``scale / 2`` (plus the fp16 rounding of the scale, absorbed by the clamp).
    Raises ``ValueError`` if a row's scale overflows fp16 (``amax > 127 * 65504``).
    """
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    scales = (amax / INT8_QMAX).to(torch.float16)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("int8 quantisation: a row's scale overflows fp16 (amax > 127 * 65504)")
    scale32 = scales.to(torch.float32).unsqueeze(-1)
    safe = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    values = torch.round(xf / safe).clamp_(-INT8_QMAX, INT8_QMAX)
    values = torch.where(scale32 > 0, values, torch.zeros_like(values))
    return values.to(torch.int8), scales


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token_int8` (float32)."""
    return values.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)


def rotate_and_quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token_int8(hadamard_rotate(x))``: the C8 storage form of ``x``."""
    return quantize_per_token_int8(hadamard_rotate(x))


@dataclass(frozen=True)
class QuantIndexerInputs:
    """The C8 indexer's inputs, as ``quant_lightning_indexer`` takes them.

    query               int8 [T, H, D]            (Hadamard-rotated)
    query_dequant_scale fp16 [T, H]
    key                 int8 [blocks, block_size, 1, D]   (Hadamard-rotated, PA_BSND)
    key_dequant_scale   fp16 [blocks, block_size, 1]
    """

    query: torch.Tensor
    query_dequant_scale: torch.Tensor
    key: torch.Tensor
    key_dequant_scale: torch.Tensor


def prepare_quant_indexer_inputs(query: torch.Tensor, key: torch.Tensor) -> QuantIndexerInputs:
    """Rotate and quantise a bf16/fp32 index query ``[T,H,D]`` and paged index-key
    cache ``[blocks, block_size, 1, D]`` into the C8 indexer's inputs."""
    if query.dim() != 3:
        raise ValueError(f"query must be [T, H, D], got shape {tuple(query.shape)}")
    if key.dim() != 4 or key.shape[2] != 1:
        raise ValueError(f"key must be PA_BSND [blocks, block_size, 1, D], got {tuple(key.shape)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query dim {query.shape[-1]} != key dim {key.shape[-1]}")
    q_values, q_scales = rotate_and_quantize(query)
    k_values, k_scales = rotate_and_quantize(key)
    return QuantIndexerInputs(query=q_values, query_dequant_scale=q_scales, key=k_values, key_dequant_scale=k_scales)
