"""What a decode TP rank tells each prefill rank about its P/D endpoint.

SGLang's registration message (``build_receiver_registration_message``: decode ->
prefill, once per connection) is a list of frames that the prefill parses
positionally and whose extra trailing frames it ignores. The decode manager appends
one frame: a MessagePack-encoded :class:`DecodeAdvert`. The prefill manager decodes
it strictly (typed, bounded, versioned, validated; never unpickled); a malformed
advert fails the peer's requests with the reason instead of being used.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec

from .errors import ProtocolError, TopologyError
from .topology import PDTopology

#: 2: ``main_kv`` (where the decode DP rank holds the main KV). 3: ``draft_layers``.
#: 4: ``indexer_dtype``.
ADVERT_VERSION = 4
#: Index of the advert frame in the registration message (SGLang 0.5.23 sends 20 frames).
ADVERT_FRAME_INDEX = 20

#: ``split``: main KV as SGLang's NPU MLA pool (``latent`` + ``rope`` page blocks on the
#: device). ``host_rows``: main KV in the sparse-decode host pool, one 576-wide row per
#: token, so a page is one block of ``page_size * 1152`` bytes (``latent_rope``).
LayoutKind = Literal["split", "host_rows"]
#: ``tp_shared``: one main-KV pool per decode DP rank, shared by its TP ranks (each rank
#: pulls its disjoint range, every rank reads all of it); ``per_rank``: each rank's own pool.
MainKV = Literal["tp_shared", "per_rank"]
#: The decode's index-K cache: ``bf16`` keys, or ``int8`` (LIM-C8: Hadamard-rotated int8
#: keys + one fp16 scale per token, the layout's ``indexer`` + ``indexer_scale`` tensors).
IndexerDtype = Literal["bf16", "int8"]

_Port = Annotated[int, msgspec.Meta(ge=1024, le=65535)]
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=1024)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=1024)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class DecodeAdvert(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One decode TP rank's P/D endpoint.

    host / control_port: where its ``DecodeReceiver`` listens
        (``kv_port + dp_rank * d_tp + d_rank``).
    kv_port: the decode's ``pd_transfer.kv_port`` (base of the control ports).
    dp_rank / d_tp / d_rank: its attention DP rank, attention TP size and rank.
    engine / data_protocol: its transfer engine and data path (must match prefill's).
    layout_kind: how its main-KV destination is laid out (see :data:`LayoutKind`).
    main_kv: whether that destination is shared by the DP rank's TP ranks (see
        :data:`MainKV`); ``d_tp > 1`` needs ``tp_shared``
        (:meth:`~.topology.PDTopology.check_main_kv`).
    draft_layers: the speculative draft (NextN / MTP) layers the decode serves, numbered
        after its base layers; their main KV is always device pages (``latent`` /
        ``rope``, as ``split``), whatever ``layout_kind`` says of the base layers. The
        prefill must serve the same draft layers (it sends them after its base layers).
    indexer_dtype: the dtype of its index-K cache (see :data:`IndexerDtype`); for ``int8``
        the prefill packs its bf16 keys into int8 + scales (``host_rows`` only).
    """

    version: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    host: _Name
    control_port: _Port
    kv_port: _Port
    dp_rank: _Rank
    d_tp: _Size
    d_rank: _Rank
    engine: _Name
    data_protocol: _Name
    layout_kind: LayoutKind
    main_kv: MainKV = "per_rank"
    draft_layers: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    indexer_dtype: IndexerDtype = "bf16"

    def validate(self) -> None:
        if self.version != ADVERT_VERSION:
            raise ProtocolError(
                f"decode advert version {self.version}, this side speaks {ADVERT_VERSION}: "
                "run the same sglang-ascend-offload version on prefill and decode"
            )
        if self.d_rank >= self.d_tp:
            raise ProtocolError(f"decode advert: d_rank {self.d_rank} >= d_tp {self.d_tp}")
        expected = self.kv_port + self.dp_rank * self.d_tp + self.d_rank
        if expected != self.control_port:
            raise ProtocolError(
                f"decode advert: control port {self.control_port} is not kv_port "
                f"{self.kv_port} + dp_rank {self.dp_rank} * d_tp {self.d_tp} + d_rank "
                f"{self.d_rank} = {expected}"
            )
        if self.indexer_dtype == "int8" and self.layout_kind != "host_rows":
            raise ProtocolError(
                "decode advert: an int8 index-K cache is served only by a host_rows (sparse decode offload) decode"
            )
        try:
            PDTopology(self.d_tp, self.d_tp).check_main_kv(self.main_kv)
        except TopologyError as exc:
            raise ProtocolError(f"decode advert: {exc}") from None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DecodeAdvert)


def encode_advert(advert: DecodeAdvert) -> bytes:
    advert.validate()
    return _encoder.encode(advert)


def decode_advert(frame: bytes) -> DecodeAdvert:
    """Decode and validate one advert frame; :class:`ProtocolError` on anything wrong."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) > 4096:
        raise ProtocolError("decode advert frame missing or oversized")
    try:
        advert = _decoder.decode(frame)
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError(f"malformed decode advert: {exc}") from None
    advert.validate()
    return advert


def advert_from_registration(frames) -> Optional[DecodeAdvert]:
    """The advert of an SGLang registration message, ``None`` if it carries none.

    Raises :class:`ProtocolError` when the frame is present but invalid.
    """
    if len(frames) <= ADVERT_FRAME_INDEX:
        return None
    return decode_advert(bytes(frames[ADVERT_FRAME_INDEX]))
