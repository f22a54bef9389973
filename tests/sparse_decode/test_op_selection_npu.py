"""On an Ascend node with the built AscendC extension, the defaults select the fused ops
(the CPU twin with a simulated platform: ``test_op_selection.py``).

On a runner without an NPU it skips with its reason; on an NPU runner a missing
torch_npu, extension or kernel fails (``tests/npu_requirements.py``).
"""

from __future__ import annotations

import pytest
from npu_requirements import npu_present, require_npu, require_npu_extension, requires

from sglang_ascend_offload.ops import fused
from sglang_ascend_offload.sparse_decode import op_selection

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]


def _extension_built():
    require_npu()
    for kernel in (fused.LIM_KERNEL, fused.LIM_C8_KERNEL, fused.COPY_SFA_KERNEL, fused.REGISTER_HOST_KERNEL):
        require_npu_extension(kernel)


@requires(_extension_built)
@pytest.mark.parametrize(
    "indexer_dtype, indexer_op", [("bf16", "lightning_indexer_manage"), ("int8", "quant_lightning_indexer_manage")]
)
def test_the_defaults_select_fused_on_an_npu_with_the_built_extension(indexer_dtype, indexer_op):
    plan = op_selection.select_ops(indexer_dtype=indexer_dtype).check()  # platform and extension detected
    assert plan.platform == "npu"
    assert plan.indexer.fused and plan.indexer.ops == (indexer_op,) and plan.indexer.source == "default"
    assert plan.attention.fused and plan.attention.ops == ("copy_sparse_flash_attention",)
    opted_out = op_selection.select_ops(fused_lim=False, fused_copy_sfa=False).check()
    assert not opted_out.indexer.fused and not opted_out.attention.fused
    # what the served backend runs: fused Copy-SFA, the separate indexer until it calls LIM
    served = op_selection.select_ops(indexer_dtype=indexer_dtype, indexer_wired=False).check()
    assert served.attention.fused and not served.indexer.fused
