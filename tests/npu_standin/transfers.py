"""Device<->host traffic of the stand-in ``npu`` device, counted per call site.

Every device->host read (``.cpu()``, ``.item()``, ``.tolist()``, ``bool(t)``, printing,
``torch.equal``, an op whose output shape depends on device data such as ``nonzero``)
and every host->device copy (``.to("npu")``, ``torch.tensor(..., device="npu")``,
``npu_t.copy_(cpu_t)``, a CPU index tensor that torch_npu moves to the device) is one
:class:`Transfer`, tagged with its call site: ``path:line`` of the first frame outside
torch and this package (``path`` relative to the repository when it is inside it).

A test counts what a piece of code does with::

    with transfers.counting() as seen:
        engine.run_layer(...)
    assert seen.count("d2h") == 0, seen.sites("d2h")
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterator, List

import torch

KINDS = ("d2h", "h2d", "sync")  # sync: a host wait (torch.npu.synchronize, ...)

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STANDIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep
_REPO = os.path.dirname(os.path.dirname(_STANDIN_DIR.rstrip(os.sep))) + os.sep


@dataclass(frozen=True)
class Transfer:
    """One transfer: ``kind`` (``d2h`` / ``h2d``), ``what`` (the op, e.g. ``aten._to_copy``),
    ``site`` (``path:line``), ``nbytes`` and whether a host->device source was pinned."""

    kind: str
    what: str
    site: str
    nbytes: int
    pinned: bool = False


@dataclass
class Window:
    """The transfers seen while a :func:`counting` block ran."""

    seen: List[Transfer] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for t in self.seen if t.kind == kind)

    def sites(self, kind: str) -> Dict[str, int]:
        """``{site: count}`` of one kind, for an assertion message."""
        return dict(collections.Counter(t.site for t in self.seen if t.kind == kind))

    def of(self, kind: str) -> List[Transfer]:
        return [t for t in self.seen if t.kind == kind]


_windows: List[Window] = []
_lock = threading.Lock()


def call_site() -> str:
    """``path:line`` of the innermost frame outside torch, the stdlib and the stand-in
    (its own tests count as callers)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        standin = path.startswith(_STANDIN_DIR) and not os.path.basename(path).startswith("test_")
        if not (path.startswith(_TORCH_DIR) or standin or path.startswith(_STDLIB_DIR)):
            shown = path[len(_REPO) :] if path.startswith(_REPO) else path
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def record(kind: str, what: str, nbytes: int, pinned: bool = False, site: str = "") -> Transfer:
    """Record one transfer in every open window (and return it)."""
    if kind not in KINDS:
        raise ValueError(f"transfer kind {kind!r}: expected one of {KINDS}")
    event = Transfer(kind, what, site or call_site(), int(nbytes), pinned)
    with _lock:
        for window in _windows:
            window.seen.append(event)
    return event


@contextlib.contextmanager
def counting() -> Iterator[Window]:
    """Count the transfers of the block (windows nest; each sees everything inside it)."""
    window = Window()
    with _lock:
        _windows.append(window)
    try:
        yield window
    finally:
        with _lock:
            _windows.remove(window)
