"""The sparse decode engine with ``ops="fused"`` on CPU: the AscendC Copy-SFA kernel run on
its functional model (``ops/ascendc_cpu_ops.py``), against ``ops="reference"``.

The same workload as the NPU twin (``test_engine_fused_npu.py``: request churn, idle rows,
padded selections, two rows of one request, speculative suffixes rewritten every step) at
the shapes the kernel serves (latent 512, rope 64, top-k 128, hot 256; 16 heads, and 4
heads padded to 8 by the host code), fewer steps (the model is slow):

* every layer step runs the fused Copy-SFA op, which is the model (nothing stands in);
* per step (``run_against_full_kv``): each occupied slot holds exactly its host row, the
  miss slots hold their host rows and nothing else moved, misses equal the LRU contract
  model's, H2D bytes equal misses x row bytes, and the output matches attention over the
  full host KV within the fused tolerance (``2e-2``, absolute and relative);
* the run's counters (selected, hits, misses, H2D / D2H bytes, rows) equal the
  ``ops="reference"`` run's exactly.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

from sglang_ascend_offload.ops import ascendc_cpu_ops, fused, registry

from .test_engine_equivalence import run_against_full_kv
from .test_engine_fused_npu import NPU_DIMS

ATTN_TOL = 2e-2  # docs/fused_ops.md: the fused Copy-SFA tolerance
STEPS = 12

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ to build the AscendC functional model"
)


@pytest.fixture(scope="module")
def fused_cpu():
    """``ops="fused"`` on CPU registers the model ops; removed after this module."""
    registry.select("copy_sparse_flash_attention", "fused")
    assert ascendc_cpu_ops.registered()
    yield
    ascendc_cpu_ops.unregister()


@pytest.mark.parametrize("heads", [16, 4])
def test_engine_with_ops_fused_on_cpu_equals_ops_reference(fused_cpu, heads, monkeypatch):
    from sglang_ascend_offload.ops.contract import OpImpl
    from sglang_ascend_offload.ops.registry import _REGISTRY

    dims = dataclasses.replace(NPU_DIMS, heads=heads)
    steps = STEPS
    reference = run_against_full_kv("lru", steps, seed=99, ops="reference", dims=dims)
    real = registry.select("copy_sparse_flash_attention", "fused")
    assert real.fn is fused.copy_sparse_flash_attention_fused
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real.fn(*args, **kwargs)

    monkeypatch.setitem(
        _REGISTRY.impls,
        ("copy_sparse_flash_attention", "fused"),
        OpImpl("copy_sparse_flash_attention", "fused", counted, real.unavailable),
    )
    got = run_against_full_kv("lru", steps, seed=99, ops="fused", dims=dims, attention_tol=ATTN_TOL)
    assert len(calls) == steps * dims.layers  # every layer step ran the model's Copy-SFA
    for field in ("selected", "hits", "misses", "h2d_bytes", "d2h_bytes", "rows"):
        assert getattr(got.total, field) == getattr(reference.total, field), field
    assert got.total.misses > 0 and got.total.hits > 0
