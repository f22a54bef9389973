"""Memcache backend. On CPU: the meta service starts from its config file and a
metadata-only client connects; the data-path client needs the Ascend driver and
fails with a clear error; null addresses from batch_alloc are rejected. On an
Ascend node (``npu`` marker): bit-exact put/get of layer blocks, leases, the
pipeline end to end on Memcache."""

import importlib.util
import os
import socket

import pytest
import torch
from npu_requirements import npu_present, require_package

from sglang_ascend_offload import platform
from sglang_ascend_offload.config import LayerwisePrefillOffloadConfig, MemcacheConfig
from sglang_ascend_offload.layerwise_prefill.store import StoreError, StoreUnavailable, make_store
from sglang_ascend_offload.layerwise_prefill.store_memcache import (
    MemcacheClient,
    MemcacheHostKVStore,
    MetaServiceProcess,
    read_mmc_conf,
    shipped_config,
    write_mmc_conf,
)
from sglang_ascend_offload.testing.machine_lock import machine_lock
from sglang_ascend_offload.testing.ports import reserve_port

HAVE_MEMCACHE = importlib.util.find_spec("memcache_hybrid") is not None
needs_memcache = pytest.mark.skipif(
    not HAVE_MEMCACHE and not npu_present(),
    reason="memcache-hybrid not installed (pip install memcache-hybrid memfabric-hybrid)",
)
npu_only = [pytest.mark.npu, pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN")]


def _free_ports(n):
    """Ports reserved across processes for this test process (``testing/ports.py``: never a
    ``bind(0)`` port that another process's outgoing connection can take before the
    meta service binds it)."""
    return [reserve_port() for _ in range(n)]


@pytest.fixture(scope="module")
def mmc_conf(tmp_path_factory):
    """(meta conf path, local conf path) on free loopback ports."""
    d = tmp_path_factory.mktemp("mmc")
    meta_port, store_port, metrics_port = _free_ports(3)
    meta = d / "mmc-meta.conf"
    write_mmc_conf(
        str(meta),
        {
            "ock.mmc.meta_service_url": f"tcp://127.0.0.1:{meta_port}",
            "ock.mmc.meta_service.config_store_url": f"tcp://127.0.0.1:{store_port}",
            "ock.mmc.meta_service.metrics_url": f"http://127.0.0.1:{metrics_port}",
            "ock.mmc.log_level": "error",
            "ock.mmc.log_path": str(d / "logs"),
        },
    )
    local = d / "mmc-local.conf"
    write_mmc_conf(
        str(local),
        {
            "ock.mmc.meta_service_url": f"tcp://127.0.0.1:{meta_port}",
            "ock.mmc.local_service.config_store_url": f"tcp://127.0.0.1:{store_port}",
            "ock.mmc.log_level": "error",
            "ock.mmc.local_service.world_size": "4",
            "ock.mmc.local_service.protocol": "host_rdma",
            "ock.mmc.local_service.dram.size": "64MB",
        },
    )
    return str(meta), str(local)


@pytest.fixture(scope="module")
def meta_service(mmc_conf):
    require_package("memcache_hybrid", "pip install memcache-hybrid memfabric-hybrid")
    # one meta service per machine (Memcache locks /tmp/mmc_meta_service.lock): another test run
    # on this machine waits here instead of failing with "meta service is already running"
    with machine_lock("memcache_meta_service"):
        with MetaServiceProcess(mmc_conf[0], start_timeout_s=60, stop_grace_s=0.2) as svc:
            yield svc


def test_conf_round_trip(tmp_path):
    p = tmp_path / "x.conf"
    p.write_text("# comment\n\nock.a = 1\nock.b=tcp://h:5\n")
    items = read_mmc_conf(str(p))
    assert items == {"ock.a": "1", "ock.b": "tcp://h:5"}
    write_mmc_conf(str(tmp_path / "y.conf"), items)
    assert read_mmc_conf(str(tmp_path / "y.conf")) == items
    (tmp_path / "bad.conf").write_text("no equals sign\n")
    with pytest.raises(StoreError, match="bad.conf:1"):
        read_mmc_conf(str(tmp_path / "bad.conf"))


@needs_memcache
def test_shipped_configs_exist():
    assert "meta_service_url" in "".join(read_mmc_conf(shipped_config("mmc-meta.conf")))
    assert "protocol" in "".join(read_mmc_conf(shipped_config("mmc-local.conf")))


@needs_memcache
def test_meta_service_runs_on_cpu_from_config_file(meta_service):
    with socket.create_connection((meta_service.host, meta_service.port), timeout=1):
        pass
    assert meta_service.pid and os.path.exists(f"/proc/{meta_service.pid}")


@needs_memcache
def test_uninitialised_client_allocation_looks_like_success_but_is_rejected(meta_service, mmc_conf):
    import memcache_hybrid

    raw = memcache_hybrid.DistributedObjectStore()
    # The pitfall this backend guards against: no init, yet a "0" per key.
    assert list(raw.batch_alloc(["k"], [4096], 1, 0)) == [0]
    # A metadata-only client (no Ascend driver needed) initialises against the meta service ...
    client = MemcacheClient(mmc_conf[1], protocol="host_rdma", device_id=0, init_bm=False)
    try:
        assert client.service_id != 2**32 - 1
        assert client.exists(["nothing-here"]) == [False]
        # ... but has no storage: allocation answers null addresses, which we reject.
        with pytest.raises(StoreError, match="null addresses"):
            client.batch_alloc(["k1", "k2"], [4096, 4096])
    finally:
        client.close()
    with pytest.raises(StoreError, match="closed"):
        client.exists(["k"])


@needs_memcache
@pytest.mark.skipif(platform.device_kind() == "npu", reason="checks the CPU failure path")
def test_data_path_client_without_driver_fails_clearly(meta_service, mmc_conf):
    cfg = LayerwisePrefillOffloadConfig(
        store_backend="memcache", memcache=MemcacheConfig(local_config=mmc_conf[1], protocol="host_rdma")
    )
    with pytest.raises(StoreUnavailable, match="Ascend driver"):
        make_store(cfg)


def test_local_backend_factory():
    store = make_store(LayerwisePrefillOffloadConfig(store_backend="local"))
    assert store.name == "local"


# ------------------------------------------------------------------ Ascend only
@pytest.fixture
def npu_store(meta_service, mmc_conf):
    cfg = MemcacheConfig(local_config=mmc_conf[1], protocol="device_sdma")
    store = MemcacheHostKVStore(cfg, device_id=int(torch.npu.current_device()))
    yield store
    store.close()


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN")
def test_npu_put_get_layers_bit_exact(npu_store):
    dev = platform.default_device()
    buf = [torch.randn(16, 512, device=dev).to(torch.bfloat16), torch.randn(16, 64, device=dev).to(torch.bfloat16)]
    npu_store.register(buf)
    keys = ["t/a/L0", "t/b/L0"]
    parts = [[t[0:8] for t in buf], [t[8:16] for t in buf]]
    npu_store.put(keys, parts)
    assert npu_store.exists(keys + ["t/c/L0"]) == [True, True, False]
    out = [torch.zeros_like(t) for t in buf]
    npu_store.register(out)
    npu_store.get_into(keys, [[t[0:8] for t in out], [t[8:16] for t in out]])
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(out, buf))
    npu_store.add_lease(keys, 5000)
    npu_store.remove_lease(keys)
    addrs = npu_store.client.batch_alloc(["t/alloc"], [4096])
    assert addrs[0] != 0
    npu_store.remove(keys + ["t/alloc"])
    assert npu_store.exists(keys) == [False, False]


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN")
def test_npu_pipeline_on_memcache_equals_local(npu_store):
    from sglang_ascend_offload.layerwise_prefill.pipeline import LayerwisePrefillPipeline, PrefillRequest, run_forward
    from sglang_ascend_offload.layerwise_prefill.planner import LayerKVSpec, TensorSpec, plan_buffers
    from sglang_ascend_offload.layerwise_prefill.store_local import LocalHostKVStore

    main = (TensorSpec((64, 512), "bfloat16"), TensorSpec((64, 64), "bfloat16"))
    plan = plan_buffers([LayerKVSpec(i, main) for i in range(6)], 2, [0])
    req = PrefillRequest("a", tuple(range(40)))
    req2 = PrefillRequest("b", tuple(range(32)) + (7, 7, 7))

    def compute(layer, buf, layout):
        for r in layout.requests:
            lo, hi = r.row0 + r.prefix_len, r.row0 + r.total_len
            g = torch.Generator().manual_seed(layer * 1000 + hi)
            for t in buf:
                t[lo:hi].copy_(torch.randn(hi - lo, t.shape[1], generator=g).to(t.dtype))

    outs = []
    for store in (npu_store, LocalHostKVStore()):
        with LayerwisePrefillPipeline(plan, store, block_tokens=16, namespace="npu-test") as pipe:
            run_forward(pipe, [req], compute)
            stats = run_forward(pipe, [req2], compute)
            assert stats.prefix_tokens == 32
            outs.append([t.cpu().clone() for b in pipe.buffers for t in b])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
