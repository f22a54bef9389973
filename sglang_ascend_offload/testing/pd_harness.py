"""Multi-process P/D scenarios: real prefill and decode ranks in separate processes.

Used by the tests (``tests/transfer``) and ``bench transfer``. One scenario =
``p_tp`` prefill rank processes + ``d_tp`` decode rank processes, each with its
own transfer engine (Mooncake over TCP on 127.0.0.1 by default), talking through
the real control plane. Prefill writes deterministic content into a few reusable
layer slots (fewer slots than layers, so the slot gates matter), publishes every
layer; decode pulls main KV into a host pool shared by its TP ranks (a shared
memory file) and indexer + scale into rank-local tensors. The parent then checks,
bit-exactly, that every request decode calls done holds exactly prefill's bytes,
and for every failure that: nothing hung, no slot stayed gated, the failed
destination was refused to the scheduler and released, the error reached the
request on both sides.

Worker processes use numpy buffers and never import torch (a torch import costs
seconds per process on small machines); the parent compares with ``torch.equal``.
"""

from __future__ import annotations

import functools
import os
import random
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .pd_faults import FaultPlan

MODULE = __name__


# ------------------------------------------------------------------ spec
@dataclass(frozen=True)
class ScenarioSpec:
    """One P/D transfer scenario (all sizes small by default: seconds on 2 cores).

    main_tensors: ``(name, bytes per token)`` of the main KV parts (latent, rope).
    indexer_bytes / scale_bytes: per token; 0 = the model has none.
    request_blocks: block count of each request (requests ``r0, r1, ...``).
    slot_blocks: blocks per prefill layer slot; pool_blocks: blocks per decode layer.
    decode_faults / prefill_faults: injected on every rank of that side.
    decode_up: False = no decode process at all (handshake must time out).
    measure_memcpy: decode ranks also time a plain memcpy of each read's bytes.
    measure_raw: decode ranks record every engine read (peer, addresses, lengths) and,
        once their requests are terminal, issue the same reads again through the
        engine's own batch read API (no protocol): the raw-engine yardstick. Prefill
        ranks keep their buffers registered until that replay is over.
    """

    name: str
    p_tp: int = 1
    d_tp: int = 1
    num_layers: int = 4
    num_slots: int = 2
    block_tokens: int = 4
    main_tensors: Tuple[Tuple[str, int], ...] = (("latent", 32), ("rope", 8))
    indexer_bytes: int = 16
    scale_bytes: int = 4
    request_blocks: Tuple[int, ...] = (1, 3, 5)
    slot_blocks: int = 16
    pool_blocks: int = 32
    layer_timeout_s: float = 5.0
    handshake_timeout_s: float = 10.0
    read_retries: int = 1
    engine: str = "mooncake"
    decode_faults: FaultPlan = field(default_factory=FaultPlan)
    prefill_faults: FaultPlan = field(default_factory=FaultPlan)
    decode_up: bool = True
    measure_memcpy: bool = False
    measure_raw: bool = False
    seed: int = 0

    @property
    def request_ids(self) -> List[str]:
        return [f"r{i}" for i in range(len(self.request_blocks))]


def expected_block_bytes(seed: int, rid: str, layer: int, tensor: str, num_blocks: int, block_bytes: int) -> np.ndarray:
    """Deterministic ``[num_blocks, block_bytes]`` uint8 content (same in every process)."""
    key = zlib.crc32(f"{seed}/{rid}/{layer}/{tensor}".encode())
    return np.random.default_rng(key).integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)


def _raw(role: str, name: str, per_layer: List[np.ndarray]):
    from ..transfer.layout import RawTensor

    return RawTensor(role, name, per_layer[0].shape[1], per_layer[0].shape[0], [a.ctypes.data for a in per_layer])


def _regions(arrays: List[np.ndarray]) -> List[Tuple[int, int]]:
    return sorted({a.ctypes.data: a.nbytes for a in arrays}.items())


def _tensor_specs(spec: ScenarioSpec) -> List[Tuple[str, str, int]]:
    """``(role, name, block_bytes)`` of every tensor, main first."""
    bt = spec.block_tokens
    out = [("main", name, width * bt) for name, width in spec.main_tensors]
    if spec.indexer_bytes:
        out.append(("indexer", "indexer", spec.indexer_bytes * bt))
        if spec.scale_bytes:
            out.append(("indexer_scale", "indexer_scale", spec.scale_bytes * bt))
    return out


# ------------------------------------------------------------------ worker side
_ENGINES: Dict[Tuple[str, str], Any] = {}


def _engine(spec: ScenarioSpec, role: str):
    """One engine per worker process and role, reused across scenarios."""
    from ..config import PDTransferConfig
    from ..transfer.engine import create_engine

    key = (spec.engine, role)
    if key not in _ENGINES:
        _ENGINES[key] = create_engine(PDTransferConfig(engine=spec.engine, host="127.0.0.1"), role)
    return _ENGINES[key]


def _config(spec: ScenarioSpec, kv_port: int):
    from ..config import PDTransferConfig

    return PDTransferConfig(
        engine=spec.engine,
        kv_port=kv_port,
        host="127.0.0.1",
        handshake_timeout_s=spec.handshake_timeout_s,
        layer_timeout_s=spec.layer_timeout_s,
        read_retries=spec.read_retries,
    )


def _wrap(engine, plan: FaultPlan):
    from .pd_faults import FaultInjector, FaultyEngine, FaultyOutbox

    if not plan.active:
        return engine, None, None
    inj = FaultInjector(plan)
    return FaultyEngine(engine, inj), FaultyOutbox(inj), inj


# perf_counter of the end of this worker process's latest engine read (ours or the raw replay's):
# Mooncake's TCP connections slow down after being idle (the kernel's slow start after idle,
# ``net.ipv4.tcp_slow_start_after_idle``: layers read 2-3x slower after >= 0.3 s of idle on
# loopback), so the raw replay is started after as long an idle as our reads were
_LAST_READ_END: List[Optional[float]] = [None]
REPLAY_IDLE_CAP_S = 3.0  # longest idle given to the raw replay before it starts


class _ReadClock:
    """Wraps a decode engine: stamps :data:`_LAST_READ_END` after every read (every run)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, peer_session, dst_addrs, src_addrs, lengths) -> None:
        try:
            self.inner.read(peer_session, dst_addrs, src_addrs, lengths)
        finally:
            _LAST_READ_END[0] = time.perf_counter()


class _RecordingEngine:
    """Wraps a decode engine: every successful read's arguments and wall interval, in order."""

    def __init__(self, inner):
        self.inner = inner
        self.reads: List[Tuple[str, List[int], List[int], List[int]]] = []
        self.intervals: List[Tuple[float, float]] = []  # (start, end) of each read, perf_counter
        self.first_start: Optional[float] = None
        self.last_end: Optional[float] = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, peer_session, dst_addrs, src_addrs, lengths) -> None:
        t0 = time.perf_counter()
        self.inner.read(peer_session, dst_addrs, src_addrs, lengths)
        self.last_end = time.perf_counter()
        if self.first_start is None:
            self.first_start = t0
        self.reads.append((peer_session, list(dst_addrs), list(src_addrs), list(lengths)))
        self.intervals.append((t0, self.last_end))


def raw_engine_replay(base, reads, reps: int = 1, per_call: Optional[List[float]] = None) -> Tuple[int, float]:
    """Issue ``reads`` again through the engine's own batch read API, in order, ``reps`` times.

    Returns ``(bytes per repetition, best seconds)``: the bare engine's time for exactly
    the transfers the protocol made (same registered buffers, same chunk lists, same
    processes), with no control plane in between. ``per_call``, when given, receives the
    seconds of each call (one per recorded read) of the best repetition.
    """
    native = base.native
    nbytes = sum(sum(n) for _, _, _, n in reads)
    best = float("inf")
    best_calls: List[float] = []
    for _ in range(reps):
        calls = []
        t0 = time.perf_counter()
        for session, dst, src, lengths in reads:
            c0 = time.perf_counter()
            rc = native.batch_transfer_sync_read(session, dst, src, lengths)
            _LAST_READ_END[0] = time.perf_counter()
            calls.append(_LAST_READ_END[0] - c0)
            if rc != 0:
                raise RuntimeError(f"raw engine replay: batch_transfer_sync_read returned {rc}")
        took = time.perf_counter() - t0
        if took < best:
            best, best_calls = took, calls
    if per_call is not None:
        per_call[:] = best_calls
    return nbytes, best


def raw_done_path(pool_path: str, d_rank: int) -> str:
    return f"{pool_path}.raw{d_rank}"


@dataclass
class _DecodeBuffers:
    """One decode rank's receiving memory: main KV in the host pool shared by the decode TP
    ranks (a shared memory file), indexer and scale in rank-local arrays."""

    pool: np.memmap  # the whole shared host pool file, mapped MAP_SHARED
    arrays: List[np.ndarray]  # every buffer the engine registers (pool parts, then local tensors)
    local: Dict[str, np.ndarray]  # tensor name -> [layers, pool_blocks, block_bytes] (rank-local)
    layout: Any  # transfer.layout.KVLayout over those buffers


def _decode_buffers(spec: ScenarioSpec, pool_path: str) -> _DecodeBuffers:
    """Map the host pool at ``pool_path``, allocate the rank-local tensors, lay them out."""
    from ..transfer.layout import layout_from_regions

    specs = _tensor_specs(spec)
    main_specs = [s for s in specs if s[0] == "main"]
    pool_bytes = spec.num_layers * spec.pool_blocks * sum(bb for _, _, bb in main_specs)
    pool = np.memmap(pool_path, dtype=np.uint8, mode="r+", shape=(pool_bytes,))  # MAP_SHARED
    raws, arrays, offset = [], [], 0
    for role, name, bb in main_specs:
        n = spec.num_layers * spec.pool_blocks * bb
        view = pool[offset : offset + n].reshape(spec.num_layers, spec.pool_blocks, bb)
        raws.append(_raw(role, name, [view[l] for l in range(spec.num_layers)]))
        arrays.append(pool[offset : offset + n])
        offset += n
    local: Dict[str, np.ndarray] = {}
    for role, name, bb in specs:
        if role != "main":
            local[name] = np.zeros((spec.num_layers, spec.pool_blocks, bb), dtype=np.uint8)
            raws.append(_raw(role, name, [local[name][l] for l in range(spec.num_layers)]))
            arrays.append(local[name])
    layout = layout_from_regions(spec.block_tokens, raws)
    if spec.measure_raw or spec.measure_memcpy:
        for a in arrays:  # a serving pool is long touched: no first-touch page faults in the timing
            a[...] = 0
    return _DecodeBuffers(pool, arrays, local, layout)


@dataclass
class _RawReplay:
    """The raw-engine replay of one decode rank's reads (``measure_raw``)."""

    result: Tuple[int, float]  # (bytes per repetition, best seconds): raw_engine_replay's answer
    calls: List[float]  # seconds of each replayed read, in order
    idle_ours: float  # engine idle before our first read
    idle_given: float  # the idle waited before the replay (idle_ours capped at REPLAY_IDLE_CAP_S)
    idle_seen: float  # the idle the replay really had


def _replay_raw(
    base, recorder: _RecordingEngine, arrays: List[np.ndarray], previous_read_end: Optional[float], done_path: str
) -> _RawReplay:
    """Replay ``recorder``'s reads through the bare engine, once every request is terminal here.

    Prefill still holds its buffers for this. Its slots hold the last layers by now, so the
    replay overwrites earlier layers' bytes: the delivered bytes are kept aside and put back
    for the parent's verification. ``done_path`` is created at the end (prefill then lets go).
    """
    saved = [a.copy() for a in arrays]
    # the same idle before the replay as before our first read (equal connection state)
    idle_ours = (
        recorder.first_start - previous_read_end
        if recorder.first_start is not None and previous_read_end is not None
        else REPLAY_IDLE_CAP_S
    )
    idle_given = min(max(idle_ours, 0.0), REPLAY_IDLE_CAP_S)
    time.sleep(max(0.0, idle_given - (time.perf_counter() - (_LAST_READ_END[0] or 0.0))))
    idle_seen = time.perf_counter() - (_LAST_READ_END[0] or 0.0)
    calls: List[float] = []
    try:
        result = raw_engine_replay(base, recorder.reads, per_call=calls)
    finally:
        for a, keep in zip(arrays, saved):
            a[...] = keep
        del saved
        open(done_path, "w").close()
    return _RawReplay(result, calls, idle_ours, idle_given, idle_seen)


def _serve_until_stopped(
    receiver, deadline: float, stop_path: str, replay: Optional[Callable[[], _RawReplay]]
) -> Optional[_RawReplay]:
    """Serve until every prefill rank has finished (``stop_path`` exists) and every request
    is terminal here with its failed destinations released, or until ``deadline``.

    ``replay`` (the raw-engine replay, when measured) runs once, as soon as no request is
    pending; its result is returned (None without one).
    """
    done: Optional[_RawReplay] = None
    while time.monotonic() < deadline:
        if replay is not None and done is None and not receiver.pending_requests():
            done = replay()
        if os.path.exists(stop_path) and not receiver.pending_requests() and not receiver.unreleased_failed():
            break
        time.sleep(0.005)
    if os.environ.get("PD_HARNESS_DEBUG") and time.monotonic() >= deadline:
        import faulthandler
        import sys

        faulthandler.dump_traceback(sys.stderr, all_threads=True)
    return done


def _claim_all(receiver, rids) -> Dict[str, str]:
    """Try to hand every request's destination out: ``claimed`` or ``refused: why``."""
    from ..transfer.errors import RequestFailed

    claims: Dict[str, str] = {}
    for rid in rids:
        try:
            receiver.claim(rid)
            claims[rid] = "claimed"
        except RequestFailed as exc:
            claims[rid] = f"refused: {exc.reason}"
        except Exception as exc:  # noqa: BLE001 - pending: not claimable either
            claims[rid] = f"refused: {exc}"
    return claims


def _decode_report(
    spec: ScenarioSpec,
    receiver,
    destinations,
    released: List[str],
    local: Dict[str, np.ndarray],
    injector,
    recorder: Optional[_RecordingEngine],
    replay: Optional[_RawReplay],
    t0: float,
) -> Dict[str, Any]:
    """What one decode rank reports to the parent once serving is over."""
    statuses = {rid: receiver.status(rid) for rid in destinations}
    claims = _claim_all(receiver, destinations)
    memcpy_bps = None
    if spec.measure_memcpy and receiver.stats.reads:
        memcpy_bps = _memcpy_rate(receiver.stats.read_bytes // receiver.stats.reads, receiver.stats.reads)
    raw = replay.result if replay is not None else None
    raw_calls = replay.calls if replay is not None else []
    return {
        "statuses": {r: (s.state.value, s.reason) for r, s in statuses.items()},
        "claims": claims,
        "released": released,
        "local": {k: v.copy() for k, v in local.items()},
        "stats": asdict(receiver.stats),
        "rejected": receiver.endpoint.rejected,
        "handler_errors": receiver.endpoint.handler_errors,
        "injected": dict(injector.injected) if injector else {},
        "memcpy_bytes_per_s": memcpy_bps,
        "timings": [(t.batch_id, t.layer, t.seconds) for t in receiver.timings],
        "read_ranges": [t.ranges for t in receiver.timings],
        "stages": receiver.stages.records() if receiver.stages is not None else None,
        "read_span": ((recorder.reads and recorder.last_end - recorder.first_start) or None)
        if recorder is not None
        else None,
        "read_gaps": (
            [b[0] - a[1] for a, b in zip(recorder.intervals, recorder.intervals[1:])] if recorder is not None else []
        ),
        # per read: ours = its read plus the idle gap before it (the first: its read alone),
        # raw = the same read replayed through the engine's own API
        "layer_seconds": (
            [b[1] - a[1] for a, b in zip(recorder.intervals, recorder.intervals[1:])]
            if recorder is not None and recorder.intervals
            else []
        ),
        "raw_layer_seconds": raw_calls[1:],
        "raw_bytes": raw[0] if raw else None,
        "raw_seconds": raw[1] if raw else None,
        # idle of this process's engine before our first read, the idle given to the raw
        # replay (the same, capped at REPLAY_IDLE_CAP_S) and the idle it really had
        "idle_before_reads_s": (replay.idle_ours, replay.idle_given, replay.idle_seen) if raw else None,
        "seconds_until_terminal": time.monotonic() - t0,
    }


def run_decode_rank(
    spec: ScenarioSpec,
    d_rank: int,
    kv_port: int,
    pool_path: str,
    destinations: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]],
    wait_s: float,
    stop_path: str,
) -> Dict[str, Any]:
    """Serve one decode TP rank like a long-lived server; report.

    It stays up until the parent signals that every prefill rank has finished
    (``stop_path`` exists) and every request is terminal here, or ``wait_s``.
    """
    from ..transfer.decode_side import DecodeReceiver
    from ..transfer.destinations import RequestDestination

    bufs = _decode_buffers(spec, pool_path)
    base = _engine(spec, "decode")
    regions = _regions(bufs.arrays)
    base.register(regions)
    engine, outbox, injector = _wrap(base, spec.decode_faults)
    recorder = None
    previous_read_end = _LAST_READ_END[0]  # before this run's first read (None: none in this process yet)
    engine = _ReadClock(engine)
    if spec.measure_raw:
        engine = recorder = _RecordingEngine(engine)
    released: List[str] = []
    receiver = DecodeReceiver(
        _config(spec, kv_port),
        d_tp=spec.d_tp,
        d_rank=d_rank,
        layout=bufs.layout,
        engine=engine,
        on_release=lambda d: released.append(d.request_id),
        send_filter=outbox,
    )
    replay = (
        None
        if recorder is None
        else functools.partial(
            _replay_raw, base, recorder, bufs.arrays, previous_read_end, raw_done_path(pool_path, d_rank)
        )
    )
    try:
        for rid, (main_blocks, idx_blocks) in destinations.items():
            receiver.expect(RequestDestination(rid, tuple(main_blocks), tuple(idx_blocks)))
        receiver.start()
        t0 = time.monotonic()
        raw = _serve_until_stopped(receiver, t0 + wait_s, stop_path, replay)
        return _decode_report(spec, receiver, destinations, released, bufs.local, injector, recorder, raw, t0)
    finally:
        receiver.close()
        base.unregister([a for a, _ in regions])
        del bufs


def _memcpy_rate(chunk_bytes: int, reps: int) -> float:
    """Bytes/s of a plain in-process copy of ``chunk_bytes``, ``reps`` times (numpy memcpy)."""
    src = np.random.default_rng(0).integers(0, 256, size=max(1, chunk_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    dt = time.perf_counter() - t0
    return chunk_bytes * reps / dt if dt > 0 else float("inf")


def _slot_images(
    spec: ScenarioSpec, specs: List[Tuple[str, str, int]], sources: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]]
) -> Dict[Tuple[int, str], np.ndarray]:
    """``(layer, tensor) -> the whole slot's bytes`` with every request's expected content.

    Every layer's content is made before the first publish: the layer loop then only copies a
    whole slot image (a stand-in for the forward's write), so the timed transfer does not wait
    on random-number generation or scattered writes.
    """
    images: Dict[Tuple[int, str], np.ndarray] = {}
    for layer in range(spec.num_layers):
        for role, name, bb in specs:
            image = images[(layer, name)] = np.zeros((spec.slot_blocks, bb), dtype=np.uint8)
            for rid, (main_blocks, idx_blocks) in sources.items():
                blocks = list(main_blocks if role == "main" else idx_blocks)
                image[blocks] = expected_block_bytes(spec.seed, rid, layer, name, len(main_blocks), bb)
    return images


def _prefill_handshake(sender, ids: List[str], report: Dict[str, Any]) -> None:
    """Announce the requests and connect; a failed handshake aborts every request."""
    from ..transfer.errors import HandshakeError

    try:
        sender.handshake()
    except HandshakeError as exc:
        report["handshake"] = f"{type(exc).__name__}: {exc}"
        for rid in ids:
            sender.abort(rid, f"handshake failed: {exc}")


@dataclass
class _PrefillSlots:
    """One prefill rank's reusable layer slots and what every layer writes into them."""

    buffers: Dict[str, List[np.ndarray]]  # tensor name -> one [slot_blocks, block_bytes] array per slot
    slot_of: List[int]  # layer -> its slot
    images: Dict[Tuple[int, str], np.ndarray]  # (layer, tensor) -> the whole slot's bytes of that layer


def _publish_layers(
    spec: ScenarioSpec,
    sender,
    gates,
    slots: _PrefillSlots,
    sources: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]],
    ids: List[str],
    report: Dict[str, Any],
) -> None:
    """Write and publish every layer through the reusable slots, each after its slot's gate opens.

    The first layer of every slot is in place before the first publish, as a forward would
    have written them while the handshake ran; a reused slot is rewritten only after its gate
    opens, while decode reads another layer. A gate timeout (a hang without our deadlines)
    stops the loop.
    """
    from ..layerwise_prefill.gates import GateError, GateTimeout
    from ..transfer.prefill_side import SourceBlocks

    for layer in range(min(spec.num_slots, spec.num_layers)):
        for name, buffers in slots.buffers.items():
            np.copyto(buffers[slots.slot_of[layer]], slots.images[(layer, name)])
    for layer in range(spec.num_layers):
        slot = slots.slot_of[layer]
        try:
            gates.wait_free(slot, spec.layer_timeout_s * 2 + 1.0)
        except GateError:
            report["gate_errors"] += 1  # previous content's read failed; slot is free
        except GateTimeout:
            report["gate_timeouts"] += 1  # would be a hang without our deadlines
            break
        if layer >= spec.num_slots:  # the first use of each slot was written before publishing
            for name, buffers in slots.buffers.items():
                np.copyto(buffers[slot], slots.images[(layer, name)])
        sender.publish_layer(
            layer,
            slot,
            {rid: SourceBlocks(m, i) for rid, (m, i) in sources.items()},
            finished=ids if layer == spec.num_layers - 1 else (),
        )


def _wait_settled(spec: ScenarioSpec, sender, ids: List[str]) -> None:
    """Wait until every batch is answered and every request is terminal, at most two layer
    deadlines (and a second)."""
    settle = time.monotonic() + spec.layer_timeout_s * 2 + 1.0
    while time.monotonic() < settle and (sender.open_batches() or any(not sender.status(r).terminal for r in ids)):
        time.sleep(0.005)


def _hold_buffers_for_replay(raw_done: str) -> None:
    """Keep the buffers registered while decode replays our reads on the bare engine: until
    it creates ``raw_done``, at most 120 s."""
    end = time.monotonic() + 120.0
    while time.monotonic() < end and not os.path.exists(raw_done):
        time.sleep(0.005)


def _prefill_report(sender, gates, injector, ids: List[str]) -> Dict[str, Any]:
    """What one prefill rank reports to the parent once its requests are settled."""
    statuses = {rid: sender.status(rid) for rid in ids}
    return {
        "statuses": {r: (s.state.value, s.reason) for r, s in statuses.items()},
        "open_batches": sender.open_batches(),
        "busy_slots": [(s, l, sorted(p)) for s, l, p in gates.busy_slots()],
        "stats": asdict(sender.stats),
        "rejected": sender.endpoint.rejected,
        "handler_errors": sender.endpoint.handler_errors,
        "injected": dict(injector.injected) if injector else {},
        "timings": [(t.batch_id, t.layer, t.seconds) for t in sender.timings],
        "stages": sender.stages.records() if sender.stages is not None else None,
    }


def run_prefill_rank(
    spec: ScenarioSpec,
    p_rank: int,
    kv_port: int,
    sources: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]],
    raw_done: Optional[str] = None,
) -> Dict[str, Any]:
    """Compute (write) and publish every layer of every request on one prefill rank; report."""
    from ..layerwise_prefill.gates import SlotGates
    from ..transfer.layout import layout_from_regions
    from ..transfer.prefill_side import PrefillSender

    specs = _tensor_specs(spec)
    slots = {
        name: [np.zeros((spec.slot_blocks, bb), dtype=np.uint8) for _ in range(spec.num_slots)] for _, name, bb in specs
    }
    slot_of = [layer % spec.num_slots for layer in range(spec.num_layers)]
    layout = layout_from_regions(
        spec.block_tokens,
        [_raw(role, name, [slots[name][slot_of[l]] for l in range(spec.num_layers)]) for role, name, _ in specs],
    )
    base = _engine(spec, "prefill")
    regions = _regions([a for arrs in slots.values() for a in arrs])
    base.register(regions)
    engine, outbox, injector = _wrap(base, spec.prefill_faults)
    gates = SlotGates(spec.num_slots)
    cfg = _config(spec, kv_port)
    sender = PrefillSender(
        cfg,
        p_tp=spec.p_tp,
        d_tp=spec.d_tp,
        p_rank=p_rank,
        layout=layout,
        engine=engine,
        gates=gates,
        decode_host="127.0.0.1",
        send_filter=outbox,
    )
    report: Dict[str, Any] = {"handshake": "ok", "gate_errors": 0, "gate_timeouts": 0}
    ids = list(sources)
    held = _PrefillSlots(slots, slot_of, _slot_images(spec, specs, sources))
    t0 = time.monotonic()
    timings = report["timings"] = {}
    try:
        for rid, n in zip(spec.request_ids, spec.request_blocks):
            sender.add_request(rid, n)
        _prefill_handshake(sender, ids, report)
        if sender.connected:
            _publish_layers(spec, sender, gates, held, sources, ids, report)
        timings["published"] = time.monotonic() - t0
        _wait_settled(spec, sender, ids)
        timings["settled"] = time.monotonic() - t0
        if raw_done is not None and sender.connected:  # the decode replays our reads: keep buffers
            _hold_buffers_for_replay(raw_done)
        report.update(_prefill_report(sender, gates, injector, ids))
        return report
    finally:
        sender.close()
        timings["closed"] = time.monotonic() - t0
        report["busy_slots_after_close"] = [(s, l, sorted(p)) for s, l, p in gates.busy_slots()]
        base.unregister([a for a, _ in regions])


# ------------------------------------------------------------------ parent side
@dataclass
class ScenarioResult:
    """What the parent concluded from one scenario (one row of the bench table)."""

    name: str
    outcome: str
    hung: bool
    destination_used_after_failure: bool
    leaked_slots: int
    verified: bool
    prefill: Dict[int, Any]
    decode: Dict[int, Any]
    request_status: Dict[str, Tuple[str, str]]
    problems: List[str]
    seconds: float


def _free_port_base(count: int) -> int:
    """First of ``count`` consecutive control ports, reserved across processes (flock'ed, below
    the ephemeral range: :mod:`sglang_ascend_offload.testing.ports`); give back with
    :func:`_release_ports`."""
    from .ports import reserve_port

    return reserve_port(count)


def _release_ports(base: int, count: int) -> None:
    from .ports import release

    release(base, count)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def plan_blocks(spec: ScenarioSpec):
    """Prefill source blocks and decode destination blocks per request (non-contiguous)."""
    from ..transfer.destinations import BlockPool

    rng = random.Random(spec.seed)
    total = sum(spec.request_blocks)
    if total > spec.slot_blocks or total > spec.pool_blocks:
        raise ValueError("requests do not fit the slot / pool blocks")
    src_main = rng.sample(range(spec.slot_blocks), total)
    src_idx = rng.sample(range(spec.slot_blocks), total)
    main_pool = BlockPool(spec.pool_blocks, shuffle_seed=spec.seed + 1)
    idx_pool = BlockPool(spec.pool_blocks, shuffle_seed=spec.seed + 2)
    sources, dests, k = {}, {}, 0
    has_idx = bool(spec.indexer_bytes)
    for rid, n in zip(spec.request_ids, spec.request_blocks):
        sources[rid] = (tuple(src_main[k : k + n]), tuple(src_idx[k : k + n]) if has_idx else ())
        dests[rid] = (main_pool.allocate(n), idx_pool.allocate(n) if has_idx else ())
        k += n
    return sources, dests


def _rank_tasks(spec: ScenarioSpec, kv_port: int, pool_path: str, stop_path: str, sources, dests):
    """``(decode_tasks, prefill_tasks)``: worker index -> ``(module, function, kwargs)``.
    Prefill ranks take workers ``0 .. p_tp - 1``, decode ranks the next ``d_tp`` (none
    when ``spec.decode_up`` is False)."""
    from ..transfer.topology import PDTopology

    wait_s = spec.layer_timeout_s * (spec.num_layers + 2) + spec.handshake_timeout_s
    decode_tasks, prefill_tasks = {}, {}
    if spec.decode_up:
        for d in range(spec.d_tp):
            decode_tasks[spec.p_tp + d] = (
                MODULE,
                "run_decode_rank",
                dict(
                    spec=spec,
                    d_rank=d,
                    kv_port=kv_port,
                    pool_path=pool_path,
                    destinations=dests,
                    wait_s=wait_s,
                    stop_path=stop_path,
                ),
            )
    topo = PDTopology(spec.p_tp, spec.d_tp)
    for p in range(spec.p_tp):
        raw_done = raw_done_path(pool_path, topo.d_rank_of(p)) if spec.measure_raw and spec.decode_up else None
        prefill_tasks[p] = (
            MODULE,
            "run_prefill_rank",
            dict(spec=spec, p_rank=p, kv_port=kv_port, sources=sources, raw_done=raw_done),
        )
    return decode_tasks, prefill_tasks


def _run_ranks(pool, spec: ScenarioSpec, sources, dests, timeout_s: float) -> Tuple[Dict[int, Any], float, np.ndarray]:
    """Run every rank of ``spec`` on ``pool``: ``(worker index -> report or exception, seconds,
    the decode host pool's bytes)``. The decode servers start first and stop once every
    prefill rank is done; the host pool file and the control ports are given back."""
    from .workers import collect, run_tasks

    kv_port = _free_port_base(spec.d_tp)
    main_bb = [w * spec.block_tokens for _, w in spec.main_tensors]
    pool_bytes = spec.num_layers * spec.pool_blocks * sum(main_bb)
    fd, pool_path = tempfile.mkstemp(prefix="pd_host_pool_", dir=_shm_dir())
    os.ftruncate(fd, pool_bytes)
    os.close(fd)
    stop_path = pool_path + ".stop"
    decode_tasks, prefill_tasks = _rank_tasks(spec, kv_port, pool_path, stop_path, sources, dests)
    t0 = time.monotonic()
    try:
        for i, (module, func, kwargs) in decode_tasks.items():
            pool.submit(i, module, func, **kwargs)
        out = run_tasks(pool, prefill_tasks, timeout_s)
        open(stop_path, "w").close()  # every prefill rank is done: decode servers may stop
        out.update(collect(pool, list(decode_tasks), max(1.0, timeout_s - (time.monotonic() - t0))))
        seconds = time.monotonic() - t0
        host_pool = np.fromfile(pool_path, dtype=np.uint8, count=pool_bytes)
    finally:
        for path in [pool_path, stop_path] + [raw_done_path(pool_path, d) for d in range(spec.d_tp)]:
            if os.path.exists(path):
                os.unlink(path)
        _release_ports(kv_port, spec.d_tp)
    return out, seconds, host_pool


def _leaked_slots_and_stuck(prefill: Dict[int, Any], decode: Dict[int, Any]) -> Tuple[int, bool]:
    """Slots still gated (before and after close) over the prefill ranks, and whether any
    rank timed out on a gate or left a request pending."""
    leaked, stuck = 0, False
    for p, r in prefill.items():
        if isinstance(r, dict):
            leaked += len(r["busy_slots"]) + len(r["busy_slots_after_close"])
            stuck |= r["gate_timeouts"] > 0 or any(s == "pending" for s, _ in r["statuses"].values())
    for d, r in decode.items():
        if isinstance(r, dict):
            stuck |= any(s == "pending" for s, _ in r["statuses"].values())
    return leaked, stuck


def _combined_status(spec: ScenarioSpec, rid: str, prefill_states: List[Tuple[str, str]], decode_ok: Dict[int, Any]):
    """The request's status as the scheduler sees it: decode's ranks combined, or failed
    when a decode rank did not report (died, or none was up)."""
    from ..transfer.status import RequestStatus, TransferState, combine_rank_statuses

    if decode_ok and len(decode_ok) == spec.d_tp:
        return combine_rank_statuses(
            [
                RequestStatus(TransferState(r["statuses"][rid][0]), r["statuses"][rid][1])
                for _, r in sorted(decode_ok.items())
            ]
        )
    seen = "; ".join(f"prefill: {why}" for s, why in prefill_states if s == "failed")[:400]
    return RequestStatus(TransferState.FAILED, f"{'decode rank(s) died' if spec.decode_up else 'no decode'}; {seen}")


def _request_statuses(
    spec: ScenarioSpec, prefill: Dict[int, Any], decode_ok: Dict[int, Any], problems: List[str]
) -> Tuple[Dict[str, Tuple[str, str]], bool]:
    """Every request's combined ``(state, reason)``, and whether a failed request's destination
    was handed out or never released (each such finding is added to ``problems``)."""
    from ..transfer.status import TransferState

    request_status: Dict[str, Tuple[str, str]] = {}
    used_after_failure = False
    for rid in spec.request_ids:
        prefill_states = [r["statuses"][rid] for r in prefill.values() if isinstance(r, dict)]
        st = _combined_status(spec, rid, prefill_states, decode_ok)
        if st.state is TransferState.DONE and any(s != "done" for s, _ in prefill_states):
            problems.append(f"{rid}: done on decode but not on every prefill rank")
        if st.state is not TransferState.DONE:
            for d, r in decode_ok.items():
                if r["claims"][rid] == "claimed":
                    used_after_failure = True
                    problems.append(f"{rid}: decode rank {d} handed a failed request's destination out")
                if r["statuses"][rid][0] == "failed" and rid not in r["released"]:
                    used_after_failure = True
                    problems.append(f"{rid}: decode rank {d} never released a failed destination")
        request_status[rid] = (st.state.value, st.reason)
    return request_status, used_after_failure


def _outcome(hung: bool, request_status: Dict[str, Tuple[str, str]]) -> str:
    """``hung``, ``done`` (every request) or ``failed: <the first failure's reason>``."""
    states = {s for s, _ in request_status.values()}
    if hung:
        return "hung"
    if states == {"done"}:
        return "done"
    reasons = [r for s, r in request_status.values() if s == "failed"]
    return "failed: " + (clip_words(reasons[0], 200) if reasons else "?")


def _judge(spec: ScenarioSpec, out: Dict[int, Any], dests, host_pool: np.ndarray, seconds: float) -> ScenarioResult:
    """The parent's verdict on one scenario from its ranks' reports and the host pool."""
    from .workers import TaskTimeout

    problems: List[str] = []
    hung = any(isinstance(v, TaskTimeout) for v in out.values())
    prefill = {p: out[p] for p in range(spec.p_tp)}
    decode = {d: out[spec.p_tp + d] for d in range(spec.d_tp) if spec.p_tp + d in out}
    for who, v in list(prefill.items()) + [(f"d{d}", v) for d, v in decode.items()]:
        if isinstance(v, Exception):
            problems.append(f"rank {who}: {type(v).__name__}: {str(v)[-400:]}")
    leaked, stuck = _leaked_slots_and_stuck(prefill, decode)
    hung |= stuck
    # request status across ranks: decode's combined view is what the scheduler sees
    decode_ok = {d: r for d, r in decode.items() if isinstance(r, dict)}
    request_status, used_after_failure = _request_statuses(spec, prefill, decode_ok, problems)
    verified = True  # every request decode calls done holds exactly prefill's bytes
    for rid, n in zip(spec.request_ids, spec.request_blocks):
        if request_status[rid][0] != "done":
            continue
        verified &= _verify_request(spec, rid, n, dests[rid], host_pool, decode_ok, problems)
    verified &= not used_after_failure
    return ScenarioResult(
        spec.name,
        _outcome(hung, request_status),
        hung,
        used_after_failure,
        leaked,
        verified,
        prefill,
        decode,
        request_status,
        problems,
        seconds,
    )


def run_scenario(pool, spec: ScenarioSpec, timeout_s: float = 60.0) -> ScenarioResult:
    """Run ``spec`` on ``pool`` (needs ``p_tp + d_tp`` workers) and judge it."""
    from ..transfer.topology import PDTopology

    PDTopology(spec.p_tp, spec.d_tp)  # invalid pairs fail here, before any process work
    if pool.size < spec.p_tp + spec.d_tp:
        raise ValueError(f"scenario needs {spec.p_tp + spec.d_tp} workers, pool has {pool.size}")
    sources, dests = plan_blocks(spec)
    out, seconds, host_pool = _run_ranks(pool, spec, sources, dests, timeout_s)
    return _judge(spec, out, dests, host_pool, seconds)


def clip_words(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` characters, else cut at the last word boundary + ``...``."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ;:,") + "..."


def _verify_request(spec, rid, n, dest, host_pool, decode_ok, problems) -> bool:
    """Bit-exact check of one done request: host pool (main) and every rank's indexer/scale."""
    import torch

    def same(got: np.ndarray, want: np.ndarray) -> bool:
        return torch.equal(torch.from_numpy(np.ascontiguousarray(got)), torch.from_numpy(want))

    main_blocks, idx_blocks = dest
    ok = True
    offset = 0
    for name, width in spec.main_tensors:
        bb = width * spec.block_tokens
        size = spec.num_layers * spec.pool_blocks * bb
        view = host_pool[offset : offset + size].reshape(spec.num_layers, spec.pool_blocks, bb)
        offset += size
        for layer in range(spec.num_layers):
            want = expected_block_bytes(spec.seed, rid, layer, name, n, bb)
            if not same(view[layer][list(main_blocks)], want):
                ok = False
                problems.append(f"{rid}: main tensor {name} layer {layer} differs in the host pool")
    for d, r in decode_ok.items():
        for name, local in r["local"].items():
            bb = local.shape[-1]
            for layer in range(spec.num_layers):
                want = expected_block_bytes(spec.seed, rid, layer, name, n, bb)
                if not same(local[layer][list(idx_blocks)], want):
                    ok = False
                    problems.append(f"{rid}: {name} layer {layer} differs on decode rank {d}")
    return ok


def valid_pairs(p_sizes=(1, 2, 4), d_sizes=(1, 2)) -> List[Tuple[int, int]]:
    return [(p, d) for p in p_sizes for d in d_sizes if p >= d and p % d == 0]


def fault_scenarios(base: Optional[ScenarioSpec] = None) -> List[ScenarioSpec]:
    """The failure table: each breaks one thing at layer 1 with short deadlines.

    The deadline (2 s) is short enough to keep the table quick but long enough that
    layer 0, which carries the first Mooncake connection, never misses it on a loaded
    2-core CI machine: with 0.5 s a slow layer 0 made prefill give up before the fault
    at layer 1 was ever reached, and the scenario tested nothing.
    """
    b = base or ScenarioSpec(name="base", p_tp=2, d_tp=1, layer_timeout_s=2.0, handshake_timeout_s=4.0, read_retries=1)
    r = b.read_retries
    return [
        # recovery, not a deadline, is under test here: a loaded machine must not turn
        # the retried read (or a decode worker's first engine start) into a deadline miss,
        # so this scenario gets roomy deadlines
        replace(
            b,
            name="read_retry_recovers",
            layer_timeout_s=max(b.layer_timeout_s, 10.0),
            handshake_timeout_s=max(b.handshake_timeout_s, 20.0),
            decode_faults=FaultPlan(fail_reads=r, fail_layers=(1,)),
        ),
        # every read of layer 1 fails (contributors read concurrently, a small budget could be
        # spread over them and absorbed by their retries)
        replace(b, name="read_failure", decode_faults=FaultPlan(fail_reads=1 << 20, fail_layers=(1,))),
        replace(b, name="dropped_answer", decode_faults=FaultPlan(drop_kinds=("read_done",), fault_layer=1)),
        replace(
            b,
            name="decode_slower_than_deadline",
            decode_faults=FaultPlan(read_delay_s=b.layer_timeout_s * 2, delay_layers=(1,)),
        ),
        replace(b, name="malformed_ready", prefill_faults=FaultPlan(truncate_kinds=("ready",), fault_layer=1)),
        replace(b, name="malformed_answer", decode_faults=FaultPlan(truncate_kinds=("read_done",), fault_layer=1)),
        replace(b, name="dead_decode", decode_faults=FaultPlan(exit_on_layer=1)),
        replace(b, name="decode_never_up", decode_up=False),
    ]
