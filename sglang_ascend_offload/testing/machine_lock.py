"""Exclusive sections across every process of this machine, for tests.

Some things exist once per machine whatever their configuration says: Memcache's
meta service takes a POSIX lock on the fixed path ``/tmp/mmc_meta_service.lock`` and
refuses to start while another one holds it ("meta service is already running"), so
two test runs on one machine (CI next to a developer's run, or two fresh clones) must
not start theirs at the same time. :func:`machine_lock` serialises such sections with
an ``flock`` in the port-reservation folder of :mod:`.ports` (dropped by the kernel
when the holder dies, so a crashed run leaves nothing stale behind).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator

from .ports import _lock_dir

__all__ = ["machine_lock"]


_held: Dict[str, int] = {}  # name -> how many open ``with`` blocks of this process hold it
_held_lock = threading.Lock()


@contextmanager
def machine_lock(name: str, timeout_s: float = 600.0, poll_s: float = 0.1) -> Iterator[None]:
    """Hold the machine-wide lock ``name`` for the ``with`` block; waits for another
    process's hold up to ``timeout_s`` and then raises :class:`TimeoutError`. Re-entrant
    within a process (a module fixture and a test of that module may both take it)."""
    with _held_lock:
        nested = _held.get(name, 0) > 0
        if nested:
            _held[name] += 1
    if nested:
        try:
            yield
        finally:
            with _held_lock:
                _held[name] -= 1
        return
    fd = _acquire(_lock_dir() / f"{name}.lock", timeout_s, poll_s)
    with _held_lock:
        _held[name] = 1
    try:
        yield
    finally:
        with _held_lock:
            _held[name] = 0
        os.close(fd)  # closing the only descriptor drops the flock


def _acquire(path, timeout_s: float, poll_s: float) -> int:
    """An open descriptor of ``path`` holding its exclusive ``flock``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise TimeoutError(
                    f"machine lock {path} still held by another process after {timeout_s:.0f} s"
                ) from None
            time.sleep(poll_s)
