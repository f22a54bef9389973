"""Runtime statistics of sparse decode offload: Prometheus counters and a log line.

Source of truth: the engine's :class:`~sglang_ascend_offload.sparse_decode.stats.DecodeStats`
(hits, misses, selected, host->device and device->host bytes, per layer) plus the
copy time per layer measured by the backend. :class:`OffloadMetrics` turns them into

* Prometheus metrics when SGLang runs with ``--enable-metrics`` (SGLang sets
  ``PROMETHEUS_MULTIPROC_DIR`` before it spawns its schedulers; the counters written
  here are served by SGLang's own ``/metrics`` endpoint), labelled by ``layer`` and
  SGLang's ``tp_rank`` / ``dp_rank``:

  ======================================================  ========  ======================
  name                                                    type      meaning
  ======================================================  ========  ======================
  ``sglang:ascend_offload_selected_total``                counter   valid top-k entries
  ``sglang:ascend_offload_hits_total``                    counter   entries already resident
  ``sglang:ascend_offload_misses_total``                  counter   entries copied host->device
  ``sglang:ascend_offload_h2d_bytes_total``               counter   bytes host->device
  ``sglang:ascend_offload_d2h_bytes_total``               counter   bytes device->host (appends)
  ``sglang:ascend_offload_copy_seconds_total``            counter   miss-copy time
  ``sglang:ascend_offload_row_selected_total``            counter   query rows' top-k entries (a
                                                                    position two verify rows select
                                                                    counts twice here, once above)
  ``sglang:ascend_offload_row_hits_total``                counter   those that were resident
  ``sglang:ascend_offload_shadow_checks_total``           counter   rows recomputed over the host
                                                                    pool (``verify_sample_rate``)
  ``sglang:ascend_offload_shadow_mismatches_total``       counter   those that differed
  ``sglang:ascend_offload_direct_rows_total``             counter   decode rows served from their hot
                                                                    buffer with no residency step
                                                                    (``residency: adaptive``)
  ``sglang:ascend_offload_direct_h2d_bytes_total``        counter   bytes host->device into such rows
  ``sglang:ascend_offload_demotions_total``               counter   direct requests demoted to the
                                                                    residency (per layer)
  ``sglang:ascend_offload_lent_rows_total``               counter   idle request slots' hot buffers
                                                                    lent to direct requests (per layer)
  ``sglang:ascend_offload_reclaims_total``                counter   demotions because a new request
                                                                    needed a lent buffer (per layer)
  ``sglang:ascend_offload_overflow_rounds_total``         counter   requests whose verify round's
                                                                    union exceeded their hot buffer
                                                                    (per layer; served from the
                                                                    overflow area)
  ``sglang:ascend_offload_overflow_positions_total``      counter   positions served from the overflow
                                                                    area (copied host->device each
                                                                    round they overflow)
  ``sglang:ascend_offload_overflow_h2d_bytes_total``      counter   bytes host->device into it
  ``sglang:ascend_offload_hit_rate``                      gauge     hits / selected (cumulative)
  ``sglang:ascend_offload_h2d_bytes_per_step``            gauge     host->device bytes per decode
                                                                    step (a verify round with
                                                                    speculation; cumulative)
  ======================================================  ========  ======================

* a one-line summary in the log every ``metrics_log_interval_s`` seconds.

Reading the engine's counters is one device->host read, and pushing them costs one
counter update per layer and counter: on a 61-layer model about 0.7 ms of Python, which
would be paid every decode step if every step exported. So the counters are exported at
most every :data:`EXPORT_INTERVAL_S` during decode, and in full at the two moments a
reader looks: before the scheduler streams a finished request's last output (a client
that scrapes after its request completed sees every step of it) and when the scheduler
is idle (:func:`flush_exports`, called from the plugin's hooks on SGLang's output
streamer and idle loop). The log summary reads them when it is due.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ...sparse_decode.stats import Counters, DecodeStats

logger = logging.getLogger("sglang_ascend_offload.sparse_decode")

METRIC_PREFIX = "sglang:ascend_offload_"
#: Longest a decode keeps Prometheus counters unexported (seconds; the default of the
#: ``metrics_export_interval_s`` key). Scrapers poll every few seconds; a finished request
#: and an idle scheduler flush at once regardless.
EXPORT_INTERVAL_S = 1.0
_COUNTER_FIELDS = (
    "selected",
    "hits",
    "misses",
    "h2d_bytes",
    "d2h_bytes",
    "row_selected",
    "row_hits",
    "shadow_checks",
    "shadow_mismatches",
    "direct_rows",
    "direct_h2d_bytes",
    "demotions",
    "lent_rows",
    "reclaims",
    "overflow_rounds",
    "overflow_positions",
    "overflow_h2d_bytes",
)


def summary_line(stats: DecodeStats, copy_seconds: List[float], elapsed_s: float, copy_timed: bool = True) -> str:
    """``sparse-decode-offload: steps=.. hit_rate=.. hits=.. misses=.. h2d=..MiB d2h=..MiB
    h2d/step=..KiB copy_ms/layer/step=.. rows/step=.. window=..s`` (``rows/step``: query
    rows the engine stepped per decode step, the measure of its per-step work; a step is
    one verify round with speculation), then ``shadow_checks=.. shadow_mismatches=..
    shadow_ms=..`` (cumulative) when shadow verification has checked rows, and
    ``direct_rows/step=.. direct_h2d=..MiB demotions=..`` with ``residency: adaptive``
    (``demotions``: requests, not layer steps), ``overflow_rounds=.. overflow_positions=..
    overflow_h2d=..MiB`` (layer steps) once a verify round overflowed. ``copy_timed`` false
    (copy time not measured, see :class:`OffloadMetrics`): ``copy_ms/layer/step=n/a``."""
    total: Counters = stats.total
    layers = max(1, len(stats.per_layer))
    per_step = 1000.0 * sum(copy_seconds) / layers / max(1, stats.steps)
    line = (
        f"sparse-decode-offload: steps={stats.steps} hit_rate={total.hit_rate:.3f} "
        f"hits={total.hits} misses={total.misses} h2d={total.h2d_bytes / 2**20:.2f}MiB "
        f"d2h={total.d2h_bytes / 2**20:.2f}MiB h2d/step={total.h2d_bytes / 1024 / max(1, stats.steps):.1f}KiB "
        f"copy_ms/layer/step={f'{per_step:.3f}' if copy_timed else 'n/a'} "
        f"rows/step={total.rows / layers / max(1, stats.steps):.2f} window={elapsed_s:.0f}s"
    )
    if total.shadow_checks:
        line += (
            f" shadow_checks={total.shadow_checks} shadow_mismatches={total.shadow_mismatches} "
            f"shadow_ms={total.shadow_us / 1000:.1f}"
        )
    if total.direct_rows or total.demotions:
        line += (
            f" direct_rows/step={total.direct_rows / layers / max(1, stats.steps):.2f} "
            f"direct_h2d={total.direct_h2d_bytes / 2**20:.2f}MiB demotions={total.demotions // layers} "
            f"lent_rows={total.lent_rows // layers} reclaims={total.reclaims // layers}"
        )
    if total.overflow_rounds:
        line += (
            f" overflow_rounds={total.overflow_rounds} overflow_positions={total.overflow_positions} "
            f"overflow_h2d={total.overflow_h2d_bytes / 2**20:.2f}MiB"
        )
    return line


@dataclass
class _Exported:
    """Values already pushed to Prometheus (counters only move by deltas)."""

    per_layer: List[Dict[str, float]] = field(default_factory=list)


class OffloadMetrics:
    """Per-step hook of the offload backend (see module docstring).

    stats_fn: ``stats_fn(wait=...)`` returns the engine's current :class:`DecodeStats`
    (``wait=False``: device counts as of the last completed asynchronous read).
    layers: engine layers. labels: constant Prometheus labels (``tp_rank`` ...).
    copy_timing: whether the copy time may be measured. Timing a copy on a device means
    synchronising it around each phase of every layer step, which would stall the
    decode: the backend passes ``False`` off the CPU, and ``copy_seconds`` then stays 0
    (``n/a`` in the summary). export_interval_s: the longest the Prometheus counters lag
    the engine during decode (the first step exports at once; :meth:`flush` any time).
    """

    def __init__(
        self,
        stats_fn: Callable[[], DecodeStats],
        layers: int,
        *,
        prometheus: bool,
        log_interval_s: float,
        labels: Optional[Dict[str, str]] = None,
        clock: Callable[[], float] = time.monotonic,
        copy_timing: bool = True,
        export_interval_s: float = EXPORT_INTERVAL_S,
    ):
        self._stats_fn = stats_fn
        self.layers = layers
        self.copy_seconds = [0.0] * layers
        self.log_interval_s = float(log_interval_s)
        self.copy_timing = bool(copy_timing)
        self._clock = clock
        self._last_log = clock()
        self._labels = dict(labels or {})
        self._exported = _Exported(
            per_layer=[dict.fromkeys(_COUNTER_FIELDS + ("copy_seconds",), 0.0) for _ in range(layers)]
        )
        self._prom = self._make_prometheus() if prometheus else None
        self._children: Optional[List[Dict[str, Any]]] = None  # labelled counters per layer, made on first export
        self._gauges: tuple = ()
        self.last_summary: Optional[str] = None
        self.export_interval_s = float(export_interval_s)
        self._last_export: Optional[float] = None  # clock of the last export; None: none yet
        self._unexported = False  # steps ended since the last export
        if self._prom is not None:
            _EXPORTING.add(self)

    @property
    def reports_copy_time(self) -> bool:
        """Prometheus or the log summary would show a copy time."""
        return self._prom is not None or self.log_interval_s > 0

    @property
    def needs_copy_timing(self) -> bool:
        return self.copy_timing and self.reports_copy_time

    def add_copy_time(self, layer: int, seconds: float) -> None:
        self.copy_seconds[layer] += seconds

    def on_step_end(self) -> None:
        """Export deltas (Prometheus) and log the summary when each is due."""
        now = self._clock()
        due = self.log_interval_s > 0 and now - self._last_log >= self.log_interval_s
        export = self._prom is not None and (
            due or self._last_export is None or now - self._last_export >= self.export_interval_s
        )
        if not export and not due:
            self._unexported = self._prom is not None
            return
        stats = self._stats_fn(wait=due)  # an export during decode never waits for the device
        if export:
            self._export(stats, now)
        if due:
            self.last_summary = summary_line(stats, self.copy_seconds, now - self._last_log, self.copy_timing)
            logger.info(self.last_summary)
            self._last_log = now

    def flush(self, wait: bool = False) -> bool:
        """Export the steps the interval held back, if any (``wait``: read the device
        counts as of now, for a device with nothing in flight). Whether it exported."""
        if self._prom is None or not self._unexported:
            return False
        self._export(self._stats_fn(wait=wait), self._clock())
        return True

    # ------------------------------------------------------------------ prometheus
    def _make_prometheus(self):
        key = tuple(sorted(self._labels))
        if key not in _PROMETHEUS:  # one set of metric objects per process (registry is global)
            _PROMETHEUS[key] = _create_prometheus(list(self._labels))
        return _PROMETHEUS[key]

    def _export(self, stats: DecodeStats, now: float) -> None:
        """Push each counter's change since the last export (the labelled children are
        looked up once and kept)."""
        self._last_export, self._unexported = now, False
        counters, gauge, per_step = self._prom
        if self._children is None:
            self._children = [
                {
                    key: counters[key].labels(**self._labels, layer=str(layer))
                    for key in _COUNTER_FIELDS + ("copy_seconds",)
                }
                for layer in range(self.layers)
            ]
            self._gauges = (gauge.labels(**self._labels), per_step.labels(**self._labels))
        for layer, c in enumerate(stats.per_layer):
            done, children = self._exported.per_layer[layer], self._children[layer]
            for key in _COUNTER_FIELDS:
                delta = getattr(c, key) - done[key]
                if delta > 0:
                    children[key].inc(delta)
                    done[key] += delta
            delta = self.copy_seconds[layer] - done["copy_seconds"]
            if delta > 0:
                children["copy_seconds"].inc(delta)
                done["copy_seconds"] = self.copy_seconds[layer]
        total = stats.total
        self._gauges[0].set(total.hit_rate)
        self._gauges[1].set(total.h2d_bytes / max(1, stats.steps))


_PROMETHEUS: Dict[tuple, tuple] = {}
# the exporting OffloadMetrics of this process (one per offload backend), for flush_exports
_EXPORTING: "weakref.WeakSet[OffloadMetrics]" = weakref.WeakSet()


def held_back() -> bool:
    """Whether an exporting :class:`OffloadMetrics` of this process holds steps back."""
    return any(m._unexported for m in _EXPORTING)


def flush_exports(wait: bool = False) -> int:
    """Export what the interval held back in every exporting :class:`OffloadMetrics` of
    this process (``wait``: see :meth:`OffloadMetrics.flush`); how many exported."""
    return sum(m.flush(wait) for m in list(_EXPORTING))


_DOCS = {
    "selected": "valid top-k entries seen by sparse decode offload",
    "hits": "top-k entries already resident in the device hot buffer",
    "misses": "top-k entries copied host->device",
    "h2d_bytes": "bytes copied host->device (miss rows)",
    "d2h_bytes": "bytes appended device->host (new token rows)",
    "copy_seconds": "seconds spent copying miss rows host->device",
    "row_selected": "query rows' top-k entries (speculative verify rows of a request counted one by one)",
    "row_hits": "query rows' top-k entries already resident",
    "shadow_checks": "rows whose served attention was recomputed over the host pool (shadow verification)",
    "shadow_mismatches": "shadow-verified rows whose served attention differed from the recomputation",
    "direct_rows": "decode rows served from their hot buffer with no residency step (residency adaptive)",
    "direct_h2d_bytes": "bytes copied host->device into the hot buffers of direct rows",
    "demotions": "direct requests demoted to the residency (their context outgrew the room, or a lent buffer "
    "was needed)",
    "lent_rows": "idle request slots' hot buffers lent to direct requests' spans",
    "reclaims": "direct requests demoted because a new request needed a hot buffer lent to them",
    "overflow_rounds": "requests whose verify round's union of top-k exceeded their hot buffer (served from the "
    "overflow area)",
    "overflow_positions": "positions served from the overflow area (beyond a request's hot buffer this round)",
    "overflow_h2d_bytes": "bytes copied host->device into the overflow area",
}


def _create_prometheus(labels: List[str]):
    """Counters (labels + ``layer``) and the hit-rate gauge, in prometheus_client's
    default registry (multiprocess mode when SGLang set ``PROMETHEUS_MULTIPROC_DIR``)."""
    from prometheus_client import Counter, Gauge  # after SGLang set PROMETHEUS_MULTIPROC_DIR

    counters = {
        key: Counter(name=f"{METRIC_PREFIX}{key}", documentation=doc, labelnames=labels + ["layer"])
        for key, doc in _DOCS.items()
    }
    gauge = Gauge(
        name=f"{METRIC_PREFIX}hit_rate",
        documentation="cumulative hit rate of sparse decode offload",
        labelnames=labels,
        multiprocess_mode="mostrecent",
    )
    per_step = Gauge(
        name=f"{METRIC_PREFIX}h2d_bytes_per_step",
        documentation="host->device bytes per decode step of sparse decode offload (cumulative)",
        labelnames=labels,
        multiprocess_mode="mostrecent",
    )
    return counters, gauge, per_step
