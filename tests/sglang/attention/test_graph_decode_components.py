"""Graph decode paths of both backends with real SGLang objects.

Two harnesses with the same seed (``dsa_harness.Harness``: the plain DSA backend over
device KV and the offload backend over the host pool): one eager, one with SGLang's
CPU graph hooks (``init_cpu_graph_state``, ``init_forward_metadata_capture_cpu_graph``)
and every decode batch handed over the way SGLang's CPU graph runner replays a
bucket of 4: batches of fewer requests padded with entries on the reserved
``req_to_token`` row 0 (length 1, ``out_cache_loc`` 0), without request ids or
``seq_lens_cpu``; a batch of 4 as the scheduler's own batch.

Through prefill, decode steps with request churn (a finished request's row reused
by a new request, seen first in a padded replay) and changing batch sizes:

* top-k of the graph path's static-width indexer == the reference indexer's, and
  attention outputs (plain: flat rows from the static block tables; offload: the
  engine step over static row buffers) == eager, bit for bit, for the live rows;
* the offload engine's residency (which position each slot holds, row owners) ==
  eager's, and the padding entries' sink row never holds anything.
"""

from __future__ import annotations

import pytest
import torch
from dsa_harness import Harness, published_context
from graph_harness import (
    BUCKET,
    _assert_same_residency,
    _prepare_decode,
    _prepare_extend,
    _step,
)

pytestmark = pytest.mark.usefixtures("plugins_loaded")


@pytest.fixture
def ctx():
    with published_context():
        yield


def test_graph_decode_equals_eager_with_padding_and_churn(ctx):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    eager, graph = Harness(seed=3), Harness(seed=3)
    for backend in (graph.dense, graph.offload):
        backend.init_cpu_graph_state(BUCKET, BUCKET)
    zeros = torch.zeros(BUCKET, dtype=torch.int64)
    for backend in (graph.dense, graph.offload):  # the runner's capture call: every entry padding
        backend.init_forward_metadata_capture_cpu_graph(
            BUCKET, BUCKET, zeros, torch.ones(BUCKET, dtype=torch.int64), zeros, None, ForwardMode.DECODE, None
        )
    assert graph.offload.offload_graph.rows.tolist() == [graph.offload.engine.sink_row] * BUCKET

    def extend(reqs, lens):  # both harnesses allocate the same slots
        fb_e, fb_g = (_prepare_extend(h, [h.requests[r] for r in reqs], lens) for h in (eager, graph))
        assert torch.equal(fb_e.out_cache_loc, fb_g.out_cache_loc)
        _step(eager, graph, fb_e, fb_g, decode=False)

    def decode(reqs):
        fb_e, fb_g = (_prepare_decode(h, [h.requests[r] for r in reqs]) for h in (eager, graph))
        assert torch.equal(fb_e.out_cache_loc, fb_g.out_cache_loc)
        _step(eager, graph, fb_e, fb_g, decode=True)

    for h in (eager, graph):
        for rid in ("a", "b", "c"):
            h.new_request(rid)
    extend(["a", "b", "c"], [40, 9, 23])
    schedule = [["a", "b", "c"]] * 4 + [["a", "c"]] * 2  # b finishes after step 3
    for batch in schedule:
        decode(batch)
        _assert_same_residency(eager, graph)
    for h in (eager, graph):
        h.finish("b")
        h.new_request("d")  # takes b's row: churn, first decoded in a padded replay
        h.new_request("e")
        assert h.requests["d"].row == eager.requests["d"].row
    extend(["d", "e"], [17, 30])
    for batch in [["a", "c", "d"]] * 3 + [["a", "c", "d", "e"]] * 3 + [["d"]] * 2 + [["c", "e"]] * 2:
        decode(batch)
        _assert_same_residency(eager, graph)
    stats = graph.offload.engine.stats()
    assert stats.total.misses > 0 and stats.total.hits > 0
