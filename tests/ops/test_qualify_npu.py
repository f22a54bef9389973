"""Kernel qualification on an Ascend NPU (marker ``npu``): the built ``_C_ascend`` extension
against the separate torch_npu operators, at DeepSeek-V3.2's shapes, as a server runs it
at startup with ``ops: auto`` (the NPU default plan: LIM or LIM-C8 + Copy-SFA).

Holds: every fused op qualifies (top-k, residency state and miss copies exact; attention
within the stated tolerance) and the problem exercised first fill, hits, misses and
evictions. The time is reported, not asserted (``bench kernels --qualify`` prints it; the
target is under 2 s). The CPU twin: ``test_qualify.py``.
"""

from __future__ import annotations

import pytest
from npu_requirements import require_npu_extension, requires

from sglang_ascend_offload.ops import fused, qualify
from sglang_ascend_offload.ops.qualify_problem import ServedShape
from sglang_ascend_offload.sparse_decode.op_selection import select_ops

pytestmark = pytest.mark.npu


def _extension():
    for kernel in (fused.LIM_KERNEL, fused.LIM_C8_KERNEL, fused.COPY_SFA_KERNEL):
        require_npu_extension(kernel)


@requires(_extension)
@pytest.mark.parametrize("indexer_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("verify_rows", [1, 2])
def test_the_npu_default_plan_qualifies_at_deepseek_shapes(indexer_dtype, verify_rows):
    shape = ServedShape(hot_tokens=4096, top_k=2048, rows_per_request=verify_rows, indexer_dtype=indexer_dtype)
    plan = select_ops(
        "npu", indexer_dtype=indexer_dtype, rows_per_request=verify_rows, hot_tokens=4096, top_k=2048
    ).check()
    results = qualify.qualify_at_startup(plan, shape)
    assert [r.label for r in results] == ["LIM-C8" if indexer_dtype == "int8" else "LIM", "Copy-SFA"]
    for r in results:
        assert r.qualified, r.difference
        cov = r.coverage
        assert cov["first_fill_rows"] == 1 and cov["hits"] and cov["misses"] and cov["evictions"], cov
