"""NPU node only: the raw-engine yardstick of ``bench transfer`` with MemFabric.

Two processes, one NPU each (the same NPU when there is one): prefill publishes
``LAYERS`` layers of DeepSeek-V3.2-sized blocks from two reusable NPU slots, decode pulls
them into NPU destinations through the project's protocol (``PrefillSender`` /
``DecodeReceiver``, MemFabric SDMA), records every engine read, checks every byte,
then replays exactly those reads through MemFabric's own ``batch_transfer_sync_read``
(prefill keeps its buffers registered meanwhile). The test asserts bit-exactness and
that the replay moved the same bytes; the rates and their ratio (our path over the raw
engine, the ``engine_over_raw`` of the CPU benchmark) are printed, not asserted: only an
NPU node measures them.
"""

import pytest
import torch
from npu_requirements import npu_present, require_npu, require_package

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN, torch_npu and memfabric-hybrid"),
    pytest.mark.timeout(600),
]


@pytest.fixture(autouse=True)
def _npu_packages():
    """On an NPU runner a missing torch_npu or memfabric-hybrid fails these tests."""
    require_npu()
    require_package("memfabric_hybrid", "the [npu] extra")


LAYERS = 8
SLOTS = 2
BLOCK_TOKENS = 128
BLOCKS = 32  # 4096 tokens
TENSORS = (
    ("main", "latent", 1024 * BLOCK_TOKENS),
    ("main", "rope", 128 * BLOCK_TOKENS),
    ("indexer", "indexer", 256 * BLOCK_TOKENS),
)


def free_port():
    """A port reserved across processes (no bind(0) race with other listeners)."""
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port()


def content(layer: int, name: str, nbytes_per_block: int) -> torch.Tensor:
    """Deterministic ``[BLOCKS, block bytes]`` uint8 content of one layer of one tensor (CPU)."""
    g = torch.Generator().manual_seed(1000 * layer + sum(map(ord, name)))
    return torch.randint(0, 256, (BLOCKS, nbytes_per_block), dtype=torch.uint8, generator=g)


def _config(kv_port: int):
    from sglang_ascend_offload.config import PDTransferConfig

    return PDTransferConfig(
        engine="memfabric", kv_port=kv_port, host="127.0.0.1", layer_timeout_s=60.0, handshake_timeout_s=120.0
    )


def _prefill(store_url, kv_port, device, q_out, q_in):
    import torch_npu  # noqa: F401

    from sglang_ascend_offload.layerwise_prefill.gates import SlotGates
    from sglang_ascend_offload.transfer.engine_memfabric import MemFabricEngine
    from sglang_ascend_offload.transfer.layout import RawTensor, layout_from_regions
    from sglang_ascend_offload.transfer.prefill_side import PrefillSender, SourceBlocks

    torch.npu.set_device(device)
    engine = MemFabricEngine("127.0.0.1", store_url, "sdma", "prefill", device_id=device)
    slots = {
        name: [torch.zeros((BLOCKS, bb), dtype=torch.uint8, device="npu") for _ in range(SLOTS)]
        for _, name, bb in TENSORS
    }
    images = {(layer, name): content(layer, name, bb).npu() for layer in range(LAYERS) for _, name, bb in TENSORS}
    layout = layout_from_regions(
        BLOCK_TOKENS,
        [
            RawTensor(role, name, bb, BLOCKS, [slots[name][layer % SLOTS].data_ptr() for layer in range(LAYERS)])
            for role, name, bb in TENSORS
        ],
    )
    regions = sorted({t.data_ptr(): t.numel() for ts in slots.values() for t in ts}.items())
    engine.register(regions)
    gates = SlotGates(SLOTS)
    sender = PrefillSender(
        _config(kv_port), p_tp=1, d_tp=1, p_rank=0, layout=layout, engine=engine, gates=gates, decode_host="127.0.0.1"
    )
    try:
        sender.add_request("r0", BLOCKS)
        sender.handshake()
        blocks = list(range(BLOCKS))
        for layer in range(LAYERS):
            slot = layer % SLOTS
            gates.wait_free(slot, 120.0)
            for _, name, _ in TENSORS:
                slots[name][slot].copy_(images[(layer, name)])
            torch.npu.synchronize()
            sender.publish_layer(
                layer, slot, {"r0": SourceBlocks(blocks, blocks)}, finished=["r0"] if layer == LAYERS - 1 else ()
            )
        q_out.put(sender.wait(["r0"], 300.0)["r0"].state.value)
        q_in.get(timeout=600)  # decode's raw replay reads our slots: keep them registered until it is done
    finally:
        sender.close()
        engine.close()


def _decode(store_url, kv_port, device, q_out, q_in):
    import time

    import torch_npu  # noqa: F401

    from sglang_ascend_offload.testing.pd_harness import _RecordingEngine, raw_engine_replay
    from sglang_ascend_offload.transfer.decode_side import DecodeReceiver
    from sglang_ascend_offload.transfer.destinations import RequestDestination
    from sglang_ascend_offload.transfer.engine_memfabric import MemFabricEngine
    from sglang_ascend_offload.transfer.layout import RawTensor, layout_from_regions

    torch.npu.set_device(device)
    engine = MemFabricEngine("127.0.0.1", store_url, "sdma", "decode", device_id=device)
    dest = {name: torch.zeros((LAYERS, BLOCKS, bb), dtype=torch.uint8, device="npu") for _, name, bb in TENSORS}
    layout = layout_from_regions(
        BLOCK_TOKENS,
        [
            RawTensor(role, name, bb, BLOCKS, [dest[name][layer].data_ptr() for layer in range(LAYERS)])
            for role, name, bb in TENSORS
        ],
    )
    engine.register([(t.data_ptr(), t.numel()) for t in dest.values()])
    recorder = _RecordingEngine(engine)
    receiver = DecodeReceiver(_config(kv_port), d_tp=1, d_rank=0, layout=layout, engine=recorder)
    # destination blocks reversed: nothing coalesces by accident, every block is one range
    order = tuple(reversed(range(BLOCKS)))
    receiver.expect(RequestDestination("r0", order, order))
    receiver.start()
    q_out.put("up")
    try:
        end = time.monotonic() + 300
        while receiver.pending_requests() and time.monotonic() < end:
            time.sleep(0.005)
        state = receiver.status("r0").state.value
        same = all(
            torch.equal(dest[name][layer][list(order)].cpu(), content(layer, name, bb))
            for layer in range(LAYERS)
            for _, name, bb in TENSORS
        )
        ours_bytes = receiver.stats.read_bytes
        span = recorder.last_end - recorder.first_start if recorder.reads else None
        raw_bytes, raw_s = raw_engine_replay(engine, recorder.reads, reps=3)
        q_out.put(
            dict(
                state=state,
                same=same,
                ours_bytes=ours_bytes,
                span=span,
                read_s=receiver.stats.read_seconds,
                raw_bytes=raw_bytes,
                raw_s=raw_s,
                ranges=[t.ranges for t in receiver.timings],
            )
        )
        q_in.get(timeout=600)
    finally:
        receiver.close()
        engine.close()


def test_memfabric_raw_engine_yardstick():
    import multiprocessing as mp

    from sglang_ascend_offload.transfer.engine_memfabric import create_config_store

    url = f"tcp://127.0.0.1:{free_port()}"
    create_config_store(url)
    kv_port = free_port()
    ctx = mp.get_context("spawn")
    qp_out, qp_in, qd_out, qd_in = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    ndev = torch.npu.device_count()
    d = ctx.Process(target=_decode, args=(url, kv_port, 1 % ndev, qd_out, qd_in))
    d.start()
    p = None
    try:
        assert qd_out.get(timeout=300) == "up"
        p = ctx.Process(target=_prefill, args=(url, kv_port, 0, qp_out, qp_in))
        p.start()
        assert qp_out.get(timeout=600) == "done"
        res = qd_out.get(timeout=600)
    finally:
        qp_in.put("stop")
        qd_in.put("stop")
        for proc in (p, d):
            if proc is not None:
                proc.join(120)
    assert res["state"] == "done" and res["same"]
    assert res["raw_bytes"] == res["ours_bytes"] == LAYERS * BLOCKS * sum(bb for _, _, bb in TENSORS)
    assert res["ranges"] == [BLOCKS * len(TENSORS)] * LAYERS
    ours, raw = res["ours_bytes"] / res["span"], res["raw_bytes"] / res["raw_s"]
    print(
        f"\nMemFabric SDMA, {LAYERS} layers x {res['ours_bytes'] // LAYERS} bytes: P/D path {ours / 1e9:.2f} GB/s "
        f"(read span), inside reads {res['ours_bytes'] / res['read_s'] / 1e9:.2f} GB/s, raw engine "
        f"{raw / 1e9:.2f} GB/s, engine_over_raw {ours / raw:.3f}"
    )
