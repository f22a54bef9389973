"""``torch.npu`` of the stand-in device: the names the project and SGLang's pools use.

Streams and events run work at once (there is no concurrency: every op has finished
when it returns), so nothing here waits. What they still check is how they are used,
as torch_npu's ``torch_npu/npu/streams.py`` and ``csrc/core/npu/NPUEvent.cpp`` do:

* ``Stream.wait_event`` / ``Event.record`` / ``Event.wait`` take a ``Stream`` / an
  ``Event`` of this module (torch_npu's pybind11 binding raises ``TypeError`` for
  anything else, e.g. the CPU platform's null stream), ``wait_stream`` a ``Stream``;
* an event records on a stream of its own device (``RuntimeError`` otherwise);
* ``elapsed_time`` needs both events recorded, created with ``enable_timing=True``;
* waiting on an event that was never recorded is accepted by torch_npu (it orders
  nothing) and recorded here as a hazard (:data:`HAZARDS`): on a device that wait
  does not order the work it was meant to order. The stand-in test session fails a
  test that leaves a hazard behind.

Host waits (``synchronize`` of the device, a stream or an event) are counted as
``sync`` transfers (``transfers.py``) and refused inside a graph capture.
"""

from __future__ import annotations

import contextlib
import threading
from typing import List, Optional, Tuple

import torch

from . import device as dev
from . import graphs, transfers

DEVICE_COUNT = 8
#: the SoC ``get_device_name`` reports: an Atlas A2 (``soc.py`` family ``A2``)
DEVICE_NAME = "Ascend910B3"
TOTAL_MEMORY = 64 << 30

#: API uses torch_npu accepts but that order nothing on a device (see the docstring)
HAZARDS: List[str] = []

_local = threading.local()


def _index(device) -> int:
    if device is None:
        return dev.current_index()
    if isinstance(device, int):
        index = device
    else:
        d = torch.device(device)
        if d.type != dev.NAME:
            raise ValueError(f"Expected a npu device, but got: {d}")
        index = dev.current_index() if d.index is None else d.index
    if not 0 <= index < DEVICE_COUNT:
        raise RuntimeError(f"Invalid device argument {device}: the stand-in has {DEVICE_COUNT} NPUs")
    return index


def _host_wait(what: str) -> None:
    graphs.refuse_in_capture(f"a host wait ({what})")
    transfers.record("sync", what, 0)


# -------------------------------------------------------------------- streams
class Stream:
    """A stream of ``npu:<device_index>`` (work submitted to it runs at once)."""

    _ids = 0

    def __init__(self, device=None, priority: int = 0, **kwargs):
        if kwargs:
            raise TypeError(f"Stream() got unexpected keyword arguments {sorted(kwargs)}")
        self.device_index = _index(device)
        self.priority = int(priority)
        Stream._ids += 1
        self.npu_stream = Stream._ids

    @property
    def device(self) -> torch.device:
        return torch.device(dev.NAME, self.device_index)

    def wait_event(self, event: "Event") -> None:
        _check_type(event, Event, "Stream.wait_event", "event")
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        _check_type(stream, Stream, "Stream.wait_stream", "stream")
        self.wait_event(stream.record_event())

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _host_wait("Stream.synchronize")

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.npu_stream == self.npu_stream

    def __hash__(self) -> int:
        return hash((self.npu_stream, self.device_index))

    def __repr__(self) -> str:
        return f"<stand-in torch.npu.Stream device={self.device} npu_stream={self.npu_stream:#x}>"


def _check_type(value, kind, where: str, name: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(
            f"{where}(): incompatible function arguments: {name} must be a torch.npu.{kind.__name__}, "
            f"got {type(value).__name__}"
        )


class Event:
    """An event; ``record`` marks the work submitted so far (all done already)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = bool(enable_timing)
        self.device_index: Optional[int] = None
        self.recorded = False

    def record(self, stream: Optional[Stream] = None) -> None:
        stream = current_stream() if stream is None else stream
        _check_type(stream, Stream, "Event.record", "stream")
        if self.device_index is None:
            self.device_index = stream.device_index
        if self.device_index != stream.device_index:
            raise RuntimeError(
                f"Event device {self.device_index} does not match recording stream's device {stream.device_index}."
            )
        self.recorded = True

    def wait(self, stream: Optional[Stream] = None) -> None:
        stream = current_stream() if stream is None else stream
        _check_type(stream, Stream, "Event.wait", "stream")
        if not self.recorded:
            HAZARDS.append(f"Event.wait on an event never recorded, at {transfers.call_site()}")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _host_wait("Event.synchronize")

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.recorded and end_event.recorded):
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        return 0.0


def _streams():
    if not hasattr(_local, "current"):
        _local.current = {}
        _local.default = {}
    return _local


def default_stream(device=None) -> Stream:
    index = _index(device)
    state = _streams()
    if index not in state.default:
        state.default[index] = Stream(index)
    return state.default[index]


def current_stream(device=None) -> Stream:
    index = _index(device)
    return _streams().current.get(index) or default_stream(index)


def set_stream(stream: Stream) -> None:
    _check_type(stream, Stream, "set_stream", "stream")
    _streams().current[stream.device_index] = stream


@contextlib.contextmanager
def _on_stream(s: Optional[Stream]):
    if s is None:
        yield
        return
    _check_type(s, Stream, "torch.npu.stream", "stream")
    state = _streams()
    before = state.current.get(s.device_index)
    state.current[s.device_index] = s
    try:
        yield
    finally:
        if before is None:
            state.current.pop(s.device_index, None)
        else:
            state.current[s.device_index] = before


def stream(stream: Optional[Stream]):
    """``with torch.npu.stream(s):`` work goes to ``s`` (``None``: no change)."""
    return _on_stream(stream)


def synchronize(device=None) -> None:
    _index(device)
    _host_wait("torch.npu.synchronize")


# -------------------------------------------------------------------- devices
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def _lazy_init() -> None:
    return None


def device_count() -> int:
    return DEVICE_COUNT


def current_device() -> int:
    return dev.current_index()


def set_device(device) -> None:
    dev.set_current_index(_index(device))


class device:  # noqa: N801 - torch.npu.device is a class in torch_npu
    """``with torch.npu.device(i):`` the current device inside the block."""

    def __init__(self, device):
        self.index = None if device is None else _index(device)

    def __enter__(self):
        self.before = dev.current_index()
        if self.index is not None:
            dev.set_current_index(self.index)

    def __exit__(self, *exc):
        dev.set_current_index(self.before)
        return False


def get_device_name(device_name=None) -> str:
    _index(device_name)
    return DEVICE_NAME


def get_device_capability(device=None) -> Tuple[int, int]:
    _index(device)
    return (0, 0)


def mem_get_info(device=None) -> Tuple[int, int]:
    """``(free, total)`` bytes: the stand-in does not model device memory (free == total)."""
    _index(device)
    return TOTAL_MEMORY, TOTAL_MEMORY


def memory_allocated(device=None) -> int:
    _index(device)
    return 0


max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated


def empty_cache() -> None:
    return None


def reset_peak_memory_stats(device=None) -> None:
    _index(device)


def manual_seed(seed: int) -> None:
    return None


manual_seed_all = manual_seed


def _is_in_bad_fork() -> bool:
    return False


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]


# --------------------------------------------------------------------- graphs
class NPUGraph:
    """A captured graph (``graphs.py``): capture records the device work, replay reruns it."""

    def __init__(self):
        self._capture: Optional[graphs.Capture] = None

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self._capture = graphs.Capture()
        graphs.begin(self._capture)

    def capture_end(self) -> None:
        graphs.end()

    def replay(self) -> None:
        if self._capture is None:
            raise RuntimeError("NPUGraph.replay(): nothing was captured")
        self._capture.replay()

    def reset(self) -> None:
        self._capture = None

    def pool(self):
        return id(self)


@contextlib.contextmanager
def graph(
    npu_graph: NPUGraph,
    pool=None,
    stream: Optional[Stream] = None,
    auto_dispatch_capture: bool = False,
    capture_error_mode: str = "global",
):
    """``with torch.npu.graph(g):`` capture into ``g`` (on a side stream, as torch_npu does;
    ``auto_dispatch_capture`` is accepted and has no effect here)."""
    _check_type(npu_graph, NPUGraph, "torch.npu.graph", "npu_graph")
    side = Stream() if stream is None else stream
    with _on_stream(side):
        npu_graph.capture_begin(pool, capture_error_mode)
        try:
            yield npu_graph
        finally:
            npu_graph.capture_end()


def graph_pool_handle():
    return object()
