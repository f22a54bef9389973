"""Race-free TCP ports for tests and benchmarks that start servers on this machine.

Choosing a port with ``bind(("127.0.0.1", 0))`` and handing it to a server that binds
it seconds later is a race: the kernel hands out the same *ephemeral* range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default) to every
outgoing connection (Mooncake, ZMQ, HTTP clients) and every ``bind(0)``, so another
process can take the port in between. This module avoids the race instead of
retrying it:

* ports come from a fixed range below the ephemeral range that nothing else here
  picks on its own (:data:`PORT_RANGE`): SGLang chooses its NCCL port in
  22000-29999 (``get_free_port_below_ephemeral``) and Mooncake its RPC port in
  15000-17000, so the default range is 18000-21699;
* each port handed out is *reserved* across processes for the lifetime of the
  process that took it: an exclusive ``flock`` on ``<lock dir>/<port>.lock`` (the
  kernel drops it when the process dies, even by ``SIGKILL``, so nothing stale
  survives a crashed run); concurrent test runs on one machine never receive the
  same port;
* a port is also checked to be bindable on ``127.0.0.1`` and ``0.0.0.0`` right now;
* ``span`` reserves a block of consecutive ports (P/D derives ``kv_port + rank``);
  ``offsets`` reserves chosen ports relative to the first one without the ports in
  between (SGLang derives ``port + 233 .. port + 239`` from the HTTP port under DP
  attention: :data:`DP_ATTENTION_OFFSETS`). Long blocks would fragment the range over a
  long test session; a few scattered offsets never run out;
* servers give their ports back when they stop (:func:`release_ports`), so a session
  that starts hundreds of servers never drains the range.

Environment: ``SAO_TEST_PORT_RANGE=LOW-HIGH`` overrides the range,
``SAO_TEST_PORT_LOCK_DIR`` the lock folder (default ``$TMPDIR/sglang_ascend_offload_ports``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import socket
import tempfile
import threading
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "PORT_RANGE",
    "BIND_FAILURE_MARKERS",
    "reserve_port",
    "reserve_ports",
    "release",
    "release_all",
    "log_reports_bind_failure",
    "DP_ATTENTION_OFFSETS",
    "release_ports",
]


def _range_from_env() -> Tuple[int, int]:
    text = os.environ.get("SAO_TEST_PORT_RANGE", "18000-21699")
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise ValueError(f"SAO_TEST_PORT_RANGE={text!r}: expected LOW-HIGH, e.g. 18000-21699") from None
    if not 1024 <= low < high <= 65535:
        raise ValueError(f"SAO_TEST_PORT_RANGE={text!r}: need 1024 <= LOW < HIGH <= 65535")
    return low, high


PORT_RANGE: Tuple[int, int] = _range_from_env()

# Lines a server prints when its listening socket cannot bind (uvicorn, ZMQ, SGLang's
# own pre-check, Mooncake): a launcher that sees one restarts on fresh ports at once
# instead of waiting for its startup deadline.
BIND_FAILURE_MARKERS: Tuple[str, ...] = ("address already in use", "errno 98", "port is already in use")

# SGLang 0.5.23 derives its ZMQ ports from the HTTP port under DP attention
# (``port + 233`` .. ``port + 239``, server_args.PortArgs.init_new): reserve them too.
DP_ATTENTION_OFFSETS = tuple(range(233, 240))

_lock = threading.Lock()
_held: Dict[int, int] = {}  # port -> fd of its lock file, kept open for the process lifetime


def _lock_dir() -> Path:
    path = Path(os.environ.get("SAO_TEST_PORT_LOCK_DIR", Path(tempfile.gettempdir()) / "sglang_ascend_offload_ports"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _bindable(port: int) -> bool:
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _try_lock(port: int, folder: Path) -> bool:
    fd = os.open(folder / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    _held[port] = fd
    return True


def _unlock(port: int) -> None:
    fd = _held.pop(port, None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock


def reserve_ports(count: int = 1, span: int = 1, offsets: Sequence[int] = ()) -> List[int]:
    """``count`` ports, each the first of ``span`` consecutive free ports (plus the ports
    at ``offsets`` from it), reserved for this process until :func:`release_ports` or
    the process ends (never handed out to any other process meanwhile).

    Raises ``RuntimeError`` naming the range when no block is free.
    """
    if count < 1 or span < 1 or any(o < span for o in offsets):
        raise ValueError(f"count={count} and span={span} must be >= 1, offsets {tuple(offsets)} >= span")
    low, high = PORT_RANGE
    folder = _lock_dir()
    reach = max([span - 1, *offsets])
    firsts = list(range(low, high - reach + 1))
    random.Random(os.getpid() ^ random.getrandbits(32)).shuffle(firsts)
    out: List[List[int]] = []
    with _lock:
        for first in firsts:
            block = [*range(first, first + span), *(first + o for o in offsets)]
            if any(p in _held for p in block):
                continue
            taken: List[int] = []
            for port in block:
                if not _try_lock(port, folder):
                    break
                taken.append(port)
                if not _bindable(port):
                    break
            else:
                out.append(block)
                if len(out) == count:
                    return [b[0] for b in out]
                continue
            for port in taken:
                _unlock(port)
    for block in out:
        release_ports(block)
    raise RuntimeError(
        f"no block of {span} free port(s) (offsets {tuple(offsets)}) in {low}-{high} "
        "(SAO_TEST_PORT_RANGE); another run may hold them: check for lingering servers"
    )


def reserve_port(span: int = 1, offsets: Sequence[int] = ()) -> int:
    """One reserved port (the first of ``span`` consecutive reserved ports, plus ``offsets``)."""
    return reserve_ports(1, span, offsets)[0]


def release_ports(ports: Iterable[int]) -> None:
    """Give reserved ports back (a stopped server's), so the range never drains."""
    with _lock:
        for port in ports:
            _unlock(port)


def release(first: int, span: int = 1) -> None:
    """Give back a block taken by :func:`reserve_ports`."""
    release_ports(range(first, first + span))


def release_all() -> None:
    with _lock:
        for port in list(_held):
            _unlock(port)


def log_reports_bind_failure(
    text: str, ports: Iterable[int], markers: Sequence[str] = BIND_FAILURE_MARKERS
) -> Optional[int]:
    """The first of ``ports`` that a log line reports as impossible to bind, else ``None``.

    Only lines that carry a bind-failure marker *and* the port number count: libraries
    that probe ports of their own (Mooncake picks its RPC port by trying) may log
    bind failures for ports nobody asked them to use.
    """
    wanted = [int(p) for p in ports]
    for line in text.lower().splitlines():
        if any(marker in line for marker in markers):
            for port in wanted:
                if re.search(rf"(?<!\d){port}(?!\d)", line):
                    return port
    return None
