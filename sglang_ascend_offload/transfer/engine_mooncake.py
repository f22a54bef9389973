"""Mooncake Transfer Engine adapter (TCP on CPU machines, RDMA on clusters).

Uses the P2P handshake mode (metadata server ``"P2PHANDSHAKE"``): no etcd or
metadata service; a peer is addressed by ``"host:rpc_port"``. The ``mooncake``
package is imported when an engine is created, never at module import.
"""

from __future__ import annotations

import threading
from typing import List, Sequence

from .engine import Region, TransferEngine, check_read_args
from .errors import EngineError, EngineReadError, EngineUnavailable

_SUPPORTED = ("tcp", "rdma", "efa")


class MooncakeEngine(TransferEngine):
    """``mooncake.engine.TransferEngine`` in P2P-handshake mode.

    hostname: address the engine's RPC and data listeners bind to (use the
        configured control-plane host; 127.0.0.1 in tests).
    protocol: ``tcp`` (CPU machines), ``rdma`` or ``efa``.
    device_name: RDMA NICs (comma-separated), empty for TCP / auto.
    """

    name = "mooncake"

    def __init__(self, hostname: str, protocol: str = "tcp", device_name: str = ""):
        if protocol not in _SUPPORTED:
            raise EngineError(f"mooncake protocol {protocol!r} not supported: use one of {_SUPPORTED} "
                              "(pd_transfer.mooncake_protocol)")
        try:
            from mooncake.engine import TransferEngine as _MC
        except ImportError as exc:
            raise EngineUnavailable(
                "the mooncake engine needs the Mooncake transfer engine: pip install "
                "mooncake-transfer-engine-non-cuda (CPU/TCP) or mooncake-transfer-engine, and on "
                f"Debian apt-get install libibverbs1 librdmacm1 ({exc})") from exc
        self._engine = _MC()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise EngineError(f"mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, "
                              f"{protocol!r}) returned {rc}")
        self._protocol = protocol
        self._session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: List[int] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._session

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
            raise EngineError(f"mooncake register: bad regions {regions}")
        with self._lock:
            rc = self._engine.batch_register_memory(addrs, sizes)
            if rc != 0:
                raise EngineError(f"mooncake batch_register_memory of {len(addrs)} regions returned {rc}")
            self._registered.extend(addrs)

    def unregister(self, addresses: Sequence[int]) -> None:
        addrs = [int(a) for a in addresses]
        if not addrs:
            return
        with self._lock:
            rc = self._engine.batch_unregister_memory(addrs)
            for a in addrs:
                if a in self._registered:
                    self._registered.remove(a)
        if rc != 0:
            raise EngineError(f"mooncake batch_unregister_memory returned {rc}")

    def read(self, peer_session: str, dst_addrs: Sequence[int], src_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        check_read_args(dst_addrs, src_addrs, lengths)
        if not lengths:
            return
        if self._closed:
            raise EngineReadError("mooncake engine is closed")
        rc = self._engine.batch_transfer_sync_read(peer_session, [int(a) for a in dst_addrs],
                                                   [int(a) for a in src_addrs],
                                                   [int(n) for n in lengths])
        if rc != 0:
            raise EngineReadError(f"mooncake batch read of {len(lengths)} ranges "
                                  f"({sum(lengths)} bytes) from {peer_session} returned {rc}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            addrs, self._registered = self._registered, []
        if addrs:
            try:
                self._engine.batch_unregister_memory(addrs)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
