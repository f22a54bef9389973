"""The layerwise prefill pipeline on an NPU: stores, gates, transfer streams and events.

The pipeline runs two forwards (the second reuses the first's prefix) on the NPU with a
local host store and the same on the host; the layer buffers end bit-identical, the
prefix is loaded, not recomputed. On the stand-in also: every load the pipeline issues
copies from pinned host memory (a copy from pageable memory would synchronise the
transfer stream on a node), and no stream waits on an event never recorded (the
stand-in session fails a test that does, ``tests/conftest.py``).

npu-marked: an NPU runner runs it on the device; CI on the stand-in (``SAO_NPU_STANDIN=1``).
"""

from __future__ import annotations

import npu_standin
import pytest
import torch
from npu_requirements import npu_present, require_npu, requires

from sglang_ascend_offload.layerwise_prefill.pipeline import LayerwisePrefillPipeline, PrefillRequest, run_forward
from sglang_ascend_offload.layerwise_prefill.planner import LayerKVSpec, TensorSpec, plan_buffers
from sglang_ascend_offload.layerwise_prefill.store_local import LocalHostKVStore

pytestmark = [pytest.mark.npu, pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN")]

PIPELINE = "sglang_ascend_offload/layerwise_prefill/"


def _compute(layer, buf, layout):
    """The layer's new rows (seeded by layer and position), written on the buffer's device."""
    for r in layout.requests:
        lo, hi = r.row0 + r.prefix_len, r.row0 + r.total_len
        g = torch.Generator().manual_seed(layer * 1000 + hi)
        for t in buf:
            t[lo:hi].copy_(torch.randn(hi - lo, t.shape[1], generator=g).to(t.dtype))


def _run(device: str):
    main = (TensorSpec((64, 512), "bfloat16"), TensorSpec((64, 64), "bfloat16"))
    plan = plan_buffers([LayerKVSpec(i, main) for i in range(6)], 2, [0])
    first = PrefillRequest("a", tuple(range(40)))
    second = PrefillRequest("b", tuple(range(32)) + (7, 7, 7))
    with LayerwisePrefillPipeline(plan, LocalHostKVStore(), block_tokens=16, device=torch.device(device)) as pipe:
        run_forward(pipe, [first], _compute)
        stats = run_forward(pipe, [second], _compute)
        return stats, [t.cpu().clone() for b in pipe.buffers for t in b]


@requires(require_npu)
def test_the_pipeline_on_the_npu_equals_the_host():
    if npu_standin.installed():
        from npu_standin import transfers

        with transfers.counting() as seen:
            stats, on_npu = _run("npu")
        loads = [t for t in seen.of("h2d") if t.site.startswith(PIPELINE)]
        assert loads and all(t.pinned for t in loads), seen.of("h2d")
    else:
        stats, on_npu = _run("npu")
    assert stats.prefix_tokens == 32 and stats.bytes_loaded > 0
    _, on_host = _run("cpu")
    assert len(on_npu) == len(on_host) and all(torch.equal(a, b) for a, b in zip(on_npu, on_host))
