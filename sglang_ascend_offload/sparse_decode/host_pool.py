"""Host KV pool: the full main KV of every layer in host memory, shared across TP.

Layout: one tensor ``[layers, tokens, D]`` (``D`` = latent 512 + rope 64 by
default, bf16), indexed by the **caller's** token slots (SGLang's allocator owns
logical ids; the pool never invents its own). A layer's rows are
``pool.layer(l)[slot]``; the latent and rope parts are views of the same row.

Memory (``kind``):

``pinned``     page-locked host memory through :func:`platform.pinned_empty` (ordinary
               memory on a CPU-only machine). One process.
``shared``     a file mapping (``/dev/shm`` by default) that every TP rank of a DP rank
               maps: TP rank 0 :meth:`HostKVPool.create_shared` s it, the others
               :meth:`HostKVPool.attach_shared`. One allocation per DP rank.
``memfabric``  MemFabric-registered host memory (``memfabric_hybrid.offload``, imported
               lazily): the memory Ascend kernels and the MemFabric copy engine can
               address directly. NPU only.

TP sharing protocol: decode K/V is replicated over TP, so only TP rank 0 writes new
rows (:meth:`HostKVPool.write_rows`), then publishes ``(step, layer)`` through an
:class:`AppendGate`; every other rank waits on the gate for that ``(step, layer)``
before it reads (copies misses). The gate's lock gives the happens-before edge
between rank 0's stores and the readers' loads; a wait has a deadline. The gate
needs processes started by one parent; SGLang's TP schedulers are not, and use
``sglang_plugin.mem_cache.pool_host.shared.AppendOrder`` instead (per-layer counters in the
mapping's header under a process-shared semaphore, same interface via ``EngineGate``).
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

from .. import platform
from ..startup_phases import phase

__all__ = ["HostPoolShape", "HostKVPool", "AppendGate", "AppendTimeout", "populate_mapping"]

PoolKind = Literal["pinned", "shared", "memfabric"]
MADV_POPULATE_READ = 22  # Linux >= 5.14: fault a range in now (readers)
MADV_POPULATE_WRITE = 23  # ... writable (the creator)
#: Bytes per step of a pool's allocation and population: the progress granularity of
#: those startup phases (``startup_phases``; a line about every 10 s of a large pool).
CHUNK_BYTES = 256 << 20
_SIZE_FIX = "lower the pool (host_pool_tokens / --max-total-tokens) or free host memory"


@dataclass(frozen=True)
class HostPoolShape:
    """Geometry of a host pool: ``[layers, tokens, latent_dim + rope_dim]`` of ``dtype``."""

    layers: int
    tokens: int
    latent_dim: int = 512
    rope_dim: int = 64
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for name in ("layers", "tokens", "latent_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"host pool {name} must be >= 1, got {getattr(self, name)}")
        if self.rope_dim < 0:
            raise ValueError(f"host pool rope_dim must be >= 0, got {self.rope_dim}")

    @property
    def row_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of one layer (1152 for 576 bf16)."""
        return self.row_dim * self.dtype.itemsize

    @property
    def numel(self) -> int:
        return self.layers * self.tokens * self.row_dim

    @property
    def nbytes(self) -> int:
        return self.layers * self.tokens * self.row_bytes

    def dims(self):
        return (self.layers, self.tokens, self.row_dim)


class HostKVPool:
    """``[layers, tokens, D]`` host rows; see the module docstring. Implements
    :class:`~.host_rows.HostRows` with a tensor view (``tensor_backed``)."""

    tensor_backed = True

    def __init__(
        self,
        shape: HostPoolShape,
        storage: torch.Tensor,
        kind: PoolKind,
        path: Optional[Path] = None,
        owner: bool = True,
    ):
        if tuple(storage.shape) != shape.dims() or storage.dtype != shape.dtype:
            raise ValueError(f"storage {tuple(storage.shape)} {storage.dtype} does not match {shape}")
        self.shape = shape
        self.data = storage
        self.kind = kind
        self.path = path
        self.owner = owner
        self.mapping: Optional[mmap.mmap] = None  # kind "shared": the whole file (header + rows)
        self.header_bytes = 0

    # ------------------------------------------------------------------ allocation
    @classmethod
    def allocate(cls, shape: HostPoolShape, kind: PoolKind = "pinned", *, device_id: int = 0) -> "HostKVPool":
        """A private pool (``pinned`` or ``memfabric``); ``shared`` goes through
        :meth:`create_shared` / :meth:`attach_shared`."""
        if kind == "pinned":
            with phase("host-pool allocation", total_bytes=shape.nbytes, detail="pinned host memory", fix=_SIZE_FIX):
                data = platform.pinned_empty(shape.dims(), shape.dtype)
            _zero_fill(data)
            return cls(shape, data, kind)
        if kind == "memfabric":
            data = _memfabric_empty(shape, device_id)
            _zero_fill(data)
            return cls(shape, data, kind)
        if kind == "shared":
            raise ValueError(
                "kind='shared' pools are made with HostKVPool.create_shared(path) on TP rank 0 "
                "and HostKVPool.attach_shared(path) on the other TP ranks"
            )
        raise ValueError(f"unknown host pool kind {kind!r}; expected pinned | shared | memfabric")

    @classmethod
    def create_shared(
        cls, shape: HostPoolShape, path: Optional[os.PathLike] = None, *, header_bytes: int = 0, reserve: bool = False
    ) -> "HostKVPool":
        """TP rank 0: create the mapping file (zero-filled) and map it; unlinked on :meth:`close`.

        File layout: ``header_bytes`` (a multiple of 4096; the caller's metadata, e.g.
        the owner and the append-ordering counters of ``sglang_plugin.mem_cache.pool_host.shared``)
        followed by the ``[layers, tokens, D]`` rows. ``reserve``: ``posix_fallocate``
        the whole file first, so a ``/dev/shm`` too small for the pool is an ``OSError``
        here instead of a ``SIGBUS`` on the first write of an unbacked page later.
        """
        if path is None:
            path = Path("/dev/shm") / f"sglang_ascend_offload_pool_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        path = Path(path)
        _check_header_bytes(header_bytes)
        total = header_bytes + shape.nbytes
        fix = f"make {path.parent} larger or lower the pool size (host_pool_tokens / --max-total-tokens)"
        with phase("host-pool allocation", total_bytes=total, detail=f"shared mapping {path}", fix=fix) as progress:
            with open(path, "xb") as f:  # fails if it exists: never map someone else's pool by accident
                f.truncate(total)
                if reserve:
                    _reserve(f.fileno(), total, path, fix, progress.add)
        return cls._map(shape, path, header_bytes, owner=True)

    @classmethod
    def attach_shared(cls, shape: HostPoolShape, path: os.PathLike, *, header_bytes: int = 0) -> "HostKVPool":
        """Other TP ranks: map the pool TP rank 0 created at ``path`` (same ``shape`` and header)."""
        path = Path(path)
        _check_header_bytes(header_bytes)
        try:
            size = path.stat().st_size
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"host pool {path} does not exist: TP rank 0 must create_shared() it before the other ranks attach"
            ) from exc
        if size != header_bytes + shape.nbytes:
            raise ValueError(
                f"host pool {path} has {size} bytes but {shape} needs {shape.nbytes} "
                f"(+ {header_bytes} header): every TP rank must use the same pool shape"
            )
        return cls._map(shape, path, header_bytes, owner=False)

    @classmethod
    def _map(cls, shape: HostPoolShape, path: Path, header_bytes: int, owner: bool) -> "HostKVPool":
        """``MAP_SHARED`` mapping of the whole file, populated (:func:`populate_mapping`:
        resident from the start, as a pinned pool is, so RSS does not grow as the pool
        fills; shared pages, so still no private copy per rank); ``data`` views the rows
        after the header."""
        with open(path, "r+b") as f:
            mm = mmap.mmap(
                f.fileno(),
                header_bytes + shape.nbytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        populate_mapping(mm, write=owner)
        data = torch.frombuffer(mm, dtype=shape.dtype, count=shape.numel, offset=header_bytes).view(shape.dims())
        pool = cls(shape, data, "shared", path, owner=owner)
        pool.mapping = mm
        pool.header_bytes = header_bytes
        return pool

    def unlink(self) -> None:
        """Remove the mapping's name (creator only); every process that mapped it keeps
        the memory until it unmaps or exits, and the kernel frees it after the last one
        (so a killed server leaves no file behind)."""
        if self.kind == "shared" and self.owner and self.path is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Drop this process's mapping; the creator also removes the file."""
        self.data = None
        self.mapping = None
        self.unlink()

    # ------------------------------------------------------------------ access
    def layer(self, layer: int) -> torch.Tensor:
        """``[tokens, D]`` rows of ``layer``."""
        return self.data[layer]

    def latent(self, layer: int) -> torch.Tensor:
        """``[tokens, latent_dim]`` view (what SGLang's NPU MLA pool keeps in ``k_buffer``)."""
        return self.data[layer, :, : self.shape.latent_dim]

    def rope(self, layer: int) -> torch.Tensor:
        """``[tokens, rope_dim]`` view (what SGLang's NPU MLA pool keeps in ``v_buffer``)."""
        return self.data[layer, :, self.shape.latent_dim :]

    def write_rows(self, layer: int, host_slots: torch.Tensor, rows: torch.Tensor) -> int:
        """Device -> host append: ``pool[layer, host_slots[i]] = rows[i]``; returns bytes moved.

        host_slots: int ``[n]`` (unique); rows: ``[n, D]`` of the pool dtype, any device.
        """
        if rows.dim() != 2 or rows.shape[0] != host_slots.shape[0] or rows.shape[1] != self.shape.row_dim:
            raise ValueError(
                f"write_rows: rows {tuple(rows.shape)} / slots {tuple(host_slots.shape)} "
                f"do not fit [n, {self.shape.row_dim}]"
            )
        if rows.dtype != self.shape.dtype:
            raise ValueError(f"write_rows: rows dtype {rows.dtype} != pool dtype {self.shape.dtype}")
        self.data[layer].index_copy_(0, host_slots.to(torch.int64).cpu(), rows.to("cpu"))
        return rows.shape[0] * self.shape.row_bytes

    def read_rows(self, layer: int, host_slots: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` copy of rows ``host_slots`` of ``layer``."""
        return self.data[layer].index_select(0, host_slots.to(torch.int64).cpu())

    def gather_into(
        self, layer: int, host_slots: torch.Tensor, dst: torch.Tensor, dst_rows: Optional[torch.Tensor] = None
    ) -> int:
        """``dst[dst_rows[i]] = pool[layer, host_slots[i]]`` (dst ``[M, D]``, any device;
        ``dst_rows`` default ``0..n-1``); returns bytes moved."""
        rows = self.read_rows(layer, host_slots).to(dst.device)
        if dst_rows is None:
            dst[: rows.shape[0]].copy_(rows)
        else:
            dst.index_copy_(0, dst_rows.to(dst.device, torch.int64), rows)
        return rows.shape[0] * self.shape.row_bytes


def _reserve(fd: int, total: int, path: Path, fix: str, done) -> None:
    """``posix_fallocate`` the file in :data:`CHUNK_BYTES` steps (``done(nbytes)`` after
    each): a too-small file system fails here, naming the size and the fix, and the file
    is removed."""
    for start in range(0, total, CHUNK_BYTES):
        length = min(CHUNK_BYTES, total - start)
        try:
            os.posix_fallocate(fd, start, length)
        except OSError as exc:
            os.unlink(path)
            raise OSError(
                exc.errno,
                f"cannot reserve {total / 2**20:.1f} MiB for the host pool {path} ({exc.strerror}, "
                f"{start / 2**20:.1f} MiB reserved): {fix}",
            ) from exc
        done(length)


def populate_mapping(mm: mmap.mmap, *, write: bool) -> None:
    """Fault the whole mapping into this process's page tables now, in :data:`CHUNK_BYTES`
    steps (startup phase ``host-pool population``, with progress): ``write`` (the creator)
    makes the pages writable; readers map the existing ones. Kernels before 5.14 lack
    ``MADV_POPULATE_*``: one byte per page is then touched (a read, or for the creator a
    write of the same byte)."""
    total = len(mm)
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    with phase("host-pool population", total_bytes=total, fix=_SIZE_FIX) as progress:
        for start in range(0, total, CHUNK_BYTES):
            length = min(CHUNK_BYTES, total - start)
            try:
                mm.madvise(advice, start, length)
            except OSError:
                pages = torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=start)[:: mmap.PAGESIZE]
                if write:
                    pages.add_(0)
                else:
                    int(pages.sum())
            progress.add(length)


def _zero_fill(data: torch.Tensor) -> None:
    """Zero a freshly allocated pool in :data:`CHUNK_BYTES` steps: its pages are faulted in
    now (startup phase ``host-pool population``, with progress), not on the decode path."""
    flat = data.view(-1)
    step = max(1, CHUNK_BYTES // flat.element_size())
    with phase("host-pool population", total_bytes=flat.numel() * flat.element_size(), fix=_SIZE_FIX) as progress:
        for start in range(0, flat.numel(), step):
            chunk = flat[start : start + step]
            chunk.zero_()
            progress.add(chunk.numel() * chunk.element_size())


def _check_header_bytes(header_bytes: int) -> None:
    if header_bytes < 0 or header_bytes % mmap.PAGESIZE:
        raise ValueError(
            f"header_bytes={header_bytes} must be a non-negative multiple of the page size "
            f"{mmap.PAGESIZE} (the rows stay page-aligned)"
        )


def _memfabric_empty(shape: HostPoolShape, device_id: int) -> torch.Tensor:
    """Allocate the pool in MemFabric-registered host memory (NPU only)."""
    if platform.device_kind() != "npu":
        raise RuntimeError(
            "host pool kind 'memfabric' needs an Ascend NPU with CANN and memfabric-hybrid; "
            "use kind='pinned' (or 'shared' for TP sharing) elsewhere"
        )
    try:
        from memfabric_hybrid import offload  # noqa: PLC0415 - NPU-only, imported lazily
    except ImportError as exc:
        raise RuntimeError(
            "host pool kind 'memfabric' needs memfabric_hybrid.offload: "
            "pip install 'sglang-ascend-offload[npu]' and run `mfcli kernel install`"
        ) from exc
    cfg = offload.OffloadConfig()
    cfg.device_id = device_id
    cfg.reserve_size = shape.nbytes
    cfg.alloc_size = shape.nbytes
    cfg.world_size = 1
    cfg.rank_id = 0
    cfg.scene = offload.Scene.LOCAL
    cfg.flags = (
        offload.OFFLOAD_FLAG_GIANT_PAGE
    )  # the one flag memfabric-hybrid 1.3 has (SGLang's npu_memfabric uses it)
    what = f"a {shape.nbytes / 2**20:.1f} MiB MemFabric host pool on device {device_id}"
    with phase(
        "host-pool allocation",
        total_bytes=shape.nbytes,
        detail=f"MemFabric host memory, device {device_id}",
        fix=f"the MemFabric error above; {_SIZE_FIX}",
    ):
        try:
            ret = offload.initialize(cfg)
        except Exception as exc:  # noqa: BLE001 - the native layer raises plain exceptions
            raise RuntimeError(
                f"memfabric_hybrid.offload.initialize raised {exc!r} for {what}: "
                f"{_memfabric_detail()}{_MEMFABRIC_NEEDS}"
            ) from exc
        if ret != 0:
            raise RuntimeError(
                f"memfabric_hybrid.offload.initialize returned {ret} for {what}: "
                f"{_memfabric_detail()}{_MEMFABRIC_NEEDS}"
            )
        try:
            return offload.empty(list(shape.dims()), dtype=shape.dtype)
        except Exception as exc:  # noqa: BLE001 - offload.empty raises Exception("malloc failed")
            raise RuntimeError(
                f"memfabric_hybrid.offload.empty failed ({exc}) for {what} after a successful "
                f"initialize: {_memfabric_detail()}; lower host_pool_tokens / --max-total-tokens "
                "or free host memory"
            ) from exc


_MEMFABRIC_NEEDS = (
    "; a MemFabric host pool needs an Ascend NPU with its driver and CANN (source set_env.sh, "
    "run `mfcli kernel install`); without one use host pool kind 'pinned'"
)


def _memfabric_detail() -> str:
    """memfabric_hybrid's last error message, or a pointer to its log lines."""
    try:
        import memfabric_hybrid  # noqa: PLC0415 - NPU-only, imported lazily

        msg = memfabric_hybrid.get_last_err_msg()
    except Exception:  # noqa: BLE001 - best effort for an error message
        msg = ""
    return f"last error {msg!r}" if msg else "no last error recorded (see the HYBM / OFFLOAD log lines above)"


# ------------------------------------------------------------------------ TP gate
class AppendTimeout(TimeoutError):
    """A reader (a TP rank > 0) waited past its deadline for TP rank 0's append of a
    layer (the CPU append gate here, the served pool's append order in
    ``sglang_plugin/mem_cache/pool_host/shared.py``)."""


class AppendGate:
    """Orders TP rank 0's appends before the other ranks' reads of the same rows.

    A monotone counter of published ``(step, layer)`` units, ``step * layers + layer + 1``,
    in shared memory, guarded by a process-shared condition. Create it in the parent
    before starting the rank processes (it travels with them through
    ``multiprocessing``); for ranks that are not started by one parent, the same
    contract is a ``torch.distributed`` barrier over the TP group after the append.
    """

    def __init__(self, layers: int, ctx=None):
        ctx = ctx or multiprocessing.get_context()
        self.layers = layers
        self._done = ctx.Value("q", 0, lock=False)
        self._cond = ctx.Condition()

    def _unit(self, step: int, layer: int) -> int:
        return step * self.layers + layer + 1

    def publish(self, step: int, layer: int) -> None:
        """TP rank 0, after the rows of ``(step, layer)`` are written (and, on a device,
        after the D2H copy's event completed)."""
        unit = self._unit(step, layer)
        with self._cond:
            if unit > self._done.value:
                self._done.value = unit
            self._cond.notify_all()

    def wait(self, step: int, layer: int, timeout_s: float = 30.0) -> None:
        """Other ranks: return once ``(step, layer)`` (and everything before) is published."""
        unit = self._unit(step, layer)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._done.value < unit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AppendTimeout(
                        f"no append of step {step} layer {layer} from TP rank 0 within "
                        f"{timeout_s} s (last published unit {self._done.value})"
                    )
                self._cond.wait(left)

    def published(self) -> int:
        with self._cond:
            return int(self._done.value)
