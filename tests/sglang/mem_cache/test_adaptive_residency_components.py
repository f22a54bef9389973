"""``residency: adaptive`` in SGLang's hooks, eager and as SGLang's CPU graph runner replays it.

Two harnesses with the same seed and ``residency: adaptive`` (hot buffer 2 x top-k =
32 slots): one eager, one through the CPU graph hooks with a bucket of 4 (padded
replays, request churn). Requests start with contexts below the hot buffer (direct),
grow past it into the buffer of SGLang's free request slot (a span) or are demoted in
place mid-decode when there is no room. Per decode step and layer, on the live rows:

* the graph path's offload attention == the eager path's, and == the device-KV
  backend's on the same inputs, bit for bit (``test_graph_decode_components._step``);
* both engines hold the same residency state;
* direct rows, buffers lent from SGLang's free request slots and demotions happened
  on both, counted alike.
"""

from __future__ import annotations

import pytest
import torch
from dsa_harness import Harness, published_context
from graph_harness import BUCKET, _assert_same_residency, _prepare_decode, _prepare_extend, _step

pytestmark = pytest.mark.usefixtures("plugins_loaded")


@pytest.fixture
def ctx():
    with published_context():
        yield


def test_adaptive_graph_and_eager_equal_device_kv(ctx):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_ascend_offload import config as cfg

    adaptive = cfg.SparseDecodeOffloadConfig(hot_tokens=32, residency="adaptive")
    eager, graph = Harness(seed=5, offload_config=adaptive), Harness(seed=5, offload_config=adaptive)
    assert eager.offload.engine.direct is not None
    for backend in (graph.dense, graph.offload):
        backend.init_cpu_graph_state(BUCKET, BUCKET)
    zeros = torch.zeros(BUCKET, dtype=torch.int64)
    for backend in (graph.dense, graph.offload):
        backend.init_forward_metadata_capture_cpu_graph(
            BUCKET, BUCKET, zeros, torch.ones(BUCKET, dtype=torch.int64), zeros, None, ForwardMode.DECODE, None
        )

    def extend(reqs, lens):
        fb_e, fb_g = (_prepare_extend(h, [h.requests[r] for r in reqs], lens) for h in (eager, graph))
        _step(eager, graph, fb_e, fb_g, decode=False)

    def decode(reqs):
        fb_e, fb_g = (_prepare_decode(h, [h.requests[r] for r in reqs]) for h in (eager, graph))
        _step(eager, graph, fb_e, fb_g, decode=True)
        _assert_same_residency(eager, graph)

    for h in (eager, graph):
        for rid in ("a", "b", "c"):
            h.new_request(rid)
    # b stays in its own 32 slots; a and c outgrow theirs and compete for the one free request
    # slot's buffer (the first to need it spans it, the other is demoted)
    extend(["a", "b", "c"], [26, 5, 40])
    for batch in [["a", "b", "c"]] * 8 + [["a", "c"]] * 2:
        decode(batch)
    for h in (eager, graph):
        h.finish("b")
        h.new_request("d")  # b's row, first decoded in a padded replay
    extend(["d"], [30])
    for batch in [["a", "c", "d"]] * 4 + [["d"]] * 2:
        decode(batch)
    counts = [h.offload.engine.stats().total for h in (eager, graph)]
    for c in counts:
        assert c.direct_rows > 0 and c.demotions > 0 and c.lent_rows > 0, c
        assert c.misses > 0 and c.hits > 0
    for key in ("direct_rows", "demotions", "lent_rows", "reclaims", "hits", "misses"):
        assert getattr(counts[0], key) == getattr(counts[1], key), key
