"""The hot-buffer plan: every number about sparse decode's device hot buffers, in one place.

A server with sparse decode offload keeps, per target layer, one hot buffer row per
request slot on the device (:class:`~.hot_buffer.HotBuffers`) and one residency table
row beside it (``ops/contract.ResidencyTable``). How many rows, how many slots each,
and what they cost is decided here, once, by :class:`HotBufferPlan`; the startup
memory check, the device-budget split, the pool allocation, ``check-config`` and
``capacity`` read it (none of them counts rows or resolves ``hot_tokens`` itself).

In -> out:

==============================================  ==================================================
in                                              out
==============================================  ==================================================
``hot_tokens`` as configured (``None`` =        ``hot_tokens``: slots per layer and hot row
default), top-k, page size                      (:func:`resolve_hot_tokens`, the one default)
verify rows, top-k, ``hot_tokens``              ``overflow_slots`` per hot row (:func:`overflow_slots`)
target layers, main-KV row width                bytes of one hot row: hot buffer + residency table
                                                (all layers) + overflow area (one layer's worth)
running requests, P/D pre-allocation slots      ``req_slots``, ``hot_rows`` and their device bytes
==============================================  ==================================================

Which rows:

=================  ==========================================================================
``req_slots``      SGLang's request slots, the ``req_to_token`` rows: the running requests,
                   a P/D decode's pre-allocation slots and SGLang's padding row 0
``hot_rows``       the engine's hot-buffer rows: one per request slot (a request's row is its
                   ``req_to_token`` row) plus the engine's sink row that padded batch entries
                   read (:attr:`~.hot_buffer.HotBuffers.sink_row`)
``verify_rows``    query rows per request in a decode step (speculative verify rows, 1 without
                   speculation); they share their request's hot row, so they add no rows
=================  ==========================================================================

Speculative verify rows share their request's hot row, sized as plain decode's
(``2 x top-k``): the union of a request's rows' top-k is far below its bound ``verify
rows x top-k`` (measured: ``docs/sparse_decode.md``, "The union on real traces"). A round
whose union does not fit is served exactly through the **overflow area**
(``overflow.py``): ``overflow_slots`` rows per hot row, one area for all layers (they
run one after another), so it costs one layer's worth, not ``layers``.

Engine-agnostic: no torch, no SGLang; the SGLang adapter builds the plan from SGLang's
objects (``sglang_plugin/mem_cache/sizing/sparse_decode.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Optional

__all__ = [
    "HotBufferPlan",
    "PADDING_REQ_SLOTS",
    "SINK_ROWS",
    "HOT_ELEMENT_BYTES",
    "RESIDENCY_BYTES_PER_SLOT",
    "RESIDENCY_BYTES_PER_ROW",
    "default_hot_tokens",
    "required_hot_tokens",
    "least_hot_tokens",
    "overflow_slots",
    "pre_alloc_slots",
    "resolve_hot_tokens",
    "round_to_page",
    "verify_rows",
]

#: SGLang's request pool keeps row 0 for padded batch entries (``ReqToTokenPool``).
PADDING_REQ_SLOTS = 1
#: The engine's sink row, read by the padding entries of a batch (``HotBuffers``).
SINK_ROWS = 1
#: Hot buffers hold bf16 main-KV rows (the offload serves a bf16 main KV only).
HOT_ELEMENT_BYTES = 2
#: Residency table per slot: ``slot_token`` int32 + ``slot_stamp`` int64.
RESIDENCY_BYTES_PER_SLOT = 4 + 8
#: Residency table per row: ``row_req`` int64.
RESIDENCY_BYTES_PER_ROW = 8
#: The default hot buffer holds this many times top-k (verify rows or not).
DEFAULT_TOP_K_FACTOR = 2
#: Overflow-area rows per hot row are a multiple of this (the flat views attention reads
#: stay a multiple of the NPU attention rung's 16-row blocks).
OVERFLOW_ALIGN = 16


# ------------------------------------------------------------------ hot_tokens: the rules
def verify_rows(speculative_algorithm: Any, num_draft_tokens: Optional[int]) -> int:
    """Query rows per request in a decode step: SGLang's ``speculative_num_draft_tokens``
    with a speculative algorithm, else 1. Every reader of the verify-row count (the
    deployment facts, the launch checks, the running server) goes through here."""
    if not speculative_algorithm or not num_draft_tokens:
        return 1
    return int(num_draft_tokens)


def pre_alloc_slots(role: Optional[str], decode_extra_slots: Optional[int]) -> int:
    """Request slots SGLang adds for requests in transfer: on a P/D decode (``role``
    ``"decode"``: SGLang's ``disaggregation_mode``, the deployment's ``pd_role``) its
    ``--disaggregation-decode-extra-slots``, else 0."""
    return int(decode_extra_slots or 0) if role == "decode" else 0


def round_to_page(tokens: int, page_size: Optional[int]) -> int:
    """``tokens`` rounded up to a multiple of ``page_size`` (``None``: no rounding)."""
    page = page_size or 1
    return -(-int(tokens) // page) * page


def required_hot_tokens(top_k: int) -> int:
    """The fewest slots a hot row may have: one row's top-k must fit (``top_k``). With
    speculative verify rows a round whose union is larger overflows (:func:`overflow_slots`)."""
    return int(top_k)


def least_hot_tokens(top_k: int, page_size: Optional[int]) -> int:
    """The smallest valid ``hot_tokens``: :func:`required_hot_tokens` rounded up to the page size."""
    return round_to_page(required_hot_tokens(top_k), page_size)


def default_hot_tokens(top_k: int, page_size: Optional[int]) -> int:
    """``hot_tokens`` when the config leaves it unset: ``2 x top_k`` rounded up to a
    multiple of ``page_size``, with or without speculative verify rows."""
    return round_to_page(DEFAULT_TOP_K_FACTOR * int(top_k), page_size)


def resolve_hot_tokens(configured: Optional[int], top_k: int, page_size: Optional[int]) -> int:
    """The configured ``hot_tokens``, or :func:`default_hot_tokens`. The only place a
    default is chosen; whether a configured value is valid is the config rules' to say."""
    if configured is not None:
        return int(configured)
    return default_hot_tokens(top_k, page_size)


def overflow_slots(top_k: int, hot_tokens: int, verify_rows: int) -> int:
    """Overflow-area rows per hot row: what the union of a request's ``verify_rows`` rows'
    top-k can hold beyond ``hot_tokens``, ``verify_rows x top_k - hot_tokens`` rounded up
    to :data:`OVERFLOW_ALIGN` (0 when every union fits: one row, or a buffer that large)."""
    beyond = max(0, int(verify_rows) * int(top_k) - int(hot_tokens))
    return round_to_page(beyond, OVERFLOW_ALIGN) if beyond else 0


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class HotBufferPlan:
    """The hot buffers and residency tables of one engine (one DP rank's TP rank; TP
    ranks of a DP rank each hold the same).

    layers: target layers with a hot buffer (the pool's layers; a NextN draft layer
    keeps its KV on the device and has none). row_dim: elements of one main-KV row
    (``kv_lora_rank + qk_rope_head_dim``, e.g. 576). top_k: the indexer's top-k.
    hot_tokens: slots per layer and hot row, resolved (:func:`resolve_hot_tokens`).
    verify_rows: query rows per request sharing its hot row. running_requests: the
    requests that run at once (SGLang's ``max_running_requests`` per worker).
    pre_alloc_slots: a P/D decode's extra request slots for requests in transfer
    (SGLang's ``disaggregation_decode_extra_slots``; 0 elsewhere).

    Device tensors per layer: hot buffer bf16 ``[hot_rows, hot_tokens, row_dim]``;
    residency table ``slot_token`` int32 ``[hot_rows, hot_tokens]``, ``slot_stamp``
    int64 ``[hot_rows, hot_tokens]``, ``row_req`` int64 ``[hot_rows]`` (the contract's
    table: a policy's extra state and the CPU kernel's derived maps are not in it). Once,
    for all layers: the overflow area bf16 ``[hot_rows, overflow_slots, row_dim]`` (none
    when ``verify_rows x top_k <= hot_tokens``).
    """

    layers: int
    row_dim: int
    top_k: int
    hot_tokens: int
    verify_rows: int
    running_requests: int
    pre_alloc_slots: int = 0

    def __post_init__(self) -> None:
        low = {
            name: getattr(self, name)
            for name in ("layers", "row_dim", "top_k", "hot_tokens", "verify_rows", "running_requests")
            if getattr(self, name) < 1
        }
        if low or self.pre_alloc_slots < 0:
            raise ValueError(f"HotBufferPlan: {low or {}} must be >= 1, pre_alloc_slots >= 0; got {self}")

    @classmethod
    def build(
        cls,
        *,
        configured_hot_tokens: Optional[int],
        top_k: int,
        page_size: Optional[int],
        verify_rows: int,
        layers: int,
        row_dim: int,
        running_requests: int,
        pre_alloc_slots: int = 0,
    ) -> "HotBufferPlan":
        """The plan for a config's ``hot_tokens`` (``None`` = the default), the model shape
        and the server's concurrency."""
        return cls(
            layers=int(layers),
            row_dim=int(row_dim),
            top_k=int(top_k),
            hot_tokens=resolve_hot_tokens(configured_hot_tokens, top_k, page_size),
            verify_rows=int(verify_rows),
            running_requests=int(running_requests),
            pre_alloc_slots=int(pre_alloc_slots),
        )

    def with_running_requests(self, running_requests: int) -> "HotBufferPlan":
        return replace(self, running_requests=int(running_requests))

    # -------------------------------------------------------------- rows
    @property
    def req_slots(self) -> int:
        """SGLang's request slots (``req_to_token`` rows): running + pre-allocation + padding."""
        return self.running_requests + self.pre_alloc_slots + PADDING_REQ_SLOTS

    @property
    def hot_rows(self) -> int:
        """Hot-buffer rows of the engine: one per request slot + the sink row."""
        return self.req_slots + SINK_ROWS

    @property
    def fixed_hot_rows(self) -> int:
        """Hot rows that do not serve a running request: pre-allocation, padding, sink."""
        return self.hot_rows - self.running_requests

    @property
    def overflow_slots(self) -> int:
        """Overflow-area rows per hot row (:func:`overflow_slots`; 0 = no area)."""
        return overflow_slots(self.top_k, self.hot_tokens, self.verify_rows)

    # -------------------------------------------------------------- bytes
    @property
    def hot_bytes_per_row(self) -> int:
        """Hot buffer of one hot row over all layers: ``layers x hot_tokens x row_dim x 2``."""
        return self.layers * self.hot_tokens * self.row_dim * HOT_ELEMENT_BYTES

    @property
    def residency_bytes_per_row(self) -> int:
        """Residency table of one hot row over all layers: ``layers x (hot_tokens x 12 + 8)``."""
        return self.layers * (self.hot_tokens * RESIDENCY_BYTES_PER_SLOT + RESIDENCY_BYTES_PER_ROW)

    @property
    def overflow_bytes_per_row(self) -> int:
        """Overflow area of one hot row, one layer's worth (the layers share the area):
        ``overflow_slots x row_dim x 2``."""
        return self.overflow_slots * self.row_dim * HOT_ELEMENT_BYTES

    @property
    def device_bytes_per_row(self) -> int:
        """What one more hot row costs on the device: hot buffer + residency table + overflow area."""
        return self.hot_bytes_per_row + self.residency_bytes_per_row + self.overflow_bytes_per_row

    @property
    def hot_buffer_bytes(self) -> int:
        return self.hot_rows * self.hot_bytes_per_row

    @property
    def residency_table_bytes(self) -> int:
        return self.hot_rows * self.residency_bytes_per_row

    @property
    def overflow_bytes(self) -> int:
        return self.hot_rows * self.overflow_bytes_per_row

    @property
    def device_bytes(self) -> int:
        """Every hot row's hot buffer and residency table, all layers, and the overflow area."""
        return self.hot_rows * self.device_bytes_per_row

    @property
    def host_bytes_per_token(self) -> int:
        """Host-pool bytes of one token over all layers (the main KV: ``layers x row_dim x 2``)."""
        return self.layers * self.row_dim * HOT_ELEMENT_BYTES

    def running_requests_fitting(self, device_bytes: int) -> int:
        """How many running requests' hot rows fit ``device_bytes`` next to the fixed
        rows (may be < 1: not even one fits)."""
        return int(device_bytes) // self.device_bytes_per_row - self.fixed_hot_rows

    # -------------------------------------------------------------- words
    def rows_in_words(self) -> str:
        """``"3 hot rows (1 request + 1 padding slot + 1 sink row)"`` and the like."""
        parts = [f"{self.running_requests} request{'s' if self.running_requests != 1 else ''}"]
        if self.pre_alloc_slots:
            parts.append(f"{self.pre_alloc_slots} P/D pre-allocation slots")
        parts += [f"{PADDING_REQ_SLOTS} padding slot", f"{SINK_ROWS} sink row"]
        return f"{self.hot_rows} hot rows ({' + '.join(parts)})"

    def formula(self) -> str:
        """The device bytes as a formula with the numbers (for logs and errors)."""
        shared = f", one per request shared by its {self.verify_rows} verify rows" if self.verify_rows > 1 else ""
        overflow = (
            f" + {self.overflow_slots} overflow rows x {self.row_dim * HOT_ELEMENT_BYTES} B per row (one area "
            "for all layers)"
            if self.overflow_slots
            else ""
        )
        return (
            f"{self.rows_in_words()}{shared} x {self.layers} layers x {self.hot_tokens} hot_tokens x "
            f"({self.row_dim * HOT_ELEMENT_BYTES} B hot buffer + {RESIDENCY_BYTES_PER_SLOT} B residency) "
            f"+ {RESIDENCY_BYTES_PER_ROW} B per row and layer{overflow}"
        )

    def to_dict(self) -> Dict[str, int]:
        """Inputs and derived numbers, JSON-ready (``check-config --json``)."""
        out: Dict[str, int] = asdict(self)
        for name in (
            "req_slots",
            "hot_rows",
            "fixed_hot_rows",
            "hot_bytes_per_row",
            "residency_bytes_per_row",
            "device_bytes_per_row",
            "hot_buffer_bytes",
            "residency_table_bytes",
            "overflow_slots",
            "overflow_bytes_per_row",
            "overflow_bytes",
            "device_bytes",
        ):
            out[name] = getattr(self, name)
        return out
