"""Mooncake Transfer Engine adapter (TCP on CPU machines, RDMA on clusters).

Uses the P2P handshake mode (metadata server ``"P2PHANDSHAKE"``): no etcd or
metadata service; a peer is addressed by ``"host:rpc_port"``. The ``mooncake``
package is imported when an engine is created, never at module import.
"""

from __future__ import annotations

from typing import List

from .engine import BatchEngineAdapter
from .errors import EngineError, EngineUnavailable

_SUPPORTED = ("tcp", "rdma", "efa")


class MooncakeEngine(BatchEngineAdapter):
    """``mooncake.engine.TransferEngine`` in P2P-handshake mode.

    hostname: address the engine's RPC and data listeners bind to (use the
        configured control-plane host; 127.0.0.1 in tests).
    protocol: ``tcp`` (CPU machines), ``rdma`` or ``efa``.
    device_name: RDMA NICs (comma-separated), empty for TCP / auto.
    """

    name = "mooncake"

    def __init__(self, hostname: str, protocol: str = "tcp", device_name: str = ""):
        if protocol not in _SUPPORTED:
            raise EngineError(
                f"mooncake protocol {protocol!r} not supported: use one of {_SUPPORTED} (pd_transfer.mooncake_protocol)"
            )
        try:
            from mooncake.engine import TransferEngine as _MC
        except ImportError as exc:
            raise EngineUnavailable(
                "the mooncake engine needs the Mooncake transfer engine: pip install "
                "mooncake-transfer-engine-non-cuda (CPU/TCP) or mooncake-transfer-engine, and on "
                f"Debian apt-get install libibverbs1 librdmacm1 ({exc})"
            ) from exc
        engine = _MC()
        rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise EngineError(
                f"mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}"
            )
        self._started(engine, f"{hostname}:{engine.get_rpc_port()}", protocol)

    def _unregister(self, addrs: List[int]) -> int:
        return 0 if self._engine.batch_unregister_memory(addrs) == 0 else len(addrs)
