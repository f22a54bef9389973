"""In-process stand-in of the ``memfabric_hybrid`` calls the MemFabric group pool makes,
for CPU tests across real processes.

Names, parameter names, defaults, enum members and values follow the installed
``memfabric_hybrid`` 1.3.0 (its pybind11 ``__doc__`` signatures;
``test_fake_memfabric_conformance.py`` checks that they still do). Return codes
follow the real convention: ``0`` success, non-zero failure with a message for
``get_last_err_msg()``.

What is underneath:

* ``bm.initialize(store_url, ...)`` keys the "store" by the URL: a directory
  ``$FAKE_MEMFABRIC_DIR/store.<host>_<port>`` holding one file per rank's segment;
* ``bm.create2(local_dram_size=N)`` with ``N > 0`` creates and maps the segment file
  of ``N`` bytes of this rank (``destroy()`` unlinks it);
* a global virtual address (GVA) is ``GVA_BASE + rank * GVA_STRIDE + offset``: the
  same number in every process (a fixed convention); ``copy_data`` translates a GVA
  to this process's mapping of that rank's segment (mapped on first use) and any
  other address is taken as a local address; the bytes move with ``ctypes.memmove``;
* copy types are checked against the addresses: ``G2L`` / ``G2H`` / ``GH2L`` /
  ``GH2H`` need a GVA source and a local destination, ``L2G`` / ``H2G`` / ``L2GH``
  / ``H2GH`` a local source and a GVA destination, ``G2G`` both global. A mismatch
  (or a range past a segment's end) returns ``-1``, as a bad real copy does.

Fault injection (``FAKE_MEMFABRIC_FAIL``, comma-separated ``what:rank``):
``join:R`` -- rank R's ``join()`` returns -1; ``exit_join:R`` -- rank R's process
exits (``os._exit(17)``) inside ``join()``: a rank that dies during setup.

Install with :func:`install` (``sys.modules['memfabric_hybrid']`` and
``sys.modules['memfabric_hybrid.bm']``); never part of the runtime package.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import sys
import time
import types
from pathlib import Path
from typing import Dict, List, Optional, Sequence

DIR_ENV = "FAKE_MEMFABRIC_DIR"
FAIL_ENV = "FAKE_MEMFABRIC_FAIL"
GVA_BASE = 0x5A00_0000_0000
GVA_STRIDE = 1 << 36  # 64 GiB of address space per rank

_last_err = ""
_mf_up = False


def _set_err(msg: str) -> int:
    global _last_err
    _last_err = msg
    return -1


def _faults() -> Dict[str, List[int]]:
    out: Dict[str, List[int]] = {}
    for item in filter(None, (os.environ.get(FAIL_ENV) or "").split(",")):
        what, _, rank = item.partition(":")
        out.setdefault(what, []).append(int(rank))
    return out


# ------------------------------------------------------------------ top level
def initialize(flags: int = 0) -> int:
    global _mf_up
    _mf_up = True
    return 0


def uninitialize() -> None:
    global _mf_up
    _mf_up = False


def get_last_err_msg() -> str:
    return _last_err


def get_and_clear_last_err_msg() -> str:
    global _last_err
    msg, _last_err = _last_err, ""
    return msg


# ------------------------------------------------------------------ bm enums
class BmCopyType(enum.IntEnum):
    L2G = 0
    G2L = 1
    G2H = 2
    H2G = 3
    L2GH = 4
    GH2L = 5
    GH2H = 6
    H2GH = 7
    G2G = 8
    AUTO = 9


class BmDataOpType(enum.IntEnum):
    SDMA = 1
    HOST_RDMA = 2
    HOST_TCP = 4
    DEVICE_RDMA = 8
    HOST_URMA = 16
    HOST_SHM = 32
    DEVICE_URMA = 64
    DEVICE_UBOE = 128


class BmMemType(enum.IntEnum):
    LOCAL_DEVICE = 0
    LOCAL_HOST = 1
    DEVICE = 2
    HOST = 3


class BmGroupEvent(enum.IntEnum):
    JOIN_EVENT = 0
    LEAVE_EVENT = 1


_FROM_GLOBAL = {BmCopyType.G2L, BmCopyType.G2H, BmCopyType.GH2L, BmCopyType.GH2H}
_TO_GLOBAL = {BmCopyType.L2G, BmCopyType.H2G, BmCopyType.L2GH, BmCopyType.H2GH}


class BmConfig:
    """Same fields and defaults as the real ``bm.BmConfig`` (times in seconds)."""

    def __init__(self) -> None:
        self.auto_ranking = True
        self.create_timeout = 120
        self.dynamic_world_size = False
        self.flags = 0
        self.init_timeout = 120
        self.operation_timeout = 900
        self.rank_id = 65535
        self.start_store = True
        self.start_store_only = False
        self.unified_address_space = True
        self._nic = ""

    def set_nic(self, nic: str) -> None:
        self._nic = nic


class _State:
    store: Optional[Path] = None
    rank: int = -1
    world: int = 0
    timeout_s: float = 120.0


_state = _State()


def _store_dir(url: str) -> Path:
    base = Path(os.environ.get(DIR_ENV) or "/dev/shm")
    tail = url.split("://", 1)[-1].replace(":", "_").replace("/", "_").strip("[]")
    return base / f"store.{tail}"


def _initialize(store_url: str, world_size: int, device_id: int, config: BmConfig) -> int:
    if not _mf_up:
        return _set_err("fake bm.initialize: memfabric_hybrid.initialize() was not called")
    if not store_url.startswith("tcp://"):
        return _set_err(f"fake bm.initialize: bad store url {store_url!r}")
    store = _store_dir(store_url)
    if config.start_store:
        store.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + float(config.init_timeout)
    while not store.is_dir():  # the store is rank 0's (start_store); others connect to it
        if time.monotonic() > deadline:
            return _set_err(f"fake bm.initialize: no config store at {store_url} within {config.init_timeout} s")
        time.sleep(0.01)
    if config.auto_ranking:  # ranks in order of arrival, as the real store assigns them
        rank = 0
        while True:
            try:
                os.close(os.open(store / f"rank.{rank}", os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                rank += 1
    else:
        rank = int(config.rank_id)
    if not 0 <= rank < world_size:
        return _set_err(f"fake bm.initialize: rank {rank} outside world size {world_size}")
    _state.store, _state.rank, _state.world = store, rank, world_size
    _state.timeout_s = float(config.operation_timeout)
    return 0


def _uninitialize(flags: int = 0) -> None:
    if _state.store is not None:
        try:
            (_state.store / f"rank.{_state.rank}").unlink()
        except FileNotFoundError:
            pass
        try:
            _state.store.rmdir()  # the last one out removes the store
        except OSError:
            pass
    _state.store, _state.rank = None, -1


def _bm_rank_id() -> int:
    return _state.rank if _state.rank >= 0 else 0xFFFFFFFF


class BigMemory:
    """A rank's view of one BM entity (see the module docstring for the memory)."""

    def __init__(self) -> None:
        raise TypeError("No constructor defined!")  # pybind11's message: made by bm.create2

    @classmethod
    def _make(cls, entity: int, local_dram_size: int, max_dram_size: int) -> "BigMemory":
        self = object.__new__(cls)
        self._entity = entity
        self._rank = _state.rank
        self._store = _state.store
        self._size = local_dram_size
        self._max = max_dram_size
        self._maps: Dict[int, mmap.mmap] = {}
        self._addr: Dict[int, int] = {}
        self._joined = False
        self._own: Optional[Path] = None
        if local_dram_size > 0:
            path = self._segment(self._rank)
            with open(path, "xb") as f:
                f.truncate(local_dram_size)
            self._own = path
        return self

    def _segment(self, rank: int) -> Path:
        return self._store / f"entity{self._entity}.rank{rank}.host"

    def join(self, flags: int = 0) -> int:
        faults = _faults()
        if self._rank in faults.get("exit_join", []):
            os._exit(17)
        if self._rank in faults.get("join", []):
            return _set_err(f"fake bm join: injected failure on rank {self._rank}")
        self._joined = True
        return 0

    def leave(self, flags: int = 0) -> int:
        if not self._joined:
            return _set_err("fake bm leave: not joined")
        self._joined = False
        return 0

    def destroy(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()
        self._addr.clear()
        if self._own is not None:
            try:
                self._own.unlink()
            except FileNotFoundError:
                pass
            self._own = None

    def peer_rank_ptr(self, peer_rank: int, mem_type: BmMemType = BmMemType.DEVICE) -> int:
        if mem_type != BmMemType.HOST or not 0 <= peer_rank < _state.world:
            return 0
        return GVA_BASE + peer_rank * GVA_STRIDE

    def local_mem_size(self, mem_type: BmMemType = BmMemType.DEVICE) -> int:
        return self._size if mem_type == BmMemType.HOST else 0

    def _local(self, gva: int, size: int) -> int:
        """This process's address of ``[gva, gva + size)``; 0 if it is not in a segment."""
        rank, off = divmod(gva - GVA_BASE, GVA_STRIDE)
        if not 0 <= rank < _state.world:
            return 0
        if rank not in self._addr:
            path = self._segment(rank)
            try:
                with open(path, "r+b") as f:
                    mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
            except FileNotFoundError:  # the owner left (or never backed it): not addressable
                return 0
            self._maps[rank] = mm
            self._addr[rank] = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        if off + size > len(self._maps[rank]):
            return 0
        return self._addr[rank] + off

    @staticmethod
    def _is_gva(addr: int) -> bool:
        return GVA_BASE <= addr < GVA_BASE + 64 * GVA_STRIDE

    def copy_data(
        self, src_ptr: int, dst_ptr: int, size: int, type: BmCopyType, flags: int = 0, stream: int = 0
    ) -> int:
        if not self._joined:
            return _set_err("fake bm copy_data: the entity was not joined")
        kind = BmCopyType(type)
        want_src = kind in _FROM_GLOBAL or kind == BmCopyType.G2G
        want_dst = kind in _TO_GLOBAL or kind == BmCopyType.G2G
        if kind != BmCopyType.AUTO and (self._is_gva(src_ptr) != want_src or self._is_gva(dst_ptr) != want_dst):
            return _set_err(
                f"fake bm copy_data: copy type {kind.name} does not match src {src_ptr:#x} / dst {dst_ptr:#x}"
            )
        src = self._local(src_ptr, size) if self._is_gva(src_ptr) else src_ptr
        dst = self._local(dst_ptr, size) if self._is_gva(dst_ptr) else dst_ptr
        if not src or not dst:
            return _set_err(f"fake bm copy_data: {size} B at {src_ptr:#x} -> {dst_ptr:#x} is outside every segment")
        ctypes.memmove(dst, src, size)
        return 0

    def copy_data_batch(
        self,
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int],
        sizes: Sequence[int],
        count: int,
        type: BmCopyType,
        flags: int = 0,
        stream: int = 0,
    ) -> int:
        if not len(src_addrs) == len(dst_addrs) == len(sizes) >= count:
            return _set_err("fake bm copy_data_batch: address / size lists shorter than count")
        for i in range(count):
            ret = self.copy_data(src_addrs[i], dst_addrs[i], sizes[i], type, flags, stream)
            if ret != 0:
                return ret
        return 0

    def wait(self) -> int:
        return 0  # copies above are synchronous


def _create2(
    id: int,
    local_dram_size: int,
    max_dram_size: int,
    local_hbm_size: int = 0,
    max_hbm_size: int = 0,
    data_op_type: BmDataOpType = BmDataOpType.SDMA,
    enable_56bits_gva: bool = False,
    flags: int = 0,
    shm_fd: int = -1,
    tag: str = "",
    tag_op_info: str = "",
) -> BigMemory:
    if _state.store is None:
        raise RuntimeError("fake bm.create2: bm.initialize() was not called")
    if local_dram_size > max_dram_size:
        raise RuntimeError(f"fake bm.create2: local_dram_size {local_dram_size} > max_dram_size {max_dram_size}")
    return BigMemory._make(id, local_dram_size, max_dram_size)


bm = types.ModuleType("memfabric_hybrid.bm")
bm.BmCopyType = BmCopyType
bm.BmDataOpType = BmDataOpType
bm.BmMemType = BmMemType
bm.BmGroupEvent = BmGroupEvent
bm.BmConfig = BmConfig
bm.BigMemory = BigMemory
bm.initialize = _initialize
bm.uninitialize = _uninitialize
bm.create2 = _create2
bm.bm_rank_id = _bm_rank_id
# the real functions are called by their own names
_initialize.__name__, _uninitialize.__name__, _create2.__name__, _bm_rank_id.__name__ = (
    "initialize",
    "uninitialize",
    "create2",
    "bm_rank_id",
)

#: names of the stand-in, for the conformance test: top-level functions, bm functions,
#: bm classes with the methods / attributes this stand-in defines
TOP_FUNCTIONS = ("initialize", "uninitialize", "get_last_err_msg", "get_and_clear_last_err_msg")
BM_FUNCTIONS = ("initialize", "uninitialize", "create2", "bm_rank_id")
BM_METHODS = {
    "BigMemory": (
        "join",
        "leave",
        "destroy",
        "peer_rank_ptr",
        "local_mem_size",
        "copy_data",
        "copy_data_batch",
        "wait",
    ),
    "BmConfig": ("set_nic",),
}
BM_ATTRIBUTES = {
    "BmConfig": (
        "auto_ranking",
        "create_timeout",
        "dynamic_world_size",
        "flags",
        "init_timeout",
        "operation_timeout",
        "rank_id",
        "start_store",
        "start_store_only",
        "unified_address_space",
    )
}
BM_ENUMS = ("BmCopyType", "BmDataOpType", "BmMemType", "BmGroupEvent")


def module() -> types.ModuleType:
    """The stand-in as a ``memfabric_hybrid`` module object."""
    mod = types.ModuleType("memfabric_hybrid")
    for name in TOP_FUNCTIONS:
        setattr(mod, name, globals()[name])
    mod.bm = bm
    mod.__fake__ = True
    return mod


def install() -> types.ModuleType:
    """Put the stand-in in ``sys.modules`` (call before anything imports memfabric_hybrid)."""
    mod = module()
    sys.modules["memfabric_hybrid"] = mod
    sys.modules["memfabric_hybrid.bm"] = bm
    return mod
