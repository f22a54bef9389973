"""Hot buffers (device).

Per layer one tensor ``[R, H, D]`` (``R`` decode rows, ``H = hot_tokens >= top_k``
slots, ``D`` = latent + rope, e.g. 512 + 64 = 576, bf16) on the device. The
residency manager decides which slot holds which logical position; the miss copy
host -> hot buffer is the op ``copy_miss_rows`` (reference rung and its rows form in
``ops/residency.py``). :meth:`HotBuffers.flat_indices` turns remapped slots into
row numbers of the flattened buffer ``[R*H, D]`` (``r*H + slot``, ``-1`` kept),
which is what sparse attention with ``layout_kv="flat"`` consumes.

With an overflow area (``overflow_slots = X > 0``: speculative verify rows whose union
may exceed ``H``, ``overflow.py``) every layer's buffer and the area are views of one
device allocation ``[layers * (R+1) * H + (R+1) * X, D]``, the area last, so one flat
view reaches a layer's rows and the area (:meth:`HotBuffers.attention_flat`): attention
reads both through the same ``layout_kv="flat"`` indices, whichever rung runs it.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = ["HotBuffers"]


class HotBuffers:
    """Per-layer device buffers of one engine: ``R`` rows plus one padding *sink* row.

    Each layer's storage is ``[R + 1, H, D]``; row ``R`` (:attr:`sink_row`) serves the
    padding entries of a batch (it never holds anything). :meth:`layer` is the view of
    the ``R`` real rows, :meth:`flat` the flat view of all ``R + 1`` (what sparse
    attention indexes). Content of a slot is meaningful only where the residency
    table says the slot holds a position; initial content is zero.

    ``overflow_slots`` ``X``: rows of the overflow area per engine row (0: none),
    :attr:`overflow` ``[R + 1, X, D]``, shared by every layer (they run one at a time).
    """

    def __init__(
        self,
        layers: int,
        rows: int,
        hot_tokens: int,
        row_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        overflow_slots: int = 0,
    ):
        self.rows = rows
        self.hot_tokens = hot_tokens
        self.row_dim = row_dim
        self.layers = layers
        self.overflow_slots = int(overflow_slots)
        self.overflow: Optional[torch.Tensor] = None
        self._storage: Optional[torch.Tensor] = None
        if self.overflow_slots:
            per_layer = (rows + 1) * hot_tokens
            total = layers * per_layer + (rows + 1) * self.overflow_slots
            if total > torch.iinfo(torch.int32).max:
                raise ValueError(
                    f"hot buffers with an overflow area of {total} rows: attention indexes them with int32 "
                    "from a layer's first row to the area's end; fewer rows x hot_tokens x layers"
                )
            self._storage = torch.zeros((total, row_dim), dtype=dtype, device=device)
            self.buffers: List[torch.Tensor] = [
                self._storage[i * per_layer : (i + 1) * per_layer].view(rows + 1, hot_tokens, row_dim)
                for i in range(layers)
            ]
            self.overflow = self._storage[layers * per_layer :].view(rows + 1, self.overflow_slots, row_dim)
        else:
            self.buffers = [
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

    def attention_flat(self, layer: int) -> torch.Tensor:
        """The flat view attention reads for ``layer``: :meth:`flat` without an overflow
        area; with one, from the layer's first row to the end of the allocation, so the
        area's row ``r*X + i`` is row :meth:`overflow_base` ``+ r*X + i`` of it."""
        if self._storage is None:
            return self.flat(layer)
        return self._storage[layer * (self.rows + 1) * self.hot_tokens :]

    def overflow_base(self, layer: int) -> int:
        """Row of :meth:`attention_flat` ``(layer)`` where the overflow area starts."""
        return (self.layers - layer) * (self.rows + 1) * self.hot_tokens

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
        return flat_hot_indices(slots, rows, self.hot_tokens)

    @property
    def nbytes(self) -> int:
        """Device bytes of every layer's buffer and the overflow area."""
        if self._storage is not None:
            return self._storage.numel() * self._storage.element_size()
        return sum(b.numel() * b.element_size() for b in self.buffers)


def flat_hot_indices(slots: torch.Tensor, rows: torch.Tensor, hot_tokens: int) -> torch.Tensor:
    """int32 ``[B, 1, K]`` rows of a flat ``[(R+1)*H, D]`` hot buffer: ``rows[b] * H +
    slots[b, j]`` for remapped ``slots`` ``[B, K]`` and engine ``rows`` int64 ``[B]``;
    ``-1`` (no slot) stays ``-1``, which sparse attention ignores. Static shapes, no host
    read: the eager and the captured decode step both use it."""
    base = rows.to(slots.device, torch.int64)[:, None] * hot_tokens
    flat = torch.where(slots >= 0, base + slots.to(torch.int64), torch.full_like(base, -1).expand_as(slots))
    return flat.to(torch.int32).unsqueeze(1)
