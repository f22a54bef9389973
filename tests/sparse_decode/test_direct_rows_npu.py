"""``residency: adaptive`` on an Ascend NPU: the engine's device side (the direct rows'
mask and identity slots, the copies into their buffers, the on-device permutation that
demotes them) on the NPU, against the ``always`` engine there and full-KV attention,
over the CPU test's workload (``test_direct_rows.run_adaptive_against_always``) with
the separate operators. (The fused Copy-SFA takes the production shapes only; direct
rows reach it as hit-only rows: no misses, positions as slots.)"""

from __future__ import annotations

import importlib

import pytest
from npu_requirements import npu_present, require_npu, requires

from .test_direct_rows import run_adaptive_against_always

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]


@requires(require_npu)
def test_adaptive_equals_always_on_the_npu():
    importlib.import_module("torch_npu")  # lazily: only an NPU runner has it
    run_adaptive_against_always("torch", "reference", device="npu")
