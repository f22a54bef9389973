"""``residency: adaptive`` on an Ascend NPU: the engine's device side (the direct rows'
mask and identity slots, the copies into their buffers, the on-device permutation that
demotes them) on the NPU, against the ``always`` engine there and full-KV attention,
over the CPU test's workload (``test_direct_rows.run_adaptive_against_always``) with
the separate operators. (The fused Copy-SFA takes the production shapes only; direct
rows reach it as hit-only rows: no misses, positions as slots.)"""

from __future__ import annotations

import importlib

import npu_standin
import pytest
from npu_requirements import npu_present, require_npu, requires

from .test_direct_rows import STEPS, run_adaptive_against_always

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]


#: steps on the npu stand-in: the CPU twin (test_direct_rows.py) runs the full 400 of the same
#: workload on the same ops; the stand-in's point is the device side (half of them: directs,
#: demotions and spans all occur)
STANDIN_STEPS = 200


@requires(require_npu)
def test_adaptive_equals_always_on_the_npu():
    importlib.import_module("torch_npu")  # lazily: only an NPU runner has it
    steps = STANDIN_STEPS if npu_standin.installed() else STEPS
    run_adaptive_against_always("torch", "reference", device="npu", steps=steps)
