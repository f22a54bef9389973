"""Where we run: device kind, streams/events, pinned host memory, SoC facts.

Nothing here imports ``torch_npu`` at module import time. The first call to
:func:`device_kind` probes, in order: an importable ``torch_npu`` with at least
one NPU (``npu``), CUDA (``cuda``), otherwise ``cpu``. The probe result is cached.

On CPU the stream and event helpers are synchronous no-ops: work submitted "on a
stream" runs immediately on the calling thread, and waiting on an event returns at
once. Code written against these helpers is therefore correct on every device and
overlaps transfers only where the device can.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from .soc import soc_family  # noqa: F401 - the one SoC mapping, re-exported

DEVICE_KINDS = ("npu", "cuda", "cpu")


def _torch_npu():
    """Import torch_npu lazily; ``None`` if it is not installed or unusable."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - a broken CANN install must not break CPU use
        return None


@functools.lru_cache(maxsize=1)
def device_kind() -> str:
    """``"npu"``, ``"cuda"`` or ``"cpu"``; overridable with SGLANG_ASCEND_OFFLOAD_DEVICE."""
    forced = os.environ.get("SGLANG_ASCEND_OFFLOAD_DEVICE")
    if forced:
        if forced not in DEVICE_KINDS:
            raise ValueError(f"SGLANG_ASCEND_OFFLOAD_DEVICE={forced!r}: expected one of {DEVICE_KINDS}")
        return forced
    npu = _torch_npu()
    if npu is not None and hasattr(torch, "npu") and torch.npu.is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_device() -> torch.device:
    kind = device_kind()
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, 0)


@functools.lru_cache(maxsize=1)
def soc_name() -> Optional[str]:
    """The installed NPU's SoC name, or ``None`` where there is no NPU."""
    if device_kind() != "npu":
        return None
    try:
        return str(torch.npu.get_device_name(0))
    except Exception:  # noqa: BLE001
        return None


_device_queries = True


@contextlib.contextmanager
def without_device_queries() -> Iterator[None]:
    """Within the block :func:`installed_soc` does not ask the device for its SoC name
    (``check-config --launch`` decides a launch without touching the device)."""
    global _device_queries
    before, _device_queries = _device_queries, False
    try:
        yield
    finally:
        _device_queries = before


def installed_soc() -> Tuple[Optional[str], Optional[str]]:
    """``(soc, why undecided)`` of an NPU deployment, read from the installed CANN build
    (``cann_install.py``: no NPU initialisation, no runtime query). :func:`soc_name`, the
    device's own answer where torch_npu already has it, is only a cross-check (skipped
    under :func:`without_device_queries`)."""
    from . import cann_install

    runtime = soc_name() if device_kind() == "npu" and _device_queries else None
    return cann_install.deployment_soc(runtime)


# --------------------------------------------------------------------------- streams
@dataclass
class _NullStream:
    """Stand-in for a device stream on CPU: work runs synchronously."""

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: "_NullEvent") -> None:
        return None

    def wait_stream(self, stream: "_NullStream") -> None:
        return None


@dataclass
class _NullEvent:
    """Stand-in for a device event on CPU: always complete."""

    def record(self, stream: Optional[_NullStream] = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: Optional[_NullStream] = None) -> None:
        return None


def _device_module():
    kind = device_kind()
    if kind == "npu":
        return torch.npu
    if kind == "cuda":
        return torch.cuda
    return None


def new_stream():
    """A new side stream on the current device, or a synchronous stand-in on CPU."""
    mod = _device_module()
    return _NullStream() if mod is None else mod.Stream()


def current_stream():
    mod = _device_module()
    return _NullStream() if mod is None else mod.current_stream()


def new_event():
    mod = _device_module()
    return _NullEvent() if mod is None else mod.Event()


@contextlib.contextmanager
def stream_context(stream) -> Iterator[None]:
    """``with stream_context(s):`` issues work on ``s`` (a no-op on CPU)."""
    mod = _device_module()
    if mod is None or isinstance(stream, _NullStream):
        yield
        return
    with mod.stream(stream):
        yield


def synchronize() -> None:
    mod = _device_module()
    if mod is not None:
        mod.synchronize()


# ------------------------------------------------------------------------- host memory
def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host tensor where a device exists; ordinary host memory on CPU.

    Pinning only matters for asynchronous host<->device copies; on a CPU-only
    machine there is no device to copy to, and ``pin_memory=True`` would fail.
    """
    pin = device_kind() != "cpu"
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def describe() -> dict:
    """Facts for ``python -m sglang_ascend_offload env``."""
    kind = device_kind()
    return {
        "device_kind": kind,
        "torch": torch.__version__,
        "torch_npu_installed": importlib.util.find_spec("torch_npu") is not None,
        "soc_name": soc_name(),
        "soc_family": soc_family(soc_name()),
        "triton_installed": importlib.util.find_spec("triton") is not None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
