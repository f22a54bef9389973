"""One host KV pool per attention-DP group, shared by the group's TP ranks (CPU: a
named shared mapping; NPU with attention TP > 1: TP rank 0's MemFabric memory reached
through global addresses, :func:`open_memfabric_group`, with the same append ordering
in a header-only control mapping, :mod:`.group_rendezvous`).

MLA's latent KV is replicated over attention TP, so one host copy per group is
enough. Inside a served SGLang process:

* the group's attention-TP rank 0 removes stale pools of dead servers
  (:func:`reclaim_stale`), creates the mapping ``<dir>/sao_hostpool.<pid>.<session>.g<group>``
  (``dir`` = ``$SGLANG_ASCEND_OFFLOAD_SHM_DIR`` or ``/dev/shm``), reserves its bytes
  (``posix_fallocate``: a too-small ``/dev/shm`` fails at startup, not with ``SIGBUS``
  later) and broadcasts ``(path, session)`` over SGLang's attention-TP CPU group;
* the other ranks map exactly that path and check its header (magic, session,
  owner pid and start time, geometry) -- a file of another server is never mapped;
* after a barrier (every rank mapped it) rank 0 **unlinks the name**. The memory
  lives on while the ranks map it and the kernel frees it when the last one exits,
  so a stopped *or SIGKILLed* server leaves no file behind. A server killed in the
  short window between create and unlink leaves a file whose header names a dead
  owner; the next start on the node reclaims it (pid + process start time, so a
  reused pid does not keep it alive).

File layout (:data:`HEADER`): a header of ``header_bytes_for(layers)`` bytes (page
multiple), then the rows ``[layers, tokens, D]`` of :class:`~....sparse_decode.host_pool.HostKVPool`.
The header holds identity fields, a process-shared POSIX semaphore and one int64
*published* counter per layer.

Append ordering: :mod:`.append_order` (rank 0's appends before the other ranks' reads).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from .... import SUPPORTED_SGLANG_VERSION
from ....sparse_decode.host_pool import AppendTimeout, HostKVPool, HostPoolShape
from ....startup_phases import phase
from .append_order import COUNTERS_OFFSET, DEFAULT_TIMEOUT_S, TIMEOUT_ENV, AppendOrder, EngineGate

logger = logging.getLogger(__name__)

__all__ = [
    "SHM_DIR_ENV",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT_S",
    "PREFIX",
    "AppendTimeout",
    "AppendOrder",
    "GroupView",
    "PoolHeader",
    "SharedPool",
    "header_bytes_for",
    "pool_dir",
    "append_timeout_s",
    "create_pool",
    "attach_pool",
    "open_group_pool",
    "read_header",
    "reclaim_stale",
    "sglang_group",
    "GroupDiscoveryError",
    "process_start_ticks",
    "EngineGate",
    "RankPool",
    "allocate_rank_pool",
    "open_memfabric_group",
]

SHM_DIR_ENV = "SGLANG_ASCEND_OFFLOAD_SHM_DIR"
PREFIX = "sao_hostpool"
MAGIC = b"SAOHPOOL"
VERSION = 1
# magic, version, header_bytes, owner_pid, owner_start_ticks, session (16 B), group, group_size,
# layers, tokens, row_dim, element size
HEADER = struct.Struct("<8sIIqq16siiqqqi")


def header_bytes_for(layers: int) -> int:
    """Header size: identity + semaphore + ``layers`` int64 counters, rounded up to a page."""
    need = COUNTERS_OFFSET + 8 * layers
    return -(-need // mmap.PAGESIZE) * mmap.PAGESIZE


def pool_dir() -> Path:
    return Path(os.environ.get(SHM_DIR_ENV) or "/dev/shm")


def append_timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} must be > 0 seconds")
    return value


def process_start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[19])  # field 22 overall: state is field 3 = fields[0]


# ------------------------------------------------------------------ header
@dataclass(frozen=True)
class PoolHeader:
    """Identity of a shared pool file (first :data:`HEADER` bytes)."""

    header_bytes: int
    owner_pid: int
    owner_start_ticks: int
    session: str  # 32 hex digits
    group: int
    group_size: int
    layers: int
    tokens: int
    row_dim: int
    element_size: int

    def owner_alive(self) -> bool:
        return process_start_ticks(self.owner_pid) == self.owner_start_ticks

    def matches(self, shape: HostPoolShape) -> bool:
        return (self.layers, self.tokens, self.row_dim, self.element_size) == (
            shape.layers,
            shape.tokens,
            shape.row_dim,
            shape.row_bytes // shape.row_dim,
        )


def read_header(path: os.PathLike) -> Optional[PoolHeader]:
    """The header of ``path``; None when the file is too short or not a pool of this format."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
    except OSError:
        return None
    if len(raw) < HEADER.size:
        return None
    magic, version, hb, pid, start, session, group, gsize, layers, tokens, row_dim, esize = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return None
    return PoolHeader(hb, pid, start, session.hex(), group, gsize, layers, tokens, row_dim, esize)


def _name_pid(name: str) -> Optional[int]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == PREFIX and parts[1].isdigit():
        return int(parts[1])
    return None


def reclaim_stale(directory: Optional[os.PathLike] = None) -> List[Path]:
    """Remove pool files of dead owners in ``directory``; returns what was removed.

    A file is stale when its header names an owner that is gone (pid not running, or
    running with another start time: a reused pid). A file without a complete header
    (its creator died while writing it) is stale when the pid in its name is gone.
    Files of live owners are never touched.
    """
    directory = Path(directory) if directory is not None else pool_dir()
    removed = []
    try:
        entries = list(directory.glob(f"{PREFIX}.*"))
    except OSError:
        return removed
    for path in entries:
        header = read_header(path)
        if header is not None:
            stale = not header.owner_alive()
            owner = header.owner_pid
        else:
            owner = _name_pid(path.name)
            stale = owner is not None and process_start_ticks(owner) is None
        if stale:
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:  # e.g. another user's file: leave it, say so
                logger.warning(
                    "sparse decode offload: cannot remove the stale host pool %s of dead owner pid %s "
                    "(%s); remove it by hand",
                    path,
                    owner,
                    exc,
                )
                continue
            removed.append(path)
            logger.warning(
                "sparse decode offload: reclaimed a stale host pool %s (%.1f MiB) of a server that "
                "is gone (owner pid %s)",
                path,
                size / 2**20,
                owner,
            )
    return removed


# ------------------------------------------------------------------ create / attach
@dataclass(frozen=True)
class SharedPool:
    """A mapped shared pool: the rows, the ordering, and where it came from."""

    pool: HostKVPool
    order: AppendOrder
    path: Path
    session: str
    group: int
    group_size: int
    rank: int


def _session_bytes(session: str) -> bytes:
    return bytes.fromhex(session)


def create_pool(
    shape: HostPoolShape,
    *,
    group: int = 0,
    group_size: int = 1,
    directory: Optional[Path] = None,
    session: Optional[str] = None,
    timeout_s: Optional[float] = None,
) -> SharedPool:
    """Rank 0: reclaim stale pools, create + reserve + map a new one, write its header."""
    directory = Path(directory) if directory is not None else pool_dir()
    reclaim_stale(directory)
    session = session or uuid.uuid4().hex
    pid = os.getpid()
    path = directory / f"{PREFIX}.{pid}.{session[:12]}.g{group}"
    hb = header_bytes_for(shape.layers)
    pool = HostKVPool.create_shared(shape, path, header_bytes=hb, reserve=True)
    try:
        order = AppendOrder(
            pool.mapping, shape.layers, rank=0, group=group, timeout_s=timeout_s or append_timeout_s(), init=True
        )
        start = process_start_ticks(pid)
        pool.mapping[: HEADER.size] = HEADER.pack(
            MAGIC,
            VERSION,
            hb,
            pid,
            start,
            _session_bytes(session),
            group,
            group_size,
            shape.layers,
            shape.tokens,
            shape.row_dim,
            shape.row_bytes // shape.row_dim,
        )
    except BaseException:
        pool.close()
        raise
    return SharedPool(pool, order, path, session, group, group_size, 0)


def attach_pool(
    shape: HostPoolShape,
    path: os.PathLike,
    session: str,
    *,
    rank: int,
    group: int = 0,
    timeout_s: Optional[float] = None,
) -> SharedPool:
    """Ranks > 0: map ``path`` after checking that it is the pool rank 0 just announced."""
    path = Path(path)
    header = read_header(path)
    if header is None:
        raise RuntimeError(
            f"host pool {path} is missing or has no valid header: attention-TP rank 0 of group "
            f"{group} announced it but it cannot be read"
        )
    problems = []
    if header.session != session:
        problems.append(f"session {header.session} != announced {session}")
    if not header.owner_alive():
        problems.append(f"its owner pid {header.owner_pid} is gone")
    if not header.matches(shape):
        problems.append(
            f"geometry {header.layers}x{header.tokens}x{header.row_dim} (elem {header.element_size} B) "
            f"!= this rank's {shape}"
        )
    if header.group != group:
        problems.append(f"group {header.group} != {group}")
    if problems:
        raise RuntimeError(f"refusing to map host pool {path}: " + "; ".join(problems))
    pool = HostKVPool.attach_shared(shape, path, header_bytes=header.header_bytes)
    order = AppendOrder(pool.mapping, shape.layers, rank=rank, group=group, timeout_s=timeout_s or append_timeout_s())
    return SharedPool(pool, order, path, session, group, header.group_size, rank)


@dataclass(frozen=True)
class GroupView:
    """The ranks that share one pool: this rank's index, the size, the group's index
    among the server's pools, and collectives over the group's CPU (gloo) group."""

    rank: int
    size: int
    group: int
    groups: int
    broadcast_object: Callable[[Any], Any]
    barrier: Callable[[], None]
    groups_per_node: int = 1


#: What an operator does when a group rendezvous fails or hangs (startup phase logs).
RENDEZVOUS_FIX = (
    "every attention-TP rank of the group must reach it: read the other ranks' logs for their own "
    "startup error (a rank that failed or died earlier leaves the others waiting)"
)


def open_group_pool(
    shape: HostPoolShape, view: GroupView, *, directory: Optional[Path] = None, timeout_s: Optional[float] = None
) -> SharedPool:
    """Rank 0 creates, broadcasts ``(path, session)``, the others attach; after a barrier
    rank 0 unlinks the name (see the module docstring). Every rank's mapping is populated
    as it is mapped (``HostKVPool`` create / attach: startup phase ``host-pool population``)."""
    meet = dict(detail=f"attention-TP rank {view.rank} of {view.size}, group {view.group}", fix=RENDEZVOUS_FIX)
    if view.rank == 0:
        shared = create_pool(shape, group=view.group, group_size=view.size, directory=directory, timeout_s=timeout_s)
        try:
            with phase("group rendezvous", **meet):
                view.broadcast_object({"path": str(shared.path), "session": shared.session})
                view.barrier()
        finally:
            shared.pool.unlink()
        return shared
    with phase("group rendezvous", **meet):
        announced: Dict[str, str] = view.broadcast_object(None)
    shared = attach_pool(
        shape, announced["path"], announced["session"], rank=view.rank, group=view.group, timeout_s=timeout_s
    )
    with phase("group rendezvous", **meet):
        view.barrier()
    return shared


class GroupDiscoveryError(RuntimeError):
    """SGLang's parallel state says the host pool is shared by several ranks (attention TP
    > 1) or names several DP replicas, and the group (or the replica) cannot be read."""


def sglang_group() -> Optional[GroupView]:
    """This process's attention-TP group inside a served SGLang process.

    ``None`` (a private pool for this rank, the reason logged) where there is nothing to
    share with: no SGLang parallel configuration in this process (component use), or an
    attention TP of 1 whose group is not built (component tests publish a context without
    process groups). A :class:`GroupDiscoveryError` with the reason where the published
    configuration asks for a pool shared by attention TP > 1 ranks and the group cannot be
    read (never one private pool per rank, the host memory times the TP), or where it
    names several DP replicas and this one's index cannot be read (group ids would
    collide across replicas)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        expected = int(par.attn_tp_size)
    except Exception as exc:  # noqa: BLE001 - nothing published: not a served process
        logger.info(
            "sparse decode offload: no SGLang parallel configuration in this process (%s): this rank's host "
            "pool is private",
            exc,
        )
        return None
    try:
        coord = par.attn_tp_group
        rank, size = int(coord.rank_in_group), int(coord.world_size)
        attn_dp_rank, attn_dp = int(par.attn_dp_rank), int(par.attn_dp_size)
    except Exception as exc:  # noqa: BLE001 - the group is not built (or SGLang renamed it)
        if expected > 1:
            raise GroupDiscoveryError(
                f"sparse decode offload: attention TP is {expected}, so the {expected} ranks of each attention-DP "
                f"group share one host pool, but SGLang's attention-TP group cannot be read ({exc!r}); refusing "
                f"to allocate a private pool per rank ({expected} x the host memory). The plugin supports "
                f"SGLang {SUPPORTED_SGLANG_VERSION} (python -m sglang_ascend_offload env shows the installed one)"
            ) from exc
        logger.info(
            "sparse decode offload: SGLang's attention-TP group is not built in this process (%s); attention TP "
            "is 1, so this rank's host pool is private, as a group of one's is",
            exc,
        )
        return None
    replica, replicas, nnodes = _replica(par, attn_dp)
    groups = replicas * attn_dp
    return GroupView(
        rank=rank,
        size=size,
        group=replica * attn_dp + attn_dp_rank,
        groups=groups,
        broadcast_object=lambda obj: coord.broadcast_object(obj, src=0),
        barrier=lambda: torch_barrier(coord),
        groups_per_node=max(1, groups // nnodes),
    )


def _replica(par, attn_dp: int):
    """``(replica, replicas, nnodes)``: this server replica's index among the DP replicas
    that run without DP attention (``--dp N`` alone: one scheduler and one attention-DP
    group per replica; with DP attention the groups are the attention-DP ranks, one
    replica), and the nodes. Group ids are ``replica * attn_dp + attn_dp_rank``: distinct
    over the server, so a replica index that cannot be read is a :class:`GroupDiscoveryError`."""
    from sglang.srt.runtime_context import get_server_args

    try:
        args = get_server_args()
    except Exception as exc:  # noqa: BLE001
        raise GroupDiscoveryError(
            f"sparse decode offload: SGLang's parallel state is built but its server args cannot be read ({exc!r}): "
            "cannot tell the DP replicas apart"
        ) from exc
    replicas = int(getattr(args, "dp_size", 1) or 1) if attn_dp == 1 else 1
    nnodes = int(getattr(args, "nnodes", 1) or 1)
    if replicas == 1:
        return 0, 1, nnodes
    try:
        replica = int(par.dp_rank)
    except Exception as exc:  # noqa: BLE001 - None or unreadable
        raise GroupDiscoveryError(
            f"sparse decode offload: --dp {replicas} without DP attention runs {replicas} replicas, each with "
            f"its own host pool, but this replica's DP rank cannot be read ({exc!r}): their group ids would "
            "collide"
        ) from exc
    return replica, replicas, nnodes


def torch_barrier(coord) -> None:
    """A barrier over the coordinator's CPU (gloo) group."""
    import torch.distributed as dist

    if int(coord.world_size) > 1:
        dist.barrier(group=coord.cpu_group)


# ------------------------------------------------------------------ served allocation
@dataclass(frozen=True)
class RankPool:
    """What one served rank uses: its pool (a :class:`HostKVPool`, or on NPU with attention
    TP > 1 the group's :class:`~.npu_memfabric.MemfabricGroupPool`), the ordering
    (None for a private pool), its attention-TP rank in the group, and the group (None
    outside a server)."""

    pool: Any
    order: Optional[AppendOrder]
    rank: int
    view: Optional[GroupView]
    shared: Optional[SharedPool] = None
    control: Any = None  # group_rendezvous.GroupControl of a MemFabric group pool


def _npu_device_index(view: GroupView) -> int:
    """The NPU this rank's MemFabric pool registers; without ``torch.npu`` (CPU runs of the
    group logic) the attention-TP rank, logged."""
    try:
        import torch

        return int(torch.npu.current_device())
    except Exception as exc:  # noqa: BLE001
        logger.warning(
            "sparse decode offload: torch.npu.current_device() failed (%r): the MemFabric group pool of rank %d "
            "uses device %d (its attention-TP rank)",
            exc,
            view.rank,
            view.rank,
        )
        return view.rank


def open_memfabric_group(
    shape: HostPoolShape,
    view: GroupView,
    *,
    directory: Optional[Path] = None,
    timeout_s: Optional[float] = None,
    device_id: Optional[int] = None,
) -> RankPool:
    """NPU, attention TP > 1: one MemFabric host pool for the group. Rank 0 creates the
    control block (append counters + rank status table, :mod:`.group_rendezvous`) and
    broadcasts it with its BM store URL; every rank opens
    :class:`~.npu_memfabric.MemfabricGroupPool` (rank 0 backs the memory, the
    others reach it through its global address). Closed at interpreter exit, in order."""
    import atexit

    from .group_rendezvous import open_group_control
    from .npu_memfabric import MemfabricGroupPool, MemfabricPoolConfig, free_store_url

    extra = {"store_url": free_store_url()} if view.rank == 0 else None
    ctl = open_group_control(shape, view, extra=extra, directory=directory, timeout_s=timeout_s)
    dev = device_id if device_id is not None else _npu_device_index(view)
    pool = MemfabricGroupPool(
        shape, view.rank, view.size, MemfabricPoolConfig(device_id=dev), ctl.announced["store_url"], ctl.rendezvous
    )
    atexit.register(pool.close)
    return RankPool(pool, ctl.order, view.rank, view, None, ctl)


def allocate_rank_pool(
    shape: HostPoolShape, kind: str, *, view: Optional[GroupView] = None, directory: Optional[Path] = None
) -> RankPool:
    """The host pool of this rank inside SGLang: one pool per attention-DP group.

    ``kind`` is what the platform asks for (``pinned`` off NPU, ``memfabric`` on NPU).
    Outside a served process (``view`` None and no SGLang parallel state): a private
    pool of ``kind``. In a server, off NPU: the group's shared mapping
    (:func:`open_group_pool`) for every group (on CPU also a group of one, so each
    group's pool is one observable mapping); on a GPU a group of one keeps its private
    pinned pool. On NPU a group of one keeps its private MemFabric pool; a larger group
    shares one MemFabric pool that rank 0 allocates and the others reach through global
    addresses (:func:`open_memfabric_group`), ordered by the same :class:`AppendOrder`.
    """
    from .... import capacity, platform

    view = view if view is not None else sglang_group()
    if view is None:
        return RankPool(HostKVPool.allocate(shape, kind), None, 0, None)
    device = platform.device_kind()
    if kind == "memfabric" and view.size > 1:
        rp = open_memfabric_group(shape, view, directory=directory)
    elif kind == "memfabric" or (view.size == 1 and device != "cpu"):
        rp = RankPool(HostKVPool.allocate(shape, kind), None, 0, view)
    else:
        shared = open_group_pool(shape, view, directory=directory)
        rp = RankPool(shared.pool, shared.order, view.rank, view, shared)
    if view.rank == 0:
        node = capacity.host_pool_bytes_per_node(shape.layers * shape.row_bytes, shape.tokens, view.groups_per_node)
        if rp.shared is not None:
            where = f"shared mapping {rp.shared.path} (name removed once all {view.size} TP ranks mapped it)"
        elif rp.control is not None:
            where = (
                f"MemFabric host memory of TP rank 0 at global address {rp.pool.base:#x}, read by all "
                f"{view.size} TP ranks"
            )
        else:
            where = f"{rp.pool.kind} memory"
        logger.info(
            "sparse decode offload: host pool of attention-DP group %d: %d B = %d layers x %d tokens x %d B "
            "in %s; host bytes per node: %d B (%.1f MiB) = %d pool(s) (one per DP rank, shared by its TP "
            "ranks)",
            view.group,
            shape.nbytes,
            shape.layers,
            shape.tokens,
            shape.row_bytes,
            where,
            node,
            node / 2**20,
            view.groups_per_node,
        )
    return rp
