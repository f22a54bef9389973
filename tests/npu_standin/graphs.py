"""Graph capture and replay on the stand-in ``npu`` device (``torch.npu.NPUGraph``).

A real NPU graph records the device work a block issues, without running it, and
replays it later on the same memory; host code runs once, at capture. The stand-in does
the same at the level it sees: every op on ``npu`` tensors dispatched while a capture is
open is recorded as an :class:`Entry` (a closure that recomputes it, and the output
buffers it refreshes). To give later ops of the block their operands' shapes, each op
is executed at capture too, and every tensor it writes in place is restored when the
capture ends (:meth:`Capture.undo`, newest first): after the capture, device state is
what it was before it, as on a device. :meth:`Capture.replay` runs the entries again
in order, writing fresh results into the buffers the capture returned, so tensors a
test kept from the capture see the replayed values. Ops on CPU tensors alone are host
code: not recorded.

What a real capture refuses, the stand-in refuses inside a capture (``RuntimeError``):

* a device->host read (``.item()``, ``.cpu()``, ``nonzero``, ...): the host cannot
  wait for work that has not run;
* a host->device copy from pageable (not pinned) memory: the runtime stages it
  synchronously. A copy from pinned memory is recorded and re-reads the host buffer at
  every replay, as a captured memcpy node does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from . import transfers


@dataclass
class Entry:
    """One recorded op: ``run()`` recomputes it and returns fresh outputs matching
    ``outputs`` (the buffers handed out at capture; ``None`` for an output that aliases
    an input, which the recomputation writes in place); ``h2d``: the host->device copy it
    does, re-counted at every replay."""

    run: Callable[[], object]
    outputs: List[Optional[torch.Tensor]]
    h2d: Optional[transfers.Transfer] = None


@dataclass
class Capture:
    entries: List[Entry] = field(default_factory=list)
    #: ``(memory written at capture, its content before)``, restored at the end
    written: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    closed: bool = False

    def keep_before_write(self, memory: torch.Tensor) -> None:
        """Remember ``memory``'s content before an op of the capture writes it."""
        self.written.append((memory, memory.clone()))

    def undo(self) -> None:
        for memory, before in reversed(self.written):
            memory.copy_(before)
        self.written.clear()

    def replay(self) -> None:
        if not self.closed:
            raise RuntimeError("NPUGraph.replay(): the capture has not ended")
        for entry in self.entries:
            fresh = entry.run()
            if entry.h2d is not None:
                t = entry.h2d
                transfers.record(t.kind, t.what, t.nbytes, t.pinned, site=t.site)
            fresh_list = list(fresh) if isinstance(fresh, (tuple, list)) else [fresh]
            for buffer, value in zip(entry.outputs, fresh_list):
                if buffer is not None and isinstance(value, torch.Tensor):
                    buffer.copy_(value)


_local = threading.local()


def active() -> Optional[Capture]:
    """The capture open on this thread, if any."""
    return getattr(_local, "capture", None)


def begin(capture: Capture) -> None:
    if active() is not None:
        raise RuntimeError("a graph capture is already open on this thread (nested captures are not supported)")
    _local.capture = capture


def end() -> Capture:
    capture = active()
    if capture is None:
        raise RuntimeError("no graph capture is open on this thread")
    capture.closed = True
    _local.capture = None
    capture.undo()
    return capture


def refuse_in_capture(what: str) -> None:
    """A device->host read (or a pageable copy) inside a capture: the error a real capture gives."""
    if active() is not None:
        raise RuntimeError(
            f"operation not permitted when stream is capturing: {what} at {transfers.call_site()} "
            "(a captured NPU graph cannot read device data on the host or copy from pageable memory)"
        )
