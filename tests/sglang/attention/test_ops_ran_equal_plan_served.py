"""The SGLang decode step runs exactly its operator plan, indexer included.

``dsa_harness.Harness`` (real SGLang objects: the ``Indexer``, pools, forward batches)
with every ladder implementation wrapped by ``tests/op_recorder.py`` before the backends
are built. Over the offload backend's decode steps, the ``(op, rung, via)`` that ran --
the indexer hook, the engine's residency step, miss copy and attention -- equal the
engine plan's ``decode_stages()``:

* ``ops: reference``: the reference indexer, the CPU residency kernels, the reference
  attention;
* ``ops: fused`` on the AscendC kernels' functional model: LIM selects and steps the
  residency, Copy-SFA copies and attends; nothing else runs.

The harness's device-KV backend (the comparison path) keeps unrecorded ops.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest
from dsa_harness import Harness, published_context
from op_recorder import planned, record_ops

from sglang_ascend_offload import config as cfg

pytestmark = pytest.mark.usefixtures("plugins_loaded")

#: shapes the fused kernels take (test_fused_indexer_components.py)
FUSED_SHAPE = dict(page_size=64, top_k=128, index_heads=8, max_context=1024, slots=4096)
DECODE_STEPS = 3


def _decode_calls(monkeypatch, ops: str, shape: dict, hot: int):
    originals = {}
    calls = record_ops(monkeypatch, originals)
    h = Harness(offload_config=cfg.SparseDecodeOffloadConfig(hot_tokens=hot, ops=ops), seed=5, **shape)
    for name in ("indexer_op", "attention_op"):  # the comparison path: not the subject
        impl = getattr(h.dense, name)
        setattr(h.dense, name, originals[(impl.op, impl.rung)])
    reqs = [h.new_request("a"), h.new_request("b")]
    h.extend(reqs, [300, 170])
    calls.clear()
    for _ in range(DECODE_STEPS):
        h.decode(reqs)
    return h, Counter(calls)


def _assert_ran_the_plan(h, ran):
    plan = h.offload.engine.plan
    assert set(ran) == planned(plan), f"ran {sorted(ran)}, the plan says {plan.describe()}"
    assert all(n >= DECODE_STEPS * h.layers for n in ran.values()), ran


def test_reference_decode_runs_its_plan(monkeypatch):
    with published_context():
        h, ran = _decode_calls(monkeypatch, "reference", dict(page_size=16, max_context=512), hot=32)
        assert set(ran) == {
            ("lightning_indexer", "reference", ""),
            ("residency_manage", "reference", "cpu kernel"),
            ("copy_miss_rows", "reference", "cpu kernel"),
            ("sparse_mla_attention", "reference", ""),
        }
        _assert_ran_the_plan(h, ran)


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ to build the AscendC functional model"
)
def test_fused_decode_runs_its_plan(monkeypatch):
    from sglang_ascend_offload.ops import ascendc_cpu_ops

    try:
        with published_context():
            h, ran = _decode_calls(monkeypatch, "fused", FUSED_SHAPE, hot=256)
            assert set(ran) == {
                ("lightning_indexer_manage", "fused", ""),
                ("copy_sparse_flash_attention", "fused", ""),
            }
            _assert_ran_the_plan(h, ran)
    finally:
        ascendc_cpu_ops.unregister()
