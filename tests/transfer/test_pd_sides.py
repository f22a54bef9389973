"""Decode receiver and prefill sender in one process (Mooncake over TCP on 127.0.0.1).

Real engines and sockets; peers that misbehave are played by raw TCP sockets that
send hand-made (valid or broken) frames, so each validation rule and each
deadline is exercised on its own.
"""

import contextlib
import importlib.util
import socket
import threading
import time

import msgspec
import pytest
import torch

from sglang_ascend_offload.config import PDTransferConfig
from sglang_ascend_offload.layerwise_prefill.gates import GateError, SlotGates
from sglang_ascend_offload.transfer.channel import HEADER, frame
from sglang_ascend_offload.transfer.decode_side import DecodeReceiver
from sglang_ascend_offload.transfer.destinations import RequestDestination
from sglang_ascend_offload.transfer.errors import (
    HandshakeError,
    HandshakeTimeout,
    RequestFailed,
    TopologyError,
    TransferError,
)
from sglang_ascend_offload.transfer.layout import TensorLayers, build_layout, registration_regions
from sglang_ascend_offload.transfer.prefill_side import PrefillSender, SourceBlocks
from sglang_ascend_offload.transfer.protocol import (
    PROTOCOL_VERSION,
    MetaAck,
    MetaHandshake,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    Rejected,
    RequestRange,
    TransferVerdict,
    decode_message,
    encode_message,
)
from sglang_ascend_offload.transfer.status import TransferState

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)",
    ),
    pytest.mark.timeout(60),
]

V = PROTOCOL_VERSION
L = 4  # layers
S = 2  # prefill slots (layers share them round-robin)
WIDTHS = {"latent": 64, "rope": 16, "indexer": 32, "indexer_scale": 8}  # block bytes
ROLES = {"latent": "main", "rope": "main", "indexer": "indexer", "indexer_scale": "indexer_scale"}


def free_port():
    """A port reserved across processes (no bind(0) race with other listeners)."""
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port()


@pytest.fixture(scope="module")
def engines():
    from sglang_ascend_offload.transfer.engine_mooncake import MooncakeEngine

    p, d = MooncakeEngine("127.0.0.1"), MooncakeEngine("127.0.0.1")
    yield p, d
    p.close()
    d.close()


class Side:
    """Tensors of one side registered with an engine; unregistered by ``close``."""

    def __init__(self, engine, names, per_layer_fn, block_tokens=4):
        self.engine = engine
        self.tensors = [TensorLayers(ROLES[n], n, per_layer_fn(n)) for n in names]
        self.layout = build_layout(block_tokens, self.tensors)
        self.regions = registration_regions(self.tensors)
        engine.register(self.regions)

    def close(self):
        self.engine.unregister([a for a, _ in self.regions])


def prefill_side(engine, names=tuple(WIDTHS), blocks=16):
    slots = {n: [torch.zeros(blocks, WIDTHS[n], dtype=torch.uint8) for _ in range(S)] for n in names}
    side = Side(engine, names, lambda n: [slots[n][layer % S] for layer in range(L)])
    side.slots = slots
    return side


def decode_side(engine, names=tuple(WIDTHS), blocks=32, widths=WIDTHS, block_tokens=4, layers=L):
    store = {n: torch.zeros(layers, blocks, widths[n], dtype=torch.uint8) for n in names}
    side = Side(engine, names, lambda n: [store[n][i] for i in range(layers)], block_tokens)
    side.store = store
    return side


def cfg(port, **kw):
    # Deadlines no step can reach on a loaded machine unless a test is about one: those
    # tests set their own (0.3 s) and identify the deadline by the message naming it.
    base = dict(
        engine="mooncake",
        kv_port=port,
        host="127.0.0.1",
        layer_timeout_s=30.0,
        handshake_timeout_s=30.0,
        read_retries=1,
    )
    base.update(kw)
    return PDTransferConfig(**base)


@pytest.fixture()
def rig(engines):
    """A started decode receiver (d_tp=1) with request ``a`` (3 blocks) expected."""
    pe, de = engines
    port = free_port()
    dec_side, pre_side = decode_side(de), prefill_side(pe)
    released = []
    recv = DecodeReceiver(cfg(port), d_tp=1, d_rank=0, layout=dec_side.layout, engine=de, on_release=released.append)
    dest = RequestDestination("a", (5, 9, 2), (7, 1, 3))
    recv.expect(dest)
    recv.start()

    class Rig:
        pass

    r = Rig()
    r.port, r.recv, r.dec, r.pre, r.dest, r.released, r.pe = port, recv, dec_side, pre_side, dest, released, pe
    yield r
    recv.close()
    dec_side.close()
    pre_side.close()


class FramedSocket:
    """One end of a control connection driven by hand: frames in, frames out."""

    def __init__(self, sock):
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, msg):
        self.send_raw(frame(encode_message(msg) if not isinstance(msg, bytes) else msg))

    def recv_payload(self, timeout_s=5.0) -> bytes:
        end = time.monotonic() + timeout_s
        while len(self.buf) < 4 or len(self.buf) < 4 + HEADER.unpack_from(self.buf)[0]:
            left = end - time.monotonic()
            assert left > 0, "nothing received"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                raise AssertionError("nothing received") from None
            assert data, "connection closed by the endpoint"
            self.buf += data
        n = HEADER.unpack_from(self.buf)[0]
        payload, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
        return payload

    def recv(self, timeout_s=5.0):
        return decode_message(self.recv_payload(timeout_s))

    def close(self):
        self.sock.close()


class RawPeer(FramedSocket):
    """A hand-driven prefill peer (connects like a dealer) for crafted messages."""

    def __init__(self, port):
        super().__init__(socket.create_connection(("127.0.0.1", port), timeout=5.0))


def handshake_msg(pre, engine, p_tp=1, p_rank=0, d_tp=1):
    lay = pre.layout
    return MetaHandshake(
        version=V,
        session=engine.session_id,
        engine="mooncake",
        data_protocol="tcp",
        p_tp=p_tp,
        p_rank=p_rank,
        d_tp=d_tp,
        main_tensor_count=len(lay.main),
        has_indexer=lay.indexer is not None,
        has_indexer_scale=lay.indexer_scale is not None,
        layer_timeout_ms=2000,
        layout=lay,
    )


def rr(rid="a", n=3, main=(0, 1, 2), main_off=0, idx=(4, 5, 6), idx_off=0):
    return RequestRange(
        request_id=rid,
        num_blocks=n,
        main_offset=main_off,
        main_src_blocks=list(main),
        indexer_offset=idx_off,
        indexer_src_blocks=list(idx),
    )


def batch(layer, reqs, batch_id=None, finished=(), member=0, ratio=1):
    return ReadReadyBatch(
        version=V,
        batch_id=layer if batch_id is None else batch_id,
        layer=layer,
        member=member,
        ratio=ratio,
        requests=reqs,
        finished=list(finished),
    )


def wait_until(pred, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


def fill(pre, slot, seed):
    g = torch.Generator().manual_seed(seed)
    for n, tensors in pre.slots.items():
        tensors[slot].copy_(torch.randint(0, 256, tensors[slot].shape, dtype=torch.uint8, generator=g))


def dest_untouched(r):
    return all(int(t.count_nonzero()) == 0 for t in r.dec.store.values())


# ------------------------------------------------------------------ end to end in process
def test_every_layer_bit_exact_and_slots_reused_only_after_read(rig):
    r = rig
    gates = SlotGates(S)
    sender = PrefillSender(
        cfg(r.port), p_tp=1, d_tp=1, p_rank=0, layout=r.pre.layout, engine=r.pe, gates=gates, decode_host="127.0.0.1"
    )
    try:
        sender.handshake()
        sender.add_request("a", 3)
        src = SourceBlocks([0, 1, 2], [4, 5, 6])
        expected = []
        for layer in range(L):
            slot = layer % S
            gates.wait_free(slot, 5.0)
            fill(r.pre, slot, layer)
            expected.append({n: t[slot].clone() for n, t in r.pre.slots.items()})
            sender.publish_layer(layer, slot, {"a": src}, finished=["a"] if layer == L - 1 else [])
        assert sender.wait(["a"], 5.0)["a"].state is TransferState.DONE
        assert wait_until(lambda: r.recv.status("a").state is TransferState.DONE)
        got = r.recv.claim("a")
        assert got == r.dest
        for layer in range(L):
            for n in ("latent", "rope"):
                assert torch.equal(r.dec.store[n][layer][[5, 9, 2]], expected[layer][n][[0, 1, 2]])
            for n in ("indexer", "indexer_scale"):
                assert torch.equal(r.dec.store[n][layer][[7, 1, 3]], expected[layer][n][[4, 5, 6]])
        assert gates.busy_slots() == []
        assert sender.stats.read_done == L and r.recv.stats.reads == L
        assert r.released == []  # a claimed destination belongs to the scheduler
    finally:
        sender.close()


def test_request_needs_positive_verdict_before_done(rig):
    r = rig
    peer = RawPeer(r.port)
    try:
        peer.send(handshake_msg(r.pre, r.pe))
        assert peer.recv().accepted
        for layer in range(L):
            peer.send(batch(layer, [rr()], finished=["a"] if layer == L - 1 else []))
            assert isinstance(peer.recv(), ReadDone)
        time.sleep(0.05)
        assert r.recv.status("a").state is TransferState.PENDING  # data there, no verdict yet
        with pytest.raises(TransferError, match="still transferring"):
            r.recv.claim("a")
        peer.send(TransferVerdict(version=V, request_ids=["a"], ok=True, reason=""))
        assert wait_until(lambda: r.recv.status("a").state is TransferState.DONE)
    finally:
        peer.close()


def test_abort_verdict_invalidates_and_releases_destination(rig):
    r = rig
    peer = RawPeer(r.port)
    try:
        peer.send(handshake_msg(r.pre, r.pe))
        assert peer.recv().accepted
        for layer in range(L):
            peer.send(batch(layer, [rr()], finished=["a"] if layer == L - 1 else []))
            assert isinstance(peer.recv(), ReadDone)
        peer.send(TransferVerdict(version=V, request_ids=["a"], ok=False, reason="prefill deadline"))
        assert wait_until(lambda: r.recv.status("a").state is TransferState.FAILED)
        assert "prefill deadline" in r.recv.status("a").reason
        with pytest.raises(RequestFailed, match="prefill deadline"):
            r.recv.claim("a")
        assert r.released == [r.dest]
    finally:
        peer.close()


def test_abort_before_any_layer_fails_request(rig):
    r = rig
    peer = RawPeer(r.port)
    try:
        peer.send(handshake_msg(r.pre, r.pe))
        assert peer.recv().accepted
        peer.send(TransferVerdict(version=V, request_ids=["a", "unknown"], ok=False, reason="cancelled"))
        assert wait_until(lambda: r.recv.status("a").state is TransferState.FAILED)
        assert r.released == [r.dest] and r.recv.pending_requests() == []
    finally:
        peer.close()


# ------------------------------------------------------------------ validation before reads
BAD_RANGES = [
    ("short main share", rr(main=(0, 1)), "not this rank's share"),
    ("wrong main offset", rr(main_off=1, main=(0, 1)), "not this rank's share"),
    ("wrong indexer share", rr(idx=(4, 5)), "indexer range"),
    ("block count differs", rr(n=2, main=(0, 1), idx=(4, 5)), "decode destination 3"),
    ("source out of buffer", rr(main=(0, 1, 16)), "out of the prefill buffer"),
]


@pytest.mark.parametrize("label,bad,match", BAD_RANGES, ids=[b[0] for b in BAD_RANGES])
def test_invalid_ranges_fail_without_reading(rig, label, bad, match):
    r = rig
    peer = RawPeer(r.port)
    try:
        peer.send(handshake_msg(r.pre, r.pe))
        assert peer.recv().accepted
        fill(r.pre, 0, 1)
        peer.send(batch(0, [bad]))
        ans = peer.recv()
        assert isinstance(ans, ReadFailed) and match in ans.reason
        st = r.recv.status("a")
        assert st.state is TransferState.FAILED and match in st.reason
        assert r.released == [r.dest]
        assert r.recv.stats.reads == 0 and dest_untouched(r)  # nothing partially written
        with pytest.raises(RequestFailed):
            r.recv.claim("a")
    finally:
        peer.close()


def test_non_zero_member_must_not_send_main_and_layer_twice_and_early_finish(engines):
    pe, de = engines
    port = free_port()
    dec, pre = decode_side(de), prefill_side(pe)
    recv = DecodeReceiver(cfg(port), d_tp=1, d_rank=0, layout=dec.layout, engine=de)
    for i, rid in enumerate(("m", "twice", "early", "ratio")):
        blocks = tuple(range(3 * i, 3 * i + 3))
        recv.expect(RequestDestination(rid, blocks, blocks))
    recv.start()
    m0, m1 = RawPeer(port), RawPeer(port)
    try:
        m0.send(handshake_msg(pre, pe, p_tp=2, p_rank=0))
        m1.send(handshake_msg(pre, pe, p_tp=2, p_rank=1))
        assert m0.recv().accepted and m1.recv().accepted
        # member 1 sends main blocks for "m"
        m1.send(batch(0, [rr("m", main=(0, 1, 2), idx=(6,), idx_off=2)], member=1, ratio=2))
        ans = m1.recv()
        assert isinstance(ans, ReadFailed) and "only member 0" in ans.reason
        # the same layer twice
        m0.send(batch(0, [rr("twice", idx=(4, 5), idx_off=0)], member=0, ratio=2))
        assert isinstance(m0.recv(), ReadDone)
        m0.send(batch(0, [rr("twice", idx=(4, 5), idx_off=0)], batch_id=99, member=0, ratio=2))
        ans = m0.recv()
        assert isinstance(ans, ReadFailed) and "sent twice" in ans.reason
        # finished after one layer
        m0.send(batch(0, [rr("early", idx=(4, 5))], batch_id=5, finished=["early"], member=0, ratio=2))
        ans = m0.recv()
        assert isinstance(ans, ReadFailed) and "finished without layers [1, 2, 3]" in ans.reason
        # member/ratio disagreeing with the handshake
        m0.send(batch(1, [rr("ratio", idx=(4, 5))], batch_id=6, member=1, ratio=2))
        ans = m0.recv()
        assert isinstance(ans, ReadFailed) and "disagree with the handshake" in ans.reason
        assert recv.stats.reads == 2  # the valid layer-0 batches of "twice" and "early"
        for rid in ("m", "twice", "early", "ratio"):
            assert recv.status(rid).state is TransferState.FAILED
    finally:
        m0.close()
        m1.close()
        recv.close()
        dec.close()
        pre.close()


def test_prefill_instances_of_different_tp_feed_one_decode_rank(engines):
    """A TP-1 prefill instance (ratio 1) and a TP-2 one (ratio 2: rank 0 sends the main
    KV and half the indexer, rank 1 the other half) both hand-shake with one decode rank
    and each moves its own request, bit-exact; a request whose contributors come from
    both instances is failed for it (its contributors disagree on the topology)."""
    pe, de = engines
    port = free_port()
    dec = decode_side(de)
    recv = DecodeReceiver(cfg(port), d_tp=1, d_rank=0, layout=dec.layout, engine=de)
    recv.expect(RequestDestination("x", (5, 9, 2), (5, 9, 2)))
    recv.expect(RequestDestination("y", (11, 12, 13, 14), (21, 22, 23, 24)))
    recv.expect(RequestDestination("z", (30, 31), (30, 31)))
    recv.start()
    sides = {name: prefill_side(pe) for name in ("a", "b0", "b1")}
    senders = {}
    try:
        for name, (p_tp, p_rank) in {"a": (1, 0), "b0": (2, 0), "b1": (2, 1)}.items():
            senders[name] = PrefillSender(
                cfg(port),
                p_tp=p_tp,
                d_tp=1,
                p_rank=p_rank,
                layout=sides[name].layout,
                engine=pe,
                gates=SlotGates(S),
                decode_host="127.0.0.1",
            )
            senders[name].handshake()  # all three accepted by the one decode rank
        jobs = {"a": [("x", 3)], "b0": [("y", 4)], "b1": [("y", 4)]}
        expected = {}
        for layer in range(L):
            for name, reqs in jobs.items():
                slot = layer % S
                senders[name].gates.wait_free(slot, 5.0)
                fill(sides[name], slot, 100 * layer + len(name) + ord(name[-1]))
                expected[(name, layer)] = {n: t[slot].clone() for n, t in sides[name].slots.items()}
                for rid, n in reqs:
                    if layer == 0:
                        senders[name].add_request(rid, n)
                    src = SourceBlocks(list(range(n)), list(range(4, 4 + n)))
                    senders[name].publish_layer(layer, slot, {rid: src}, finished=[rid] if layer == L - 1 else [])
        assert senders["a"].wait(["x"], 10.0)["x"].state is TransferState.DONE
        for name in ("b0", "b1"):
            assert senders[name].wait(["y"], 10.0)["y"].state is TransferState.DONE
        assert wait_until(lambda: recv.status("x").state is TransferState.DONE)
        assert wait_until(lambda: recv.status("y").state is TransferState.DONE)
        for layer in range(L):
            a, b0, b1 = (expected[(n, layer)] for n in ("a", "b0", "b1"))
            for n in ("latent", "rope"):
                assert torch.equal(dec.store[n][layer][[5, 9, 2]], a[n][[0, 1, 2]])
                assert torch.equal(dec.store[n][layer][[11, 12, 13, 14]], b0[n][[0, 1, 2, 3]])  # member 0 only
            for n in ("indexer", "indexer_scale"):
                assert torch.equal(dec.store[n][layer][[5, 9, 2]], a[n][[4, 5, 6]])
                assert torch.equal(dec.store[n][layer][[21, 22]], b0[n][[4, 5]])  # the split indexer
                assert torch.equal(dec.store[n][layer][[23, 24]], b1[n][[6, 7]])
        # "z": layer 0 from the TP-1 instance, then a contribution from the TP-2 one
        senders["a"].add_request("z", 2)
        senders["b1"].add_request("z", 2)
        senders["a"].gates.wait_free(0, 5.0)
        senders["a"].publish_layer(0, 0, {"z": SourceBlocks([0, 1], [4, 5])})
        assert wait_until(lambda: 0 in recv._tracks["z"].delivered.get(0, set()))
        senders["b1"].gates.wait_free(0, 5.0)
        senders["b1"].publish_layer(0, 0, {"z": SourceBlocks([0, 1], [4, 5])})
        assert wait_until(lambda: recv.status("z").state is TransferState.FAILED)
        assert "contributors disagree on the request's P/D topology" in recv.status("z").reason
    finally:
        for sender in senders.values():
            sender.close()
        recv.close()
        dec.close()
        for side in sides.values():
            side.close()


def test_batch_for_unknown_request_and_without_handshake(rig):
    r = rig
    peer = RawPeer(r.port)
    try:
        peer.send(batch(0, [rr()]))
        ans = peer.recv()
        assert isinstance(ans, ReadFailed) and "no accepted handshake" in ans.reason
        peer.send(handshake_msg(r.pre, r.pe))
        assert peer.recv().accepted
        peer.send(batch(0, [rr("zzz")]))
        ans = peer.recv()
        assert isinstance(ans, ReadFailed) and "unknown request" in ans.reason
        peer.send(batch(1, []))  # a contributor with nothing still gets an answer
        assert isinstance(peer.recv(), ReadDone)
    finally:
        peer.close()


MISMATCHES = [
    ("rope block bytes", dict(widths=dict(WIDTHS, rope=32)), "main tensor 'rope' block bytes"),
    ("no indexer on decode", dict(names=("latent", "rope")), "indexer presence"),
    ("scale layout", dict(widths=dict(WIDTHS, indexer_scale=4)), "LIC8 scale block bytes"),
    ("layers", dict(layers=3), "layers: prefill 4, decode 3"),
    ("tokens per block", dict(block_tokens=8), "tokens per block"),
]


@pytest.mark.parametrize("label,kw,match", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_handshake_refused_on_layout_mismatch(engines, label, kw, match):
    pe, de = engines
    port = free_port()
    dec, pre = decode_side(de, **kw), prefill_side(pe)
    recv = DecodeReceiver(cfg(port), d_tp=1, d_rank=0, layout=dec.layout, engine=de).start()
    sender = PrefillSender(
        cfg(port), p_tp=1, d_tp=1, p_rank=0, layout=pre.layout, engine=pe, gates=SlotGates(S), decode_host="127.0.0.1"
    )
    try:
        with pytest.raises(HandshakeError, match=match):
            sender.handshake()
        assert not sender.connected
        with pytest.raises(TransferError, match="before a successful handshake"):
            sender.publish_layer(0, 0, {})
    finally:
        sender.close()
        recv.close()
        dec.close()
        pre.close()


def test_handshake_refused_for_wrong_decode_rank_and_protocol(rig):
    r = rig
    peer = RawPeer(r.port)
    try:
        peer.send(handshake_msg(r.pre, r.pe, p_tp=2, p_rank=1, d_tp=2))  # belongs to decode rank 1
        ack = peer.recv()
        assert not ack.accepted and "decode TP" in ack.reason
        hs = msgspec.structs.replace(handshake_msg(r.pre, r.pe), data_protocol="rdma")
        peer.send(hs)
        ack = peer.recv()
        assert not ack.accepted and "both sides must match" in ack.reason
    finally:
        peer.close()


def test_invalid_topology_rejected_when_configuring_sender(engines):
    pe, _ = engines
    pre = prefill_side(pe)
    try:
        with pytest.raises(TopologyError):
            PrefillSender(
                cfg(free_port()),
                p_tp=2,
                d_tp=4,
                p_rank=0,
                layout=pre.layout,
                engine=pe,
                gates=SlotGates(S),
                decode_host="127.0.0.1",
            )
    finally:
        pre.close()


def test_handshake_timeout_when_nobody_listens(engines):
    pe, _ = engines
    pre = prefill_side(pe)
    sender = PrefillSender(
        cfg(free_port(), handshake_timeout_s=0.3),
        p_tp=1,
        d_tp=1,
        p_rank=0,
        layout=pre.layout,
        engine=pe,
        gates=SlotGates(S),
        decode_host="127.0.0.1",
    )
    try:
        with pytest.raises(HandshakeTimeout, match="did not answer the metadata handshake within 0.300s"):
            sender.handshake()  # the message names the configured deadline that fired
    finally:
        sender.close()
        pre.close()


# ------------------------------------------------------------------ malformed input, live
def test_malformed_frames_are_rejected_and_never_acted_on(rig):
    r = rig
    peer = RawPeer(r.port)
    try:
        good = encode_message(batch(0, [rr()]))
        for blob in (b"\x00garbage", good[: len(good) // 2], msgspec.msgpack.encode({"kind": "ready"})):
            peer.send(blob)
            ans = peer.recv()
            assert isinstance(ans, Rejected)
        assert r.recv.endpoint.rejected == 3 and r.recv.stats.batches == 0
        assert r.recv.status("a").state is TransferState.PENDING and dest_untouched(r)
        peer.send(handshake_msg(r.pre, r.pe))  # still serving
        assert peer.recv().accepted
        assert r.recv.endpoint.handler_errors == 0
    finally:
        peer.close()


def test_oversized_frame_closes_only_that_connection(rig):
    from sglang_ascend_offload.transfer.protocol import MAX_MESSAGE_BYTES

    r = rig
    bad, good = RawPeer(r.port), RawPeer(r.port)
    try:
        bad.send_raw(HEADER.pack(MAX_MESSAGE_BYTES + 1) + b"x" * 16)
        assert isinstance(bad.recv(), Rejected)
        bad.sock.settimeout(5.0)
        assert bad.sock.recv(16) == b""  # the stream cannot be resynchronised: closed
        good.send(handshake_msg(r.pre, r.pe))
        assert good.recv().accepted  # the other peer is still served
        assert r.recv.endpoint.alive and r.recv.endpoint.handler_errors == 0
        assert r.recv.status("a").state is TransferState.PENDING and dest_untouched(r)
    finally:
        bad.close()
        good.close()


def test_fuzzed_frames_do_not_stop_the_receiver(rig):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    r = rig
    peer = RawPeer(r.port)

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=200))
    def feed(payload):
        peer.send(payload)  # any bytes inside a well-formed frame

    try:
        feed()
        peer.send(handshake_msg(r.pre, r.pe))
        deadline = time.monotonic() + 10
        while True:  # drain Rejected answers until the handshake's ack arrives
            msg = peer.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(msg, MetaAck):
                break
        assert msg.accepted
        assert r.recv.endpoint.alive and r.recv.endpoint.handler_errors == 0
        assert r.recv.status("a").state is TransferState.PENDING
    finally:
        peer.close()


# ------------------------------------------------------------------ prefill deadlines and answers
class FakeDecode:
    """A listener that accepts the sender's connection, handshakes and answers batches as told."""

    def __init__(self, port):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(4)
        self.conn = None

    def _conn(self, timeout_s):
        if self.conn is None:
            self.listener.settimeout(timeout_s)
            sock, _ = self.listener.accept()
            self.conn = FramedSocket(sock)
        return self.conn

    def recv(self, timeout_s=5.0):
        return self._conn(timeout_s).recv(timeout_s)

    def send(self, msg):
        self._conn(5.0).send(msg)

    def close(self):
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def _handshake(sender, fake):
    import threading

    t = threading.Thread(target=sender.handshake, kwargs={"timeout_s": 5.0})
    t.start()
    assert isinstance(fake.recv(), MetaHandshake)
    fake.send(MetaAck(version=V, accepted=True, reason="", d_rank=0))
    t.join(5.0)
    assert sender.connected


@pytest.fixture()
def sender_rig(engines, request):
    pe, _ = engines
    port = free_port()
    pre = prefill_side(pe)
    gates = SlotGates(S)
    fake = FakeDecode(port)
    # a deadline long enough that no answer the test sends at once can miss it on a loaded machine;
    # the deadline test asks for 0.3 s itself
    layer_timeout = getattr(request, "param", 10.0)
    sender = PrefillSender(
        cfg(port, layer_timeout_s=layer_timeout),
        p_tp=1,
        d_tp=1,
        p_rank=0,
        layout=pre.layout,
        engine=pe,
        gates=gates,
        decode_host="127.0.0.1",
    )
    _handshake(sender, fake)
    sender.add_request("a", 3)
    yield sender, gates, fake
    sender.close()
    fake.close()
    pre.close()


SRC = {"a": SourceBlocks([0, 1, 2], [4, 5, 6])}


@pytest.mark.parametrize("sender_rig", [0.3], indirect=True)
def test_layer_deadline_releases_slot_with_error_and_fails_request(sender_rig):
    sender, gates, fake = sender_rig
    sender.publish_layer(0, 0, SRC)
    assert isinstance(fake.recv(), ReadReadyBatch)  # decode never answers
    # the layer deadline (0.3 s) fails the slot, not the gate's own 60 s wait
    with pytest.raises(GateError, match="no answer from decode rank 0 within 0.300s"):
        gates.wait_free(0, 60.0)
    st = sender.status("a")
    assert st.state is TransferState.FAILED and "no answer" in st.reason
    verdict = fake.recv()
    assert isinstance(verdict, TransferVerdict) and not verdict.ok and verdict.request_ids == ["a"]
    fake.send(ReadDone(version=V, batch_id=0, layer=0))  # late answer: ignored
    assert wait_until(lambda: sender.stats.late_answers == 1)
    assert sender.status("a").state is TransferState.FAILED
    assert sender.publish_layer(1, 1, SRC) is None  # failed requests are not published again
    assert gates.busy_slots() == [] and sender.open_batches() == 0


def test_read_failed_releases_gate_with_error(sender_rig):
    sender, gates, fake = sender_rig
    sender.publish_layer(0, 0, SRC)
    b = fake.recv()
    fake.send(ReadFailed(version=V, batch_id=b.batch_id, layer=0, reason="disk on fire", request_ids=[]))
    with pytest.raises(GateError, match="READ_FAILED from decode: disk on fire"):
        gates.wait_free(0, 5.0)
    assert "disk on fire" in sender.status("a").reason


def test_malformed_answer_never_releases_gate_early(sender_rig):
    sender, gates, fake = sender_rig
    sender.publish_layer(0, 0, SRC)
    b = fake.recv()
    good = encode_message(ReadDone(version=V, batch_id=b.batch_id, layer=0))
    fake.send(good[:-2])
    assert isinstance(fake.recv(), Rejected)
    assert gates.pending(0) == {"pd_read"}  # not acted on
    fake.send(ReadDone(version=V, batch_id=b.batch_id + 1, layer=0))  # unknown batch: ignored
    fake.send(ReadDone(version=V, batch_id=b.batch_id, layer=3))  # wrong layer: ignored
    time.sleep(0.05)
    assert gates.pending(0) == {"pd_read"}
    fake.send(good)
    gates.wait_free(0, 5.0)
    assert sender.stats.rejected_messages == 1 and sender.stats.late_answers == 2


def test_done_after_every_layer_acked_and_verdict_sent(sender_rig):
    sender, gates, fake = sender_rig
    for layer in range(L):
        gates.wait_free(layer % S, 5.0)
        sender.publish_layer(layer, layer % S, SRC, finished=["a"] if layer == L - 1 else [])
        b = fake.recv()
        assert b.finished == (["a"] if layer == L - 1 else [])
        fake.send(ReadDone(version=V, batch_id=b.batch_id, layer=layer))
    assert sender.wait(["a"], 5.0)["a"].state is TransferState.DONE
    v = fake.recv()
    assert isinstance(v, TransferVerdict) and v.ok


def test_close_releases_open_gates_and_aborts(sender_rig):
    sender, gates, fake = sender_rig
    sender.publish_layer(0, 0, SRC)
    sender.publish_layer(1, 1, SRC)
    assert len(gates.busy_slots()) == 2
    sender.close()
    assert gates.busy_slots() == []
    with pytest.raises(GateError, match="closed"):
        gates.wait_free(0, 0.1)
    assert sender.status("a").state is TransferState.FAILED


def test_publish_argument_checks(sender_rig):
    sender, gates, fake = sender_rig
    with pytest.raises(ValueError, match="main source blocks"):
        sender.publish_layer(0, 0, {"a": SourceBlocks([0, 1], [4, 5])})
    with pytest.raises(ValueError, match="finished after 1 of 4"):
        sender.publish_layer(0, 0, SRC, finished=["a"])
    with pytest.raises(KeyError):
        sender.publish_layer(0, 0, {"b": SourceBlocks([0], [1])})
    assert gates.busy_slots() == []  # nothing half-published


# ------------------------------------------------------------------ decode deadline and retries
def test_decode_fails_stalled_transfer_after_deadline(engines):
    pe, de = engines
    port = free_port()
    dec, pre = decode_side(de), prefill_side(pe)
    released = []
    recv = DecodeReceiver(
        cfg(port, layer_timeout_s=0.3), d_tp=1, d_rank=0, layout=dec.layout, engine=de, on_release=released.append
    )
    recv.expect(RequestDestination("a", (5, 9, 2), (7, 1, 3)))
    recv.start()
    peer = RawPeer(port)
    try:
        peer.send(handshake_msg(pre, pe))
        assert peer.recv().accepted
        time.sleep(0.5)
        assert recv.status("a").state is TransferState.PENDING  # no deadline before transfer starts
        peer.send(batch(0, [rr()]))
        assert isinstance(peer.recv(), ReadDone)
        # the event: the deadline fails the request (identified by its message), however late
        assert wait_until(lambda: recv.status("a").state is TransferState.FAILED, 30.0)
        assert "no transfer progress for 0.300s" in recv.status("a").reason
        assert len(released) == 1 and recv.stats.deadline_failures == 1
    finally:
        peer.close()
        recv.close()
        dec.close()
        pre.close()


@contextlib.contextmanager
def accepted_peer(engines, engine, on_release=None, **cfg_kw):
    """A started decode receiver over ``engine`` with request ``a`` expected, and a raw prefill
    peer whose handshake it accepted: ``(receiver, peer, destination)``."""
    pe, de = engines
    port = free_port()
    dec, pre = decode_side(de), prefill_side(pe)
    recv = DecodeReceiver(
        cfg(port, **cfg_kw), d_tp=1, d_rank=0, layout=dec.layout, engine=engine, on_release=on_release
    )
    dest = RequestDestination("a", (5, 9, 2), (7, 1, 3))
    recv.expect(dest)
    recv.start()
    peer = RawPeer(port)
    try:
        peer.send(handshake_msg(pre, pe))
        assert peer.recv().accepted
        yield recv, peer, dest
    finally:
        peer.close()
        recv.close()
        dec.close()
        pre.close()


def test_bounded_read_retries(engines):
    from sglang_ascend_offload.testing.pd_faults import FaultInjector, FaultPlan, FaultyEngine

    for fails, ok in ((1, True), (2, False)):
        inj = FaultInjector(FaultPlan(fail_reads=fails))
        with accepted_peer(engines, FaultyEngine(engines[1], inj), read_retries=1) as (recv, peer, _):
            peer.send(batch(0, [rr()]))
            ans = peer.recv()
            assert isinstance(ans, ReadDone if ok else ReadFailed)
            assert inj.injected["fail_read"] == fails
            assert recv.stats.read_retries == 1
            if not ok:
                assert "after 2 attempt(s)" in ans.reason


class RaisingEngine:
    """An engine adapter with a bug: its read raises something other than EngineReadError."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, *args):
        raise RuntimeError("adapter bug")


def test_a_read_that_raises_fails_the_request_and_releases_its_destination(engines):
    released = []
    with accepted_peer(engines, RaisingEngine(engines[1]), on_release=released.append) as (recv, peer, dest):
        peer.send(batch(0, [rr()]))
        ans = peer.recv()
        assert isinstance(ans, ReadFailed) and "adapter bug" in ans.reason
        st = recv.status("a")
        assert st.state is TransferState.FAILED and "internal error during the read" in st.reason
        assert released == [dest]  # not leased forever by a read that never finished cleanly
        assert recv.unreleased_failed() == []


def test_expect_validates_destination(rig):
    r = rig
    with pytest.raises(ValueError, match="already expected"):
        r.recv.expect(r.dest)
    with pytest.raises(ValueError, match="outside the host pool"):
        r.recv.expect(RequestDestination("x", (99,), (1,)))
    with pytest.raises(ValueError, match="indexer blocks for"):
        r.recv.expect(RequestDestination("y", (1, 2), (1,)))
    with pytest.raises(ValueError, match="repeated"):
        r.recv.expect(RequestDestination("z", (1, 1), (2, 3)))


@pytest.mark.parametrize("sender_rig", [30.0], indirect=True)
def test_fuzzed_answers_never_release_a_gate(sender_rig):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sender, gates, fake = sender_rig
    sender.publish_layer(0, 0, SRC)
    b = fake.recv()

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=120))
    def feed(blob):
        try:
            msg = decode_message(blob)
        except Exception:
            msg = None
        if msg is not None:
            return  # a well-formed message (answer, Rejected) is not junk
        fake.send(blob)

    feed()
    time.sleep(0.1)
    assert gates.pending(0) == {"pd_read"}  # junk never releases the slot
    assert sender.endpoint.alive and sender.endpoint.handler_errors == 0
    assert sender.stats.read_done == 0 and sender.stats.read_failed == 0
    fake.send(ReadDone(version=V, batch_id=b.batch_id, layer=0))  # the real answer still works
    gates.wait_free(0, 5.0)


# ------------------------------------------------------------------ channel
def test_dealer_queues_until_the_decode_is_up_and_delivers_on_close():
    """Messages sent before the decode listens arrive once it does, in order, even when the
    sender closes right away (the abort verdicts after a handshake timeout)."""
    from sglang_ascend_offload.transfer.channel import ControlEndpoint

    port = free_port()
    dealer = ControlEndpoint("dealer", "127.0.0.1", port, expect=(MetaAck,), on_message=lambda p, m: None)
    dealer.start()
    try:
        for i in range(3):
            dealer.send(TransferVerdict(version=V, request_ids=[f"r{i}"], ok=False, reason="aborted"))
        time.sleep(0.1)  # several connection attempts fail meanwhile
        fake = FakeDecode(port)
        closer = threading.Thread(target=dealer.close)
        closer.start()  # close waits (bounded) for the queue to drain
        got = [fake.recv(5.0) for _ in range(3)]
        closer.join(5.0)
        assert [m.request_ids for m in got] == [["r0"], ["r1"], ["r2"]]
        assert not closer.is_alive() and dealer.sent == 3 and dealer.dropped == 0
    finally:
        dealer.close()
        fake.close()
