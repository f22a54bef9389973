"""The control path's receive spin and stage stamps.

No transfer engine needed: an in-process engine copies with ``ctypes.memmove``,
so these run wherever the package imports.
"""

import ctypes
import socket
import threading
import time

import numpy as np
import pytest

from sglang_ascend_offload.config import PDTransferConfig
from sglang_ascend_offload.layerwise_prefill.gates import SlotGates
from sglang_ascend_offload.transfer import channel
from sglang_ascend_offload.transfer.channel import ControlEndpoint, spin_recv, spin_us_from_env
from sglang_ascend_offload.transfer.decode_side import DecodeReceiver
from sglang_ascend_offload.transfer.destinations import RequestDestination
from sglang_ascend_offload.transfer.errors import TransferError
from sglang_ascend_offload.transfer.layout import RawTensor, layout_from_regions
from sglang_ascend_offload.transfer.prefill_side import PrefillSender, SourceBlocks
from sglang_ascend_offload.transfer.protocol import PROTOCOL_VERSION, MetaAck, Rejected, TransferVerdict
from sglang_ascend_offload.transfer.stages import (
    DECODE_STAMPS,
    PREFILL_STAMPS,
    STAGES,
    TRACE_ENV,
    StageLog,
    stage_breakdown,
)
from sglang_ascend_offload.transfer.status import TransferState

pytestmark = pytest.mark.timeout(60)


def free_port():
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port()


# ------------------------------------------------------------------ spin_recv
@pytest.fixture()
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _finishes_before(fn, deadline_s: float):
    """Run ``fn`` in a thread; its result if it returned within ``deadline_s`` (else the
    test fails: the call waited for its window instead of the event)."""
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    worker.start()
    worker.join(deadline_s)
    assert not worker.is_alive(), f"still waiting after {deadline_s} s"
    return out["value"]


WINDOW_NS = 600_000_000_000  # a 10-minute spin window: only the event can end the call in time


def test_spin_recv_returns_bytes_that_arrive_during_the_spin(pair):
    a, b = pair
    threading.Timer(0.02, lambda: a.sendall(b"hello")).start()
    got = _finishes_before(lambda: spin_recv(b, spin_ns=WINDOW_NS), 60)  # returned on arrival
    assert got == b"hello"


def test_spin_recv_gives_up_after_its_window_and_blocking_recv_gets_later_bytes(pair):
    a, b = pair
    t0 = time.monotonic()
    assert _finishes_before(lambda: spin_recv(b, spin_ns=2_000_000), 60) is None  # 2 ms, nothing sent
    assert time.monotonic() - t0 >= 0.002  # spun its whole window before giving up
    a.sendall(b"late")
    b.settimeout(5.0)
    assert b.recv(64) == b"late"  # the caller's blocking receive after the spin


def test_spin_recv_sees_eof_at_once_and_stops_on_close(pair):
    a, b = pair
    stop = threading.Event()
    threading.Timer(0.02, stop.set).start()
    assert _finishes_before(lambda: spin_recv(b, spin_ns=WINDOW_NS, stop=stop), 60) is None  # stop ends it
    a.shutdown(socket.SHUT_WR)
    assert _finishes_before(lambda: spin_recv(b, spin_ns=WINDOW_NS), 60) == b""  # peer gone: EOF at once


def test_spin_setting_from_environment(monkeypatch):
    monkeypatch.delenv(channel.SPIN_ENV, raising=False)
    assert spin_us_from_env(150.0) == 150.0
    monkeypatch.setenv(channel.SPIN_ENV, "0")
    assert spin_us_from_env(150.0) == 0.0
    monkeypatch.setenv(channel.SPIN_ENV, "75.5")
    assert spin_us_from_env(0.0) == 75.5
    for bad in ("fast", "-1", "1e9"):
        monkeypatch.setenv(channel.SPIN_ENV, bad)
        with pytest.raises(TransferError, match=channel.SPIN_ENV):
            spin_us_from_env(0.0)


# ------------------------------------------------------------------ endpoints with a spin
class _Collect:
    def __init__(self):
        self.got = []
        self.event = threading.Event()

    def __call__(self, peer, msg):
        self.got.append((peer, msg))
        self.event.set()

    def wait(self, n, timeout_s=10.0):
        end = time.monotonic() + timeout_s
        while len(self.got) < n and time.monotonic() < end:
            time.sleep(0.002)
        return len(self.got) >= n


def _verdict(i):
    return TransferVerdict(version=PROTOCOL_VERSION, request_ids=[f"r{i}"], ok=True, reason="")


def _wait_for(pred, timeout_s=30.0):
    """Poll ``pred`` until it holds; whether it did (a deadline on the event, not a speed bound)."""
    end = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < end:
        time.sleep(0.002)
    return pred()


@pytest.mark.parametrize("caught", [True, False], ids=["caught_by_the_spin", "after_the_spin"])
def test_endpoint_receives_messages_during_and_after_the_spin(caught):
    """Each message is sent once the router's reader is in the state under test: with a
    10-minute window only the next message (or close) can end the spin, so every later
    message is caught by it; with a 1 ms window the next message is sent only after the
    spin has run out, so the reader got it from its blocking receive."""
    spin_us = WINDOW_NS // 1000 if caught else 1_000
    port = free_port()
    router_got = _Collect()
    router = ControlEndpoint(
        "router",
        "127.0.0.1",
        port,
        expect=(TransferVerdict,),
        on_message=router_got,
        spin_us=spin_us,
        name="spin-router",
    )
    router._idle_cores = lambda: True  # as on a machine with an idle core (this one may be loaded)
    router.start()
    dealer = ControlEndpoint(
        "dealer", "127.0.0.1", port, expect=(Rejected,), on_message=lambda p, m: None, spin_us=0
    ).start()
    try:
        assert router.spin_us == spin_us and dealer.spin_us == 0
        for i in range(3):
            dealer.send(_verdict(i))
            assert router_got.wait(i + 1, timeout_s=30.0), f"message {i} never arrived"
            if not caught:  # the event: the spin after message i ran out (the reader then blocks)
                assert _wait_for(lambda: router.spin_misses == i + 1), f"the spin after message {i} never ended"
        assert [m.request_ids[0] for _, m in router_got.got] == ["r0", "r1", "r2"]
        if caught:  # messages 1 and 2 ended the spins after 0 and 1; the spin after 2 is still running
            assert _wait_for(lambda: router.spins == 2)
            assert router.spin_misses == 0
        else:  # every spin ran out; messages 1 and 2 still arrived, through the blocking receive
            assert router.spin_misses == 3 and router.spins == 0
    finally:
        dealer.close()
        router.close()
    # close ends a spin that is still running (the 10-minute window above): nothing is left running
    assert not router.alive
    assert not [t for t in threading.enumerate() if t.name.startswith("spin-router") and t.is_alive()]


def test_no_spin_without_an_idle_core():
    port = free_port()
    got = _Collect()
    router = ControlEndpoint("router", "127.0.0.1", port, expect=(TransferVerdict,), on_message=got, spin_us=5_000_000)
    router._idle_cores = lambda: False  # every core busy: block at once
    router.start()
    dealer = ControlEndpoint("dealer", "127.0.0.1", port, expect=(Rejected,), on_message=lambda p, m: None).start()
    try:
        for i in range(3):
            dealer.send(_verdict(i))
            assert got.wait(i + 1)
        assert router.spins == router.spin_misses == 0 and router.spins_skipped_busy >= 2
    finally:
        dealer.close()
        router.close()


def test_idle_cores_follows_the_load_average(monkeypatch):
    load = [0.5]
    monkeypatch.setattr(channel.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    monkeypatch.setattr(channel.os, "sched_getaffinity", lambda pid: {0, 1})
    idle = channel.IdleCores(period_s=0.0)  # re-read on every call
    assert idle() is True
    load[0] = 2.5
    assert idle() is False
    slow = channel.IdleCores(period_s=3600.0)
    assert slow() is False  # first call reads
    load[0] = 0.1
    assert slow() is False  # not re-read within the period


def test_frames_whole_split_batched_and_invalid_over_a_raw_socket():
    """The reader decodes a lone whole frame straight from the received bytes and falls back to
    its buffer for partial or several frames; an invalid lone frame is still rejected."""
    from sglang_ascend_offload.transfer.protocol import decode_message, encode_message

    port = free_port()
    got, invalid = _Collect(), []
    router = ControlEndpoint(
        "router",
        "127.0.0.1",
        port,
        expect=(TransferVerdict,),
        on_message=got,
        on_invalid=lambda peer, err: invalid.append(str(err)),
        spin_us=0,
    ).start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        f = [channel.frame(encode_message(_verdict(i))) for i in range(5)]
        sock.sendall(f[0])  # one whole frame per recv (the fast path)
        assert got.wait(1)
        sock.sendall(f[1][:3])  # a frame split inside its header, then inside its payload
        time.sleep(0.05)
        sock.sendall(f[1][3:9])
        time.sleep(0.05)
        sock.sendall(f[1][9:])
        assert got.wait(2)
        sock.sendall(f[2] + f[3] + f[4][:5])  # two frames and a partial third in one write
        time.sleep(0.05)
        sock.sendall(f[4][5:])
        assert got.wait(5)
        assert [m.request_ids[0] for _, m in got.got] == ["r0", "r1", "r2", "r3", "r4"]
        sock.sendall(channel.frame(b"\x81\xa4kind\xa4nope"))  # a lone whole frame of an unknown kind
        sock.settimeout(5.0)
        head = sock.recv(4, socket.MSG_WAITALL)
        answer = decode_message(sock.recv(channel.HEADER.unpack(head)[0], socket.MSG_WAITALL))
        assert isinstance(answer, Rejected) and invalid and router.rejected == 1
        sock.sendall(f[0])  # the connection keeps serving after a rejected frame
        assert got.wait(6) and len(got.got) == 6
    finally:
        sock.close()
        router.close()


# ------------------------------------------------------------------ sender + receiver with stage stamps
class MemmoveEngine:
    """Same-process 'engine': reads are memmoves between registered numpy buffers."""

    name = "mooncake"
    data_protocol = "tcp"
    session_id = "local:1"

    def read(self, peer_session, dst_addrs, src_addrs, lengths):
        for d, s, n in zip(dst_addrs, src_addrs, lengths):
            ctypes.memmove(d, s, n)


WIDTHS = {"latent": 64, "rope": 8, "indexer": 16, "indexer_scale": 4}
ROLES = {"latent": "main", "rope": "main", "indexer": "indexer", "indexer_scale": "indexer_scale"}


def _layout(per_layer):
    return layout_from_regions(
        1, [RawTensor(ROLES[n], n, WIDTHS[n], a[0].shape[0], [x.ctypes.data for x in a]) for n, a in per_layer.items()]
    )


@pytest.mark.parametrize("trace", [True, False])
def test_layers_through_one_slot_with_and_without_stage_stamps(trace):
    layers, blocks = 6, 3
    slot = {n: np.zeros((blocks, w), dtype=np.uint8) for n, w in WIDTHS.items()}
    dest = {n: np.zeros((layers, 8, w), dtype=np.uint8) for n, w in WIDTHS.items()}
    src_layout = _layout({n: [slot[n]] * layers for n in WIDTHS})
    dst_layout = _layout({n: [dest[n][i] for i in range(layers)] for n in WIDTHS})
    port = free_port()
    # deadlines no step of this test can reach on a loaded machine: it is about the bytes and
    # the stamps, not about how fast they move (the deadlines have their own tests)
    cfg = PDTransferConfig(
        engine="mooncake", kv_port=port, host="127.0.0.1", layer_timeout_s=30.0, handshake_timeout_s=30.0
    )
    engine = MemmoveEngine()
    recv = DecodeReceiver(cfg, d_tp=1, d_rank=0, layout=dst_layout, engine=engine, trace=trace)
    recv.expect(RequestDestination("a", (5, 1, 6), (2, 7, 0)))
    recv.start()
    gates = SlotGates(1)
    sender = PrefillSender(
        cfg,
        p_tp=1,
        d_tp=1,
        p_rank=0,
        layout=src_layout,
        engine=engine,
        gates=gates,
        decode_host="127.0.0.1",
        trace=trace,
    )
    rng = np.random.default_rng(0)
    want = {n: rng.integers(0, 256, (layers, blocks, w), dtype=np.uint8) for n, w in WIDTHS.items()}
    try:
        assert recv.endpoint.spin_us > 0 and sender.endpoint.spin_us == 0  # the sides' defaults
        assert isinstance(sender.handshake(), MetaAck)
        sender.add_request("a", blocks)
        for layer in range(layers):
            gates.wait_free(0, 30.0)  # the previous layer's answer (the event), within the layer deadline
            for n in WIDTHS:
                slot[n][...] = want[n][layer]
            sender.publish_layer(
                layer, 0, {"a": SourceBlocks([0, 1, 2], [0, 1, 2])}, finished=["a"] if layer == layers - 1 else ()
            )
        assert sender.wait(["a"], 10.0)["a"].state is TransferState.DONE
        end = time.monotonic() + 10.0
        while recv.status("a").state is TransferState.PENDING and time.monotonic() < end:
            time.sleep(0.005)
        assert recv.status("a").state is TransferState.DONE
        for n in WIDTHS:  # bit-exact at the destination blocks of every layer
            blocks_at = (5, 1, 6) if ROLES[n] == "main" else (2, 7, 0)
            assert np.array_equal(dest[n][:, list(blocks_at)], want[n])
        if not trace:
            assert sender.stages is None and recv.stages is None
            return
        p, d = sender.stages.records(), recv.stages.records()
        assert sorted(p) == sorted(d) == list(range(layers))
        for b in range(layers):  # every stamp present, each thread's in path order
            publish, answer = PREFILL_STAMPS[:4], PREFILL_STAMPS[4:]  # publisher's / reader's thread
            assert [p[b][k] for k in publish] == sorted(p[b][k] for k in publish)
            assert [p[b][k] for k in answer] == sorted(p[b][k] for k in answer)
            assert [d[b][k] for k in DECODE_STAMPS] == sorted(d[b][k] for k in DECODE_STAMPS)
            # one clock for both sides: decode got the batch after prefill encoded it and prefill
            # got the answer after decode encoded it ("sent" may come later: sendall can return
            # after the whole round trip when the publisher loses its core meanwhile)
            assert p[b]["encoded"] <= d[b]["rx"] and d[b]["answer_encoded"] <= p[b]["answer_rx"]
        br = stage_breakdown(p, d)
        assert set(br) == {name for name, _, _ in STAGES} | {"total_minus_read"}
        assert all(v["n"] == layers and v["p50"] <= v["p99"] for v in br.values())
    finally:
        sender.close()
        recv.close()


def test_stage_breakdown_arithmetic():
    p = {0: dict(zip(PREFILL_STAMPS, [0, 10_000, 12_000, 15_000, 95_000, 97_000, 100_000]))}
    d = {
        0: dict(zip(DECODE_STAMPS, [20_000, 22_000, 30_000, 80_000, 84_000, 85_000, 90_000])),
        1: dict(zip(DECODE_STAMPS, range(7))),
    }  # no prefill record: not matched
    br = stage_breakdown(p, d)
    assert br["prefill_prepare"]["p50"] == 10.0 and br["to_decode_wakeup"]["p50"] == 5.0
    assert br["read"]["p50"] == 50.0 and br["to_prefill_wakeup"]["p50"] == 5.0
    assert br["total_minus_read"] == {"p50": 50.0, "p99": 50.0, "n": 1}  # 100 us minus the 50 us read
    assert br["decode_send"]["n"] == 1


def test_stage_log_keeps_the_latest_batches():
    log = StageLog(limit=3)
    for b in range(5):
        log.stamp(b, "publish", b)
    assert sorted(log.records()) == [2, 3, 4]


def test_trace_follows_the_environment(monkeypatch):
    from sglang_ascend_offload.transfer.stages import trace_from_env

    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert trace_from_env() is False
    monkeypatch.setenv(TRACE_ENV, "0")
    assert trace_from_env() is False
    monkeypatch.setenv(TRACE_ENV, "1")
    assert trace_from_env() is True
