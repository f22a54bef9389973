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

import threading
from typing import List, Optional, Sequence

from .engine import Region, TransferEngine, check_read_args
from .errors import EngineError, EngineReadError, EngineUnavailable

PROTOCOLS = ("sdma", "device_rdma", "device_urma")


def _import_memfabric():
    try:
        import memfabric_hybrid  # noqa: PLC0415 - NPU-only package, imported lazily
    except ImportError as exc:
        raise EngineUnavailable(
            "the memfabric engine needs memfabric-hybrid (pip install 'sglang-ascend-offload[npu]' "
            "on an Ascend node with CANN); on machines without an NPU use "
            f"pd_transfer.engine='mooncake' ({exc})") from exc
    return memfabric_hybrid


def create_config_store(store_url: str) -> None:
    """Start the MemFabric config store at ``store_url`` (``tcp://host:port``) in this process."""
    if not store_url or not store_url.startswith("tcp://"):
        raise EngineError(f"memfabric store_url {store_url!r} must look like tcp://host:port")
    mf = _import_memfabric()
    rc = mf.create_config_store(store_url)
    if rc != 0:
        raise EngineError(f"memfabric create_config_store({store_url!r}) returned {rc}: "
                          f"{mf.get_last_err_msg() or 'no detail'} (is the port free?)")


class MemFabricEngine(TransferEngine):
    """``memfabric_hybrid.TransferEngine`` for one NPU.

    store_url: the deployment's config store (``pd_transfer.store_url``), required.
    protocol: ``sdma`` (A3 default), ``device_rdma`` (A3), ``device_urma`` (950).
    role: ``prefill`` / ``decode``. device_id: the local NPU.
    """

    name = "memfabric"

    def __init__(self, hostname: str, store_url: Optional[str], protocol: str, role: str,
                 device_id: int = 0):
        if protocol not in PROTOCOLS:
            raise EngineError(f"memfabric protocol {protocol!r} not supported: use one of {PROTOCOLS}")
        if not store_url:
            raise EngineError("the memfabric engine needs pd_transfer.store_url (tcp://host:port of "
                              "the config store, created by prefill node 0)")
        mf = _import_memfabric()
        self._mf = mf
        self._engine = mf.TransferEngine()
        op_type = getattr(mf.TransDataOpType, protocol.upper(), None)
        if op_type is None:
            raise EngineUnavailable(f"installed memfabric_hybrid has no data protocol {protocol!r}; "
                                    "upgrade memfabric-hybrid or choose another pd_transfer.protocol")
        # as SGLang's Ascend engine does: the RPC port is 0 until initialize picks one
        port = self._engine.get_rpc_port()
        self._session = f"{hostname}:{port}"
        rc = self._engine.initialize(store_url, self._session, role.capitalize(), int(device_id), op_type)
        if rc != 0:
            raise EngineUnavailable(
                f"memfabric TransferEngine.initialize(store {store_url}, session {self._session}, "
                f"{role}, device {device_id}, {protocol}) returned {rc}: "
                f"{mf.get_last_err_msg() or 'no detail'} (needs an Ascend driver/CANN and a running "
                "config store)")
        if port == 0:
            self._session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._protocol = protocol
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
        with self._lock:
            rc = self._engine.batch_register_memory(addrs, sizes)
            if rc != 0:
                raise EngineError(f"memfabric batch_register_memory of {len(addrs)} regions returned {rc}")
            self._registered.extend(addrs)

    def unregister(self, addresses: Sequence[int]) -> None:
        failed = []
        with self._lock:
            for a in addresses:
                if self._engine.unregister_memory(int(a)) != 0:
                    failed.append(a)
                if a in self._registered:
                    self._registered.remove(a)
        if failed:
            raise EngineError(f"memfabric unregister_memory failed for {len(failed)} regions")

    def read(self, peer_session: str, dst_addrs: Sequence[int], src_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        check_read_args(dst_addrs, src_addrs, lengths)
        if not lengths:
            return
        if self._closed:
            raise EngineReadError("memfabric engine is closed")
        rc = self._engine.batch_transfer_sync_read(peer_session, [int(a) for a in dst_addrs],
                                                   [int(a) for a in src_addrs], [int(n) for n in lengths])
        if rc != 0:
            raise EngineReadError(f"memfabric batch read of {len(lengths)} ranges ({sum(lengths)} bytes) "
                                  f"from {peer_session} returned {rc}: {self._mf.get_last_err_msg() or ''}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            addrs, self._registered = self._registered, []
        for a in addrs:
            try:
                self._engine.unregister_memory(a)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        try:
            self._engine.unInitialize()
        except Exception:  # noqa: BLE001
            pass
