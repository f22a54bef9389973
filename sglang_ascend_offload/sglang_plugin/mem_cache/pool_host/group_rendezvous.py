"""The control block of an attention-DP group whose host pool is not a shared mapping
(NPU: MemFabric host memory reached through global addresses).

The rows live elsewhere (:mod:`.npu_memfabric`); what the group's TP ranks
still share on the node is a small header-only mapping ``<dir>/sao_hostpool.<pid>.
<session>.g<group>.order`` with the same identity header, semaphore and per-layer
*published* counters as the CPU pool file (:mod:`.shared`), so the append
ordering is the same :class:`~.shared.AppendOrder`, plus a **rank status
table** (:class:`GroupRendezvous`): one 256-byte entry per rank with its pid and
start time, the last setup phase it finished, whether it failed, a number it reports
(the global address it sees) and its error message.

Setup phases (:data:`PHASES`) are rendezvous points with a deadline: a rank reports
the phase, then waits until every rank reported it. A rank that failed a phase
(its message is in the table), died (its pid is gone) or stayed silent past the
deadline turns into :class:`GroupSetupError` on every other rank, naming that rank,
the phase and the reason -- no torch barrier that could hang. Teardown uses the same
table: ranks > 0 report ``left`` after leaving the MemFabric group; rank 0 waits for
them (dead or failed ranks count as gone) before it frees the memory.

Lifetime of the name: rank 0 creates it and unlinks it once every rank mapped it
(phase ``mapped``), as the CPU pool does; a server killed before that leaves a file
whose owner is dead, which :func:`~.shared.reclaim_stale` removes.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from ....sparse_decode.host_pool import HostPoolShape
from ....startup_phases import phase
from . import append_order
from . import shared as shp

__all__ = ["PHASES", "GroupSetupError", "GroupRendezvous", "GroupControl", "control_bytes_for", "open_group_control"]

#: setup and teardown phases, in order (``phase_index(name)`` = position + 1)
PHASES = ("mapped", "bm initialized", "joined", "addressed", "left")
ENTRY = struct.Struct("<qqiiq")  # pid, start ticks, phase, failed, value
ENTRY_BYTES = 256
MESSAGE_BYTES = ENTRY_BYTES - ENTRY.size
SUFFIX = ".order"


class GroupSetupError(RuntimeError):
    """Another rank of the group failed, died or stayed silent during setup or teardown."""


def _status_offset(layers: int) -> int:
    end = append_order.COUNTERS_OFFSET + 8 * layers
    return -(-end // 64) * 64 + 64  # 64 B for the table's own semaphore, then the entries


def control_bytes_for(layers: int, ranks: int) -> int:
    """Size of the control mapping: header, ``layers`` counters, ``ranks`` entries (page multiple)."""
    need = _status_offset(layers) + ENTRY_BYTES * ranks
    return -(-need // mmap.PAGESIZE) * mmap.PAGESIZE


def phase_index(name: str) -> int:
    return PHASES.index(name) + 1


class GroupRendezvous:
    """The rank status table in ``mapping`` (see the module docstring).

    Every read and write of the table holds its process-shared semaphore
    (``sem_timedwait`` / ``sem_post``: they order memory, as for the append counters).
    ``init``: rank 0 initialises the semaphore and zeroes the entries before it
    announces the mapping.
    """

    def __init__(
        self, mapping: mmap.mmap, layers: int, size: int, *, rank: int, group: int, timeout_s: float, init: bool = False
    ):
        self.size, self.rank, self.group, self.timeout_s = size, rank, group, timeout_s
        self._mapping = mapping
        self._sem_off = _status_offset(layers) - 64
        self._entries = _status_offset(layers)
        self._sem = ctypes.addressof(ctypes.c_char.from_buffer(mapping, self._sem_off))
        if init:
            mapping[self._entries : self._entries + ENTRY_BYTES * size] = bytes(ENTRY_BYTES * size)
            if append_order.libc().sem_init(self._sem, 1, 1) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"sem_init of the group's status lock failed: {os.strerror(err)}")

    # -------------------------------------------------------------- the lock
    def _locked(self, fn):
        c = append_order.libc()
        deadline = time.monotonic() + max(self.timeout_s, 1.0)
        while True:
            now = time.time() + max(0.0, deadline - time.monotonic())
            ts = append_order.Timespec(int(now), int((now % 1) * 1e9))
            if c.sem_timedwait(self._sem, ctypes.byref(ts)) == 0:
                break
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.ETIMEDOUT:
                raise GroupSetupError(
                    f"sparse decode offload: the status lock of attention-DP group {self.group} "
                    f"stayed held for {self.timeout_s:g} s (a rank died inside it)"
                )
            raise OSError(err, f"sem_timedwait on the group's status lock: {os.strerror(err)}")
        try:
            return fn()
        finally:
            c.sem_post(ctypes.c_void_p(self._sem))

    def _entry(self, rank: int):
        off = self._entries + rank * ENTRY_BYTES
        pid, start, phase, failed, value = ENTRY.unpack_from(self._mapping, off)
        raw = bytes(self._mapping[off + ENTRY.size : off + ENTRY_BYTES])
        return pid, start, phase, failed, value, raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def _put(self, phase: int, failed: int, value: int, message: str = "") -> None:
        off = self._entries + self.rank * ENTRY_BYTES
        pid = os.getpid()
        start = shp.process_start_ticks(pid) or 0

        def write():
            ENTRY.pack_into(self._mapping, off, pid, start, phase, failed, value)
            text = message.encode("utf-8")[: MESSAGE_BYTES - 1]
            self._mapping[off + ENTRY.size : off + ENTRY_BYTES] = text + bytes(MESSAGE_BYTES - len(text))

        self._locked(write)

    # -------------------------------------------------------------- protocol
    def report(self, phase: str, value: int = 0) -> None:
        """This rank finished ``phase``; ``value``: a number the others may read (:meth:`value`)."""
        self._put(phase_index(phase), 0, value)

    def fail(self, phase: str, message: str) -> None:
        """This rank failed ``phase``: every rank waiting on the table raises with ``message``."""
        try:
            self._put(phase_index(phase), 1, 0, message)
        except Exception:  # noqa: BLE001 - reporting is best effort; the caller raises its own error
            pass

    def value(self, rank: int) -> int:
        return self._locked(lambda: self._entry(rank))[4]

    def wait_all(self, phase: str, *, others_only: bool = False, tolerate_gone: bool = False) -> Dict[int, str]:
        """Return once every rank (``others_only``: every other rank) reported ``phase``.

        Raises :class:`GroupSetupError` naming the first rank that failed, died or did
        not report within ``timeout_s``. ``tolerate_gone`` (teardown): failed and dead
        ranks count as done; returns ``{rank: why}`` of those.
        """
        want = phase_index(phase)
        deadline = time.monotonic() + self.timeout_s
        sleep = 0.0
        while True:
            entries = self._locked(lambda: [self._entry(r) for r in range(self.size)])
            pending, gone = [], {}
            for r, entry in enumerate(entries):
                ph = entry[2]
                if r == self.rank and (others_only or ph >= want):
                    continue
                why = _gone_reason(entry)
                if why is None:
                    if ph < want:
                        pending.append(r)
                    continue
                if not tolerate_gone:
                    raise self._error(r, phase, why)
                gone[r] = why
            if not pending:
                return gone
            if time.monotonic() >= deadline:
                r = pending[0]
                ph = entries[r][2]
                last = f"its last phase was {PHASES[ph - 1]!r}" if ph else "it never reported"
                raise self._error(r, phase, f"did not report within {self.timeout_s:g} s ({last}; dead or stuck)")
            time.sleep(sleep)
            sleep = min(max(sleep * 2, 1e-3), 0.05)

    def first_failure(self, phase: str) -> Optional[GroupSetupError]:
        """The error naming another rank that already failed or died, if one did (no
        waiting): a rank whose own step fails uses it to report the group's first cause."""
        entries = self._locked(lambda: [self._entry(r) for r in range(self.size)])
        for r, entry in enumerate(entries):
            why = None if r == self.rank else _gone_reason(entry)
            if why is not None:
                return self._error(r, phase, why)
        return None

    def reach(self, phase: str, value: int = 0) -> None:
        """:meth:`report` then :meth:`wait_all`: a rendezvous with a deadline."""
        self.report(phase, value)
        self.wait_all(phase)

    def _error(self, rank: int, phase: str, why: str) -> GroupSetupError:
        return GroupSetupError(
            f"sparse decode offload: attention-TP rank {self.rank} of attention-DP group {self.group}: TP rank "
            f"{rank} {why} (waiting for phase {phase!r} of the group's MemFabric host pool; "
            f"deadline {self.timeout_s:g} s, {append_order.TIMEOUT_ENV})"
        )


def _gone_reason(entry) -> Optional[str]:
    """Why the rank of status-table ``entry`` is out of the group (failed, or its process
    died), or ``None`` while it is alive."""
    pid, start, ph, failed, _, msg = entry
    if failed:
        return f"failed at {PHASES[ph - 1]!r}: {msg}"
    if pid and shp.process_start_ticks(pid) != start:
        return f"died (pid {pid} is gone) after {PHASES[ph - 1]!r}" if ph else f"died (pid {pid} is gone)"
    return None


# ------------------------------------------------------------------ the control mapping
@dataclass
class GroupControl:
    """One rank's handle on the group's control mapping: the append ordering, the
    status table, and what rank 0 announced (``announced``: its extra fields)."""

    order: append_order.AppendOrder
    rendezvous: GroupRendezvous
    mapping: Optional[mmap.mmap]
    path: Path
    session: str
    rank: int
    group: int
    announced: Dict[str, Any]

    def unlink(self) -> None:
        if self.rank == 0:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Drop this rank's mapping (the ctypes views keep it alive until collected)."""
        self.unlink()
        self.mapping = None


def _map(path: Path, nbytes: int) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _create(shape: HostPoolShape, size: int, group: int, directory: Path, timeout_s: float) -> GroupControl:
    shp.reclaim_stale(directory)
    session = uuid.uuid4().hex
    pid = os.getpid()
    path = directory / f"{shp.PREFIX}.{pid}.{session[:12]}.g{group}{SUFFIX}"
    nbytes = control_bytes_for(shape.layers, size)
    with open(path, "xb") as f:
        f.truncate(nbytes)
    try:
        mm = _map(path, nbytes)
        order = append_order.AppendOrder(mm, shape.layers, rank=0, group=group, timeout_s=timeout_s, init=True)
        rv = GroupRendezvous(mm, shape.layers, size, rank=0, group=group, timeout_s=timeout_s, init=True)
        mm[: shp.HEADER.size] = shp.HEADER.pack(
            shp.MAGIC,
            shp.VERSION,
            nbytes,
            pid,
            shp.process_start_ticks(pid),
            bytes.fromhex(session),
            group,
            size,
            shape.layers,
            shape.tokens,
            shape.row_dim,
            shape.row_bytes // shape.row_dim,
        )
    except BaseException:
        path.unlink()
        raise
    return GroupControl(order, rv, mm, path, session, 0, group, {})


def _attach(
    shape: HostPoolShape, size: int, rank: int, group: int, announced: Dict[str, Any], timeout_s: float
) -> GroupControl:
    path = Path(announced["path"])
    if announced.get("host") != socket.gethostname():
        raise GroupSetupError(
            f"sparse decode offload: attention-TP rank {rank} of attention-DP group {group} runs on "
            f"{socket.gethostname()!r} but TP rank 0 on {announced.get('host')!r}: the MemFabric group host pool "
            "orders appends through a mapping on one node; keep each attention-TP group on one node "
            "(attention DP across nodes)"
        )
    header = shp.read_header(path)
    nbytes = control_bytes_for(shape.layers, size)
    problems = []
    if header is None:
        problems.append("it is missing or has no valid header")
    else:
        if header.session != announced["session"]:
            problems.append(f"session {header.session} != announced {announced['session']}")
        if not header.owner_alive():
            problems.append(f"its owner pid {header.owner_pid} is gone")
        if not header.matches(shape) or header.header_bytes != nbytes or header.group_size != size:
            problems.append(
                f"geometry {header.layers}x{header.tokens}x{header.row_dim} of a group of "
                f"{header.group_size} != this rank's {shape} in a group of {size}"
            )
        if header.group != group:
            problems.append(f"group {header.group} != {group}")
    if problems:
        raise GroupSetupError(f"refusing to map the group control block {path}: " + "; ".join(problems))
    mm = _map(path, nbytes)
    order = append_order.AppendOrder(mm, shape.layers, rank=rank, group=group, timeout_s=timeout_s)
    rv = GroupRendezvous(mm, shape.layers, size, rank=rank, group=group, timeout_s=timeout_s)
    return GroupControl(order, rv, mm, path, announced["session"], rank, group, announced)


def open_group_control(
    shape: HostPoolShape,
    view: "shp.GroupView",
    *,
    extra: Optional[Dict[str, Any]] = None,
    directory: Optional[Path] = None,
    timeout_s: Optional[float] = None,
) -> GroupControl:
    """Rank 0 creates the control mapping and broadcasts ``{path, session, host}`` plus
    ``extra`` (one collective); the others map it; all meet at phase ``mapped``, after
    which rank 0 removes the name. Every other rendezvous goes through the table."""
    directory = Path(directory) if directory is not None else shp.pool_dir()
    timeout_s = timeout_s or shp.append_timeout_s()
    with phase(
        "group rendezvous",
        detail=f"attention-TP rank {view.rank} of {view.size}, group {view.group}: the control block",
        fix=shp.RENDEZVOUS_FIX,
    ):
        if view.rank == 0:
            ctl = _create(shape, view.size, view.group, directory, timeout_s)
            try:
                ctl.announced = {
                    "path": str(ctl.path),
                    "session": ctl.session,
                    "host": socket.gethostname(),
                    **(extra or {}),
                }
                view.broadcast_object(ctl.announced)
                ctl.rendezvous.reach("mapped")
            finally:
                ctl.unlink()
            return ctl
        announced = view.broadcast_object(None)
        ctl = _attach(shape, view.size, view.rank, view.group, announced, timeout_s)
        ctl.rendezvous.reach("mapped")
        return ctl
