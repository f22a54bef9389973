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

from typing import List, Optional, Tuple

import torch

__all__ = ["HotBuffers", "copy_miss_rows", "copy_miss_rows_rows"]


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


def copy_miss_rows_rows(host: torch.Tensor, hot: torch.Tensor, rows: torch.Tensor, miss_tokens: torch.Tensor,
                        miss_slots: torch.Tensor, miss_count: torch.Tensor, token_table: torch.Tensor) -> None:
    """Rows form of :func:`copy_miss_rows`, static shapes and no host read (torch).

    hot ``[R', H, D]`` (all engine rows); rows int64 ``[B]`` the engine row of each
    batch entry (real rows distinct); miss lists ``[B, K]`` / ``[B]`` in batch order;
    token_table int32 ``[T, max_ctx]`` indexed by engine row (rows ``>= T`` may only
    name entries without misses, e.g. a padding sink row). Writes, for ``i <
    miss_count[b]``, ``hot[rows[b], miss_slots[b,i]] = host[token_table[rows[b],
    miss_tokens[b,i]]]``; nothing else changes value. Every one of the ``B*K`` entries is
    written (static shape): an entry past ``miss_count`` rewrites the row's last miss
    with the same bytes, a row without misses rewrites its slot 0 with its own
    content. Cost ``O(B*K*D)`` whatever the misses: the graph-capturable form; the
    CPU kernel and the Triton kernel copy only the misses.
    """
    b, k = miss_tokens.shape
    _, hot_tokens, dim = hot.shape
    ctrl = token_table.device
    count = miss_count.to(ctrl, torch.int64)
    rows_c = rows.to(ctrl, torch.int64)
    entry = torch.minimum(torch.arange(k, device=ctrl)[None, :], (count - 1).clamp(min=0)[:, None])
    tokens = miss_tokens.to(ctrl, torch.int64).gather(1, entry).clamp(min=0)
    slots = miss_slots.to(ctrl, torch.int64).gather(1, entry).clamp(min=0)
    table_rows = rows_c.clamp(max=token_table.shape[0] - 1)
    host_slots = token_table[table_rows[:, None], tokens].to(torch.int64)
    has = (count > 0)[:, None].expand(b, k).reshape(-1, 1)
    dest = (rows_c[:, None] * hot_tokens + slots).reshape(-1)
    flat = hot.view(-1, dim)
    dest_dev = dest.to(hot.device)
    staged = host.index_select(0, host_slots.reshape(-1).to(host.device)).to(hot.device, non_blocking=True)
    values = torch.where(has.to(hot.device), staged, flat.index_select(0, dest_dev))
    flat.index_copy_(0, dest_dev, values)


class HotBuffers:
    """Per-layer device buffers of one engine: ``R`` rows plus one padding *sink* row.

    Each layer's storage is ``[R + 1, H, D]``; row ``R`` (:attr:`sink_row`) serves the
    padding entries of a batch (it never holds anything). :meth:`layer` is the view of
    the ``R`` real rows, :meth:`flat` the flat view of all ``R + 1`` (what sparse
    attention indexes). Content of a slot is meaningful only where the residency
    table says the slot holds a position; initial content is zero.
    """

    def __init__(self, layers: int, rows: int, hot_tokens: int, row_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        self.rows = rows
        self.hot_tokens = hot_tokens
        self.row_dim = row_dim
        self.buffers: List[torch.Tensor] = [
            torch.zeros((rows + 1, hot_tokens, row_dim), dtype=dtype, device=device) for _ in range(layers)
        ]

    @property
    def sink_row(self) -> int:
        return self.rows

    def layer(self, layer: int) -> torch.Tensor:
        """``[R, H, D]`` view of ``layer``'s real rows."""
        return self.buffers[layer][: self.rows]

    def storage(self, layer: int) -> torch.Tensor:
        """``[R + 1, H, D]`` buffer of ``layer`` (real rows and the sink row)."""
        return self.buffers[layer]

    def flat(self, layer: int) -> torch.Tensor:
        """``[(R+1)*H, D]`` view of ``layer`` (row ``r*H + slot``)."""
        return self.buffers[layer].view((self.rows + 1) * self.hot_tokens, self.row_dim)

    def split_flat(self, layer: int, latent_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(latent [R*H, latent_dim], rope [R*H, D - latent_dim])`` views."""
        flat = self.flat(layer)
        return flat[:, :latent_dim], flat[:, latent_dim:]

    def flat_indices(self, slots: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int32 ``[B, 1, K]`` rows of the flat buffer for remapped ``slots`` ``[B, K]``.

        ``rows[b] * H + slots[b, j]`` (``rows`` int64 ``[B]``, default ``0..B-1``);
        ``-1`` stays ``-1`` (ignored by sparse attention).
        """
        if rows is None:
            rows = torch.arange(slots.shape[0], device=slots.device, dtype=torch.int64)
        base = rows.to(slots.device, torch.int64)[:, None] * self.hot_tokens
        flat = torch.where(slots >= 0, base + slots.to(torch.int64), torch.full_like(base, -1).expand_as(slots))
        return flat.to(torch.int32).unsqueeze(1)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
