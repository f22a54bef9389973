"""The engine's fused Copy-SFA branch on an Ascend NPU (the twin of the CPU stand-in
test ``test_engine_equivalence.py::test_engine_fused_copy_sfa_path_equals_full_kv``).

With ``ops=fused`` on an NPU the engine hands copy + attention of every layer step to
the AscendC Copy-SFA operator of the built ``_C_ascend`` extension. Over a workload with
request churn, idle rows, padded selections and speculative suffixes rewritten every
step (the same ``Workload`` as the CPU test):

* every occupied hot-buffer slot holds exactly its host row (the operator's copy is
  bit-exact);
* each step's H2D bytes equal misses x row bytes;
* the output matches the reference sparse attention over the full host KV within the
  stated tolerance of the fused kernels (``ATTN_TOL``, bf16 accumulation order differs).

On a runner without an NPU it skips with its reason; on an NPU runner a missing
extension or operator fails (``tests/npu_requirements.py``).
"""

from __future__ import annotations

import pytest
import torch

from npu_requirements import npu_present, require_npu_extension, requires
from sglang_ascend_offload.ops import fused, registry
from sglang_ascend_offload.ops.contract import ResidencyTable
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.verify import full_kv_attention, resident_mismatches

from .test_engine_equivalence import (HOT, K, LATENT, LAYERS, MAX_CTX, ROPE, ROWS, SCALE, Workload,
                                      begin_workload_step, layer_inputs)

ATTN_TOL = 2e-2  # the fused kernels' bf16 tolerance (tests/ops/test_fused_npu.py)

pytestmark = [pytest.mark.npu,
              pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu")]


@requires(lambda: require_npu_extension(fused.COPY_SFA_KERNEL))
def test_engine_fused_copy_sfa_on_the_npu_matches_full_kv():
    steps = 60
    host_tokens = ROWS * MAX_CTX + 8
    pool = HostKVPool.allocate(HostPoolShape(LAYERS, host_tokens, LATENT, ROPE), "pinned")
    engine = SparseDecodeEngine(EngineConfig(LAYERS, ROWS, HOT, K, LATENT, ROPE, policy="lru", ops="fused"),
                                pool, device="npu")
    assert engine._copy_sfa_op is not None and engine._copy_sfa_op.rung == "fused"
    attention = registry.select("sparse_mla_attention", "reference")
    gen = torch.Generator().manual_seed(7)
    work = Workload(7, host_tokens)
    written = {}
    row_bytes = (LATENT + ROPE) * 2
    for step in range(steps):
        req_ids, seq_lens, stable, table, writes = begin_workload_step(engine, work, written, step)
        idx = torch.tensor(writes, dtype=torch.int64)
        before = engine.stats()
        for layer in range(LAYERS):
            if writes:
                engine.append(layer, idx, torch.randn((len(writes), LATENT + ROPE), generator=gen).to(torch.bfloat16))
            topk, q, qr = layer_inputs(work, gen, seq_lens, req_ids)
            res = engine.run_layer(layer, torch.from_numpy(topk), q.npu(), qr.npu(), SCALE)
            ref = full_kv_attention(attention, pool, layer, torch.from_numpy(topk), table, q, qr, SCALE)
            torch.testing.assert_close(res.output.cpu().float(), ref.float(), atol=ATTN_TOL, rtol=ATTN_TOL)
            state = engine.table(layer)
            cpu_state = ResidencyTable(state.slot_token.cpu(), state.slot_stamp.cpu(), state.row_req.cpu())
            assert resident_mismatches(cpu_state, engine.hot.layer(layer).cpu(), pool.layer(layer), table) == 0
        after = engine.stats()
        assert after.total.h2d_bytes - before.total.h2d_bytes == (after.total.misses - before.total.misses) * row_bytes
    assert 0 < engine.stats().total.misses < engine.stats().total.selected
    pool.close()
