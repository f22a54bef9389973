"""Hot buffers (device) and the miss copy host -> device.

Per layer one tensor ``[R, H, D]`` (``R`` decode rows, ``H = hot_tokens >= top_k``
slots, ``D`` = latent + rope, e.g. 512 + 64 = 576, bf16) on the device. The
residency manager decides which slot holds which logical position; this module
only moves bytes:

* :func:`copy_miss_rows` (op ``copy_miss_rows``, rung ``reference``) writes, for
  every row ``r`` and ``i < miss_count[r]``,
  ``hot[r, miss_slots[r,i]] = host[token_table[r, miss_tokens[r,i]]]`` and nothing
  else. It gathers exactly the miss rows on the host side and moves them in one
  host -> device copy, so the bytes moved are ``misses * D * itemsize``.
* :meth:`HotBuffers.flat_indices` turns remapped slots into row numbers of the
  flattened buffer ``[R*H, D]`` (``r*H + slot``, ``-1`` kept), which is what sparse
  attention with ``layout_kv="flat"`` consumes.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

__all__ = ["HotBuffers", "copy_miss_rows"]


def copy_miss_rows(host: torch.Tensor, hot: torch.Tensor, miss_tokens: torch.Tensor,
                   miss_slots: torch.Tensor, miss_count: torch.Tensor,
                   token_table: torch.Tensor) -> None:
    """Copy the miss rows of one layer from the host pool into the hot buffer.

    host: ``[S, D]`` host rows of this layer (indexed by host slot).
    hot: ``[R, H, D]`` contiguous hot buffer of this layer (device).
    miss_tokens / miss_slots: int32 ``[R, K]`` from the residency step.
    miss_count: int32 ``[R]``. token_table: int32 ``[R, max_ctx]``, logical
    position -> host slot of each row. Bit-exact; returns nothing.
    """
    rows, hot_tokens, dim = hot.shape
    k = miss_tokens.shape[1]
    ctrl = token_table.device
    count = miss_count.to(ctrl, torch.int64)
    take = torch.arange(k, device=ctrl)[None, :] < count[:, None]
    row_of = torch.arange(rows, device=ctrl)[:, None].expand(rows, k)[take]
    tokens = miss_tokens.to(ctrl, torch.int64)[take]
    slots = miss_slots.to(ctrl, torch.int64)[take]
    host_slots = token_table[row_of, tokens].to(torch.int64)
    staged = host.index_select(0, host_slots.to(host.device))
    dest = (row_of * hot_tokens + slots).to(hot.device)
    hot.view(rows * hot_tokens, dim).index_copy_(0, dest, staged.to(hot.device, non_blocking=True))


class HotBuffers:
    """Per-layer device buffers ``[R, H, D]`` of one engine.

    Content of a slot is meaningful only where the residency table says the slot
    holds a position; initial content is zero.
    """

    def __init__(self, layers: int, rows: int, hot_tokens: int, row_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        self.rows = rows
        self.hot_tokens = hot_tokens
        self.row_dim = row_dim
        self.buffers: List[torch.Tensor] = [
            torch.zeros((rows, hot_tokens, row_dim), dtype=dtype, device=device) for _ in range(layers)
        ]

    def layer(self, layer: int) -> torch.Tensor:
        """``[R, H, D]`` buffer of ``layer``."""
        return self.buffers[layer]

    def flat(self, layer: int) -> torch.Tensor:
        """``[R*H, D]`` view of ``layer`` (row ``r*H + slot``)."""
        return self.buffers[layer].view(self.rows * self.hot_tokens, self.row_dim)

    def split_flat(self, layer: int, latent_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(latent [R*H, latent_dim], rope [R*H, D - latent_dim])`` views."""
        flat = self.flat(layer)
        return flat[:, :latent_dim], flat[:, latent_dim:]

    def flat_indices(self, slots: torch.Tensor) -> torch.Tensor:
        """int32 ``[R, 1, K]`` rows of the flat buffer for remapped ``slots`` ``[R, K]``.

        ``r * H + slots[r, j]``; ``-1`` stays ``-1`` (ignored by sparse attention).
        """
        rows = slots.shape[0]
        base = torch.arange(rows, device=slots.device, dtype=torch.int64)[:, None] * self.hot_tokens
        flat = torch.where(slots >= 0, base + slots.to(torch.int64), torch.full_like(base, -1).expand_as(slots))
        return flat.to(torch.int32).unsqueeze(1)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
