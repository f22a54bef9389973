"""Speculative decoding in the offload's observability: the overflow counters (engine stats,
Prometheus, the log line) and the speculative trace a NextN server records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ascend_offload.sglang_plugin.observability.metrics import METRIC_PREFIX, OffloadMetrics, summary_line
from sglang_ascend_offload.sglang_plugin.observability.trace_recorder import TraceRecorder, accepted_from_next_round
from sglang_ascend_offload.sparse_decode.spec_trace import is_spec_trace, load_spec_trace
from sglang_ascend_offload.sparse_decode.stats import Counters, DecodeStats, StatsAccumulator


def test_the_overflow_counters_accumulate_on_the_device_and_count_their_bytes():
    acc = StatsAccumulator(layers=2, row_bytes=1152)
    acc.overflow_counters(1).add_(torch.tensor([2, 7]))
    acc.overflow_counters(1).add_(torch.tensor([1, 3]))
    layer = acc.snapshot().per_layer
    assert (layer[0].overflow_rounds, layer[0].overflow_positions) == (0, 0)
    assert (layer[1].overflow_rounds, layer[1].overflow_positions, layer[1].overflow_h2d_bytes) == (3, 10, 10 * 1152)
    assert layer[1].selected == 0 and layer[1].h2d_bytes == 0  # not residency lookups or misses


class _Stats:
    def __init__(self, rounds, positions):
        c = [Counters(selected=4, hits=3, misses=1) for _ in range(2)]
        c[1].overflow_rounds, c[1].overflow_positions, c[1].overflow_h2d_bytes = rounds, positions, positions * 1152
        self.stats = DecodeStats(per_layer=c, steps=1)

    def __call__(self, wait=True):
        return self.stats


def test_prometheus_exports_the_overflow_counters_per_layer():
    prometheus_client = pytest.importorskip("prometheus_client")
    m = OffloadMetrics(
        _Stats(2, 9), layers=2, prometheus=True, log_interval_s=0, labels={"tp_rank": "7"}, export_interval_s=0
    )
    m.on_step_end()
    get = prometheus_client.REGISTRY.get_sample_value
    one = {"tp_rank": "7", "layer": "1"}
    assert get(f"{METRIC_PREFIX}overflow_rounds_total", one) == 2
    assert get(f"{METRIC_PREFIX}overflow_positions_total", one) == 9
    assert get(f"{METRIC_PREFIX}overflow_h2d_bytes_total", one) == 9 * 1152
    assert get(f"{METRIC_PREFIX}overflow_rounds_total", {"tp_rank": "7", "layer": "0"}) in (None, 0)


def test_the_log_line_names_overflow_once_it_happened():
    assert "overflow_rounds=2 overflow_positions=9" in summary_line(_Stats(2, 9).stats, [0.0, 0.0], 1.0)
    assert "overflow" not in summary_line(_Stats(0, 0).stats, [0.0, 0.0], 1.0)


def test_a_verify_round_recording_is_a_speculative_trace(tmp_path):
    """Three verify rows per request: request 7 commits 2 then 3 tokens, request 9 joins
    later in the freed trace row and its last round's outcome is unseen (0)."""
    path = tmp_path / "spec.npz"
    n, k = 3, 4
    rec = TraceRecorder(path, layers=2, rows=4, top_k=k, max_steps=10, meta={"x": 1}, rows_per_request=n)
    rounds = [([7, -1], [10, 0]), ([7, 9], [12, 5]), ([7, 9], [15, 7])]
    for reqs, committed in rounds:
        rec.begin_step(torch.tensor(committed, dtype=torch.int32), torch.tensor(reqs), torch.tensor([3, 5]))
        for layer in range(2):
            topk = torch.full((2 * n, k), -1, dtype=torch.int32)
            for b, (req, length) in enumerate(zip(reqs, committed)):
                if req >= 0:
                    for j in range(n):  # row j sees positions < L + j + 1
                        topk[b * n + j, :2] = torch.tensor([layer, length + j])
            rec.record_layer(layer, topk)
    rec.flush()
    assert is_spec_trace(path)
    spec = load_spec_trace(path)
    assert spec.rows_per_request == n and spec.rounds == 3 and spec.requests == 2
    assert spec.req_ids.tolist() == [[7, -1], [7, 9], [7, 9]]
    assert spec.committed.tolist() == [[10, 0], [12, 5], [15, 7]]
    assert spec.accepted.tolist() == [[2, 0], [3, 2], [0, 0]]  # from the next round; the last unseen
    assert spec.topk[1, 1, n + 2, :2].tolist() == [1, 7]  # request 9's third row, layer 1: L + 2
    assert (spec.topk[0, :, n:] == -1).all()  # request 9 not live in round 0


def test_accepted_counts_only_one_rounds_step():
    committed = np.array([[10], [11], [30]], dtype=np.int32)  # 11 -> 30: rounds the recording did not see
    reqs = np.array([[4], [4], [4]], dtype=np.int64)
    assert accepted_from_next_round(committed, reqs, 4).tolist() == [[1], [0], [0]]


def test_a_ranked_speculative_recording_is_refused(tmp_path):
    with pytest.raises(ValueError, match="record_trace_rank_depth"):
        TraceRecorder(tmp_path / "x.npz", 2, 4, 4, 10, {}, rank_depth=8, rows_per_request=2)
