"""NPU: one attention-DP group's host KV pool in MemFabric big-memory (BM) host memory,
allocated by attention-TP rank 0 and reached by the other ranks through MemFabric's
global virtual addresses (GVA). Needs an Ascend NPU, CANN and ``memfabric_hybrid``.

MemFabric facts used (``memfabric_hybrid`` Python API, its ``bm`` module):
``memfabric_hybrid.initialize()`` / ``uninitialize()`` / ``get_last_err_msg()``;
``bm.BmConfig()`` (``rank_id``, ``start_store``, ``set_nic(url)``);
``bm.initialize(store_url, world_size, device_id, cfg)`` and ``bm.uninitialize(flags)``;
``bm.create2(id=, local_dram_size=, max_dram_size=, data_op_type=)`` returning a
handle with ``join()``, ``peer_rank_ptr(rank, bm.BmMemType.HOST)`` (a GVA),
``copy_data(src, dst, nbytes, bm.BmCopyType.X, flags)`` for ``X`` in ``L2G`` / ``G2L``
(device <-> global), ``H2G`` / ``G2H`` (host <-> global), ``leave()`` and ``destroy()``.

Geometry: the same ``[layers, tokens, D]`` rows as :class:`~..sparse_decode.host_pool.HostKVPool`,
at ``gva(layer, slot) = base + ((layer * tokens) + slot) * row_bytes`` where ``base`` is
rank 0's host GVA. Rank 0 writes rows (:meth:`MemfabricGroupPool.write_rows`), every
rank reads them (:meth:`MemfabricGroupPool.read_rows`, into host or device tensors);
the ordering between them is the group's (:class:`~.shared_host_pool.AppendOrder` over
a shared mapping of the header only, or a TP-group barrier).

The served engine's miss copy indexes the host pool as a CPU tensor; on NPU with more
than one attention-TP rank it would have to copy through these GVAs instead. That path
is not wired into the engine yet: served NPU runs with attention TP > 1 keep one private
MemFabric pool per rank and say so in the log (see ``shared_host_pool.allocate_rank_pool``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..sparse_decode.host_pool import HostPoolShape

__all__ = ["MemfabricGroupPool", "MemfabricPoolConfig"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class MemfabricPoolConfig:
    """Where the BM store listens and how data moves (``data_op_type`` names a
    ``bm.BmDataOpType`` member; ``DEVICE_RDMA`` is what MemFabric's single-node
    multi-device DRAM example uses)."""

    device_id: int
    host: str = "127.0.0.1"
    data_op_type: str = "DEVICE_RDMA"
    entity_id: int = 0


class MemfabricGroupPool:
    """See the module docstring. ``rank`` / ``size``: attention-TP rank and group size;
    ``broadcast_object(obj) -> obj`` from rank 0 and ``barrier()`` over the group."""

    def __init__(self, shape: HostPoolShape, rank: int, size: int, config: MemfabricPoolConfig,
                 broadcast_object: Callable, barrier: Callable[[], None]):
        try:
            import memfabric_hybrid as mf  # noqa: PLC0415 - NPU only
            from memfabric_hybrid import bm  # noqa: PLC0415
        except ImportError as exc:
            raise RuntimeError("the MemFabric shared host pool needs memfabric_hybrid: pip install "
                               "'sglang-ascend-offload[npu]' on an Ascend machine") from exc
        self.shape, self.rank, self.size = shape, rank, size
        self._mf, self._bm = mf, bm
        self._handle = None
        self._bm_up = self._mf_up = self._joined = False
        url = broadcast_object(f"tcp://{config.host}:{_free_port()}" if rank == 0 else None)
        try:
            self._check(mf.initialize(), "memfabric_hybrid.initialize")
            self._mf_up = True
            cfg = bm.BmConfig()
            cfg.rank_id = rank
            cfg.start_store = rank == 0
            cfg.set_nic(f"tcp://{config.host}:{_free_port()}")
            self._check(bm.initialize(url, size, config.device_id, cfg), f"bm.initialize({url})")
            self._bm_up = True
            nbytes = shape.nbytes if rank == 0 else 0  # only rank 0 backs the pool
            self._handle = bm.create2(id=config.entity_id, local_dram_size=nbytes, max_dram_size=shape.nbytes,
                                      data_op_type=getattr(bm.BmDataOpType, config.data_op_type))
            self._check(self._handle.join(), "bm join")
            self._joined = True
            barrier()
            self.base = int(self._handle.peer_rank_ptr(0, bm.BmMemType.HOST))
            if self.base == 0:
                raise RuntimeError(f"MemFabric returned no host GVA for rank 0: {mf.get_last_err_msg()}")
        except BaseException:
            self.close()
            raise

    def _check(self, ret: int, what: str) -> None:
        if ret != 0:
            raise RuntimeError(f"{what} returned {ret}: {self._mf.get_last_err_msg()}")

    def gva(self, layer: int, slot: int) -> int:
        return self.base + (layer * self.shape.tokens + slot) * self.shape.row_bytes

    def write_rows(self, layer: int, host_slots: torch.Tensor, rows: torch.Tensor) -> int:
        """Rank 0: ``pool[layer, host_slots[i]] = rows[i]`` (rows ``[n, D]`` on the NPU
        (L2G) or the host (H2G)); consecutive slots go as one copy. Returns bytes moved."""
        if self.rank != 0:
            raise RuntimeError("only attention-TP rank 0 writes the group's host pool")
        rows = rows.contiguous()
        kind = self._bm.BmCopyType.L2G if rows.device.type != "cpu" else self._bm.BmCopyType.H2G
        rb = self.shape.row_bytes
        for start, first, count in _runs(host_slots):
            self._check(self._handle.copy_data(rows.data_ptr() + start * rb, self.gva(layer, first), count * rb,
                                               kind, 0), f"copy_data to layer {layer} slot {first}")
        return rows.shape[0] * rb

    def read_rows(self, layer: int, host_slots: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[n, D]`` copy of rows ``host_slots`` of ``layer`` into host memory (G2H) or
        onto ``device`` (G2L)."""
        n = host_slots.numel()
        out = torch.empty((n, self.shape.row_dim), dtype=self.shape.dtype, device=device or "cpu")
        kind = self._bm.BmCopyType.G2L if out.device.type != "cpu" else self._bm.BmCopyType.G2H
        rb = self.shape.row_bytes
        for start, first, count in _runs(host_slots):
            self._check(self._handle.copy_data(self.gva(layer, first), out.data_ptr() + start * rb, count * rb,
                                               kind, 0), f"copy_data from layer {layer} slot {first}")
        return out

    def close(self) -> None:
        """Leave the group, destroy the entity, shut MemFabric down (idempotent)."""
        if self._joined:
            self._handle.leave()
            self._joined = False
        if self._handle is not None:
            self._handle.destroy()
            self._handle = None
        if self._bm_up:
            self._bm.uninitialize(0)
            self._bm_up = False
        if self._mf_up:
            self._mf.uninitialize()
            self._mf_up = False


def _runs(slots: torch.Tensor):
    """``(index, first_slot, count)`` of each run of consecutive slots, in order."""
    s = [int(x) for x in slots.to(torch.int64).cpu().tolist()]
    i = 0
    while i < len(s):
        j = i + 1
        while j < len(s) and s[j] == s[j - 1] + 1:
            j += 1
        yield i, s[i], j - i
        i = j
