"""Decode TP rank: accept prefill contributors, validate, pull each layer, answer.

One :class:`DecodeReceiver` per decode TP rank. It binds the rank's control port
(``kv_port + dp_rank * d_tp + tp_rank`` on the configured host) and serves every
prefill rank of its contribution group (``ratio = p_tp // d_tp`` members).

Per request (registered with :meth:`DecodeReceiver.expect` before prefill starts):

* for each layer, member 0 sends this rank's share of the main blocks (into the
  TP-shared host pool) and every member sends its indexer (+ LIC8 scale) share;
* before every read the ranges are validated against the handshake and the
  topology: tensor count and block bytes, indexer presence, scale layout, the
  exact share each member must send (so the union is complete and disjoint),
  source block bounds, no layer twice. A failed check fails the request without
  reading anything; a read is retried ``read_retries`` times, then fails it;
* every ready batch is answered: READ_DONE, or READ_FAILED naming the requests;
* the request is ``done`` on this rank only when every member delivered every
  layer *and* confirmed it with a positive :class:`~.protocol.TransferVerdict`;
  across ranks use :func:`~.status.combine_rank_statuses`;
* a failure (bad range, read error, abort verdict, deadline, close) makes the
  destination invalid: :meth:`claim` refuses it and it is released through
  ``on_release`` as soon as no read into it is in flight;
* deadline: once a request's transfer has started, a gap of more than
  ``layer_timeout_s`` without progress fails it (dead or stuck prefill).

Threads: the endpoint's connection thread of each prefill peer receives that
peer's messages and serves them in the order the peer sent them (handshake,
validation + engine read + answer of every layer, verdicts), so a slow or
failing peer never delays another, and a layer is answered without any
thread hand-off; the endpoint's tick thread checks deadlines. One lock guards
all state. An engine read can take long to fail (Mooncake over TCP needs
about a second per failed batch); the request's deadline still fails it on time,
and its destination is released only once that read has returned.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..config import PDTransferConfig
from .channel import ControlEndpoint, SendFilter
from .destinations import RequestDestination
from .engine import TransferEngine
from .errors import EngineReadError, ProtocolError, RequestFailed, TopologyError, TransferError
from .layout import coalesce, layout_mismatches
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
    TensorSpec,
    TransferVerdict,
)
from .stages import DECODE_STAMPS, StageLog, trace_from_env
from .status import DONE, PENDING, RequestStatus, TransferState
from .topology import PDTopology, decode_port

logger = logging.getLogger(__name__)

OnRelease = Callable[[RequestDestination], None]


@dataclass
class DecodeStats:
    """Counters of one decode rank (read by `bench transfer` and the tests; the SGLang backend
    does not export them as metrics)."""

    batches: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    read_retries: int = 0
    read_failures: int = 0
    validation_failures: int = 0
    rejected_messages: int = 0
    deadline_failures: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    released: int = 0


# decode's reader waits this long (busy, bounded) for the next layer's batch after answering one
DECODE_SPIN_US = 150.0
TIMING_SAMPLES = 4096  # per-batch read times kept for percentiles (most recent)


class ReadTiming(NamedTuple):
    """One successful batch read: the engine call(s) only, in seconds; ``ranges`` issued."""

    batch_id: int
    layer: int
    seconds: float
    ranges: int
    nbytes: int


@dataclass
class _Peer:
    """An accepted prefill peer, with what every batch of it needs precomputed.

    main_at: per layer, its main tensor group: ``(group id, [(source spec, destination
    spec)] per main tensor, source block limit)``; layers with the same main tensors share
    one group (one group unless the draft layer's main KV lives elsewhere than the base
    layers'). Block bytes are equal per pair: checked at the handshake.
    index_pairs: the same per indexer / scale tensor (they hold every layer).
    index_limit: indexer source block ids must be below it.
    """

    identity: bytes
    hs: MetaHandshake
    member: int
    topology: PDTopology
    main_at: List[Tuple[int, List[Tuple[TensorSpec, TensorSpec]], int]] = field(default_factory=list)
    index_pairs: List[Tuple[TensorSpec, TensorSpec]] = field(default_factory=list)
    index_limit: int = 0

    @classmethod
    def accepted(cls, identity: bytes, hs: MetaHandshake, topology: PDTopology, dest: KVLayout) -> "_Peer":
        src = hs.layout
        index_pairs = [
            (getattr(src, role), getattr(dest, role))
            for role in ("indexer", "indexer_scale")
            if getattr(dest, role) is not None
        ]
        main_at: List[Tuple[int, List[Tuple[TensorSpec, TensorSpec]], int]] = [None] * dest.num_layers
        for gid, (layers, dest_main) in enumerate(dest.main_groups()):
            src_main = src.main_at(layers[0])
            group = (gid, list(zip(src_main, dest_main)), min(t.num_blocks for t in src_main))
            for layer in layers:
                main_at[layer] = group
        return cls(
            identity,
            hs,
            topology.member_of(hs.p_rank),
            topology,
            main_at,
            index_pairs,
            min((s.num_blocks for s, _ in index_pairs), default=0),
        )


@dataclass
class _Track:
    dest: RequestDestination
    state: TransferState = TransferState.PENDING
    reason: str = ""
    delivered: Dict[int, Set[int]] = field(default_factory=dict)  # member -> layers
    finished: Set[int] = field(default_factory=set)  # members that sent their last layer
    confirmed: Set[int] = field(default_factory=set)  # members with a positive verdict
    member_peer: Dict[int, bytes] = field(default_factory=dict)
    #: the P/D topology of the prefill instance sending this request (its first contributor's;
    #: every contributor must agree): prefill instances of different TP sizes may feed one
    #: decode rank, each request comes from one of them
    topology: Optional[PDTopology] = None
    inflight: int = 0
    deadline: Optional[float] = None
    released: bool = False
    claimed: bool = False
    #: member -> (main start, main count, indexer start, indexer count): its exact share (fixed
    #: once the topology is: every accepted handshake must agree on it)
    shares: Dict[int, Tuple[int, int, int, int]] = field(default_factory=dict)
    #: (member, main tensor group) -> (main source blocks, indexer source blocks, plan relative
    #: to each layer's bases): a layer whose source blocks equal the previous layer's reuses
    #: the coalesced plan
    plans: Dict[Tuple[int, int], tuple] = field(default_factory=dict)


class DecodeReceiver:
    """Control plane + reads of one decode TP rank.

    layout: this rank's destinations (main tensors = host pool, shared by the
        rank's DP group; indexer / scale = this rank's device cache).
    engine: started transfer engine with the destination memory registered.
    on_release: called (outside the lock) with a failed or abandoned request's
        destination once nothing writes into it any more.
    """

    def __init__(
        self,
        config: PDTransferConfig,
        *,
        d_tp: int,
        d_rank: int,
        layout: KVLayout,
        engine: TransferEngine,
        dp_rank: int = 0,
        on_release: Optional[OnRelease] = None,
        send_filter: Optional[SendFilter] = None,
        tick_s: float = 0.02,
        trace: Optional[bool] = None,
        spin_us: Optional[float] = None,
    ):
        if not 0 <= d_rank < d_tp:
            raise TopologyError(f"decode rank {d_rank} out of range 0..{d_tp - 1}")
        layout.validate()
        self.config = config
        self.d_tp = d_tp
        self.d_rank = d_rank
        self.layout = layout
        self.engine = engine
        # fault-injecting engines (testing/pd_faults.py) take the layer before each read
        self._set_context = getattr(engine, "set_context", None)
        self.port = decode_port(config.kv_port, dp_rank, d_rank, d_tp)
        self.stats = DecodeStats()
        #: the latest successful batch reads (for latency percentiles; bounded)
        self.timings: Deque[ReadTiming] = collections.deque(maxlen=TIMING_SAMPLES)
        #: per-batch stage stamps (stages.py) when tracing (``trace``, default from the environment)
        self.stages: Optional[StageLog] = StageLog() if (trace_from_env() if trace is None else trace) else None
        self._on_release = on_release
        self._lock = threading.Lock()
        self._peers: Dict[bytes, _Peer] = {}
        self._tracks: Dict[str, _Track] = {}
        self._closed = False
        self._endpoint = ControlEndpoint(
            "router",
            config.host,
            self.port,
            expect=(MetaHandshake, ReadReadyBatch, TransferVerdict, Rejected),
            on_message=self._on_message,
            on_invalid=self._on_invalid,
            on_tick=self._on_tick,
            tick_s=tick_s,
            send_filter=send_filter,
            name=f"pd-decode-{d_rank}",
            trace=self.stages is not None,
            spin_us=DECODE_SPIN_US if spin_us is None else spin_us,
        )

    # ------------------------------------------------------------------ API
    def start(self) -> "DecodeReceiver":
        self._endpoint.start()
        return self

    def expect(self, dest: RequestDestination) -> None:
        """Register a request's destination before its prefill starts sending."""
        n = dest.num_blocks
        problems = []
        if n < 1:
            problems.append("no blocks")
        if any(not 0 <= b < t.num_blocks for t in self.layout.main for b in dest.main_blocks):
            problems.append("main block id outside the host pool")
        if self.layout.indexer is not None:
            if len(dest.indexer_blocks) != n:
                problems.append(f"{len(dest.indexer_blocks)} indexer blocks for {n} main blocks")
            limit = min(t.num_blocks for t in (self.layout.indexer, self.layout.indexer_scale) if t)
            if any(not 0 <= b < limit for b in dest.indexer_blocks):
                problems.append("indexer block id outside the indexer cache")
        elif dest.indexer_blocks:
            problems.append("indexer blocks given but the layout has no indexer")
        if len(set(dest.main_blocks)) != n or len(set(dest.indexer_blocks)) != len(dest.indexer_blocks):
            problems.append("repeated block ids")
        if problems:
            raise ValueError(f"destination of request {dest.request_id!r}: {'; '.join(problems)}")
        with self._lock:
            if self._closed:
                raise TransferError("decode receiver is closed")
            if dest.request_id in self._tracks:
                raise ValueError(f"request {dest.request_id!r} already expected")
            self._tracks[dest.request_id] = _Track(dest=dest)

    def status(self, request_id: str) -> RequestStatus:
        with self._lock:
            t = self._tracks.get(request_id)
            if t is None:
                raise KeyError(f"unknown request {request_id!r}")
            return self._status(t)

    def claim(self, request_id: str) -> RequestDestination:
        """Hand a ``done`` request's destination to the scheduler (it owns it from now on).

        Raises :class:`~.errors.RequestFailed` for a failed request (its destination
        is invalid and released here) and :class:`TransferError` while pending.
        """
        with self._lock:
            t = self._tracks.get(request_id)
            if t is None:
                raise KeyError(f"unknown request {request_id!r}")
            if t.state is TransferState.FAILED:
                raise RequestFailed(request_id, t.reason)
            if t.state is TransferState.PENDING:
                raise TransferError(f"request {request_id!r} is still transferring")
            t.claimed = True
            del self._tracks[request_id]
            return t.dest

    def forget(self, request_id: str, reason: str = "abandoned by the scheduler") -> None:
        """Drop a request: a pending one fails (destination released when no read is in flight)."""
        release = []
        with self._lock:
            t = self._tracks.get(request_id)
            if t is None:
                return
            if t.state is TransferState.PENDING:
                self._fail_locked(t, reason, release)
            elif t.state is TransferState.DONE and not t.claimed and not t.released:
                t.released = True
                release.append(t.dest)
            if t.inflight == 0:
                del self._tracks[request_id]
        self._release(release)

    def connected_members(self) -> Set[int]:
        """Contribution-group members whose handshake was accepted."""
        with self._lock:
            return {p.member for p in self._peers.values()}

    def pending_requests(self) -> List[str]:
        with self._lock:
            return [r for r, t in self._tracks.items() if t.state is TransferState.PENDING]

    def unreleased_failed(self) -> List[str]:
        """Failed requests whose destination is not released yet (reads still in flight)."""
        with self._lock:
            return [r for r, t in self._tracks.items() if t.state is TransferState.FAILED and not t.released]

    @property
    def endpoint(self) -> ControlEndpoint:
        return self._endpoint

    def close(self, reason: str = "decode receiver closed") -> None:
        """Fail every pending request, stop both threads, release destinations."""
        release: List[RequestDestination] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for t in self._tracks.values():
                if t.state is TransferState.PENDING:
                    self._fail_locked(t, reason, release)
        # no new batches after this; a connection thread still inside an engine read finishes it first
        self._endpoint.close(timeout_s=10.0)
        with self._lock:
            still_reading = any(t.inflight for t in self._tracks.values())
        if still_reading:
            logger.error(
                "decode rank %d: an engine read is still running at close; its destinations stay leased", self.d_rank
            )
        with self._lock:  # reads are over: release whatever waited for them
            for t in self._tracks.values():
                if t.inflight:
                    continue  # a read still writes there: never hand this memory out
                if t.state is TransferState.FAILED and not t.released:
                    t.released = True
                    release.append(t.dest)
        self._release(release)

    # ------------------------------------------------------------------ state helpers
    @staticmethod
    def _status(t: _Track) -> RequestStatus:
        if t.state is TransferState.DONE:
            return DONE
        if t.state is TransferState.FAILED:
            return RequestStatus(TransferState.FAILED, t.reason)
        return PENDING

    def _fail_locked(self, t: _Track, reason: str, release: List[RequestDestination]) -> None:
        if t.state is not TransferState.PENDING:
            return
        t.state = TransferState.FAILED
        t.reason = reason
        self.stats.requests_failed += 1
        logger.warning("decode rank %d: request %s failed: %s", self.d_rank, t.dest.request_id, reason)
        if t.inflight == 0 and not t.released:
            t.released = True
            release.append(t.dest)

    def _maybe_done_locked(self, t: _Track) -> None:
        if t.state is not TransferState.PENDING or t.topology is None:
            return
        members = set(range(t.topology.ratio))
        if t.finished >= members and t.confirmed >= members:
            t.state = TransferState.DONE
            t.deadline = None
            self.stats.requests_done += 1

    def _progress_locked(self, t: _Track) -> None:
        t.deadline = time.monotonic() + self.config.layer_timeout_s

    def _release(self, dests: List[RequestDestination]) -> None:
        for d in dests:
            self.stats.released += 1
            if self._on_release is not None:
                try:
                    self._on_release(d)
                except Exception:  # noqa: BLE001
                    logger.exception("on_release failed for %s", d.request_id)

    # ------------------------------------------------------------------ connection / tick threads
    def _on_message(self, peer: bytes, msg) -> None:
        if isinstance(msg, MetaHandshake):
            self._on_handshake(peer, msg)
        elif isinstance(msg, ReadReadyBatch):
            self._serve(peer, msg)
        elif isinstance(msg, TransferVerdict):
            self._on_verdict(peer, msg)
        elif isinstance(msg, Rejected):
            self._on_rejected(peer, msg)

    def _on_invalid(self, peer: bytes, error: ProtocolError) -> None:
        self.stats.rejected_messages += 1

    def _on_handshake(self, peer: bytes, hs: MetaHandshake) -> None:
        problems = []
        if hs.engine != self.engine.name:
            problems.append(f"engine: prefill {hs.engine!r}, decode {self.engine.name!r}")
        if hs.data_protocol != self.engine.data_protocol:
            problems.append(
                f"data protocol: prefill {hs.data_protocol!r}, decode "
                f"{self.engine.data_protocol!r} (both sides must match)"
            )
        topo = None
        try:
            topo = PDTopology(hs.p_tp, hs.d_tp)
            if hs.d_tp != self.d_tp:
                problems.append(f"decode TP: prefill assumes {hs.d_tp}, decode has {self.d_tp}")
            elif topo.d_rank_of(hs.p_rank) != self.d_rank:
                problems.append(
                    f"prefill rank {hs.p_rank} belongs to decode rank {topo.d_rank_of(hs.p_rank)}, not {self.d_rank}"
                )
        except TopologyError as exc:
            problems.append(str(exc))
        problems += layout_mismatches(hs.layout, self.layout)
        with self._lock:
            if not problems:
                self._peers[peer] = _Peer.accepted(peer, hs, topo, self.layout)
        reason = "; ".join(problems)
        if problems:
            logger.warning("decode rank %d: handshake from prefill rank %d refused: %s", self.d_rank, hs.p_rank, reason)
        self._endpoint.send(
            MetaAck(version=PROTOCOL_VERSION, accepted=not problems, reason=reason[:4000], d_rank=self.d_rank), peer
        )

    def _on_verdict(self, peer: bytes, v: TransferVerdict) -> None:
        release: List[RequestDestination] = []
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                return
            for rid in v.request_ids:
                t = self._tracks.get(rid)
                if t is None or t.member_peer.setdefault(p.member, peer) != peer:
                    continue  # unknown request, or another peer is this member for it
                if v.ok:
                    t.confirmed.add(p.member)
                    self._progress_locked(t)
                    self._maybe_done_locked(t)
                else:
                    self._fail_locked(t, f"prefill rank {p.hs.p_rank} aborted: {v.reason}", release)
        self._release(release)

    def _on_rejected(self, peer: bytes, msg: Rejected) -> None:
        release: List[RequestDestination] = []
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                return
            for t in self._tracks.values():
                if t.member_peer.get(p.member) == peer:
                    self._fail_locked(t, f"prefill rank {p.hs.p_rank} rejected our message: {msg.reason}", release)
        self._release(release)

    def _on_tick(self, now: float) -> None:
        release: List[RequestDestination] = []
        with self._lock:
            for t in self._tracks.values():
                if t.state is TransferState.PENDING and t.deadline is not None and now > t.deadline:
                    self.stats.deadline_failures += 1
                    self._fail_locked(
                        t,
                        f"no transfer progress for {self.config.layer_timeout_s:.3f}s (prefill dead or stuck)",
                        release,
                    )
        self._release(release)

    # ------------------------------------------------------------------ connection thread (reads)
    def _serve(self, peer: bytes, batch: ReadReadyBatch) -> None:
        """Validate, read and answer one batch on the peer's connection thread."""
        try:
            self._serve_batch(peer, batch)
        except Exception as exc:  # noqa: BLE001 - answer rather than leave prefill waiting
            logger.exception("decode rank %d: batch %d failed unexpectedly", self.d_rank, batch.batch_id)
            self._answer_failed(peer, batch, [r.request_id for r in batch.requests], f"decode internal error: {exc}")

    def _answer_failed(self, peer: bytes, batch: ReadReadyBatch, ids: List[str], reason: str) -> None:
        self._endpoint.send(
            ReadFailed(
                version=PROTOCOL_VERSION,
                batch_id=batch.batch_id,
                layer=batch.layer,
                reason=reason[:4000],
                request_ids=ids,
            ),
            peer,
        )

    def _shares(self, t: _Track, m: int) -> Tuple[int, int, int, int]:
        sh = t.shares.get(m)
        if sh is None:
            topo = t.topology
            n = t.dest.num_blocks
            sh = t.shares[m] = topo.main_share(n, self.d_rank) + topo.indexer_share(n, m)
        return sh

    def _check_range(self, p: _Peer, t: _Track, rr: RequestRange, layer: int) -> Optional[str]:
        if t.topology is None:
            t.topology = p.topology  # the request's first contributor names its prefill instance's
        elif p.topology != t.topology:
            return (
                f"contributors disagree on the request's P/D topology: {p.topology} from prefill rank "
                f"{p.hs.p_rank}, {t.topology} from an earlier one"
            )
        topo = t.topology
        n = t.dest.num_blocks
        m = p.member
        if rr.num_blocks != n:
            return f"prefill has {rr.num_blocks} blocks, decode destination {n}"
        if t.member_peer.get(m, p.identity) != p.identity:
            return f"two prefill peers claim group member {m}"
        if layer in t.delivered.get(m, ()):
            return f"layer {layer} sent twice by member {m}"
        start, count, i_start, i_count = self._shares(t, m)
        main = rr.main_src_blocks
        if topo.sends_main(m):
            if rr.main_offset != start or len(main) != count:
                return f"main range {rr.main_offset}+{len(main)} is not this rank's share {start}+{count}"
        elif main:
            return f"member {m} sent main blocks (only member 0 does)"
        if main and max(main) >= p.main_at[layer][2]:
            return "main source block out of the prefill buffer"
        index = rr.indexer_src_blocks
        if p.index_pairs:
            if rr.indexer_offset != i_start or len(index) != i_count:
                return f"indexer range {rr.indexer_offset}+{len(index)} is not member {m}'s share {i_start}+{i_count}"
            if index and max(index) >= p.index_limit:
                return "indexer source block out of the prefill buffer"
        elif index:
            return "indexer blocks sent but this model has no indexer"
        return None

    def _plan(
        self,
        p: _Peer,
        t: _Track,
        rr: RequestRange,
        layer: int,
        dst_all: List[int],
        src_all: List[int],
        len_all: List[int],
    ) -> None:
        """Append one request's share of one layer (coalesced per tensor) to the read lists.

        Coalescing depends only on block offsets within a layer (every address of a
        tensor's layer is its base plus ``block * block_bytes``), so the plan is kept
        relative to the bases and reused while the source blocks stay the same
        (they usually do: a request keeps its slot blocks for every layer).
        """
        main, index = rr.main_src_blocks, rr.indexer_src_blocks
        gid, main_pairs, _ = p.main_at[layer]
        cached = t.plans.get((p.member, gid))
        if cached is None or cached[0] != main or cached[1] != index:
            rel = []
            for pairs, src_blocks, dst_blocks, offset in (
                (main_pairs, main, t.dest.main_blocks, rr.main_offset),
                (p.index_pairs, index, t.dest.indexer_blocks, rr.indexer_offset),
            ):
                if not src_blocks:
                    continue
                dst_ids = dst_blocks[offset : offset + len(src_blocks)]
                for s_spec, d_spec in pairs:
                    bb = d_spec.block_bytes
                    d_, s_, n_ = coalesce([b * bb for b in dst_ids], [b * bb for b in src_blocks], bb)
                    rel.append((d_spec, s_spec, d_, s_, n_))
            cached = t.plans[(p.member, gid)] = (main, index, rel)
        for d_spec, s_spec, d_, s_, n_ in cached[2]:
            dbase = d_spec.base(layer)
            sbase = s_spec.base(layer)
            if len(n_) == 1:
                dst_all.append(dbase + d_[0])
                src_all.append(sbase + s_[0])
                len_all.append(n_[0])
            else:
                dst_all += [dbase + x for x in d_]
                src_all += [sbase + x for x in s_]
                len_all += n_

    def _serve_batch(self, peer: bytes, batch: ReadReadyBatch) -> None:
        """One READ_READY batch: validate each request's range, read the valid ones, answer
        (READ_DONE, or the failed requests with every reason), then record the delivery."""
        self.stats.batches += 1
        stages = self.stages
        if stages is not None:
            rx = self._endpoint.rx_stamps()
            if rx is not None:
                stages.stamps(batch.batch_id, DECODE_STAMPS[:2], rx)
        failed: Dict[str, str] = {}  # request id -> why, answered to the prefill
        p, problem, good = self._validate_batch(peer, batch, failed)
        delivered = self._read_batch(p, batch, good, failed) if good else []
        self._answer_batch(peer, batch, problem, failed)
        if delivered:
            self._record_delivered(p.member, batch.layer, delivered)

    def _validate_batch(
        self, peer: bytes, batch: ReadReadyBatch, failed: Dict[str, str]
    ) -> Tuple[Optional["_Peer"], Optional[str], List[Tuple[_Track, RequestRange]]]:
        """``(peer state, batch-level problem or None, requests to read)``; every request
        that cannot be read gets its reason in ``failed`` (and fails here when pending).
        The requests returned are counted in flight."""
        release: List[RequestDestination] = []
        good: List[Tuple[_Track, RequestRange]] = []
        with self._lock:
            p = self._peers.get(peer)
            problem = None
            if p is None:
                problem = "no accepted handshake from this peer"
            elif batch.member != p.member or batch.ratio != p.topology.ratio:
                problem = (
                    f"member/ratio {batch.member}/{batch.ratio} disagree with the handshake "
                    f"({p.member}/{p.topology.ratio})"
                )
            elif batch.layer >= self.layout.num_layers:
                problem = f"layer {batch.layer} >= {self.layout.num_layers}"
            for rr in batch.requests:
                t = self._tracks.get(rr.request_id)
                if t is None:
                    failed[rr.request_id] = "unknown request on decode"
                    continue
                if t.state is not TransferState.PENDING:
                    failed[rr.request_id] = f"request already {t.state.value}: {t.reason}"
                    continue
                why = problem or self._check_range(p, t, rr, batch.layer)
                if why is not None:
                    self.stats.validation_failures += 1
                    failed[rr.request_id] = f"layer {batch.layer}: {why}"
                    self._fail_locked(t, failed[rr.request_id], release)
                    continue
                t.member_peer[p.member] = peer
                t.inflight += 1
                self._progress_locked(t)
                good.append((t, rr))
        if release:
            self._release(release)
        return p, problem, good

    def _read_batch(
        self, p: "_Peer", batch: ReadReadyBatch, good: List[Tuple[_Track, RequestRange]], failed: Dict[str, str]
    ) -> List[Tuple[_Track, bool]]:
        """Read the ``good`` requests' ranges of ``batch.layer`` in one engine read (with
        retries); returns ``(track, finished)`` of those read and still pending. A failed
        read fails them all (never READ_DONE), and their in-flight count drops either way."""
        dst: List[int] = []
        src: List[int] = []
        lengths: List[int] = []
        layer = batch.layer
        for t, rr in good:
            self._plan(p, t, rr, layer, dst, src, lengths)
        try:
            error = self._read_with_retries(p.hs.session, layer, dst, src, lengths, good=good, batch_id=batch.batch_id)
        except Exception as exc:  # noqa: BLE001 - e.g. a bug in an engine adapter
            # a read that did not finish cleanly is a failed read: never READ_DONE, and the
            # requests' in-flight count still drops below (else their destinations stay leased)
            logger.exception("decode rank %d: read of batch %d raised", self.d_rank, batch.batch_id)
            error = f"decode internal error during the read of layer {layer}: {exc}"
        delivered: List[Tuple[_Track, bool]] = []
        release: List[RequestDestination] = []
        with self._lock:
            # decide the answer here; the success bookkeeping (delivered layers, progress,
            # done) follows once READ_DONE is on its way. Safe to defer: this peer's next
            # message (a later layer, its verdict) runs on this same thread afterwards, no
            # other peer can act as this member (member_peer), and a deadline or abort
            # meanwhile only fails the request (done needs a pending state)
            for t, rr in good:
                t.inflight -= 1
                if error is not None:
                    failed[rr.request_id] = error
                    self._fail_locked(t, error, release)
                elif t.state is TransferState.PENDING:
                    fin = rr.request_id in batch.finished
                    missing = (
                        (set(range(self.layout.num_layers)) - t.delivered.get(p.member, set()) - {layer})
                        if fin
                        else set()
                    )
                    if missing:
                        failed[rr.request_id] = f"member {p.member} finished without layers {sorted(missing)}"
                        self._fail_locked(t, failed[rr.request_id], release)
                        continue
                    delivered.append((t, fin))
                else:
                    # failed while the read was in flight (abort, deadline): data unusable
                    failed[rr.request_id] = f"request failed during the read: {t.reason}"
                if t.state is TransferState.FAILED and t.inflight == 0 and not t.released:
                    t.released = True
                    release.append(t.dest)
        if release:
            self._release(release)
        return delivered

    def _answer_batch(self, peer: bytes, batch: ReadReadyBatch, problem: Optional[str], failed: Dict[str, str]) -> None:
        """READ_DONE when every request was read, else the failed ones with their reasons."""
        if problem is not None and not failed:
            self._answer_failed(peer, batch, [], f"layer {batch.layer}: {problem}")
        elif failed:
            ids = [r.request_id for r in batch.requests]
            reason = "; ".join(f"{r}: {w}" for r, w in sorted(failed.items()))
            self._answer_failed(peer, batch, sorted(failed) if len(failed) < len(ids) else [], reason)
        else:
            stamps = self._endpoint.send(
                ReadDone(version=PROTOCOL_VERSION, batch_id=batch.batch_id, layer=batch.layer), peer
            )
            if stamps is not None and self.stages is not None:
                self.stages.stamps(batch.batch_id, DECODE_STAMPS[4:], stamps)

    def _record_delivered(self, member: int, layer: int, delivered: List[Tuple[_Track, bool]]) -> None:
        """After the answer: ``layer`` delivered by ``member`` for each still-pending request;
        a finished member completes the request once every member has finished."""
        with self._lock:
            for t, fin in delivered:
                if t.state is not TransferState.PENDING:
                    continue  # failed after the answer (deadline, close): nothing to record
                t.delivered.setdefault(member, set()).add(layer)
                self._progress_locked(t)
                if fin:
                    t.finished.add(member)
                    self._maybe_done_locked(t)

    def _read_with_retries(
        self,
        session: str,
        layer: int,
        dst,
        src,
        lengths,
        good: Sequence[Tuple[_Track, RequestRange]] = (),
        batch_id: int = -1,
    ) -> Optional[str]:
        """None on success, else the last error after ``1 + read_retries`` attempts.

        No retry once every request of ``good`` (the batch's validated requests) has
        failed meanwhile.
        """
        if self._set_context is not None:
            self._set_context(layer)
        last = ""
        for attempt in range(1 + self.config.read_retries):
            if attempt:
                if good and not any(t.state is TransferState.PENDING for t, _ in good):
                    break
                self.stats.read_retries += 1
            t0 = time.perf_counter()
            try:
                self.engine.read(session, dst, src, lengths)
            except EngineReadError as exc:
                last = str(exc)
                continue
            t1 = time.perf_counter()
            took = t1 - t0
            if self.stages is not None:
                self.stages.stamp(batch_id, "read_start", int(t0 * 1e9))
                self.stages.stamp(batch_id, "read_end", int(t1 * 1e9))
            nbytes = sum(lengths)
            self.stats.reads += 1
            self.stats.read_bytes += nbytes
            self.stats.read_seconds += took
            self.timings.append(ReadTiming(batch_id, layer, took, len(lengths), nbytes))
            return None
        self.stats.read_failures += 1
        return f"read of layer {layer} failed after {attempt + 1} attempt(s): {last}"
