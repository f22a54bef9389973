"""A server's startup phases, each logged with its time, ending in one summary line.

What a node operator waits on at startup (a multi-GiB host pool being allocated,
populated and registered, the TP group's rendezvous, the kernel qualification) is a
*phase*: the code doing the work opens it with :func:`phase`, reports its progress in
bytes, and the phase logs

* when it starts (with its size), then about every ``progress_interval_s`` the bytes done
  of the total and the rate, and when it ends its time;
* on a failure, an error naming the phase, its size and the fix, and the same as a note on
  the exception (which propagates unchanged).

Phases log at INFO inside a :func:`startup_log` (the server's startup: a pool builder opens
one), which at its end logs one summary line of every phase and its time. Outside one (a
component test, a benchmark building an engine) phases log at DEBUG, so they stay quiet.

    with startup_log("sparse decode offload startup"):
        with phase("host-pool population", total_bytes=pool_bytes, fix="...") as progress:
            for chunk in chunks:
                populate(chunk)
                progress.add(len(chunk))

The progress interval is a parameter of :func:`startup_log` (10 s by default), so a test
sees progress lines from a pool of a few GiB.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

__all__ = ["PhaseRecord", "Progress", "StartupLog", "startup_log", "phase", "current", "gib"]

logger = logging.getLogger(__name__)

DEFAULT_PROGRESS_INTERVAL_S = 10.0


def gib(nbytes: float) -> str:
    """``nbytes`` as GiB with two decimals (``"3.00 GiB"``)."""
    return f"{nbytes / 2**30:.2f} GiB"


@dataclass
class PhaseRecord:
    """One finished (or failed) phase: name, wall seconds, bytes (``None``: not a sized
    phase), whether it failed."""

    name: str
    seconds: float
    total_bytes: Optional[int] = None
    failed: bool = False
    done_bytes: int = 0  # of a failed phase: how far it got

    def describe(self) -> str:
        size = ""
        if self.total_bytes and self.failed:
            size = f" ({gib(self.done_bytes)} of {gib(self.total_bytes)})"
        elif self.total_bytes:
            # a rate over a few milliseconds says nothing (e.g. registration on CPU)
            rate = f", {self.total_bytes / self.seconds / 2**30:.2f} GiB/s" if self.seconds >= 0.05 else ""
            size = f" ({gib(self.total_bytes)}{rate})"
        return f"{self.name} {self.seconds:.2f} s{size}{' FAILED' if self.failed else ''}"


@dataclass
class StartupLog:
    """The phases of one startup (:func:`startup_log`): what it is, the progress interval,
    and the finished phases in order."""

    what: str
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S
    phases: List[PhaseRecord] = field(default_factory=list)
    level: int = logging.INFO
    started: float = field(default_factory=time.monotonic)

    def merged(self) -> List[PhaseRecord]:
        """The phases by name, in order of first appearance, times and bytes summed (a
        rank > 0 meets its group twice; a pool may be populated in two passes)."""
        out: Dict[str, PhaseRecord] = {}
        for p in self.phases:
            m = out.setdefault(p.name, PhaseRecord(p.name, 0.0, None))
            m.seconds += p.seconds
            if p.total_bytes:
                m.total_bytes = (m.total_bytes or 0) + p.total_bytes
            m.failed = m.failed or p.failed
            m.done_bytes += p.done_bytes if p.failed else p.total_bytes or 0
        return list(out.values())

    def summary(self) -> str:
        """One line: the startup's wall time and every phase's."""
        total = time.monotonic() - self.started
        return f"{self.what}: {total:.2f} s: " + ", ".join(p.describe() for p in self.merged())


_CURRENT: contextvars.ContextVar[Optional[StartupLog]] = contextvars.ContextVar("startup_log", default=None)


def current() -> Optional[StartupLog]:
    """The startup being logged in this context, ``None`` outside one."""
    return _CURRENT.get()


@contextlib.contextmanager
def startup_log(what: str, *, progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S) -> Iterator[StartupLog]:
    """Log the phases opened inside at INFO, then one summary line (also when a phase
    failed). Nested inside another startup log, it is that one (one summary line)."""
    outer = _CURRENT.get()
    if outer is not None:
        yield outer
        return
    log = StartupLog(what, progress_interval_s)
    token = _CURRENT.set(log)
    try:
        yield log
    finally:
        _CURRENT.reset(token)
        if log.phases:
            logger.info("%s", log.summary())


class Progress:
    """Progress of one sized phase: :meth:`add` the bytes done; a line about every
    ``interval_s`` with the bytes done of the total, the rate and the time left."""

    def __init__(self, name: str, total_bytes: Optional[int], interval_s: float, level: int):
        self.name, self.total_bytes, self.interval_s, self.level = name, total_bytes, interval_s, level
        self.done_bytes = 0
        self.started = self._last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.done_bytes += int(nbytes)
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        elapsed = now - self.started
        rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
        if self.total_bytes:
            left = (self.total_bytes - self.done_bytes) / rate if rate > 0 else float("inf")
            logger.log(
                self.level,
                "startup phase %s: %s / %s (%.0f%%), %.2f GiB/s, ~%.0f s left",
                self.name,
                gib(self.done_bytes),
                gib(self.total_bytes),
                100.0 * self.done_bytes / self.total_bytes,
                rate / 2**30,
                left,
            )
        else:
            done = gib(self.done_bytes)
            logger.log(self.level, "startup phase %s: %s done, %.2f GiB/s", self.name, done, rate / 2**30)


@contextlib.contextmanager
def phase(name: str, *, total_bytes: Optional[int] = None, fix: str = "", detail: str = "") -> Iterator[Progress]:
    """One startup phase (module docstring). ``total_bytes``: its size (for progress and
    the summary); ``fix``: what to do when it fails (logged and noted on the exception);
    ``detail``: a phrase for the start line (e.g. where the memory is)."""
    log = _CURRENT.get()
    level = log.level if log is not None else logging.DEBUG
    interval = log.progress_interval_s if log is not None else DEFAULT_PROGRESS_INTERVAL_S
    size = f" of {gib(total_bytes)}" if total_bytes else ""
    logger.log(level, "startup phase %s%s%s ...", name, size, f" ({detail})" if detail else "")
    progress = Progress(name, total_bytes, interval, level)
    try:
        yield progress
    except BaseException as exc:
        seconds = time.monotonic() - progress.started
        if log is not None:
            log.phases.append(PhaseRecord(name, seconds, total_bytes, failed=True, done_bytes=progress.done_bytes))
        done = f" ({gib(progress.done_bytes)} done)" if total_bytes else ""
        what = f"startup phase {name}{size} failed after {seconds:.1f} s{done}" + (f"; fix: {fix}" if fix else "")
        logger.error("%s: %s: %s", what, type(exc).__name__, exc)
        if isinstance(exc, Exception):
            exc.add_note(what)
        raise
    seconds = time.monotonic() - progress.started
    if log is not None:
        log.phases.append(PhaseRecord(name, seconds, total_bytes))
    logger.log(level, "startup phase %s: done in %.2f s%s", name, seconds, size)
