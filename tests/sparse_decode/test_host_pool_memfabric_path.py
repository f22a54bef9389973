"""The NPU allocation paths driven on CPU with the REAL memfabric_hybrid package.

The device kind is forced to ``npu``; everything runs for real up to the first call
that needs the Ascend driver (``offload.initialize`` / ``TransferEngine.initialize``
return -1 here). That call must end in the plugin's clear error naming the NPU /
driver, never an AttributeError or TypeError from a wrong use of the API.
"""

import importlib
import socket
import sys

import pytest

from sglang_ascend_offload import platform
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape

pytest.importorskip("memfabric_hybrid")


@pytest.fixture
def real_memfabric(monkeypatch):
    """The installed memfabric_hybrid (not a test stand-in) with the device forced to npu."""
    for name in [n for n in sys.modules if n == "memfabric_hybrid" or n.startswith("memfabric_hybrid.")]:
        if "site-packages" not in (getattr(sys.modules[name], "__file__", "") or ""):
            monkeypatch.delitem(sys.modules, name)
    mf = importlib.import_module("memfabric_hybrid")
    assert "site-packages" in mf.__file__
    monkeypatch.setenv("SGLANG_ASCEND_OFFLOAD_DEVICE", "npu")
    platform.device_kind.cache_clear()
    yield mf
    platform.device_kind.cache_clear()


def test_memfabric_host_pool_fails_at_the_driver_with_a_clear_error(real_memfabric, monkeypatch):
    offload = real_memfabric.offload
    seen = {}
    real_initialize = offload.initialize

    def spy(cfg):
        seen.update(flags=cfg.flags, scene=cfg.scene, reserve=cfg.reserve_size, device=cfg.device_id)
        return real_initialize(cfg)

    monkeypatch.setattr(offload, "initialize", spy)
    shape = HostPoolShape(2, 256)
    with pytest.raises(RuntimeError) as err:
        HostKVPool.allocate(shape, "memfabric")
    assert seen == {
        "flags": offload.OFFLOAD_FLAG_GIANT_PAGE,
        "scene": offload.Scene.LOCAL,
        "reserve": shape.nbytes,
        "device": 0,
    }
    msg = str(err.value)
    assert "offload.initialize returned -1" in msg
    assert "Ascend NPU" in msg and "driver" in msg and "'pinned'" in msg
    assert "last error" in msg or "log lines" in msg


def test_memfabric_host_pool_refused_off_the_npu(monkeypatch):
    monkeypatch.setenv("SGLANG_ASCEND_OFFLOAD_DEVICE", "cpu")
    platform.device_kind.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="needs an Ascend NPU"):
            HostKVPool.allocate(HostPoolShape(2, 256), "memfabric")
    finally:
        platform.device_kind.cache_clear()


def test_memfabric_transfer_engine_fails_at_the_driver_with_a_clear_error(real_memfabric):
    from sglang_ascend_offload.transfer.engine_memfabric import MemFabricEngine, create_config_store
    from sglang_ascend_offload.transfer.errors import EngineUnavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    create_config_store(url)  # a plain TCP service: runs without the driver
    for protocol in ("sdma", "device_rdma", "device_urma"):
        with pytest.raises(EngineUnavailable) as err:
            MemFabricEngine("127.0.0.1", url, protocol, "prefill", device_id=0)
        msg = str(err.value)
        assert "TransferEngine.initialize" in msg and "returned -1" in msg and "Ascend driver" in msg
