"""Decode side: one :class:`~sglang_ascend_offload.transfer.decode_side.DecodeReceiver` per TP rank.

The receiver listens on ``kv_port + dp_rank * d_tp + d_rank`` and pulls every layer
of a request into its destination: SGLang's pages of the request, which are
host-pool page blocks for the main KV when the pool is the sparse-decode-offload
pool (``host_rows``: no device copy of the main KV is ever made) or device pool
pages otherwise (``split``), and device index-K pages for the indexer.

:class:`DecodeSink` maps SGLang's bootstrap rooms onto the receiver's request ids
and keeps what SGLang's receiver needs: the request's state, whether a failed
request's destination is *released* (no read is still writing into it — SGLang
may free those pages only then), and a claim once SGLang takes a done request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional, Sequence, Set

from .. import config as cfg
from . import pool_layouts as layouts
from .advert import ADVERT_VERSION, DecodeAdvert
from .decode_side import DecodeReceiver
from .destinations import RequestDestination
from .engine import TransferEngine
from .errors import RequestFailed, TopologyError, TransferError
from .publisher import unit_id
from .status import RequestStatus, TransferState
from .topology import PDTopology, decode_port

logger = logging.getLogger(__name__)


class DecodeSink:
    """The P/D destination side of one decode TP rank (see module doc). Thread-safe.

    config: the P/D config (``host`` / ``kv_port`` are where this rank listens);
    d_tp / d_rank / dp_rank: attention TP size, rank and attention DP rank;
    pool: the rank's KV pool (the plugin's ``HostMainKVPool`` or
    ``DeviceDSAPool``); engine: the started engine (the destinations are
    registered here); draft_pool: the speculative draft model's device pool, whose
    layers arrive after the base layers (``None`` without speculation).

    With ``d_tp > 1`` the pool's main KV must be TP-shared (this rank pulls only its
    range of each request, the other ranks pull theirs into the same memory): a
    per-rank pool raises :class:`~.pool_layouts.LayoutError` before anything is
    registered or listened on.
    """

    def __init__(
        self,
        config: cfg.PDTransferConfig,
        *,
        d_tp: int,
        d_rank: int,
        dp_rank: int,
        pool: Any,
        engine: TransferEngine,
        draft_pool: Any = None,
    ):
        self.main_kv = layouts.main_kv_placement(pool)
        try:
            PDTopology(d_tp, d_tp).check_main_kv(self.main_kv)
        except TopologyError as exc:
            raise layouts.LayoutError(f"P/D decode rank {d_rank}: {exc}") from None
        if draft_pool is not None and d_tp > 1:
            # the draft layer's main KV is per-rank device memory, but with d_tp > 1 each
            # rank pulls only its range of a request's main KV (into the shared host pool)
            raise layouts.LayoutError(
                f"P/D decode rank {d_rank}: a speculative draft (NextN) layer is received "
                f"with decode attention TP 1 only (this server has {d_tp}); serve the "
                "decode with --tp 1 per attention-DP group, or without speculation"
            )
        self.draft_layers = draft_pool.layer_num if draft_pool is not None else 0
        #: the index-K cache's dtype (the sparse decode pool's int8 LIM-C8 cache: keys + scales)
        self.indexer_dtype = getattr(pool, "indexer_dtype", "bf16")
        tensors = layouts.destination_tensors(pool, draft_pool)
        self.config = config
        self.kind = layouts.layout_kind(pool)
        self.layout = layouts.layout_of(pool, tensors)
        self.engine = engine
        self.d_tp, self.d_rank, self.dp_rank = d_tp, d_rank, dp_rank
        self.port = decode_port(config.kv_port, dp_rank, d_rank, d_tp)
        self._regions = layouts.tensors_regions(tensors)
        engine.register(self._regions)
        self._lock = threading.Lock()
        self._released: Set[str] = set()
        self._claimed: Set[str] = set()
        self._prefill_done_at = {}
        self.receiver = DecodeReceiver(
            config,
            d_tp=d_tp,
            d_rank=d_rank,
            layout=self.layout,
            engine=engine,
            dp_rank=dp_rank,
            on_release=self._on_release,
        ).start()
        logger.info(
            "P/D decode rank %d of %d listening on %s:%d (%s destinations, %s main KV%s)",
            d_rank,
            d_tp,
            config.host,
            self.port,
            self.kind,
            self.main_kv,
            f", {self.draft_layers} draft layer(s) on the device" if self.draft_layers else "",
        )

    def advert(self) -> DecodeAdvert:
        return DecodeAdvert(
            version=ADVERT_VERSION,
            host=self.config.host,
            control_port=self.port,
            kv_port=self.config.kv_port,
            dp_rank=self.dp_rank,
            d_tp=self.d_tp,
            d_rank=self.d_rank,
            engine=self.engine.name,
            data_protocol=self.engine.data_protocol,
            layout_kind=self.kind,
            main_kv=self.main_kv,
            draft_layers=self.draft_layers,
            indexer_dtype=self.indexer_dtype,
        )

    def _on_release(self, dest: RequestDestination) -> None:
        with self._lock:
            self._released.add(dest.request_id)

    # ------------------------------------------------------------------ per request
    def expect(self, room: int, pages: Sequence[int]) -> None:
        """Register ``room``'s destination: its pages (main and indexer use the same page ids)."""
        pages = tuple(int(p) for p in pages)
        rid = unit_id(room)
        with self._lock:
            self._released.discard(rid)
            self._claimed.discard(rid)
            self._prefill_done_at.pop(rid, None)
        self.receiver.expect(RequestDestination(rid, pages, pages if self.layout.indexer is not None else ()))

    def status(self, room: int) -> Optional[RequestStatus]:
        """``None`` for a room never expected (or already claimed / forgotten)."""
        try:
            return self.receiver.status(unit_id(room))
        except KeyError:
            return None

    def claimed(self, room: int) -> bool:
        with self._lock:
            return unit_id(room) in self._claimed

    def released(self, room: int) -> bool:
        with self._lock:
            return unit_id(room) in self._released

    def claim(self, room: int) -> None:
        rid = unit_id(room)
        self.receiver.claim(rid)
        with self._lock:
            self._claimed.add(rid)

    def note_prefill_done(self, room: int) -> float:
        """SGLang says prefill finished the request: when it first said so (monotonic)."""
        rid = unit_id(room)
        with self._lock:
            return self._prefill_done_at.setdefault(rid, time.monotonic())

    def fail(self, room: int, reason: str) -> None:
        """Fail a pending request (its destination is released once no read writes into it)."""
        self.receiver.forget(unit_id(room), reason)

    def wait_released(self, room: int, timeout_s: float) -> bool:
        """After :meth:`fail`: wait (bounded) until no read writes into the destination."""
        rid = unit_id(room)
        deadline = time.monotonic() + timeout_s
        while True:
            if rid not in self.receiver.unreleased_failed():
                break
            if time.monotonic() >= deadline:
                logger.error(
                    "P/D decode rank %d: a read into request %s's pages is still running after %.1fs",
                    self.d_rank,
                    room,
                    timeout_s,
                )
                return False
            time.sleep(0.005)
        self.receiver.forget(rid)  # drops the record once drained
        return True

    def forget(self, room: int, reason: str) -> bool:
        """SGLang is done with ``room``: fail it if pending, wait until no read is in flight."""
        rid = unit_id(room)
        with self._lock:
            claimed = rid in self._claimed
            self._claimed.discard(rid)
            self._released.discard(rid)
            self._prefill_done_at.pop(rid, None)
        if claimed:
            return True
        self.receiver.forget(rid, reason)
        return self.wait_released(room, self.config.layer_timeout_s)

    def failure_reason(self, room: int) -> Optional[str]:
        st = self.status(room)
        return st.reason if st is not None and st.state is TransferState.FAILED else None

    def close(self) -> None:
        """Stop the receiver (pending requests fail) and unregister the destinations."""
        self.receiver.close()
        self.engine.unregister([addr for addr, _ in self._regions])


def claim_or_reason(sink: DecodeSink, room: int) -> Optional[str]:
    """Claim a done request; the failure reason if it cannot be claimed (tests, tools)."""
    try:
        sink.claim(room)
        return None
    except RequestFailed as exc:
        return exc.reason
    except TransferError as exc:
        return str(exc)
