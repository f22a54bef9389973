"""Wire messages of the P/D transfer control plane (typed, versioned, validated).

Every message is a frozen :mod:`msgspec` struct encoded as a MessagePack map with
a ``kind`` tag; nothing is ever unpickled. Receiving is two steps, both inside
:func:`decode_message`, and a message that fails either is rejected with a
:class:`~.errors.ProtocolError` and never acted on:

1. structural decoding against the union of known kinds: unknown kinds, unknown
   fields, wrong types, negative or oversized values and oversized lists fail here
   (bounds are declared on the fields with ``msgspec.Meta``);
2. semantic validation (:meth:`validate` of each struct): protocol version,
   cross-field consistency (e.g. one base address per layer, unique request ids).

Message flow (prefill rank = DEALER, decode TP rank = ROUTER)::

    prefill                                   decode
      MetaHandshake  ------------------------>  validate vs destination layout
                     <------------------------  MetaAck(accepted, reason)
      ReadReadyBatch (one per layer) -------->  validate, pull via the engine
                     <------------------------  ReadDone | ReadFailed(reason)
      TransferVerdict(ok | abort) ----------->  request terminal on this member
                     <------------------------  Rejected(reason)  (undecodable input)

``TransferVerdict``: decode makes a request schedulable only after every contributor
confirmed it got every READ_DONE before its own deadline, so a read that finished
after prefill gave up (and may have reused the buffer) is never used.
"""

from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Tuple, Union

import msgspec

from .errors import ProtocolError

PROTOCOL_VERSION = 1

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # larger frames are rejected before decoding
MAX_LAYERS = 4096
MAX_TENSORS = 8
MAX_BLOCKS = 1 << 24  # block ids and counts
MAX_LIST = 1 << 20  # block ids in one range
MAX_REQUESTS = 1 << 16  # requests in one batch
MAX_NAME = 256
MAX_REASON = 4096
MAX_TP = 1024

Version = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS)]
Address = Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP)]
TPSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
LayerId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAYERS)]
BatchId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
BlockList = Annotated[List[BlockId], msgspec.Meta(max_length=MAX_LIST)]
RequestIdList = Annotated[List[RequestId], msgspec.Meta(max_length=MAX_REQUESTS)]

TensorRole = Literal["main", "indexer", "indexer_scale"]


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    def validate(self) -> None:
        """Semantic checks beyond the declared field bounds; raises :class:`ProtocolError`."""


class _Message(_Base, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    version: Version

    def validate(self) -> None:
        if self.version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"{type(self).__name__}: unsupported protocol version {self.version} "
                f"(this side speaks {PROTOCOL_VERSION}); run the same "
                "sglang-ascend-offload version on prefill and decode"
            )


# ------------------------------------------------------------------ layout
class TensorSpec(_Base, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One KV tensor of a side, as the peer needs to address it.

    role: ``main`` (latent / rope parts of the MLA main KV), ``indexer`` (lightning
        indexer keys) or ``indexer_scale`` (LIC8 dequant scales; follows the indexer).
    name: identifies the tensor across sides (e.g. ``"latent"``, ``"rope"``).
    block_bytes: bytes of one block of this tensor (the *block length*).
    num_blocks: blocks in each layer's region (valid block ids: ``0..num_blocks-1``).
    layer_base_addrs: per layer this tensor holds, address of block 0 (layers aliasing
        one physical slot share an address). Block ``b`` of layer ``L`` lives at
        ``base(L) + b * block_bytes``.
    layers: the logical layers this tensor holds, ascending, aligned with
        ``layer_base_addrs``; ``None`` (the default, not sent): every layer
        ``0..num_layers-1``. A main tensor may hold a subset: a decode server with sparse
        decode offload keeps its base layers as host rows (``latent_rope``) and the
        draft (NextN) layer on the device as ``latent`` / ``rope`` pages, so the layer
        numbered after the base layers has other main tensors than they do.
    """

    role: TensorRole
    name: Name
    block_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]
    layer_base_addrs: Annotated[List[Address], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    layers: Optional[Annotated[List[LayerId], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]] = None

    def held_layers(self, num_layers: int) -> List[int]:
        """The logical layers this tensor holds (of a layout of ``num_layers``)."""
        return list(range(num_layers)) if self.layers is None else list(self.layers)

    def base(self, layer: int) -> int:
        """Address of block 0 of ``layer`` (which this tensor must hold)."""
        if self.layers is None:
            return self.layer_base_addrs[layer]
        return self.layer_base_addrs[self.layers.index(layer)]

    def address(self, layer: int, block: int) -> int:
        return self.base(layer) + block * self.block_bytes


class KVLayout(_Base, frozen=True, forbid_unknown_fields=True):
    """All KV tensors of one side: main tensors first, then indexer, then its scale.

    block_tokens: tokens per block (both sides must agree).
    """

    num_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
    block_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    tensors: Annotated[List[TensorSpec], msgspec.Meta(min_length=1, max_length=MAX_TENSORS)]

    def validate(self) -> None:
        roles = [t.role for t in self.tensors]
        order = {"main": 0, "indexer": 1, "indexer_scale": 2}
        if roles.count("main") < 1:
            raise ProtocolError("layout has no main tensor")
        if roles.count("indexer") > 1 or roles.count("indexer_scale") > 1:
            raise ProtocolError("layout has more than one indexer / indexer_scale tensor")
        if "indexer_scale" in roles and "indexer" not in roles:
            raise ProtocolError("layout has an indexer_scale tensor but no indexer")
        if [order[r] for r in roles] != sorted(order[r] for r in roles):
            raise ProtocolError("layout tensors must be ordered main..., indexer, indexer_scale")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ProtocolError(f"layout tensor names are not unique: {names}")
        for t in self.tensors:
            if t.layers is not None:
                if t.role != "main":
                    raise ProtocolError(f"tensor {t.name!r}: only main tensors may hold a subset of the layers")
                if list(t.layers) != sorted(set(t.layers)) or t.layers[-1] >= self.num_layers:
                    raise ProtocolError(
                        f"tensor {t.name!r}: layers must be ascending, distinct and below {self.num_layers}"
                    )
            held = self.num_layers if t.layers is None else len(t.layers)
            if len(t.layer_base_addrs) != held:
                raise ProtocolError(f"tensor {t.name!r}: {len(t.layer_base_addrs)} base addresses for {held} layers")
        if any(t.layers is not None for t in self.main):
            held = set()
            for t in self.main:
                held.update(t.held_layers(self.num_layers))
            if len(held) != self.num_layers:
                missing = sorted(set(range(self.num_layers)) - held)
                raise ProtocolError(f"layers {missing[:8]} have no main tensor")

    @property
    def main(self) -> List[TensorSpec]:
        return [t for t in self.tensors if t.role == "main"]

    def main_at(self, layer: int) -> List[TensorSpec]:
        """The main tensors holding ``layer``, in layout order."""
        return [t for t in self.main if t.layers is None or layer in t.layers]

    def main_groups(self) -> List[Tuple[List[int], List[TensorSpec]]]:
        """``[(layers, main tensors)]``: the layers grouped by the main tensors they have
        (one group unless some main tensor holds a subset), in order of first layer."""
        groups: Dict[Tuple[str, ...], Tuple[List[int], List[TensorSpec]]] = {}
        for layer in range(self.num_layers):
            specs = self.main_at(layer)
            groups.setdefault(tuple(t.name for t in specs), ([], specs))[0].append(layer)
        return list(groups.values())

    @property
    def indexer(self) -> Optional[TensorSpec]:
        return next((t for t in self.tensors if t.role == "indexer"), None)

    @property
    def indexer_scale(self) -> Optional[TensorSpec]:
        return next((t for t in self.tensors if t.role == "indexer_scale"), None)


# ------------------------------------------------------------------ messages
class MetaHandshake(_Message, frozen=True, forbid_unknown_fields=True, tag="meta"):
    """Prefill -> decode: who I am, where my per-layer sources live, how they are laid out.

    session: the prefill engine's session id (what decode passes to its reads).
    engine / data_protocol: transfer engine and data path; both sides must match.
    main_tensor_count / has_indexer / has_indexer_scale: stated explicitly and
        cross-checked against ``layout`` (redundant summary fields: a disagreement
        means a broken sender and rejects the handshake).
    layer_timeout_ms: prefill's per-layer deadline (decode bounds its own waits by it).
    """

    session: Name
    engine: Name
    data_protocol: Name
    p_tp: TPSize
    p_rank: Rank
    d_tp: TPSize
    main_tensor_count: Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSORS)]
    has_indexer: bool
    has_indexer_scale: bool
    layer_timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=24 * 3600 * 1000)]
    layout: KVLayout

    def validate(self) -> None:
        super().validate()
        self.layout.validate()
        if self.p_rank >= self.p_tp:
            raise ProtocolError(f"handshake: p_rank {self.p_rank} >= p_tp {self.p_tp}")
        if self.main_tensor_count != len(self.layout.main):
            raise ProtocolError(
                f"handshake: main_tensor_count {self.main_tensor_count} but layout "
                f"has {len(self.layout.main)} main tensors"
            )
        if self.has_indexer != (self.layout.indexer is not None):
            raise ProtocolError("handshake: has_indexer disagrees with the layout")
        if self.has_indexer_scale != (self.layout.indexer_scale is not None):
            raise ProtocolError("handshake: has_indexer_scale disagrees with the layout")


class MetaAck(_Message, frozen=True, forbid_unknown_fields=True, tag="meta_ack"):
    """Decode -> prefill: handshake accepted, or refused with the reason."""

    accepted: bool
    reason: Reason
    d_rank: Rank


class RequestRange(_Base, frozen=True, forbid_unknown_fields=True):
    """One request's share of one layer from one contributor.

    num_blocks: the request's total blocks (decode checks it against its destination).
    main_src_blocks: source block ids (in the prefill layer buffer) of the main share;
        request blocks ``main_offset .. main_offset + len - 1``. Empty unless member 0.
    indexer_src_blocks / indexer_offset: the same for this member's indexer (and
        scale) share.
    """

    request_id: RequestId
    num_blocks: Count
    main_offset: Count
    main_src_blocks: BlockList
    indexer_offset: Count
    indexer_src_blocks: BlockList

    def validate(self) -> None:
        # two plain comparisons (hot path: once per request per layer on both sides)
        n = self.num_blocks
        if self.main_offset + len(self.main_src_blocks) > n:
            self._exceeds("main", self.main_offset, self.main_src_blocks)
        if self.indexer_offset + len(self.indexer_src_blocks) > n:
            self._exceeds("indexer", self.indexer_offset, self.indexer_src_blocks)

    def _exceeds(self, what: str, off: int, blocks: List[int]) -> None:
        raise ProtocolError(
            f"request {self.request_id!r}: {what} range {off}+{len(blocks)} exceeds its {self.num_blocks} blocks"
        )


class ReadReadyBatch(_Message, frozen=True, forbid_unknown_fields=True, tag="ready"):
    """Prefill -> decode: layer ``layer`` is written; pull these ranges.

    member / ratio: the sender's contribution-group index and the TP ratio.
    finished: requests for which this is the last layer the sender publishes.
    """

    batch_id: BatchId
    layer: LayerId
    member: Rank
    ratio: TPSize
    requests: Annotated[List[RequestRange], msgspec.Meta(max_length=MAX_REQUESTS)]
    finished: RequestIdList

    def validate(self) -> None:
        if self.version != PROTOCOL_VERSION:
            _Message.validate(self)  # raises with the version message
        if self.member >= self.ratio:
            raise ProtocolError(f"ready batch: member {self.member} >= ratio {self.ratio}")
        requests = self.requests
        if len(requests) == 1:  # the common case (one request per layer and peer): no sets built
            rid = requests[0].request_id
            if any(f != rid for f in self.finished):
                raise ProtocolError("ready batch: finished requests missing from the batch")
        else:
            ids = {r.request_id for r in requests}
            if len(ids) != len(requests):
                raise ProtocolError("ready batch: duplicate request ids")
            if not ids.issuperset(self.finished):
                raise ProtocolError("ready batch: finished requests missing from the batch")
        for r in requests:
            r.validate()


class ReadDone(_Message, frozen=True, forbid_unknown_fields=True, tag="read_done"):
    """Decode -> prefill: every range of batch ``batch_id`` was pulled."""

    batch_id: BatchId
    layer: LayerId


class ReadFailed(_Message, frozen=True, forbid_unknown_fields=True, tag="read_failed"):
    """Decode -> prefill: batch ``batch_id`` failed for ``request_ids`` (all if empty)."""

    batch_id: BatchId
    layer: LayerId
    reason: Reason
    request_ids: RequestIdList


class TransferVerdict(_Message, frozen=True, forbid_unknown_fields=True, tag="verdict"):
    """Prefill -> decode: final word on requests from this contributor.

    ok=True: every layer got READ_DONE before its deadline (decode may use the data);
    ok=False: the transfer was aborted (deadline, failure, shutdown): invalidate.
    """

    request_ids: RequestIdList
    ok: bool
    reason: Reason


class Rejected(_Message, frozen=True, forbid_unknown_fields=True, tag="rejected"):
    """Either side: your last message could not be decoded or validated."""

    reason: Reason


Message = Union[MetaHandshake, MetaAck, ReadReadyBatch, ReadDone, ReadFailed, TransferVerdict, Rejected]
MESSAGE_TYPES: Tuple[type, ...] = (
    MetaHandshake,
    MetaAck,
    ReadReadyBatch,
    ReadDone,
    ReadFailed,
    TransferVerdict,
    Rejected,
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_message(msg: Message) -> bytes:
    """MessagePack bytes of a message (validated first: we never send what we would reject)."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    msg.validate()
    return _encoder.encode(msg)


def decode_message(data: bytes, expect: Optional[Tuple[type, ...]] = None) -> Message:
    """Decode and validate one received frame; :class:`ProtocolError` on anything wrong.

    expect: the kinds acceptable on this side (e.g. decode accepts only
    handshakes, ready batches and verdicts); others are rejected.
    Never raises anything but :class:`ProtocolError` for any input bytes.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame is {type(data).__name__}, not bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = _decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"malformed message: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as exc:
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from None
    if expect is not None and not isinstance(msg, expect):
        raise ProtocolError(f"unexpected message kind {type(msg).__name__} on this side")
    try:
        msg.validate()
    except ProtocolError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError) as exc:
        raise ProtocolError(f"invalid {type(msg).__name__}: {exc}") from None
    return msg


def message_kind(msg: Message) -> str:
    """The wire tag of a message (``"meta"``, ``"ready"``, ``"read_done"``...)."""
    return type(msg).__struct_config__.tag
