"""Opt-in stage stamps of the per-layer control path (publish -> READ_DONE).

Off by default. With ``SGLANG_ASCEND_OFFLOAD_PD_TRACE=1`` in the environment of
both sides (or ``trace=True`` on :class:`~.prefill_side.PrefillSender` /
:class:`~.decode_side.DecodeReceiver`), each side records, per ready batch, the
``time.perf_counter_ns()`` of every step it takes (``PREFILL_STAMPS`` /
``DECODE_STAMPS``). ``perf_counter_ns`` is ``CLOCK_MONOTONIC`` on Linux, one
clock for every process of the machine, so stamps of the two sides subtract.
A disabled log costs one ``is None`` test per step.

:func:`stage_breakdown` turns both sides' records into per-stage durations
(``STAGES``, in path order) and their p50 / p99 in microseconds.
"""

from __future__ import annotations

import collections
import math
import os
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

TRACE_ENV = "SGLANG_ASCEND_OFFLOAD_PD_TRACE"
TRACE_LIMIT = 4096  # batches kept per side (most recent)

#: prefill-side stamps of one batch, in path order
PREFILL_STAMPS = (
    "publish",  # publish_layer entry
    "send_start",  # validation, ranges, slot gate done; endpoint.send entered
    "encoded",  # ReadReadyBatch validated and MessagePack-encoded
    "sent",  # sendall returned
    "answer_rx",  # the answer's bytes returned from recv() on the connection thread
    "answer_decoded",  # answer decoded and validated
    "handled",
)  # batch finished: gate released, request bookkeeping done
#: decode-side stamps of one batch, in path order
DECODE_STAMPS = (
    "rx",  # the batch's bytes returned from recv() on the connection thread
    "decoded",  # decoded and validated (msgspec + semantic checks)
    "read_start",  # ranges checked against the handshake, reads planned: engine call
    "read_end",  # the engine read returned
    "answer_start",  # bookkeeping after the read; endpoint.send entered
    "answer_encoded",  # READ_DONE encoded
    "answer_sent",
)  # sendall returned

#: (stage name, (side, from stamp), (side, to stamp)) in path order; ``read`` is the engine read
STAGES: Tuple[Tuple[str, Tuple[str, str], Tuple[str, str]], ...] = (
    ("prefill_prepare", ("p", "publish"), ("p", "send_start")),
    ("prefill_encode", ("p", "send_start"), ("p", "encoded")),
    ("prefill_send", ("p", "encoded"), ("p", "sent")),
    ("to_decode_wakeup", ("p", "sent"), ("d", "rx")),
    ("decode_decode", ("d", "rx"), ("d", "decoded")),
    ("decode_validate_plan", ("d", "decoded"), ("d", "read_start")),
    ("read", ("d", "read_start"), ("d", "read_end")),
    ("decode_bookkeeping", ("d", "read_end"), ("d", "answer_start")),
    ("decode_encode", ("d", "answer_start"), ("d", "answer_encoded")),
    ("decode_send", ("d", "answer_encoded"), ("d", "answer_sent")),
    ("to_prefill_wakeup", ("d", "answer_sent"), ("p", "answer_rx")),
    ("prefill_decode", ("p", "answer_rx"), ("p", "answer_decoded")),
    ("prefill_handle", ("p", "answer_decoded"), ("p", "handled")),
)


def trace_from_env() -> bool:
    """True when ``SGLANG_ASCEND_OFFLOAD_PD_TRACE`` is set to anything but ``""`` / ``0``."""
    return os.environ.get(TRACE_ENV, "") not in ("", "0")


class StageLog:
    """batch id -> {stamp name: perf_counter_ns}, the latest ``limit`` batches.

    Not locked: each batch's stamps are written by the threads that handle that
    batch one after another (the path is sequential), and a dict / OrderedDict
    item write is atomic under the GIL.
    """

    def __init__(self, limit: int = TRACE_LIMIT):
        self._limit = limit
        self._batches: "collections.OrderedDict[int, Dict[str, int]]" = collections.OrderedDict()

    def stamp(self, batch_id: int, name: str, ns: int) -> None:
        rec = self._batches.get(batch_id)
        if rec is None:
            rec = self._batches[batch_id] = {}
            if len(self._batches) > self._limit:
                self._batches.popitem(last=False)
        rec[name] = ns

    def stamps(self, batch_id: int, names: Iterable[str], values: Iterable[int]) -> None:
        for n, v in zip(names, values):
            self.stamp(batch_id, n, v)

    def records(self) -> Dict[int, Dict[str, int]]:
        """A copy: batch id -> stamps (picklable, for reports)."""
        return {b: dict(r) for b, r in list(self._batches.items())}


def _percentile(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, math.ceil(q / 100.0 * len(xs)) - 1)]


def stage_breakdown(
    prefill: Mapping[int, Mapping[str, int]], decode: Mapping[int, Mapping[str, int]]
) -> Dict[str, Dict[str, Optional[float]]]:
    """Per stage of ``STAGES``: ``{"p50", "p99", "n"}`` in microseconds over the batches
    both sides stamped completely (matched by batch id; one prefill and one decode rank).

    Also ``total_minus_read``: publish -> handled minus the read, the overhead the
    benchmark reports (here on ``perf_counter_ns`` stamps).
    """
    out: Dict[str, Dict[str, Optional[float]]] = {}
    samples: Dict[str, List[float]] = {name: [] for name, _, _ in STAGES}
    samples["total_minus_read"] = []
    for b, p in prefill.items():
        d = decode.get(b)
        if d is None or any(k not in p for k in PREFILL_STAMPS) or any(k not in d for k in DECODE_STAMPS):
            continue
        sides = {"p": p, "d": d}
        for name, (s0, k0), (s1, k1) in STAGES:
            samples[name].append((sides[s1][k1] - sides[s0][k0]) / 1e3)
        samples["total_minus_read"].append(((p["handled"] - p["publish"]) - (d["read_end"] - d["read_start"])) / 1e3)
    for name, xs in samples.items():
        out[name] = {"p50": _percentile(xs, 50), "p99": _percentile(xs, 99), "n": len(xs)}
    return out
