"""Shadow verification on an NPU (an NPU runner, or the stand-in: ``SAO_NPU_STANDIN=1
python -m pytest -m npu``): with ``ops: npu`` the engine attends with torch_npu's
``npu_sparse_flash_attention``, which takes device tensors only; the check recomputes each
sampled row on the device with that same op (``sparse_decode/shadow.py``).

* a correct engine: every layer step checks a row, every check bit-exact;
* a corrupted hot buffer that the next steps take as hits: caught and counted on that
  layer only.
"""

from __future__ import annotations

import pytest
from npu_requirements import npu_present, require_npu, requires

from .engine_steps import NPU, run_steps

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]


@requires(require_npu)
def test_every_check_of_a_correct_npu_engine_is_bit_exact():
    engine, _ = run_steps("npu", "auto", NPU, device="npu", verify_sample_rate=1.0, verify_action="fail")
    assert engine.plan.rung("sparse_mla_attention").rung == "npu"
    shadow = engine.shadow
    assert shadow.checks == NPU["steps"] * NPU["layers"] and shadow.mismatches == 0
    assert shadow.last.exact and shadow.last.max_abs_diff == 0.0


@requires(require_npu)
def test_a_corrupted_npu_hot_buffer_is_caught_on_its_layer():
    def corrupt(engine, step, layer):
        if step == 3 and layer == 1:
            engine.hot.layer(1).add_(1.0)  # every resident row of layer 1, still claimed by the residency

    engine, _ = run_steps("npu", "auto", NPU, device="npu", verify_sample_rate=1.0, before_layer=corrupt)
    per_layer = engine.stats().per_layer
    assert engine.shadow.mismatches > 0
    assert per_layer[1].shadow_mismatches == engine.shadow.mismatches and per_layer[0].shadow_mismatches == 0
