"""The served offload pool + backend over a host pool without a tensor view.

What the NPU attention-TP > 1 ranks run (their MemFabric group pool is reached
through global addresses), in one process with real SGLang objects: the host pool is
a :class:`HostKVPool` behind the host-rows interface only (``NoViewPool``), so the
prefill's extend gather goes through ``HostMainKVPool.read_host_rows``, the appends
through ``write_rows`` and every decode miss copy through ``gather_into``. Offload
on == offload off, bit for bit, with a cached prefix and request churn.
"""

from __future__ import annotations

import pytest
import torch

from sglang_ascend_offload import config as cfg

from dsa_harness import TOPK, Harness, published_context
from memfabric_group_worker import NoViewPool

pytestmark = pytest.mark.usefixtures("plugins_loaded")


def _same(step, what):
    for layer, (a, b) in enumerate(zip(step.dense_out, step.offload_out)):
        assert torch.equal(a, b), f"{what}: layer {layer} attention output differs"


def test_offload_without_a_tensor_view_equals_offload_off(monkeypatch):
    from sglang_ascend_offload.sglang_plugin import offload_pool, shared_host_pool as shp
    from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool

    made = []

    def allocate(shape, kind, **_):
        made.append(NoViewPool(HostKVPool.allocate(shape, "pinned")))
        return shp.RankPool(made[-1], None, 0, None)

    monkeypatch.setattr(offload_pool, "allocate_rank_pool", allocate)
    with published_context():
        h = Harness(offload_config=cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK))
        a = h.new_request("a")
        _same(h.extend([a], [40]), "prefill a")
        b = h.new_request("b", prefix_from="a", prefix_len=32)
        c = h.new_request("c")
        _same(h.extend([b, c], [9, 23]), "prefill b (prefix hit) + c")
        with pytest.raises(RuntimeError, match="no tensor view"):
            h.offload_pool.host_rows(0)
        for step in range(12):
            batch = [r for r in (a, b, c) if r.rid in h.requests]
            _same(h.decode(batch), f"decode step {step}")
            if step == 5:
                h.finish("c")
                d = h.new_request("d")
                _same(h.extend([d], [50]), "prefill d")
                c = d
    assert made and made[0].gathers > 0
    total = h.offload.engine.stats().total
    assert total.misses > 0 and total.hits > 0


def test_group_pool_merges_runs_of_consecutive_source_and_destination_rows():
    from sglang_ascend_offload.sglang_plugin.memfabric_shared_pool import _runs

    src = torch.tensor([3, 4, 5, 9, 10, 2, 3])
    dst = torch.tensor([0, 1, 2, 3, 7, 8, 9])
    first, at, count = _runs(src, dst)
    assert first.tolist() == [3, 9, 10, 2] and at.tolist() == [0, 3, 7, 8] and count.tolist() == [3, 1, 1, 2]
    assert [t.numel() for t in _runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))] \
        == [0, 0, 0]
    one = _runs(torch.tensor([5]), torch.tensor([0]))
    assert [t.tolist() for t in one] == [[5], [0], [1]]
