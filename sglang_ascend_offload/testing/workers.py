"""A small pool of reusable spawned worker processes (multi-process tests, benchmark).

Each worker runs tasks one at a time: ``(module, function, kwargs)`` sent over a
pipe (pickle between our own processes only; nothing from the network), the
return value or the formatted exception sent back. Workers are started once and
reused across scenarios because a fresh Python + torch + engine start costs
seconds on small machines. A worker that dies (a scenario that kills its decode)
is replaced transparently on the next submit.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

_WORKER_ENV = {
    "MOONCAKE_PROTOCOL": "tcp",
    "GLOG_minloglevel": "2",  # Mooncake logs through glog: keep warnings out of test output
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    "OMP_NUM_THREADS": "1",
}


class WorkerDied(RuntimeError):
    """The worker process exited while running a task (``exitcode`` says how)."""

    def __init__(self, index: int, exitcode: Optional[int]):
        self.index = index
        self.exitcode = exitcode
        super().__init__(f"worker {index} died (exit code {exitcode})")


class TaskTimeout(TimeoutError):
    """A task did not finish within its timeout (the worker was killed)."""


class TaskError(RuntimeError):
    """A task raised; the message carries the worker's traceback."""


def _worker_main(conn, log_path: Optional[str] = None) -> None:
    for k, v in _WORKER_ENV.items():
        os.environ.setdefault(k, v)
    if log_path is not None:  # quiet mode: C-level (glog) and Python logs go to a file, not the terminal
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        module, func, kwargs = item
        try:
            fn = getattr(importlib.import_module(module), func)
            conn.send(("ok", fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            conn.send(("err", traceback.format_exc()))


@dataclass
class _Worker:
    process: Any
    conn: Any


class WorkerPool:
    """``size`` spawned workers; :meth:`submit` then :meth:`result` per task.

    log_dir: when given, worker ``i`` writes its stdout / stderr (Python logging and the
    engines' own C++ logs) to ``log_dir/worker-i.log`` instead of the terminal.
    """

    def __init__(self, size: int, log_dir: Optional[str] = None):
        self._ctx = mp.get_context("spawn")
        self.log_dir = log_dir
        self._workers: List[Optional[_Worker]] = [None] * size
        for i in range(size):
            self._ensure(i)

    @property
    def size(self) -> int:
        return len(self._workers)

    def _ensure(self, i: int) -> _Worker:
        w = self._workers[i]
        if w is not None and w.process.is_alive():
            return w
        if w is not None:
            w.conn.close()
        parent, child = self._ctx.Pipe()
        saved = {k: os.environ.get(k) for k in _WORKER_ENV}
        os.environ.update({k: os.environ.get(k) or v for k, v in _WORKER_ENV.items()})
        try:
            log_path = os.path.join(self.log_dir, f"worker-{i}.log") if self.log_dir else None
            p = self._ctx.Process(target=_worker_main, args=(child, log_path), daemon=True, name=f"pd-worker-{i}")
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self._workers[i] = _Worker(p, parent)
        return self._workers[i]

    def submit(self, i: int, module: str, func: str, **kwargs) -> None:
        self._ensure(i).conn.send((module, func, kwargs))

    def result(self, i: int, timeout_s: float) -> Any:
        """The task's return value; raises :class:`TaskError`, :class:`WorkerDied` or :class:`TaskTimeout`."""
        w = self._workers[i]
        deadline = time.monotonic() + timeout_s
        while True:
            if w.conn.poll(0.02):
                try:
                    status, value = w.conn.recv()
                except (EOFError, OSError):
                    w.process.join(1.0)
                    raise WorkerDied(i, w.process.exitcode) from None
                if status == "ok":
                    return value
                raise TaskError(f"worker {i} task failed:\n{value}")
            if not w.process.is_alive():
                raise WorkerDied(i, w.process.exitcode)
            if time.monotonic() > deadline:
                self.kill(i)
                raise TaskTimeout(f"worker {i}: task still running after {timeout_s:.1f}s (killed)")

    def kill(self, i: int) -> None:
        w = self._workers[i]
        if w is not None and w.process.is_alive():
            w.process.kill()
            w.process.join(5.0)

    def close(self, timeout_s: float = 3.0) -> None:
        """Ask every worker to exit, wait for all together, kill stragglers."""
        live = [(i, w) for i, w in enumerate(self._workers) if w is not None]
        for _, w in live:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + timeout_s
        for i, w in live:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                self.kill(i)
            w.conn.close()
        self._workers = [None] * len(self._workers)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_tasks(pool: WorkerPool, tasks: Dict[int, tuple], timeout_s: float) -> Dict[int, Any]:
    """Submit ``{worker: (module, func, kwargs)}`` at once; collect every outcome.

    Values are results or the exception instance (:class:`TaskError`,
    :class:`WorkerDied`, :class:`TaskTimeout`), so one failure does not hide the rest.
    """
    for i, (module, func, kwargs) in tasks.items():
        pool.submit(i, module, func, **kwargs)
    return collect(pool, list(tasks), timeout_s)


def collect(pool: WorkerPool, workers: List[int], timeout_s: float) -> Dict[int, Any]:
    """Outcomes of the tasks already submitted to ``workers`` (see :func:`run_tasks`)."""
    deadline = time.monotonic() + timeout_s
    out: Dict[int, Any] = {}
    for i in workers:
        try:
            out[i] = pool.result(i, max(0.1, deadline - time.monotonic()))
        except (TaskError, WorkerDied, TaskTimeout) as exc:
            out[i] = exc
    return out
