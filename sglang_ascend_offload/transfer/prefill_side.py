"""Prefill TP rank: publish each written layer, gate its slot on decode's answer.

One :class:`PrefillSender` per prefill TP rank; it talks to exactly one decode TP
rank (``d_rank = p_rank // ratio``) as member ``p_rank % ratio`` of that rank's
contribution group.

Lifecycle:

1. :meth:`handshake` sends the source layout (per-layer base addresses of the
   layer buffers, block bytes, tensor group, indexer / scale presence) and waits
   for the decode's acceptance, at most ``handshake_timeout_s`` (100 s default);
2. :meth:`add_request` per request with its block count;
3. after a layer's KV is written into physical slot ``slot``,
   :meth:`publish_layer` computes this rank's share of every live request,
   opens the slot's gate for consumer ``consumer`` (unless the caller's pipeline
   already did, ``begin_gate=False``) and sends the ready batch;
4. READ_DONE releases the gate; READ_FAILED releases it with the error and fails
   the named requests; no answer within ``layer_timeout_s`` releases it with a
   timeout error and fails the batch's requests (no wait on a live peer is unbounded);
5. a request whose every layer got READ_DONE is ``done`` and decode is told so
   (positive :class:`~.protocol.TransferVerdict`); a failed one is aborted at
   decode (negative verdict) so decode never uses a destination read from a
   buffer prefill may already have reused.

:meth:`close` releases every gate still open (with an error) and aborts every
pending request: nothing is left locked on any exit path.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from ..config import PDTransferConfig
from ..layerwise_prefill.gates import SlotGates
from .channel import ControlEndpoint, SendFilter
from .engine import TransferEngine
from .errors import HandshakeError, HandshakeTimeout, TransferError
from .protocol import (
    PROTOCOL_VERSION,
    KVLayout,
    MetaAck,
    MetaHandshake,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    Rejected,
    RequestRange,
    TransferVerdict,
)
from .stages import PREFILL_STAMPS, StageLog, trace_from_env
from .status import DONE, PENDING, RequestStatus, TransferState
from .topology import PDTopology, decode_port

logger = logging.getLogger(__name__)

PD_CONSUMER = "pd_read"
_NONE: frozenset = frozenset()


@dataclass(frozen=True)
class SourceBlocks:
    """Where a request's blocks sit in the layer buffer, in request block order.

    main_blocks: block ids in the main tensors; indexer_blocks: in the indexer
    (and scale) tensors, same length, or empty when there is no indexer.
    """

    main_blocks: Sequence[int]
    indexer_blocks: Sequence[int] = ()


@dataclass
class PrefillStats:
    """Counters of one prefill rank; ``answer_seconds`` sums publish -> answer latency."""

    batches: int = 0
    read_done: int = 0
    read_failed: int = 0
    timeouts: int = 0
    late_answers: int = 0
    rejected_messages: int = 0
    answer_seconds: float = 0.0
    requests_done: int = 0
    requests_failed: int = 0


# prefill's reader: no spin by default (the answer follows an engine read, and the spin would take
# the GIL from the forward running on the scheduler thread)
PREFILL_SPIN_US = 0.0
TIMING_SAMPLES = 4096  # per-batch latencies kept for percentiles (most recent)


class BatchTiming(NamedTuple):
    """One answered batch: publish_layer entry -> answer handled on this rank, in seconds."""

    batch_id: int
    layer: int
    seconds: float


@dataclass
class _Batch:
    batch_id: int
    layer: int
    slot: int
    request_ids: List[str]
    sent_at: float
    deadline: float


@dataclass
class _Req:
    num_blocks: int
    state: TransferState = TransferState.PENDING
    reason: str = ""
    published: Set[int] = field(default_factory=set)
    acked: Set[int] = field(default_factory=set)
    finished: bool = False
    #: this rank's share: (main offset, main count, indexer offset, indexer count); fixed per request
    shares: Tuple[int, int, int, int] = (0, 0, 0, 0)


class PrefillSender:
    """Publishes layers of one prefill TP rank to its decode TP rank.

    layout: this rank's sources (per-layer base addresses of the layer buffers),
        registered with ``engine``.
    gates: the per-physical-slot gates shared with layerwise prefill reuse.
    decode_host / decode_dp_rank: where the decode rank listens (its control port
        follows from ``config.kv_port``).
    """

    def __init__(
        self,
        config: PDTransferConfig,
        *,
        p_tp: int,
        d_tp: int,
        p_rank: int,
        layout: KVLayout,
        engine: TransferEngine,
        gates: SlotGates,
        decode_host: str,
        decode_dp_rank: int = 0,
        consumer: str = PD_CONSUMER,
        begin_gate: bool = True,
        send_filter: Optional[SendFilter] = None,
        tick_s: float = 0.02,
        trace: Optional[bool] = None,
        spin_us: Optional[float] = None,
    ):
        self.topology = PDTopology(p_tp, d_tp)
        self.p_rank = p_rank
        self.d_rank = self.topology.d_rank_of(p_rank)
        self.member = self.topology.member_of(p_rank)
        layout.validate()
        self.config = config
        self.layout = layout
        self._has_indexer = layout.indexer is not None
        self.engine = engine
        self.gates = gates
        self.consumer = consumer
        self.begin_gate = begin_gate
        self.stats = PrefillStats()
        #: the latest answered batches (for latency percentiles; bounded)
        self.timings: Deque[BatchTiming] = collections.deque(maxlen=TIMING_SAMPLES)
        #: per-batch stage stamps (stages.py) when tracing (``trace``, default from the environment)
        self.stages: Optional[StageLog] = StageLog() if (trace_from_env() if trace is None else trace) else None
        self.port = decode_port(config.kv_port, decode_dp_rank, self.d_rank, d_tp)
        self._lock = threading.Lock()
        self._reqs: Dict[str, _Req] = {}
        self._batches: Dict[int, _Batch] = {}
        self._next_batch = 0
        self._ack: Optional[MetaAck] = None
        self._ack_event = threading.Event()
        self._closed = False
        self._endpoint = ControlEndpoint(
            "dealer",
            decode_host,
            self.port,
            expect=(MetaAck, ReadDone, ReadFailed, Rejected),
            on_message=self._on_message,
            on_invalid=self._on_invalid,
            on_tick=self._on_tick,
            tick_s=tick_s,
            send_filter=send_filter,
            name=f"pd-prefill-{p_rank}",
            trace=self.stages is not None,
            spin_us=PREFILL_SPIN_US if spin_us is None else spin_us,
        )
        self._endpoint.start()

    # ------------------------------------------------------------------ API
    def handshake(self, timeout_s: Optional[float] = None) -> MetaAck:
        """Send the metadata handshake; wait for acceptance.

        Raises :class:`~.errors.HandshakeTimeout` after ``timeout_s`` (default
        ``config.handshake_timeout_s``) and :class:`~.errors.HandshakeError` when
        decode refuses (the reason lists every mismatch).
        """
        timeout_s = self.config.handshake_timeout_s if timeout_s is None else timeout_s
        self._ack_event.clear()
        self._endpoint.send(
            MetaHandshake(
                version=PROTOCOL_VERSION,
                session=self.engine.session_id,
                engine=self.engine.name,
                data_protocol=self.engine.data_protocol,
                p_tp=self.topology.p_tp,
                p_rank=self.p_rank,
                d_tp=self.topology.d_tp,
                main_tensor_count=len(self.layout.main),
                has_indexer=self.layout.indexer is not None,
                has_indexer_scale=self.layout.indexer_scale is not None,
                layer_timeout_ms=max(1, int(self.config.layer_timeout_s * 1000)),
                layout=self.layout,
            )
        )
        if not self._ack_event.wait(timeout_s):
            raise HandshakeTimeout(
                f"decode rank {self.d_rank} at {self._endpoint.address} did not answer "
                f"the metadata handshake within {timeout_s:.3f}s (is the decode server "
                "up, and pd_transfer.kv_port / host the same on both sides?)"
            )
        ack = self._ack
        if not ack.accepted:
            raise HandshakeError(f"decode rank {self.d_rank} refused the handshake: {ack.reason}")
        return ack

    @property
    def connected(self) -> bool:
        return self._ack is not None and self._ack.accepted

    def add_request(self, request_id: str, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"request {request_id!r}: num_blocks must be >= 1")
        with self._lock:
            if self._closed:
                raise TransferError("prefill sender is closed")
            if request_id in self._reqs:
                raise ValueError(f"request {request_id!r} already added")
            topo = self.topology
            m_share = topo.main_share(num_blocks, self.d_rank) if topo.sends_main(self.member) else (0, 0)
            i_share = topo.indexer_share(num_blocks, self.member) if self._has_indexer else (0, 0)
            self._reqs[request_id] = _Req(num_blocks=num_blocks, shares=m_share + i_share)

    def publish_layer(
        self, layer: int, slot: int, sources: Mapping[str, SourceBlocks], finished: Iterable[str] = ()
    ) -> Optional[int]:
        """Layer ``layer`` of the requests in ``sources`` is written in ``slot``: send it.

        Requests already failed are skipped. ``finished`` names requests for which
        this is the last layer (every layer must have been published by then).
        Returns the batch id, or ``None`` when no live request remained (the gate
        is then left free / completed at once).
        """
        t_publish = time.monotonic()
        t_ns = time.perf_counter_ns() if self.stages is not None else 0
        if not self.connected:
            raise TransferError("publish_layer before a successful handshake")
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.layout.num_layers - 1}")
        finished = set(finished) if finished else _NONE
        if finished and not finished <= sources.keys():
            raise ValueError("finished requests must be part of this layer's batch")
        ranges: List[RequestRange] = []
        reqs: List[_Req] = []
        with self._lock:
            if self._closed:
                raise TransferError("prefill sender is closed")
            for rid, src in sources.items():
                r = self._reqs.get(rid)
                if r is None:
                    raise KeyError(f"unknown request {rid!r} (add_request first)")
                if r.state is not TransferState.PENDING:
                    continue
                n = r.num_blocks
                if len(src.main_blocks) != n:
                    raise ValueError(f"request {rid!r}: {len(src.main_blocks)} main source blocks for {n}")
                has_idx = self._has_indexer
                if has_idx and len(src.indexer_blocks) != n:
                    raise ValueError(f"request {rid!r}: {len(src.indexer_blocks)} indexer source blocks for {n}")
                if layer in r.published:
                    raise ValueError(f"request {rid!r}: layer {layer} published twice")
                if rid in finished and len(r.published) + 1 != self.layout.num_layers:
                    raise ValueError(
                        f"request {rid!r} finished after {len(r.published) + 1} of {self.layout.num_layers} layers"
                    )
                m_off, m_cnt, i_off, i_cnt = r.shares
                reqs.append(r)
                ranges.append(
                    RequestRange(
                        request_id=rid,
                        num_blocks=n,
                        main_offset=m_off,
                        main_src_blocks=[int(b) for b in src.main_blocks[m_off : m_off + m_cnt]],
                        indexer_offset=i_off,
                        indexer_src_blocks=[int(b) for b in src.indexer_blocks[i_off : i_off + i_cnt]],
                    )
                )
            if not ranges:
                if not self.begin_gate:
                    self.gates.done(slot, layer, self.consumer)
                return None
            if self.begin_gate:
                self.gates.begin(slot, layer, [self.consumer])  # raises if the slot is still busy
            for rr, r in zip(ranges, reqs):
                r.published.add(layer)
                if finished and rr.request_id in finished:
                    r.finished = True
            batch_id = self._next_batch
            self._next_batch += 1
            self._batches[batch_id] = _Batch(
                batch_id,
                layer,
                slot,
                [r.request_id for r in ranges],
                t_publish,
                t_publish + self.config.layer_timeout_s,
            )
            self.stats.batches += 1
            if self.stages is not None:
                self.stages.stamp(batch_id, "publish", t_ns)
        stamps = self._endpoint.send(
            ReadReadyBatch(
                version=PROTOCOL_VERSION,
                batch_id=batch_id,
                layer=layer,
                member=self.member,
                ratio=self.topology.ratio,
                requests=ranges,
                finished=[r.request_id for r in ranges if r.request_id in finished] if finished else [],
            )
        )
        if stamps is not None and self.stages is not None:
            self.stages.stamps(batch_id, PREFILL_STAMPS[1:4], stamps)
        return batch_id

    def status(self, request_id: str) -> RequestStatus:
        with self._lock:
            r = self._reqs.get(request_id)
            if r is None:
                raise KeyError(f"unknown request {request_id!r}")
            if r.state is TransferState.DONE:
                return DONE
            if r.state is TransferState.FAILED:
                return RequestStatus(TransferState.FAILED, r.reason)
            return PENDING

    def wait(self, request_ids: Iterable[str], timeout_s: float) -> Dict[str, RequestStatus]:
        """Statuses once all are terminal or ``timeout_s`` passed (then some may be pending)."""
        ids = list(request_ids)
        deadline = time.monotonic() + timeout_s
        while True:
            out = {rid: self.status(rid) for rid in ids}
            if all(s.terminal for s in out.values()) or time.monotonic() >= deadline:
                return out
            time.sleep(0.005)

    def forget(self, request_id: str) -> None:
        """Drop a terminal request's bookkeeping (a pending one is aborted first)."""
        self.abort(request_id, "abandoned by the scheduler")
        with self._lock:
            self._reqs.pop(request_id, None)

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            r = self._reqs.get(request_id)
            if r is None or r.state is not TransferState.PENDING:
                return
            self._fail_locked(request_id, r, reason)

    def open_batches(self) -> int:
        """Batches still waiting for decode's answer (their slots are gated)."""
        with self._lock:
            return len(self._batches)

    @property
    def endpoint(self) -> ControlEndpoint:
        return self._endpoint

    def close(self, reason: str = "prefill sender closed") -> None:
        """Release every open gate with an error, abort pending requests, stop the endpoint."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            batches, self._batches = list(self._batches.values()), {}
            for b in batches:
                self._gate_done(b, reason)
            for rid, r in self._reqs.items():
                if r.state is TransferState.PENDING:
                    self._fail_locked(rid, r, reason)
        self._ack_event.set()
        self._endpoint.close()

    # ------------------------------------------------------------------ helpers (lock held)
    def _gate_done(self, b: _Batch, error: Optional[str]) -> None:
        try:
            self.gates.done(b.slot, b.layer, self.consumer, error=error)
        except ValueError:
            logger.exception("prefill rank %d: gate of slot %d layer %d already released", self.p_rank, b.slot, b.layer)

    def _fail_locked(self, rid: str, r: _Req, reason: str) -> None:
        if r.state is not TransferState.PENDING:
            return
        r.state = TransferState.FAILED
        r.reason = reason
        self.stats.requests_failed += 1
        logger.warning("prefill rank %d: request %s failed: %s", self.p_rank, rid, reason)
        self._endpoint.send(
            TransferVerdict(version=PROTOCOL_VERSION, request_ids=[rid], ok=False, reason=reason[:4000])
        )

    def _ack_layer_locked(self, rid: str, layer: int) -> None:
        r = self._reqs.get(rid)
        if r is None or r.state is not TransferState.PENDING:
            return
        r.acked.add(layer)
        if r.finished and len(r.acked) == self.layout.num_layers:
            r.state = TransferState.DONE
            self.stats.requests_done += 1
            self._endpoint.send(TransferVerdict(version=PROTOCOL_VERSION, request_ids=[rid], ok=True, reason=""))

    # ------------------------------------------------------------------ I/O thread
    def _on_message(self, peer: bytes, msg) -> None:
        kind = type(msg)  # the endpoint only delivers the kinds of ``expect`` (exact classes)
        if kind is MetaAck:
            self._ack = msg
            self._ack_event.set()
            return
        with self._lock:
            if kind is Rejected:
                self.stats.rejected_messages += 1
                reason = f"decode rejected a message: {msg.reason}"
                for b in list(self._batches.values()):
                    self._finish_batch_locked(b, reason, b.request_ids)
                return
            b = self._batches.get(msg.batch_id)
            if b is None or b.layer != msg.layer:
                self.stats.late_answers += 1  # after a deadline, or bogus: never acted on
                return
            if kind is ReadDone:
                self.stats.read_done += 1
                self._finish_batch_locked(b, None, [])
                if self.stages is not None:
                    rx = self._endpoint.rx_stamps()
                    if rx is not None:
                        self.stages.stamps(b.batch_id, PREFILL_STAMPS[4:6], rx)
                    self.stages.stamp(b.batch_id, "handled", time.perf_counter_ns())
            else:
                self.stats.read_failed += 1
                ids = [r for r in msg.request_ids if r in b.request_ids] or b.request_ids
                self._finish_batch_locked(b, f"READ_FAILED from decode: {msg.reason}", ids)

    def _finish_batch_locked(self, b: _Batch, error: Optional[str], failed_ids: List[str]) -> None:
        del self._batches[b.batch_id]
        took = time.monotonic() - b.sent_at
        self.stats.answer_seconds += took
        if error is None:
            self.timings.append(BatchTiming(b.batch_id, b.layer, took))
        self._gate_done(b, error)
        for rid in b.request_ids:
            r = self._reqs.get(rid)
            if r is None:
                continue
            if rid in failed_ids:
                self._fail_locked(rid, r, f"layer {b.layer}: {error}")
            else:
                self._ack_layer_locked(rid, b.layer)

    def _on_invalid(self, peer: bytes, error) -> None:
        self.stats.rejected_messages += 1

    def _on_tick(self, now: float) -> None:
        with self._lock:
            for b in [b for b in self._batches.values() if now > b.deadline]:
                self.stats.timeouts += 1
                self._finish_batch_locked(
                    b,
                    f"no answer from decode rank {self.d_rank} within {self.config.layer_timeout_s:.3f}s",
                    b.request_ids,
                )
