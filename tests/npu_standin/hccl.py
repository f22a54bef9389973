"""The ``hccl`` process-group backend of the stand-in device: gloo underneath.

``dist.init_process_group("hccl")`` and ``dist.new_group(..., backend="hccl")`` create
an :class:`HcclGroup`, a Python ``ProcessGroup`` (torch takes a backend that is one as
the group itself). Its collectives take ``npu`` tensors and run on a gloo group over the
same store with the CPU memory behind them, so the bytes really move between the
processes; CPU tensors are refused, as HCCL refuses host memory. ``barrier`` runs over
gloo (HCCL's barrier is an allreduce on the device).
"""

from __future__ import annotations

from datetime import timedelta
from typing import List

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from . import device

NAME = "hccl"


def _device_memory(what: str, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The CPU memory of the collective's ``npu`` tensors (host tensors refused)."""
    for t in tensors:
        if not isinstance(t, device.NpuTensor):
            raise RuntimeError(f"hccl {what}: HCCL collectives take npu tensors, got one on {t.device}")
    return [device.cpu_of(t) for t in tensors]


class HcclGroup(dist.ProcessGroup):
    """An hccl group of ``size`` ranks whose collectives run on a gloo group."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._gloo = c10d.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return NAME

    def name(self) -> str:
        return NAME

    def broadcast(self, tensors, opts=None):
        return self._gloo.broadcast(_device_memory("broadcast", tensors), opts or c10d.BroadcastOptions())

    def allreduce(self, tensors, opts=None):
        return self._gloo.allreduce(_device_memory("allreduce", tensors), opts or c10d.AllreduceOptions())

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs = [_device_memory("allgather", list(o)) for o in output_tensors]
        ins = _device_memory("allgather", input_tensors)
        return self._gloo.allgather(outs, ins, opts or c10d.AllgatherOptions())

    def barrier(self, opts=None):
        return self._gloo.barrier(opts or c10d.BarrierOptions())


def _create(store, rank, size, timeout):
    return HcclGroup(store, rank, size, timeout)


def register() -> None:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=[device.NAME])
