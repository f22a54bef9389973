"""The engine's fused Copy-SFA branch on an Ascend NPU (the twin of the CPU stand-in
test ``test_engine_equivalence.py::test_engine_fused_copy_sfa_path_equals_full_kv``).

The same comparison (``run_against_full_kv``: the same ``Workload`` with request churn,
idle rows, padded selections, two rows of one request and speculative suffixes rewritten
every step, the same seed and step count) with the engine on the NPU, ``ops=fused``, and
the real AscendC Copy-SFA operator of the built ``_C_ascend`` extension
(``torch.ops.sglang_ascend_offload.npu_fused_scatter_copy_sparse_flash_attention``) in
place of the stand-in, at shapes the kernel serves (``docs/fused_ops.md``: latent 512,
rope 64, top-k a multiple of 128; 16 heads, and 4 heads, which its host code pads to 8):

* every layer step goes through the fused operator;
* the hot buffer after each step: every occupied slot holds exactly its host row, the
  miss slots hold their host rows and no other slot changed (the copy is bit-exact);
* the misses equal the LRU contract model's, and H2D bytes equal misses x row bytes;
* the output matches the reference sparse attention over the full host KV within the
  fused kernels' tolerance (``ATTN_TOL``: bf16 probabilities, another summation order).

On a runner without an NPU it skips with its reason; on an NPU runner a missing
torch_npu, extension or operator fails (``tests/npu_requirements.py``).
"""

from __future__ import annotations

import dataclasses
import importlib

import npu_standin
import pytest
from npu_requirements import npu_present, require_npu, require_npu_extension, requires

from sglang_ascend_offload.ops import fused, registry

from .test_engine_equivalence import STAND_IN_SEED, STAND_IN_STEPS, Dims, pool_tokens, run_against_full_kv

ATTN_TOL = 2e-2  # the fused kernels' bf16 tolerance (docs/fused_ops.md, tests/ops/test_fused_npu.py)
#: steps on the npu stand-in: its Copy-SFA is the functional model, whose arithmetic the CPU twin
#: (test_engine_fused_cpu_model.py, 12 steps) runs; the stand-in's point is the device path
STANDIN_STEPS = 12

# Shapes the fused Copy-SFA serves. Contexts reach beyond top-k, so selections are both
# whole contexts (padded with -1) and random subsets; the hot buffer holds two top-k.
NPU_DIMS = Dims(
    layers=2,
    rows=4,
    k=128,
    hot=256,
    latent=512,
    rope=64,
    heads=16,
    max_ctx=398,
    first_len=300,
    scale=(512 + 64) ** -0.5,
)

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]


def _npu_ready():
    require_npu()
    require_npu_extension(fused.COPY_SFA_KERNEL)


@requires(_npu_ready)
@pytest.mark.parametrize("heads", [16, 4])
def test_engine_fused_copy_sfa_on_the_npu_matches_full_kv(heads, monkeypatch):
    importlib.import_module("torch_npu")  # lazily: only an NPU runner has it (it registers the "npu" device)
    from sglang_ascend_offload.ops.contract import OpImpl
    from sglang_ascend_offload.ops.registry import _REGISTRY

    dims = dataclasses.replace(NPU_DIMS, heads=heads)
    # The engine registers each layer's view of the host pool with the extension on first
    # use; aclrtHostRegister needs 4 KiB-aligned views, as a served pool (a page-size
    # multiple of tokens) has: rows of 1152 B, so a multiple of 32 rows per layer.
    assert pool_tokens(dims) % 32 == 0
    real = registry.select("copy_sparse_flash_attention", "fused")  # the AscendC operator
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real.fn(*args, **kwargs)

    monkeypatch.setitem(
        _REGISTRY.impls,
        ("copy_sparse_flash_attention", "fused"),
        OpImpl("copy_sparse_flash_attention", "fused", counted, real.unavailable),
    )
    steps = STANDIN_STEPS if npu_standin.installed() else STAND_IN_STEPS
    stats = run_against_full_kv(
        "lru", steps, seed=STAND_IN_SEED, ops="fused", dims=dims, device="npu", attention_tol=ATTN_TOL
    )
    assert stats.steps == steps and len(calls) == steps * dims.layers
