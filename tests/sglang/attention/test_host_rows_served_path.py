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
from dsa_harness import TOPK, Harness, published_context
from memfabric_group_worker import NoViewPool

from sglang_ascend_offload import config as cfg

pytestmark = pytest.mark.usefixtures("plugins_loaded")


def _same(step, what):
    for layer, (a, b) in enumerate(zip(step.dense_out, step.offload_out)):
        assert torch.equal(a, b), f"{what}: layer {layer} attention output differs"


def test_offload_without_a_tensor_view_equals_offload_off(monkeypatch):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool import sparse_decode as offload_pool
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp
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
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host.npu_memfabric import _runs

    src = torch.tensor([3, 4, 5, 9, 10, 2, 3])
    dst = torch.tensor([0, 1, 2, 3, 7, 8, 9])
    first, at, count = _runs(src, dst)
    assert first.tolist() == [3, 9, 10, 2] and at.tolist() == [0, 3, 7, 8] and count.tolist() == [3, 1, 1, 2]
    assert [t.numel() for t in _runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))] == [
        0,
        0,
        0,
    ]
    one = _runs(torch.tensor([5]), torch.tensor([0]))
    assert [t.tolist() for t in one] == [[5], [0], [1]]


def test_a_control_block_left_by_a_killed_rank0_is_reclaimed(tmp_path):
    """A rank 0 that died between creating the group's control mapping and unlinking it
    leaves ``sao_hostpool.<pid>....order``; the next start's reclaim removes it."""
    import subprocess
    import sys
    import textwrap

    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp

    code = textwrap.dedent(f"""
        from pathlib import Path
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import group_rendezvous as gr
        from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape
        ctl = gr._create(HostPoolShape(2, 64, 8, 4), 2, 0, Path({str(tmp_path)!r}), 5.0)
        print(ctl.path, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    left = tmp_path / out.stdout.strip().rsplit("/", 1)[-1]
    assert left.exists() and left.name.endswith(".order")
    header = shp.read_header(left)
    assert header is not None and header.group_size == 2 and not header.owner_alive()
    assert shp.reclaim_stale(tmp_path) == [left] and not left.exists()


def test_a_rank_whose_own_step_fails_names_the_groups_first_failure(tmp_path):
    """Rank 1 failed at 'joined' first; rank 0's own later error (e.g. its segment's store
    gone) is reported as the group's first cause: ``first_failure`` names rank 1 without
    waiting, and is ``None`` while every other rank is alive and well."""
    import mmap

    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import group_rendezvous as gr
    from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape

    shape = HostPoolShape(2, 64, 8, 4)
    ctl = gr._create(shape, 2, 0, tmp_path, 5.0)
    try:
        other = gr.GroupRendezvous(ctl.mapping, shape.layers, 2, rank=1, group=0, timeout_s=5.0)
        other.report("bm initialized")
        ctl.rendezvous.report("bm initialized")
        assert ctl.rendezvous.first_failure("joined") is None
        other.fail("joined", "RuntimeError: bm join returned -1 (injected)")
        err = ctl.rendezvous.first_failure("joined")
        assert isinstance(err, gr.GroupSetupError)
        assert "TP rank 1 failed at 'joined'" in str(err) and "injected" in str(err)
        assert other.first_failure("joined") is None  # its own failure is not another rank's
    finally:
        assert isinstance(ctl.mapping, mmap.mmap)
        ctl.close()
