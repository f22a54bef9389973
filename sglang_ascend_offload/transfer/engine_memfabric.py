"""MemFabric transfer engine adapter (production path on Ascend A2/A3/950).

``memfabric_hybrid`` is imported lazily (it needs the Ascend driver and CANN to
initialise). Facts used (memfabric-hybrid 1.3):

* ``create_config_store(url) -> int`` starts the config store that every engine
  of a deployment joins (one process does it: prefill node 0);
* ``TransferEngine().initialize(store_url, session_id, role, device_id,
  TransDataOpType.<SDMA|DEVICE_RDMA|DEVICE_URMA>) -> int`` (role ``"Prefill"`` /
  ``"Decode"``; ``session_id`` is ``"host:port"``);
* ``batch_register_memory(addrs, sizes) -> int``, ``unregister_memory(addr)``;
* ``batch_transfer_sync_read(peer_session, local_addrs, peer_addrs, lengths) -> int``.

Both sides must use the same data protocol; the handshake checks it.
"""

from __future__ import annotations

from typing import List, Optional

from .engine import BatchEngineAdapter
from .errors import EngineError, EngineUnavailable

PROTOCOLS = ("sdma", "device_rdma", "device_urma")


def _import_memfabric():
    try:
        import memfabric_hybrid  # noqa: PLC0415 - NPU-only package, imported lazily
    except ImportError as exc:
        raise EngineUnavailable(
            "the memfabric engine needs memfabric-hybrid (pip install 'sglang-ascend-offload[npu]' "
            "on an Ascend node with CANN); on machines without an NPU use "
            f"pd_transfer.engine='mooncake' ({exc})"
        ) from exc
    return memfabric_hybrid


def create_config_store(store_url: str) -> None:
    """Start the MemFabric config store at ``store_url`` (``tcp://host:port``) in this process."""
    if not store_url or not store_url.startswith("tcp://"):
        raise EngineError(f"memfabric store_url {store_url!r} must look like tcp://host:port")
    mf = _import_memfabric()
    rc = mf.create_config_store(store_url)
    if rc != 0:
        raise EngineError(
            f"memfabric create_config_store({store_url!r}) returned {rc}: "
            f"{mf.get_last_err_msg() or 'no detail'} (is the port free?)"
        )


class MemFabricEngine(BatchEngineAdapter):
    """``memfabric_hybrid.TransferEngine`` for one NPU.

    store_url: the deployment's config store (``pd_transfer.store_url``), required.
    protocol: ``sdma`` (A3 default), ``device_rdma`` (A3), ``device_urma`` (950).
    role: ``prefill`` / ``decode``. device_id: the local NPU.
    """

    name = "memfabric"

    def __init__(self, hostname: str, store_url: Optional[str], protocol: str, role: str, device_id: int = 0):
        if protocol not in PROTOCOLS:
            raise EngineError(f"memfabric protocol {protocol!r} not supported: use one of {PROTOCOLS}")
        if not store_url:
            raise EngineError(
                "the memfabric engine needs pd_transfer.store_url (tcp://host:port of "
                "the config store, created by prefill node 0)"
            )
        mf = _import_memfabric()
        self._mf = mf
        engine = mf.TransferEngine()
        op_type = getattr(mf.TransDataOpType, protocol.upper(), None)
        if op_type is None:
            raise EngineUnavailable(
                f"installed memfabric_hybrid has no data protocol {protocol!r}; "
                "upgrade memfabric-hybrid or choose another pd_transfer.protocol"
            )
        # as SGLang's Ascend engine does: the RPC port is 0 until initialize picks one
        port = engine.get_rpc_port()
        session = f"{hostname}:{port}"
        rc = engine.initialize(store_url, session, role.capitalize(), int(device_id), op_type)
        if rc != 0:
            raise EngineUnavailable(
                f"memfabric TransferEngine.initialize(store {store_url}, session {session}, "
                f"{role}, device {device_id}, {protocol}) returned {rc}: "
                f"{mf.get_last_err_msg() or 'no detail'} (needs an Ascend driver/CANN and a running "
                "config store)"
            )
        if port == 0:
            session = f"{hostname}:{engine.get_rpc_port()}"
        self._started(engine, session, protocol)

    def _unregister(self, addrs: List[int]) -> int:
        return sum(1 for a in addrs if self._engine.unregister_memory(int(a)) != 0)

    def _read_error_detail(self) -> str:
        return f": {self._mf.get_last_err_msg() or 'no detail'}"

    def _shutdown(self, registered: List[int]) -> None:
        super()._shutdown(registered)
        try:
            self._engine.unInitialize()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
