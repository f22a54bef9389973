"""Offload statistics export (Prometheus + log line) and bounded trace recording."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from sglang_ascend_offload.sglang_plugin.observability.metrics import METRIC_PREFIX, OffloadMetrics, summary_line
from sglang_ascend_offload.sglang_plugin.observability.trace_recorder import TraceRecorder, trace_path
from sglang_ascend_offload.sparse_decode.stats import Counters, DecodeStats
from sglang_ascend_offload.sparse_decode.trace import load_trace


class FakeStats:
    def __init__(self):
        self.stats = DecodeStats(per_layer=[Counters(), Counters()], steps=0)
        self.reads = 0

    def step(self, hits, misses, row_bytes=1152):
        self.stats.steps += 1
        for c in self.stats.per_layer:
            c.selected += hits + misses
            c.hits += hits
            c.misses += misses
            c.h2d_bytes += misses * row_bytes
            c.d2h_bytes += row_bytes

    def __call__(self, wait: bool = True):
        self.reads += 1
        return self.stats


def test_summary_line_numbers():
    fake = FakeStats()
    fake.step(hits=6, misses=2)
    line = summary_line(fake.stats, [0.002, 0.004], elapsed_s=30)
    assert "steps=1" in line and "hit_rate=0.750" in line and "hits=12" in line and "misses=4" in line
    assert "copy_ms/layer/step=3.000" in line
    assert f"h2d/step={2 * 2 * 1152 / 1024:.1f}KiB" in line  # 2 layers x 2 misses x 1152 B in 1 step
    assert "copy_ms/layer/step=n/a" in summary_line(fake.stats, [0.0, 0.0], elapsed_s=30, copy_timed=False)


def test_copy_time_is_not_measured_where_it_would_synchronise_the_device():
    """Off the CPU the backend passes ``copy_timing=False``: the engine is never asked to
    time (it would synchronise around every layer phase), with or without reporting."""
    for prometheus, interval in ((False, 30.0), (False, 0.0)):
        on_cpu = OffloadMetrics(FakeStats(), 2, prometheus=prometheus, log_interval_s=interval)
        on_device = OffloadMetrics(FakeStats(), 2, prometheus=prometheus, log_interval_s=interval, copy_timing=False)
        assert on_cpu.needs_copy_timing == (interval > 0) and on_cpu.reports_copy_time == (interval > 0)
        assert not on_device.needs_copy_timing and on_device.reports_copy_time == (interval > 0)


def test_log_line_is_periodic_and_reads_stats_only_when_due(caplog):
    now = [0.0]
    fake = FakeStats()
    m = OffloadMetrics(fake, layers=2, prometheus=False, log_interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="sglang_ascend_offload.sparse_decode"):
        for t in (1, 5, 9):
            now[0] = t
            fake.step(3, 1)
            m.on_step_end()
        assert fake.reads == 0 and m.last_summary is None
        now[0] = 10.5
        m.on_step_end()
    assert fake.reads == 1
    assert "sparse-decode-offload: steps=3 hit_rate=0.750" in caplog.text


def test_prometheus_counters_follow_the_engine():
    prometheus_client = pytest.importorskip("prometheus_client")
    fake = FakeStats()
    m = OffloadMetrics(
        fake, layers=2, prometheus=True, log_interval_s=0, labels={"tp_rank": "0"}, export_interval_s=0
    )  # every step
    fake.step(hits=5, misses=3)
    m.add_copy_time(1, 0.25)
    m.on_step_end()
    fake.step(hits=1, misses=0)
    m.on_step_end()
    get = prometheus_client.REGISTRY.get_sample_value
    labels = {"tp_rank": "0", "layer": "1"}
    assert get(f"{METRIC_PREFIX}hits_total", labels) == 6
    assert get(f"{METRIC_PREFIX}misses_total", labels) == 3
    assert get(f"{METRIC_PREFIX}h2d_bytes_total", labels) == 3 * 1152
    assert get(f"{METRIC_PREFIX}copy_seconds_total", labels) == 0.25
    assert get(f"{METRIC_PREFIX}hit_rate", {"tp_rank": "0"}) == pytest.approx(6 / 9)
    assert get(f"{METRIC_PREFIX}h2d_bytes_per_step", {"tp_rank": "0"}) == pytest.approx(2 * 3 * 1152 / 2)


def test_prometheus_export_is_held_back_by_the_interval_and_flushed():
    """During decode the counters are exported at most every ``export_interval_s``: the
    first step exports, the steps within the interval wait, the next step past it exports
    them all; ``flush`` exports the held-back steps at once and only when there are some."""
    prometheus_client = pytest.importorskip("prometheus_client")
    now = [100.0]
    fake = FakeStats()
    m = OffloadMetrics(
        fake,
        layers=2,
        prometheus=True,
        log_interval_s=0,
        labels={"tp_rank": "5"},
        clock=lambda: now[0],
        export_interval_s=1.0,
    )
    hits = lambda: prometheus_client.REGISTRY.get_sample_value(  # noqa: E731
        f"{METRIC_PREFIX}hits_total", {"tp_rank": "5", "layer": "0"}
    )
    for t in (100.0, 100.3, 100.6):
        now[0] = t
        fake.step(hits=2, misses=1)
        m.on_step_end()
    assert hits() == 2 and fake.reads == 1  # steps 2 and 3 held back, their stats not even read
    assert m.flush() and hits() == 6 and fake.reads == 2
    assert not m.flush() and fake.reads == 2  # nothing held back: no read, no export
    now[0] = 100.9
    fake.step(hits=2, misses=1)
    m.on_step_end()  # 0.3 s after the flush: held back
    assert hits() == 6
    now[0] = 101.7
    fake.step(hits=2, misses=1)
    m.on_step_end()
    assert hits() == 10


def test_scheduler_hooks_flush_before_a_finish_is_streamed_and_when_idle():
    """The plugin's hooks on SGLang's scheduler: a step's outputs with a finished request
    flush the held-back counters before they are sent, one without does not; the idle
    hook flushes (reading the device counts as of now)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang_ascend_offload.sglang_plugin.observability import export_hooks

    now = [0.0]
    fake = FakeStats()
    waits = []
    stats = lambda wait=True: (waits.append(wait), fake(wait))[1]  # noqa: E731
    m = OffloadMetrics(
        stats,
        layers=2,
        prometheus=True,
        log_interval_s=0,
        labels={"tp_rank": "6"},
        clock=lambda: now[0],
        export_interval_s=60.0,
    )
    misses = lambda: prometheus_client.REGISTRY.get_sample_value(  # noqa: E731
        f"{METRIC_PREFIX}misses_total", {"tp_rank": "6", "layer": "1"}
    )

    class Req:
        def __init__(self, done):
            self.done = done

        def finished(self):
            return self.done

    fake.step(hits=0, misses=4)
    m.on_step_end()
    fake.step(hits=0, misses=3)
    m.on_step_end()
    assert misses() == 4
    export_hooks.flush_before_stream_output(object(), [Req(False), Req(False)], False)
    assert misses() == 4  # nothing finished: the interval still holds
    export_hooks.flush_before_stream_output(object(), reqs=[Req(False), Req(True)], return_logprob=False)
    assert misses() == 7 and waits[-1] is False
    fake.step(hits=0, misses=5)
    m.on_step_end()
    export_hooks.flush_after_idle(None, object())
    assert misses() == 12 and waits[-1] is True


def test_scheduler_hooks_are_registered(plugins_loaded):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_ascend_offload.sglang_plugin import compat

    for target in (compat.TARGET_ON_IDLE, compat.TARGET_STREAM_OUTPUT):
        assert target in HookRegistry._patched, target


def test_trace_recorder_is_bounded_and_valid(tmp_path):
    path = tmp_path / "t.npz"
    rec = TraceRecorder(path, layers=2, rows=3, top_k=4, max_steps=5, meta={"x": 1}, flush_every=2)
    for step in range(8):
        seq = torch.tensor([step + 5, 0, step + 3], dtype=torch.int32)
        req = torch.tensor([7, -1, 9])
        rec.begin_step(seq, req)
        for layer in range(2):
            topk = torch.full((3, 4), -1, dtype=torch.int32)
            topk[0] = torch.tensor([0, 1, step + 4, 2])
            topk[2, :2] = torch.tensor([step + 2, 0])
            rec.record_layer(layer, topk)
        if step == 3:
            assert load_trace(path).steps == 4  # flushed every 2 steps
    trace = load_trace(path)
    assert trace.steps == 5 and rec.done
    assert np.array_equal(trace.seq_lens[:, 0], np.arange(5, 10))
    # compact trace rows: the idle batch entry takes none, request 9 is trace row 1
    assert trace.rows == 2 and (trace.req_ids[:, 1] == 9).all()
    assert trace.topk[4, 1, 0, 2] == 8 and trace.topk[4, 1, 1, :2].tolist() == [6, 0]
    assert (trace.topk[:, :, 1, 2:] == -1).all()


def test_trace_path_per_dp_rank():
    assert str(trace_path("/x/run.npz", None, 1)) == "/x/run.npz"
    assert str(trace_path("/x/run.npz", 3, 4)) == "/x/run.dp3.npz"


class _SlowEvent:
    """A device event that completes only when the test says so."""

    done = False

    def record(self, stream=None):
        pass

    def query(self):
        return _SlowEvent.done


def test_the_per_step_read_never_waits_for_the_device(monkeypatch):
    """``snapshot(wait=False)`` (the per-step Prometheus export): while the device has not
    finished the host copy, the device counts are the last ones that landed (no wait);
    host counts are current; ``wait=True`` (the interval's log summary) is always current.
    On CPU the copy completes at once and there is no lag."""
    from sglang_ascend_offload import platform
    from sglang_ascend_offload.sparse_decode.stats import StatsAccumulator

    acc = StatsAccumulator(layers=1, row_bytes=8)
    acc.record_residency(0, torch.tensor(4), torch.tensor(3), torch.tensor(1))
    assert acc.snapshot(wait=False).per_layer[0].selected == 4  # CPU: no lag
    monkeypatch.setattr(platform, "new_event", _SlowEvent)
    _SlowEvent.done = False
    acc.record_residency(0, torch.tensor(4), torch.tensor(4), torch.tensor(0))
    acc.record_d2h(0, 16)
    lagged = acc.snapshot(wait=False)
    assert lagged.per_layer[0].selected == 4 and lagged.per_layer[0].d2h_bytes == 16  # device lags, host current
    assert acc.snapshot(wait=True).per_layer[0].selected == 8
    _SlowEvent.done = True  # the copy started by the lagged read has landed
    assert acc.snapshot(wait=False).per_layer[0].hits == 7


def test_total_sums_every_counter_field():
    """``DecodeStats.total`` (read by every per-step export) adds each field of every layer."""
    from dataclasses import fields

    names = [f.name for f in fields(Counters)]
    layers = [Counters(*(10 * layer + i + 1 for i in range(len(names)))) for layer in range(3)]
    total = DecodeStats(per_layer=layers, steps=4).total
    for i, name in enumerate(names):
        assert getattr(total, name) == sum(10 * layer + i + 1 for layer in range(3)), name
