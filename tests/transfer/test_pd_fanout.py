"""One prefill rank, two decode instances, one layer buffer: the slot waits for both."""

import importlib.util
import time

import pytest
import torch

from sglang_ascend_offload.config import PDTransferConfig
from sglang_ascend_offload.layerwise_prefill.gates import GateError, SlotGates
from sglang_ascend_offload.testing.pd_faults import FaultInjector, FaultPlan, FaultyEngine
from sglang_ascend_offload.transfer.decode_side import DecodeReceiver
from sglang_ascend_offload.transfer.destinations import RequestDestination
from sglang_ascend_offload.transfer.layout import TensorLayers, build_layout, registration_regions
from sglang_ascend_offload.transfer.prefill_fanout import PrefillFanout
from sglang_ascend_offload.transfer.prefill_side import PrefillSender, SourceBlocks
from sglang_ascend_offload.transfer.status import TransferState

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="needs mooncake-transfer-engine-non-cuda"),
    pytest.mark.timeout(60),
]

L, S = 3, 1  # three layers through ONE slot: every layer waits for both decodes


def free_port_pair():
    """Two consecutive control ports (two decode DP ranks), reserved across processes."""
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port(2)


@pytest.fixture()
def world():
    from sglang_ascend_offload.transfer.engine_mooncake import MooncakeEngine

    pe, d1e, d2e = (MooncakeEngine("127.0.0.1") for _ in range(3))
    slot = torch.zeros(8, 32, dtype=torch.uint8)
    pre = [TensorLayers("main", "latent", [slot] * L)]
    pe.register(registration_regions(pre))
    decodes = []
    for eng in (d1e, d2e):
        store = torch.zeros(L, 16, 32, dtype=torch.uint8)
        t = [TensorLayers("main", "latent", [store[i] for i in range(L)])]
        eng.register(registration_regions(t))
        decodes.append((eng, store, build_layout(4, t)))
    yield pe, slot, build_layout(4, pre), decodes
    for e in (pe, d1e, d2e):
        e.close()


def test_slot_released_only_after_every_decode_instance_answered(world):
    pe, slot, pre_layout, decodes = world
    gates = SlotGates(S)
    # two decode instances = two DP ranks of one server here (ports kv_port and kv_port + 1)
    kv_port = free_port_pair()
    cfg = PDTransferConfig(engine="mooncake", kv_port=kv_port, layer_timeout_s=30.0)  # a deadline only for a stall
    plan = FaultInjector(FaultPlan(read_delay_s=0.3, max_delays=L))  # decode 1 is slow
    receivers = []
    for dp, (eng, store, lay) in enumerate(decodes):
        engine = FaultyEngine(eng, plan) if dp == 1 else eng
        r = DecodeReceiver(cfg, d_tp=1, d_rank=0, dp_rank=dp, layout=lay, engine=engine)
        r.expect(RequestDestination(f"q{dp}", (3 + dp, 9)))
        receivers.append(r.start())

    def make(host, dp):
        return PrefillSender(
            cfg,
            p_tp=1,
            d_tp=1,
            p_rank=0,
            layout=pre_layout,
            engine=pe,
            gates=gates,
            decode_host=host,
            decode_dp_rank=dp,
            begin_gate=False,
        )

    fan = PrefillFanout(gates, make)
    try:
        fan.add_request("q0", 2, "127.0.0.1", 0)
        fan.add_request("q1", 2, "127.0.0.1", 1)
        assert len(fan.senders()) == 2
        srcs = {"q0": SourceBlocks([0, 1]), "q1": SourceBlocks([2, 3])}
        assert len(fan.consumers(srcs)) == 2
        seen = []
        for layer in range(L):
            t0 = time.monotonic()
            gates.wait_free(0, 5.0)
            if layer:
                seen.append(time.monotonic() - t0)
            slot.copy_(
                torch.randint(0, 256, slot.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(layer))
            )
            want = slot.clone()
            fan.publish_layer(layer, 0, srcs, finished=list(srcs) if layer == L - 1 else [])
            gates.wait_free(0, 5.0)  # both decodes have read this layer
            for dp, (_, store, _) in enumerate(decodes):
                assert torch.equal(store[layer][[3 + dp, 9]], want[[2 * dp, 2 * dp + 1]])
        assert all(fan.status(r).state is TransferState.DONE for r in srcs)
        for dp, r in enumerate(receivers):  # the positive verdict is on its way to decode
            deadline = time.monotonic() + 5.0
            while r.status(f"q{dp}").state is TransferState.PENDING and time.monotonic() < deadline:
                time.sleep(0.005)
            assert r.claim(f"q{dp}")
        assert plan.injected["delay"] == L  # the slow decode really gated every reuse
    finally:
        fan.close()
        for r in receivers:
            r.close()


def test_one_failing_decode_fails_only_its_requests_and_frees_the_slot(world):
    pe, slot, pre_layout, decodes = world
    gates = SlotGates(S)
    kv_port = free_port_pair()
    # the failing decode answers READ_FAILED at once; the healthy one must never hit a deadline,
    # even on a loaded machine (2 s was missed once with three test suites on 2 cores)
    cfg = PDTransferConfig(engine="mooncake", kv_port=kv_port, layer_timeout_s=30.0, read_retries=0)
    receivers = []
    for dp, (eng, store, lay) in enumerate(decodes):
        engine = FaultyEngine(eng, FaultInjector(FaultPlan(fail_reads=1))) if dp == 1 else eng
        r = DecodeReceiver(cfg, d_tp=1, d_rank=0, dp_rank=dp, layout=lay, engine=engine)
        r.expect(RequestDestination(f"q{dp}", (3 + dp, 9)))
        receivers.append(r.start())
    fan = PrefillFanout(
        gates,
        lambda host, dp: PrefillSender(
            cfg,
            p_tp=1,
            d_tp=1,
            p_rank=0,
            layout=pre_layout,
            engine=pe,
            gates=gates,
            decode_host=host,
            decode_dp_rank=dp,
            begin_gate=False,
        ),
    )
    try:
        fan.add_request("q0", 2, "127.0.0.1", 0)
        fan.add_request("q1", 2, "127.0.0.1", 1)
        srcs = {"q0": SourceBlocks([0, 1]), "q1": SourceBlocks([2, 3])}
        fan.publish_layer(0, 0, srcs)
        with pytest.raises(GateError, match="injected read failure"):
            gates.wait_free(0, 30.0)
        assert fan.status("q1").state is TransferState.FAILED
        assert fan.status("q0").state is TransferState.PENDING
        # the failed request drops out: the next layer's gate waits for decode 0 only
        assert fan.consumers(srcs) == [fan.senders()[0].consumer]
        fan.publish_layer(1, 0, srcs)
        gates.wait_free(0, 30.0)
        # a caller-opened gate with a stale P/D consumer does not keep the slot
        gates.begin(0, 2, ["save"] + sorted(c.consumer for c in fan.senders()))
        fan.publish_layer(
            2, 0, srcs, finished=list(srcs), begin_gate=False, consumers=sorted(c.consumer for c in fan.senders())
        )
        gates.done(0, 2, "save")
        gates.wait_free(0, 30.0)
        assert fan.status("q0").state is TransferState.DONE
        # a publish that fails its argument checks after the gate opened releases the gate
        fan.add_request("q2", 2, "127.0.0.1", 0)
        with pytest.raises(ValueError, match="main source blocks"):
            fan.publish_layer(0, 0, {"q2": SourceBlocks([0])})
        with pytest.raises(GateError, match="publish failed"):
            gates.wait_free(0, 1.0)
        assert gates.busy_slots() == []
    finally:
        fan.close()
        for r in receivers:
            r.close()
