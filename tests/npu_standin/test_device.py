"""The stand-in ``npu`` device itself: what it accepts, refuses and counts.

Each rule of ``rules.py`` (torch_npu's operand acceptance), each transfer kind of
``transfers.py`` and each refusal of a graph capture (``graphs.py``) is checked with a
case that passes and one that must fail. Runs in a stand-in process only
(``SAO_NPU_STANDIN=1 python -m pytest -m npu``); on an NPU runner the device is real.
"""

from __future__ import annotations

import pytest
import torch

import npu_standin
from npu_standin import graphs, transfers

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_standin.installed(), reason="tests the npu stand-in (SAO_NPU_STANDIN=1)"),
]


def _here(offset: int = 0) -> str:
    """``path:line`` of the caller's line (plus ``offset``), as transfers name sites."""
    import sys

    frame = sys._getframe(1)
    return f"tests/npu_standin/test_device.py:{frame.f_lineno + offset}"


def test_the_platform_probe_sees_the_stand_in_as_an_npu():
    import torch_npu

    from sglang_ascend_offload import platform

    assert platform.device_kind() == "npu" and platform.soc_name() == "Ascend910B3"
    assert torch_npu.__file__.startswith(npu_standin.SITE)
    assert torch.npu.is_available() and torch.npu.device_count() >= 2


def test_factories_moves_and_views_hold_the_data():
    host = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    dev = host.to("npu")
    assert dev.device == torch.device("npu", 0) and type(dev).__name__ == "NpuTensor"
    assert torch.equal(dev.cpu(), host)
    assert torch.zeros(2, device="npu:1").device.index == 1
    assert torch.tensor([1, 2], device="npu").device.type == "npu" and host.npu().is_npu
    view = dev[1]  # a view: writes through it land in the base
    view.fill_(-1)
    dev[torch.tensor([0], device="npu"), 0] = 7
    expected = host.clone()
    expected[1] = -1
    expected[0, 0] = 7
    assert torch.equal(dev.cpu(), expected)
    assert not torch.equal(dev.cpu(), host)  # negative control: the writes changed it
    assert dev.view(torch.int16).shape == (3, 8) and dev.to(torch.float32).device == dev.device


def test_pinned_memory_is_tracked():
    pinned = torch.empty(64, dtype=torch.uint8, pin_memory=True)
    assert pinned.is_pinned() and pinned[8:].is_pinned()
    assert not torch.empty(64, dtype=torch.uint8).is_pinned()
    assert torch.ones(4).pin_memory().is_pinned()
    with transfers.counting() as seen:
        pinned.to("npu", non_blocking=True)
        torch.empty(8).to("npu")
    assert [t.pinned for t in seen.of("h2d")] == [True, False]


def test_mixed_devices_are_refused_as_torch_npu_refuses_them():
    dev = torch.arange(5, device="npu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        dev + torch.arange(5)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.index_select(dev, 0, torch.tensor(0))  # a CPU 0-d index: not a scalar operand here
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.arange(5)[dev]  # a CPU tensor indexed on the device
    with pytest.raises(RuntimeError, match="at least two devices, npu:0 and npu:1"):
        dev + torch.arange(5, device="npu:1")
    with pytest.raises(TypeError, match="can't convert npu:0 device type tensor to numpy"):
        dev.numpy()
    # accepted: a CPU 0-d tensor where torch_npu takes it as a scalar; a CPU index tensor
    assert torch.equal((dev + torch.tensor(2)).cpu(), torch.arange(2, 7))
    assert torch.equal(torch.where(dev > 2, dev, torch.tensor(0)).cpu(), torch.tensor([0, 0, 0, 3, 4]))
    assert torch.equal(dev[torch.tensor([4, 0])].cpu(), torch.tensor([4, 0]))


def test_reads_and_copies_are_counted_at_their_call_site():
    dev = torch.arange(6, device="npu")
    with transfers.counting() as seen:
        first_site = _here(1)
        dev.cpu()
        dev.sum().item()
        dev.tolist()
        bool(dev[1])
        repr(dev)
        torch.equal(dev, dev)
        torch.nonzero(dev)
        dev[dev > 2]  # a boolean index: nonzero on the device
    assert seen.count("d2h") == 8, seen.sites("d2h")
    assert seen.sites("d2h")[first_site] == 1
    with transfers.counting() as seen:
        torch.tensor([1, 2], device="npu")
        torch.ones(3).to("npu")
        dev.copy_(torch.zeros(6, dtype=torch.int64))
        dev[torch.tensor([1])]  # the CPU index moves to the device
        dev + 1  # no transfer
    assert seen.count("h2d") == 4 and seen.count("d2h") == 0, seen.seen


def test_graph_capture_replays_device_work_and_refuses_host_traffic():
    static_in = torch.zeros(4, device="npu")
    counter = torch.zeros(1, device="npu")
    host_rows = torch.arange(4, dtype=torch.float32).pin_memory()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        staged = host_rows.to("npu", non_blocking=True)  # pinned: captured as a copy node
        out = static_in * 2 + staged
        counter.add_(1)
    assert float(counter.cpu()) == 0  # capture records device work without running it
    static_in.copy_(torch.ones(4))
    host_rows.add_(10)  # the replay re-reads the host buffer
    with transfers.counting() as seen:
        graph.replay()
    assert torch.equal(out.cpu(), torch.arange(4, dtype=torch.float32) + 12)
    assert float(counter.cpu()) == 1
    assert seen.count("h2d") == 1 and seen.count("d2h") == 0
    for bad in (lambda: out.sum().item(), lambda: torch.ones(2).to("npu"), torch.npu.synchronize):
        g = torch.npu.NPUGraph()
        with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
            with torch.npu.graph(g):
                bad()
        assert graphs.active() is None


def test_streams_and_events_check_their_use():
    side = torch.npu.Stream()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        side.wait_stream(object())
    with pytest.raises(TypeError, match="incompatible function arguments"):
        torch.npu.Event().record(object())
    event = torch.npu.Event()
    event.record(side)
    with pytest.raises(RuntimeError, match="does not match recording stream's device"):
        event.record(torch.npu.Stream(device=1))
    with pytest.raises(RuntimeError, match="must be recorded"):
        torch.npu.Event(enable_timing=True).elapsed_time(event)
    with torch.npu.stream(side):
        assert torch.npu.current_stream() == side
    assert torch.npu.current_stream() == torch.npu.default_stream()
    hazards = npu_standin.npu_module.HAZARDS
    before = len(hazards)
    torch.npu.Event().wait(side)  # torch_npu accepts it, and it orders nothing
    assert len(hazards) == before + 1 and "never recorded" in hazards[-1]
    del hazards[before:]  # seen: not left behind for the session's hazard check


def test_hccl_moves_npu_tensors_and_refuses_host_tensors():
    from datetime import timedelta

    import torch._C._distributed_c10d as c10d

    from npu_standin.hccl import HcclGroup

    group = HcclGroup(c10d.HashStore(), 0, 1, timedelta(seconds=30))
    dev = torch.arange(4, dtype=torch.float32, device="npu")
    group.allreduce([dev]).wait()
    assert torch.equal(dev.cpu(), torch.arange(4, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="HCCL collectives take npu tensors"):
        group.broadcast([torch.zeros(2)])
