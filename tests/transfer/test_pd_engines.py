"""Transfer engines behind one interface: Mooncake (TCP, here) and MemFabric (NPU).

MemFabric needs the Ascend driver to initialise; on CPU we check that asking for
it fails with a clear EngineUnavailable and that its config store (which does run
on CPU) starts. The ``npu`` tests move bytes between two processes' NPU buffers
and are executed by a CANN runner.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import List, NamedTuple

import pytest
import torch
from npu_requirements import npu_present

from sglang_ascend_offload import platform
from sglang_ascend_offload.config import PDTransferConfig
from sglang_ascend_offload.testing.pd_faults import FaultInjector, FaultPlan, FaultyEngine, FaultyOutbox
from sglang_ascend_offload.transfer.engine import check_read_args, create_engine
from sglang_ascend_offload.transfer.errors import EngineError, EngineReadError
from sglang_ascend_offload.transfer.protocol import PROTOCOL_VERSION, ReadDone, ReadReadyBatch

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
HAVE_MEMFABRIC = importlib.util.find_spec("memfabric_hybrid") is not None
needs_mooncake = pytest.mark.skipif(not HAVE_MOONCAKE, reason="needs mooncake-transfer-engine-non-cuda")
on_npu = pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN, torch_npu and memfabric-hybrid")


def free_port():
    """A port reserved across processes (no bind(0) race with other listeners)."""
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port()


@pytest.fixture(scope="module")
def pair():
    from sglang_ascend_offload.transfer.engine_mooncake import MooncakeEngine

    a, b = MooncakeEngine("127.0.0.1"), MooncakeEngine("127.0.0.1")
    yield a, b
    a.close()
    b.close()


@needs_mooncake
def test_mooncake_batched_read_is_bit_exact(pair):
    src_engine, dst_engine = pair
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    src_engine.register([(src.data_ptr(), src.numel())])
    dst_engine.register([(dst.data_ptr(), dst.numel())])
    try:
        assert src_engine.name == "mooncake" and src_engine.data_protocol == "tcp"
        assert src_engine.session_id.startswith("127.0.0.1:")
        # two disjoint ranges, swapped
        dst_engine.read(
            src_engine.session_id,
            [dst.data_ptr(), dst.data_ptr() + 1024],
            [src.data_ptr() + 1024, src.data_ptr()],
            [1024, 1024],
        )
        assert torch.equal(dst[:1024], src[1024:2048]) and torch.equal(dst[1024:2048], src[:1024])
        assert int(dst[2048:].count_nonzero()) == 0
        with pytest.raises(EngineReadError, match="returned"):
            dst_engine.read(src_engine.session_id, [dst.data_ptr()], [src.data_ptr() + (1 << 30)], [64])
    finally:
        src_engine.unregister([src.data_ptr()])
        dst_engine.unregister([dst.data_ptr()])


def test_read_argument_checks():
    with pytest.raises(ValueError, match="2 destinations, 1 sources"):
        check_read_args([1, 2], [1], [1, 1])
    with pytest.raises(ValueError, match="> 0"):
        check_read_args([1], [1], [0])


@needs_mooncake
def test_mooncake_rejects_unknown_protocol_and_closed_reads():
    from sglang_ascend_offload.transfer.engine_mooncake import MooncakeEngine

    with pytest.raises(EngineError, match="not supported"):
        MooncakeEngine("127.0.0.1", protocol="carrier-pigeon")
    e = create_engine(PDTransferConfig(engine="mooncake"), "decode", mooncake_protocol="tcp")
    e.close()
    with pytest.raises(EngineReadError, match="closed"):
        e.read("127.0.0.1:1", [1], [1], [1])
    with pytest.raises(ValueError, match="role"):
        create_engine(PDTransferConfig(engine="mooncake"), "router")
    with pytest.raises(EngineError, match="wildcard"):
        create_engine(PDTransferConfig(engine="mooncake", host="0.0.0.0"), "decode")


def test_memfabric_needs_store_url_and_known_protocol():
    from sglang_ascend_offload.transfer.engine_memfabric import MemFabricEngine

    with pytest.raises(EngineError, match="store_url"):
        create_engine(PDTransferConfig(engine="memfabric", store_url=None), "prefill")
    with pytest.raises(EngineError, match="not supported"):
        MemFabricEngine("127.0.0.1", "tcp://127.0.0.1:1", "host_tcp", "prefill")


class _Child(NamedTuple):
    """A finished child interpreter: its process result and the lines it passed to ``result()``."""

    proc: subprocess.CompletedProcess
    results: List[str]

    def context(self) -> str:
        return self.proc.stdout[-2000:] + self.proc.stderr[-2000:]


_RESULT_PREAMBLE = """
import os as _os
def result(*parts):
    with open(_os.environ["SAO_TEST_RESULTS"], "a") as _f:
        _f.write(" ".join(map(str, parts)) + "\\n")
"""


def _run(code: str, timeout: float = 60.0) -> _Child:
    """Run ``code`` in a fresh interpreter (MemFabric logs to stdout and keeps store threads).

    The child reports through ``result(...)``, which appends a line to a file of its own:
    MemFabric's C++ threads write their TRACE lines to the same stdout, so a printed line
    can come back with a log line spliced into its middle.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.txt")
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", SAO_TEST_RESULTS=path)
        proc = subprocess.run(
            [sys.executable, "-c", _RESULT_PREAMBLE + textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        results = open(path).read().splitlines() if os.path.exists(path) else []
    return _Child(proc, results)


@pytest.mark.skipif(platform.device_kind() == "npu", reason="checks the CPU failure path")
def test_memfabric_engine_unavailable_without_driver():
    r = _run("""
        from sglang_ascend_offload.config import PDTransferConfig
        from sglang_ascend_offload.transfer.engine import create_engine
        from sglang_ascend_offload.transfer.errors import EngineUnavailable
        try:
            create_engine(PDTransferConfig(engine="memfabric", store_url="tcp://127.0.0.1:9"), "decode")
        except EngineUnavailable as exc:
            result("unavailable:", exc)
        else:
            result("started")
    """)
    line = r.results
    assert line and line[0].startswith("unavailable:"), r.context()
    assert ("memfabric-hybrid" in line[0]) or ("Ascend driver" in line[0])


@pytest.mark.skipif(not HAVE_MEMFABRIC and not npu_present(), reason="memfabric-hybrid not installed")
def test_memfabric_config_store_starts_on_cpu():
    port = free_port()
    r = _run(f"""
        from sglang_ascend_offload.transfer.engine_memfabric import create_config_store
        from sglang_ascend_offload.transfer.errors import EngineError
        create_config_store("tcp://127.0.0.1:{port}")
        result("store up")
        try:
            create_config_store("not-a-url")
        except EngineError as exc:
            result("bad url:", exc)
    """)
    lines = r.results
    assert lines[:1] == ["store up"], r.context()
    assert lines[1].startswith("bad url:") and "tcp://host:port" in lines[1]


def test_fault_wrappers_count_what_they_inject():
    class Null:
        name, session_id, data_protocol = "null", "x:1", "tcp"
        reads = 0

        def read(self, *a):
            Null.reads += 1

        def register(self, r):
            pass

        def unregister(self, a):
            pass

        def close(self):
            pass

    inj = FaultInjector(
        FaultPlan(
            fail_reads=2,
            fail_layers=(1,),
            drop_kinds=("read_done",),
            truncate_kinds=("ready",),
            fault_layer=1,
            max_message_faults=1,
        )
    )
    eng = FaultyEngine(Null(), inj)
    eng.set_context(0)
    eng.read("p", [1], [1], [1])
    eng.set_context(1)
    for _ in range(2):
        with pytest.raises(EngineReadError, match="injected"):
            eng.read("p", [1], [1], [1])
    eng.read("p", [1], [1], [1])  # budget of failures spent
    assert Null.reads == 2 and inj.injected["fail_read"] == 2
    out = FaultyOutbox(inj)
    done0, done1 = (
        ReadDone(version=PROTOCOL_VERSION, batch_id=0, layer=0),
        ReadDone(version=PROTOCOL_VERSION, batch_id=1, layer=1),
    )
    assert out(done0, b"abc") == b"abc"  # other layer untouched
    assert out(done1, b"abc") is None and out(done1, b"abc") == b"abc"  # dropped once
    ready = ReadReadyBatch(version=PROTOCOL_VERSION, batch_id=1, layer=1, member=0, ratio=1, requests=[], finished=[])
    assert out(ready, b"abcdef") == b"abc"
    assert inj.injected == {"fail_read": 2, "drop": 1, "truncate": 1}


# ------------------------------------------------------------------ NPU (CANN runner)
def _npu_peer(role, store_url, device, q_out, q_in):
    import torch_npu  # noqa: F401

    from sglang_ascend_offload.transfer.engine_memfabric import MemFabricEngine

    torch.npu.set_device(device)
    engine = MemFabricEngine("127.0.0.1", store_url, "sdma", role, device_id=device)
    g = torch.Generator().manual_seed(7)
    t = (
        torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g).npu()
        if role == "prefill"
        else torch.zeros(1 << 20, dtype=torch.uint8, device="npu")
    )
    engine.register([(t.data_ptr(), t.numel())])
    q_out.put((engine.session_id, t.data_ptr()))
    cmd = q_in.get(timeout=120)
    if cmd[0] == "read":
        _, peer, src = cmd
        engine.read(peer, [t.data_ptr(), t.data_ptr() + 4096], [src + 8192, src], [4096, 4096])
        want = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        got = t.cpu()
        q_out.put(bool(torch.equal(got[:4096], want[8192:12288]) and torch.equal(got[4096:8192], want[:4096])))
        q_in.get(timeout=120)
    engine.close()


@pytest.mark.npu
@on_npu
def test_memfabric_npu_to_npu_read_bit_exact():
    import multiprocessing as mp

    from sglang_ascend_offload.transfer.engine_memfabric import create_config_store

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    create_config_store(url)
    ctx = mp.get_context("spawn")
    qp_out, qp_in, qd_out, qd_in = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    ndev = torch.npu.device_count()
    p = ctx.Process(target=_npu_peer, args=("prefill", url, 0, qp_out, qp_in))
    d = ctx.Process(target=_npu_peer, args=("decode", url, 1 % ndev, qd_out, qd_in))
    p.start()
    d.start()
    try:
        p_session, p_addr = qp_out.get(timeout=120)
        qd_out.get(timeout=120)
        qd_in.put(("read", p_session, p_addr))
        assert qd_out.get(timeout=120) is True
    finally:
        qd_in.put(("stop",))
        qp_in.put(("stop",))
        p.join(60)
        d.join(60)
