"""The one interface every transfer engine implements, and the factory.

The project writes the protocol, never a data path: each implementation is a thin
adapter over an existing engine (MemFabric on Ascend, Mooncake over TCP or RDMA).
Reads are *pulls*: the caller (decode) names local destination addresses and the
peer's (prefill's) registered source addresses.

Contract of :meth:`TransferEngine.read`: either every byte of every range has been
copied when it returns, or it raises :class:`~.errors.EngineReadError` (and the
destinations must be treated as garbage). Lengths are in bytes; the three lists
have equal length; addresses must lie in memory registered on each side.
"""

from __future__ import annotations

import abc
import threading
from typing import List, Optional, Sequence, Tuple

from ..config import PDTransferConfig
from .errors import EngineError, EngineReadError

Region = Tuple[int, int]  # (address, length in bytes)


class TransferEngine(abc.ABC):
    """A running transfer engine bound to this process."""

    #: ``"mooncake"`` / ``"memfabric"`` (sent in the handshake; both sides must match).
    name: str = ""

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """What a peer passes to :meth:`read` to reach this engine (e.g. ``"host:port"``)."""

    @property
    @abc.abstractmethod
    def data_protocol(self) -> str:
        """Data path in use (``tcp``, ``rdma``, ``sdma``, ``device_rdma``...); both sides must match."""

    @abc.abstractmethod
    def register(self, regions: Sequence[Region]) -> None:
        """Make ``regions`` readable by peers / writable by reads; raises :class:`EngineError`."""

    @abc.abstractmethod
    def unregister(self, addresses: Sequence[int]) -> None:
        """Undo :meth:`register` for regions starting at ``addresses``."""

    @abc.abstractmethod
    def read(
        self, peer_session: str, dst_addrs: Sequence[int], src_addrs: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Pull ``lengths[i]`` bytes from the peer's ``src_addrs[i]`` to local ``dst_addrs[i]``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (idempotent)."""

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BatchEngineAdapter(TransferEngine):
    """What the MemFabric and Mooncake adapters share: both wrap an engine object with
    ``batch_register_memory(addrs, sizes)`` and ``batch_transfer_sync_read(peer, dst,
    src, lengths)`` returning 0 on success. Subclasses start ``self._engine`` and call
    :meth:`_started`; they implement :meth:`_unregister` and may extend :meth:`_shutdown`.
    """

    def _started(self, engine, session: str, protocol: str) -> None:
        self._engine = engine
        self._session = session
        self._protocol = protocol
        self._registered: List[int] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._session

    @property
    def native(self):
        """The wrapped engine object itself (its own batch API; the benchmark's raw yardstick)."""
        return self._engine

    @property
    def data_protocol(self) -> str:
        return self._protocol

    def register(self, regions: Sequence[Region]) -> None:
        regions = list(regions)
        if not regions:
            return
        addrs = [int(a) for a, _ in regions]
        sizes = [int(n) for _, n in regions]
        if any(a <= 0 for a in addrs) or any(n <= 0 for n in sizes):
            raise EngineError(f"{self.name} register: bad regions {regions}")
        with self._lock:
            rc = self._engine.batch_register_memory(addrs, sizes)
            if rc != 0:
                raise EngineError(f"{self.name} batch_register_memory of {len(addrs)} regions returned {rc}")
            self._registered.extend(addrs)

    def unregister(self, addresses: Sequence[int]) -> None:
        addrs = [int(a) for a in addresses]
        if not addrs:
            return
        with self._lock:
            failed = self._unregister(addrs)
            for a in addrs:
                if a in self._registered:
                    self._registered.remove(a)
        if failed:
            raise EngineError(f"{self.name}: unregistering {failed} of {len(addrs)} regions failed")

    @abc.abstractmethod
    def _unregister(self, addrs: List[int]) -> int:
        """Unregister ``addrs`` with the engine; returns how many failed."""

    def _read_error_detail(self) -> str:
        return ""

    def read(
        self, peer_session: str, dst_addrs: Sequence[int], src_addrs: Sequence[int], lengths: Sequence[int]
    ) -> None:
        check_read_args(dst_addrs, src_addrs, lengths)
        if not lengths:
            return
        if self._closed:
            raise EngineReadError(f"{self.name} engine is closed")
        rc = self._engine.batch_transfer_sync_read(
            peer_session, list(map(int, dst_addrs)), list(map(int, src_addrs)), list(map(int, lengths))
        )
        if rc != 0:
            raise EngineReadError(
                f"{self.name} batch read of {len(lengths)} ranges ({sum(lengths)} bytes) "
                f"from {peer_session} returned {rc}{self._read_error_detail()}"
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            addrs, self._registered = self._registered, []
        self._shutdown(addrs)

    def _shutdown(self, registered: List[int]) -> None:
        """Best-effort release at close: unregister what is still registered."""
        if registered:
            try:
                self._unregister(registered)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


def check_read_args(dst_addrs: Sequence[int], src_addrs: Sequence[int], lengths: Sequence[int]) -> None:
    """Shared argument check of :meth:`TransferEngine.read` implementations."""
    if not len(dst_addrs) == len(src_addrs) == len(lengths):
        raise ValueError(f"read: {len(dst_addrs)} destinations, {len(src_addrs)} sources, {len(lengths)} lengths")
    if len(lengths) and min(lengths) <= 0:
        raise ValueError("read: every length must be > 0")


def create_engine(
    config: PDTransferConfig, role: str, *, device_id: int = 0, mooncake_protocol: Optional[str] = None
) -> TransferEngine:
    """Start the engine named by ``config.engine`` for ``role`` (``prefill`` / ``decode``).

    mooncake: data path from the ``mooncake_protocol`` argument, else
    ``config.mooncake_protocol`` (default ``tcp``: the only path on machines without
    RDMA NICs), on ``config.mooncake_device_name``.
    memfabric: ``config.protocol`` (sdma / device_rdma / device_urma) and
    ``config.store_url`` (required). Raises :class:`~.errors.EngineUnavailable`
    when the engine cannot run here, with what to install or change.
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    problems = config._check()  # a directly built config has not been through the parser
    if problems:
        raise EngineError("invalid pd_transfer config: " + "; ".join(problems))
    if config.engine == "mooncake":
        from .engine_mooncake import MooncakeEngine

        protocol = mooncake_protocol or config.mooncake_protocol
        return MooncakeEngine(hostname=config.host, protocol=protocol, device_name=config.mooncake_device_name)
    if config.engine == "memfabric":
        from .engine_memfabric import MemFabricEngine

        return MemFabricEngine(
            hostname=config.host, store_url=config.store_url, protocol=config.protocol, role=role, device_id=device_id
        )
    raise EngineError(f"unknown transfer engine {config.engine!r}: use 'memfabric' or 'mooncake'")
