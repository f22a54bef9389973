"""Wire messages: round trip, validation on receipt, and fuzzing of the decoder."""

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ascend_offload.transfer.errors import ProtocolError
from sglang_ascend_offload.transfer.protocol import (
    PROTOCOL_VERSION,
    KVLayout,
    MetaAck,
    MetaHandshake,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    Rejected,
    RequestRange,
    TensorSpec,
    TransferVerdict,
    decode_message,
    encode_message,
    message_kind,
)

V = PROTOCOL_VERSION


def layout(num_layers=2, indexer=True, scale=True):
    t = [
        TensorSpec(
            role="main",
            name="latent",
            block_bytes=64,
            num_blocks=8,
            layer_base_addrs=[0x1000 * (i + 1) for i in range(num_layers)],
        ),
        TensorSpec(
            role="main",
            name="rope",
            block_bytes=16,
            num_blocks=8,
            layer_base_addrs=[0x9000 * (i + 1) for i in range(num_layers)],
        ),
    ]
    if indexer:
        t.append(
            TensorSpec(
                role="indexer",
                name="indexer",
                block_bytes=32,
                num_blocks=8,
                layer_base_addrs=[0x20000 + i for i in range(num_layers)],
            )
        )
    if scale:
        t.append(
            TensorSpec(
                role="indexer_scale",
                name="scale",
                block_bytes=8,
                num_blocks=8,
                layer_base_addrs=[0x30000 + i for i in range(num_layers)],
            )
        )
    return KVLayout(num_layers=num_layers, block_tokens=4, tensors=t)


def handshake(**kw):
    base = dict(
        version=V,
        session="127.0.0.1:1234",
        engine="mooncake",
        data_protocol="tcp",
        p_tp=2,
        p_rank=1,
        d_tp=1,
        main_tensor_count=2,
        has_indexer=True,
        has_indexer_scale=True,
        layer_timeout_ms=1000,
        layout=layout(),
    )
    base.update(kw)
    return MetaHandshake(**base)


def ready(**kw):
    base = dict(
        version=V,
        batch_id=7,
        layer=1,
        member=0,
        ratio=2,
        requests=[
            RequestRange(
                request_id="a",
                num_blocks=3,
                main_offset=0,
                main_src_blocks=[1, 2, 3],
                indexer_offset=0,
                indexer_src_blocks=[4, 5],
            )
        ],
        finished=["a"],
    )
    base.update(kw)
    return ReadReadyBatch(**base)


ALL = [
    handshake(),
    MetaAck(version=V, accepted=False, reason="x", d_rank=0),
    ready(),
    ReadDone(version=V, batch_id=1, layer=0),
    ReadFailed(version=V, batch_id=1, layer=0, reason="boom", request_ids=["a"]),
    TransferVerdict(version=V, request_ids=["a", "b"], ok=True, reason=""),
    Rejected(version=V, reason="bad"),
]


@pytest.mark.parametrize("msg", ALL, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode_message(msg)
    assert decode_message(data) == msg
    assert msgspec.msgpack.decode(data)["kind"] == message_kind(msg)


def raw(msg, **changes):
    d = msgspec.to_builtins(msg)
    d.update(changes)
    return msgspec.msgpack.encode(d)


@pytest.mark.parametrize(
    "data,match",
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
        (msgspec.msgpack.encode({"kind": "exec", "version": 1}), "malformed"),
        (raw(ReadDone(version=V, batch_id=1, layer=0), extra=1), "unknown field"),
        (raw(ReadDone(version=V, batch_id=1, layer=0), batch_id=-1), ">= 0"),
        (raw(ReadDone(version=V, batch_id=1, layer=0), layer="1"), "int"),
        (raw(ReadDone(version=V, batch_id=1, layer=0), version=2), "unsupported protocol version 2"),
        (raw(handshake(), p_rank=2), "p_rank 2 >= p_tp 2"),
        (raw(handshake(), main_tensor_count=3), "main_tensor_count"),
        (raw(handshake(), has_indexer=False), "has_indexer"),
        (raw(handshake(), has_indexer_scale=False), "has_indexer_scale"),
        (raw(handshake(), layout=msgspec.to_builtins(layout(scale=False)) | {"num_layers": 3}), "base addresses"),
        (raw(ready(), member=2), "member 2 >= ratio 2"),
        (raw(ready(), finished=["zzz"]), "finished"),
        (raw(ready(), requests=msgspec.to_builtins(ready().requests) * 2), "duplicate"),
        (raw(ready(), requests=[msgspec.to_builtins(ready().requests[0]) | {"main_offset": 1}]), "exceeds"),
    ],
)
def test_malformed_or_invalid_is_rejected(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_message(data)


def test_layout_rules():
    lay = msgspec.to_builtins(layout())
    bad_order = dict(lay, tensors=list(reversed(lay["tensors"])))
    with pytest.raises(ProtocolError, match="ordered"):
        decode_message(raw(handshake(), layout=bad_order))
    scale_only = dict(lay, tensors=[lay["tensors"][0], lay["tensors"][3]])
    with pytest.raises(ProtocolError, match="no indexer"):
        decode_message(raw(handshake(), layout=scale_only, has_indexer=False))
    no_main = dict(lay, tensors=lay["tensors"][2:])
    with pytest.raises(ProtocolError, match="no main"):
        decode_message(raw(handshake(), layout=no_main, main_tensor_count=1))
    dup = dict(lay, tensors=[lay["tensors"][0], lay["tensors"][0]])
    with pytest.raises(ProtocolError, match="not unique"):
        decode_message(raw(handshake(), layout=dup, has_indexer=False, has_indexer_scale=False))
    with pytest.raises(ProtocolError, match=">= 1"):  # zero address
        t0 = dict(lay["tensors"][0], layer_base_addrs=[0, 1])
        decode_message(raw(handshake(), layout=dict(lay, tensors=[t0] + lay["tensors"][1:])))


def draft_layout(num_layers=3):
    """Base layers 0..n-2 as host rows, the draft layer n-1 as latent / rope pages."""
    base = list(range(num_layers - 1))
    return KVLayout(
        num_layers=num_layers,
        block_tokens=4,
        tensors=[
            TensorSpec(
                role="main",
                name="latent_rope",
                block_bytes=80,
                num_blocks=8,
                layer_base_addrs=[0x1000 * (i + 1) for i in base],
                layers=base,
            ),
            TensorSpec(
                role="main",
                name="latent",
                block_bytes=64,
                num_blocks=8,
                layer_base_addrs=[0x50000],
                layers=[num_layers - 1],
            ),
            TensorSpec(
                role="main",
                name="rope",
                block_bytes=16,
                num_blocks=8,
                layer_base_addrs=[0x60000],
                layers=[num_layers - 1],
            ),
            TensorSpec(
                role="indexer",
                name="indexer",
                block_bytes=32,
                num_blocks=8,
                layer_base_addrs=[0x20000 + i for i in range(num_layers)],
            ),
        ],
    )


def test_layers_held_by_a_subset_of_main_tensors():
    lay = draft_layout()
    hs = handshake(layout=lay, main_tensor_count=3, has_indexer_scale=False)
    got = decode_message(encode_message(hs))
    assert got == hs and got.layout.main_at(2)[0].address(2, 3) == 0x50000 + 3 * 64
    assert got.layout.main_at(1)[0].address(1, 2) == 0x2000 + 2 * 80
    assert [g[0] for g in got.layout.main_groups()] == [[0, 1], [2]]
    # a layout without subsets is sent without the field (wire format of whole-layer layouts unchanged)
    assert b"\xa6layers" not in encode_message(handshake()) and b"\xa6layers" in encode_message(hs)
    wire = msgspec.to_builtins(lay)

    def refused(tensors, match, **kw):
        with pytest.raises(ProtocolError, match=match):
            decode_message(raw(hs, layout=dict(wire, tensors=tensors), **kw))

    t = wire["tensors"]
    refused([t[0], t[3]], r"layers \[2\] have no main tensor", main_tensor_count=1)
    refused([dict(t[0], layers=[1, 0]), *t[1:]], "ascending")
    refused([dict(t[0], layers=[0, 3]), *t[1:]], "below 3")
    refused([dict(t[0], layers=[0]), *t[1:]], "2 base addresses for 1 layers")
    refused([*t[:3], dict(t[3], layers=[0, 1, 2])], "only main tensors")


def test_expect_filters_kinds_per_side():
    data = encode_message(ReadDone(version=V, batch_id=1, layer=0))
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode_message(data, expect=(MetaHandshake, ReadReadyBatch))
    assert decode_message(data, expect=(ReadDone,))


def test_encoder_refuses_what_a_peer_would_reject():
    with pytest.raises(ProtocolError):
        encode_message(ready(member=5))
    with pytest.raises(TypeError):
        encode_message({"kind": "read_done"})


def test_oversized_frame_rejected_before_decoding(monkeypatch):
    from sglang_ascend_offload.transfer import protocol

    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 16)
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode_message(encode_message(ReadDone(version=V, batch_id=1, layer=0)))


# ------------------------------------------------------------------ fuzzing
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes_never_crash(data):
    try:
        msg = decode_message(data)
    except ProtocolError:
        return
    assert message_kind(msg)  # whatever decodes is a fully valid message


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=8,
)
field_names = st.sampled_from(
    [
        "kind",
        "version",
        "batch_id",
        "layer",
        "member",
        "ratio",
        "requests",
        "finished",
        "reason",
        "request_ids",
        "ok",
        "accepted",
        "d_rank",
        "layout",
        "session",
        "num_blocks",
        "main_offset",
        "main_src_blocks",
    ]
)
kinds = st.sampled_from(["meta", "meta_ack", "ready", "read_done", "read_failed", "verdict", "rejected", "x"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds, st.dictionaries(field_names, msgpack_values, max_size=8), st.data())
def test_fuzz_structured_messages_never_crash(kind, fields, data):
    payload = dict(fields, kind=kind)
    if data.draw(st.booleans()):
        payload["version"] = V
    encoded = msgspec.msgpack.encode(payload)
    cut = data.draw(st.integers(0, len(encoded)))
    for blob in (encoded, encoded[:cut]):
        try:
            decode_message(blob)
        except ProtocolError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALL), st.data())
def test_fuzz_mutated_valid_messages(msg, data):
    blob = bytearray(encode_message(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    try:
        out = decode_message(bytes(blob))
    except ProtocolError:
        return
    out.validate()  # anything accepted passed every check
