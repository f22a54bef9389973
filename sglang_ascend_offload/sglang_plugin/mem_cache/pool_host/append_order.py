"""The order of TP rank 0's host-pool appends before the other ranks' reads, across
independent processes that map one pool file (:mod:`.shared`; on an NPU the header-only
control mapping of :mod:`.group_rendezvous`).

The mapping's header holds a process-shared POSIX semaphore at :data:`SEM_OFFSET` and one
int64 *published* counter per layer from :data:`COUNTERS_OFFSET`.

Append ordering (:class:`AppendOrder`). Every rank counts its own ``set_kv_buffer``
calls per layer (TP ranks run the same forwards, so the counts agree). Rank 0 writes
the rows, then stores its count in the layer's counter; a reader, before it reads
layer ``l`` of the host pool (extend gather or decode miss copy), waits until the
counter reaches its own count. A deadline (:data:`TIMEOUT_ENV`, default
:data:`DEFAULT_TIMEOUT_S`) turns a dead or stuck rank 0 into :class:`AppendTimeout`,
naming the rank, the group, the layer and the append number: never a read of stale
rows.

Memory ordering. The counter is read and written only while holding the semaphore
(``sem_timedwait`` / ``sem_post`` through ctypes). POSIX lists ``sem_post`` and
``sem_wait`` among the functions that synchronize memory (XBD 4.12), which glibc
implements with release/acquire atomics: rank 0's row stores happen before its
``sem_post``, the reader's loads of the rows happen after its ``sem_wait`` that saw
the new counter. This holds on weakly ordered CPUs (Kunpeng / ARMv8), where a plain
counter store in shared memory could become visible before the rows it publishes.
A torch.distributed barrier over the TP group would also order them, but costs a
collective per layer; the counter costs two uncontended semaphore operations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import time
from typing import Callable, Optional

from ....sparse_decode.host_pool import AppendTimeout

TIMEOUT_ENV = "SGLANG_ASCEND_OFFLOAD_APPEND_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
SEM_OFFSET = 256  # sem_t (32 B on 64-bit Linux, x86-64 and aarch64); 64 B reserved
SEM_BYTES = 64
COUNTERS_OFFSET = 512  # int64 [layers] published append counts


def _never() -> bool:
    return False


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def libc():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        lib.sem_post.argtypes = [ctypes.c_void_p]
        lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(Timespec)]
        lib.sem_trywait.argtypes = [ctypes.c_void_p]
        _libc = lib
    return _libc


class AppendOrder:
    """TP rank 0's appends before the other ranks' reads, across independent processes.

    ``mapping``: the pool file's mapping (header at offset 0). ``rank`` /
    ``group``: attention-TP rank and group index (for messages). ``init``: rank 0
    initialises the semaphore and zeroes the counters (before anyone attaches).
    Call :meth:`appended` on every rank after each ``set_kv_buffer`` of a layer (rank
    0: after its rows are in host memory) and :meth:`wait_readable` before reading a
    layer's host rows. See the module docstring for the memory-ordering argument.
    """

    def __init__(
        self,
        mapping: mmap.mmap,
        layers: int,
        *,
        rank: int,
        group: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        init: bool = False,
    ):
        self.layers = layers
        self.rank = rank
        self.group = group
        self.timeout_s = timeout_s
        self._sem = ctypes.addressof(ctypes.c_char.from_buffer(mapping, SEM_OFFSET))
        self._sem_arg = ctypes.c_void_p(self._sem)
        self._trywait, self._post = libc().sem_trywait, libc().sem_post
        self._published = (ctypes.c_int64 * layers).from_buffer(mapping, COUNTERS_OFFSET)
        self._local = [0] * layers
        #: ``() -> bool``: while true, rank 0 writes its rows but does not publish them (what a
        #: stuck rank 0 looks like to the readers). Always false in service; the test harness
        #: (``testing/harness.py``, seam ``hold_appends``) sets it.
        self.hold: Callable[[], bool] = _never
        self.waits = 0  # reads that found the rows not yet published
        self.wait_s = 0.0
        self.checks = 0
        if init:
            for i in range(layers):
                self._published[i] = 0
            if libc().sem_init(self._sem, 1, 1) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"sem_init of the host pool's append lock failed: {os.strerror(err)}")

    # -------------------------------------------------------------- lock
    def _lock(self, deadline: float, layer: int, want: int, step: Optional[int]) -> None:
        c = libc()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(layer, want, step, holding=True)
            now = time.time() + left
            ts = Timespec(int(now), int((now % 1) * 1e9))
            if c.sem_timedwait(self._sem, ctypes.byref(ts)) == 0:
                return
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err != errno.ETIMEDOUT:
                raise OSError(err, f"sem_timedwait on the host pool's append lock: {os.strerror(err)}")

    def _unlock(self) -> None:
        self._post(self._sem_arg)

    def _read(self, layer: int, deadline: float, want: int, step: Optional[int]) -> int:
        self._lock(deadline, layer, want, step)
        try:
            return int(self._published[layer])
        finally:
            self._unlock()

    def _try_read(self, layer: int) -> int:
        """One uncontended locked read (``sem_trywait`` synchronizes memory like
        ``sem_wait``); -1 when the lock is busy."""
        if self._trywait(self._sem_arg) != 0:
            return -1
        try:
            return self._published[layer]
        finally:
            self._post(self._sem_arg)

    # -------------------------------------------------------------- protocol
    def appended(self, layer: int) -> None:
        """One ``set_kv_buffer`` of ``layer`` happened on this rank (rank 0: rows written)."""
        self._local[layer] += 1
        if self.rank != 0:
            return
        if self.hold():
            return  # rank 0 "stuck" (see ``hold``)
        if self._trywait(self._sem_arg) == 0:  # fast path: the lock is free
            self._published[layer] = self._local[layer]
            self._post(self._sem_arg)
            return
        deadline = time.monotonic() + self.timeout_s
        self._lock(deadline, layer, self._local[layer], None)
        try:
            self._published[layer] = self._local[layer]
        finally:
            self._unlock()

    def wait_readable(self, layer: int, step: Optional[int] = None) -> None:
        """Return once rank 0 published every append of ``layer`` this rank has seen."""
        if self.rank == 0:
            return
        want = self._local[layer]
        self.checks += 1
        for _ in range(32):  # fast path: published (or about to be), no clock, no sleep
            if self._try_read(layer) >= want:
                return
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        sleep = 0.0
        while True:
            # the lock itself gets at least 1 s: only a lock that stays held is "held"
            have = self._read(layer, max(deadline, time.monotonic() + 1.0), want, step)
            if have >= want:
                if sleep:
                    self.waits += 1
                    self.wait_s += time.monotonic() - t0
                return
            if time.monotonic() >= deadline:
                raise self._timeout(layer, want, step, holding=False, have=have)
            time.sleep(sleep)
            sleep = min(max(sleep * 2, 20e-6), 2e-3)

    def published(self, layer: int) -> int:
        return self._read(layer, time.monotonic() + self.timeout_s, 0, None)

    def _timeout(self, layer: int, want: int, step: Optional[int], holding: bool, have: Optional[int] = None):
        what = f"decode step {step}, " if step is not None else ""
        state = (
            "the pool's append lock stayed held (rank 0 died or stalled inside publish)"
            if holding
            else f"rank 0 has published {have} for that layer"
        )
        return AppendTimeout(
            f"sparse decode offload: attention-TP rank {self.rank} of attention-DP group {self.group} waited "
            f"{self.timeout_s:g} s for TP rank 0's append #{want} of layer {layer} ({what}{state}). TP rank 0 "
            "is dead or stuck; failing this step instead of reading stale host rows "
            f"(deadline: {TIMEOUT_ENV})"
        )


class EngineGate:
    """:class:`~....sparse_decode.host_pool.AppendGate`'s interface over an :class:`AppendOrder`
    for :class:`~....sparse_decode.engine.SparseDecodeEngine` on ranks > 0: ``wait(step,
    layer)`` waits for the layer's appends this rank has seen; ``publish`` is a no-op
    (rank 0 publishes in ``set_kv_buffer``, right after the rows are written)."""

    def __init__(self, order: AppendOrder):
        self.order = order

    def publish(self, step: int, layer: int) -> None:
        return None

    def wait(self, step: int, layer: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.order.wait_readable(layer, step)
