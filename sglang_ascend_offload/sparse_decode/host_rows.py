"""What the decode engine needs from a host pool: the host-rows interface.

Two implementations:

* :class:`~.host_pool.HostKVPool` (``tensor_backed = True``): the rows are a host
  tensor ``[layers, tokens, D]`` (pinned, a shared mapping, or MemFabric offload
  memory); the engine's copy kernels index it directly (``layer(l)``), which keeps the
  per-layer step graph-capturable and free of host reads;
* ``sglang_plugin.mem_cache.pool_host.npu_memfabric.MemfabricGroupPool`` (``tensor_backed =
  False``): the rows are rank 0's MemFabric host memory, reached through global
  addresses; there is no tensor view, so writes and gathers are MemFabric copies with
  host-side slot lists (eager only).

Contract (both): ``shape`` a :class:`~.host_pool.HostPoolShape`; slots int ``[n]``
(unique for writes); rows / destinations ``[*, D]`` of ``shape.dtype``; each call is
complete when it returns (a writer may publish right after ``write_rows``).
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from .host_pool import HostPoolShape

__all__ = ["HostRows", "is_tensor_backed"]


@runtime_checkable
class HostRows(Protocol):
    shape: HostPoolShape
    kind: str
    tensor_backed: bool

    def write_rows(self, layer: int, host_slots: torch.Tensor, rows: torch.Tensor) -> int:
        """``pool[layer, host_slots[i]] = rows[i]``; rows ``[n, D]``; returns bytes moved."""

    def gather_into(
        self, layer: int, host_slots: torch.Tensor, dst: torch.Tensor, dst_rows: Optional[torch.Tensor] = None
    ) -> int:
        """``dst[dst_rows[i]] = pool[layer, host_slots[i]]``; dst contiguous ``[M, D]``
        (``dst_rows`` default ``0..n-1``); returns bytes moved."""

    def read_rows(self, layer: int, host_slots: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` host copy of rows ``host_slots`` of ``layer``."""


def is_tensor_backed(pool) -> bool:
    """Whether ``pool.layer(l)`` is a tensor the copy kernels can index."""
    return bool(getattr(pool, "tensor_backed", True))
