"""The decode counters on an Ascend NPU: the per-step read (``snapshot(wait=False)``)
takes the device counts through an asynchronous host copy and an event, never a
synchronisation, and catches up with the synchronous read once the device is done."""

from __future__ import annotations

import importlib

import pytest
from npu_requirements import npu_present, require_npu, requires

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu"),
]


@requires(require_npu)
def test_the_nowait_read_catches_up_with_the_device_counts():
    importlib.import_module("torch_npu")  # lazily: only an NPU runner has it
    import torch

    from sglang_ascend_offload.sparse_decode.stats import StatsAccumulator

    acc = StatsAccumulator(layers=2, row_bytes=1152, device="npu")
    for step in range(20):
        for layer in range(2):
            hits = torch.tensor(step % 5, device="npu")
            acc.record_residency(layer, hits + 3, hits, torch.tensor(3, device="npu"))
        acc.record_step()
        seen = acc.snapshot(wait=False).total
        assert seen.selected <= (step + 1) * 2 * 3 + 2 * sum(s % 5 for s in range(step + 1))
    torch.npu.synchronize()
    exact = acc.snapshot(wait=True).total
    for _ in range(2):  # the copy in flight lands, then a fresh one is taken
        latest = acc.snapshot(wait=False).total
    assert (latest.selected, latest.hits, latest.misses) == (exact.selected, exact.hits, exact.misses)
    assert exact.misses == 20 * 2 * 3
