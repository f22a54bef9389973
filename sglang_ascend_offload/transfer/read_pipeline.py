"""Overlapping engine reads of one prefill peer, completed in the order they were sent.

Why: decode used to read a peer's layers strictly one after the other on the peer's
connection thread: validate, read, answer, then the next layer. When prefill has
published several layers at once (a whole forward's KV, or a layerwise prefill
running ahead), the engine then idles between reads for decode's per-layer Python
(answer, next frame, validation, plan), and a transport that moves more bytes with
several batches in flight (Mooncake's TCP transport: measured about 1.3x with two) is
never given them. On an NPU node a MemFabric layer read takes a few hundred
microseconds, so those gaps would be a large share of line rate.

Mechanism (policy-free; :class:`~.decode_side.DecodeReceiver` decides what a job is):

* a job is one validated batch with its planned read; :meth:`ReadPipeline.submit`
  queues it and returns at once, so the connection thread goes on to the next frame;
* up to ``depth`` lane threads (started on first use) take queued jobs in order and
  run ``read(job)``; each engine read releases the GIL, so reads overlap;
* ``complete(job)`` (answer + bookkeeping) runs for every job exactly once, strictly
  in submission order, on whichever lane finished the oldest outstanding job: a
  batch's answer never overtakes an earlier one, and a request's last layer is
  checked only after every earlier layer of it was recorded;
* :meth:`close` stops the lanes after their current read and completes every job
  that never started with ``cancel(job)`` then ``complete(job)``; a lane still
  inside a read after the timeout keeps its job (and every later one) outstanding,
  so its destination is never released while an engine may write there.

The caller reads inline instead (no thread hand-off, as before) when nothing is
outstanding and no further frame is waiting: :meth:`busy` tells it.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Deque, Generic, List, TypeVar

logger = logging.getLogger(__name__)

Job = TypeVar("Job")


class ReadPipeline(Generic[Job]):
    """Per-peer queue of reads: ``depth`` lanes, in-order completion.

    read(job): performs the job's engine read(s); must not raise (record errors on the job).
    complete(job): answers and records the job; called once per job, in submission order.
    cancel(job): marks a job that was never read (receiver closing) before its completion.
    """

    def __init__(self, depth: int, read: Callable[[Job], None], complete: Callable[[Job], None],
                 cancel: Callable[[Job], None], name: str = "pd-read"):
        if depth < 1:
            raise ValueError(f"read pipeline depth must be >= 1, got {depth}")
        self.depth = depth
        self.name = name
        self._read, self._complete, self._cancel = read, complete, cancel
        self._cond = threading.Condition()
        self._queued: Deque[list] = collections.deque()  # entries submitted, not taken by a lane yet
        self._outstanding: Deque[list] = collections.deque()  # [job, read_finished] in order
        self._completing = False  # one thread runs complete() at a time, in order
        self._closed = False
        self._lanes: List[threading.Thread] = []
        #: jobs submitted / completed; most reads in flight at once (for tests and the benchmark)
        self.submitted = 0
        self.completed = 0
        self.max_in_flight = 0
        self._in_flight = 0
        self._idle = 0  # lanes waiting for a job

    def busy(self) -> bool:
        """Whether a submitted job is not completed yet (then later jobs must queue behind it)."""
        with self._cond:
            return bool(self._outstanding)

    def submit(self, job: Job, needs_read: bool = True) -> None:
        """Queue ``job`` (``needs_read=False``: nothing to read, complete it in its turn)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after close")
            entry = [job, not needs_read]
            self._outstanding.append(entry)
            self.submitted += 1
            if needs_read:
                self._queued.append(entry)
                if len(self._lanes) < self.depth and len(self._queued) > self._idle:
                    self._start_lane()
                self._cond.notify()
        if not needs_read:
            self._drain_completions()

    def close(self, timeout_s: float = 10.0) -> int:
        """Stop the lanes, cancel and complete jobs never started; returns how many stay
        outstanding because a lane is still inside a read after ``timeout_s``."""
        with self._cond:
            self._closed = True
            never_started = list(self._queued)
            self._queued.clear()
            for entry in never_started:
                entry[1] = True
            self._cond.notify_all()
            lanes = list(self._lanes)
        for entry in never_started:
            try:
                self._cancel(entry[0])
            except Exception:  # noqa: BLE001 - a cancel bug must not keep the others outstanding
                logger.exception("%s: cancel failed", self.name)
        for t in lanes:
            if t is not threading.current_thread():
                t.join(timeout_s)
        self._drain_completions()
        with self._cond:
            return len(self._outstanding)

    # ------------------------------------------------------------------ lanes
    def _start_lane(self) -> None:
        t = threading.Thread(target=self._lane, name=f"{self.name}-lane{len(self._lanes)}", daemon=True)
        self._lanes.append(t)
        t.start()

    def _lane(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._queued:
                    return  # closed and nothing left to read
                entry = self._queued.popleft()
                self._in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self._in_flight)
            try:
                self._read(entry[0])
            except Exception:  # noqa: BLE001 - read() records its errors; this is a bug guard
                logger.exception("%s: read failed unexpectedly", self.name)
            with self._cond:
                self._in_flight -= 1
                entry[1] = True
            self._drain_completions()

    def _drain_completions(self) -> None:
        """Complete finished jobs at the head of the order (one completing thread at a time)."""
        while True:
            with self._cond:
                if self._completing or not self._outstanding or not self._outstanding[0][1]:
                    return
                self._completing = True
                job = self._outstanding[0][0]
            try:
                self._complete(job)
            except Exception:  # noqa: BLE001 - complete() answers itself; never stall the order
                logger.exception("%s: completion failed unexpectedly", self.name)
            finally:
                with self._cond:
                    self._outstanding.popleft()
                    self.completed += 1
                    self._completing = False
