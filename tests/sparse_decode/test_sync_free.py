"""The offloaded decode step is sync-free and capturable.

(a) CPU: the per-layer step (:func:`decode_layer_step`: residency of every serving
    policy in the rows form, miss copy, remap, sparse attention) of two layers runs
    under ``torch.compile(fullgraph=True)`` (a graph break fails the test, and so does
    a recompilation after the first step) through request churn, a changing batch
    with a padding entry on the sink row and speculative suffixes. Residency state,
    outputs and hot buffers are compared bit for bit with an eager run of the same
    inputs; attention outputs within ``|c - e| <= 2e-2 + 2e-2 |e|`` (bf16 outputs,
    fused float32 arithmetic may round differently).
(b) ``npu``: the same step captured in an NPU graph, replayed across steps with
    changing top-k, equals eager.
(c) CUDA (skipped without a CUDA device): the Triton rung's step captured in a CUDA
    graph under ``torch.cuda.set_sync_debug_mode("error")`` and replayed, bit-exact
    against eager.
"""

from __future__ import annotations

import pytest
import torch
from npu_requirements import npu_present

from sglang_ascend_offload import platform
from sglang_ascend_offload.sparse_decode.engine import decode_layer_step
from sglang_ascend_offload.sparse_decode.policies import make_manager

LAYERS, ROWS, HOT, K, LATENT, ROPE, HEADS, BATCH = 2, 4, 8, 4, 16, 8, 2, 3
SINK = ROWS
STEPS = 7
CTX = 40
SCALE = 0.3
TOL = 2e-2


def scenario(device="cpu", seed=0):
    """Per step: rows [B] (two real rows, changing, plus one padding entry on the sink
    row), req_ids (churn on row 1 at step 4), stable_len, and per layer a top-k of
    distinct positions that includes speculative ones (>= stable_len)."""
    g = torch.Generator().manual_seed(seed)
    host_slots = torch.randperm(200, generator=g)[: (ROWS + 1) * CTX].to(torch.int32).view(ROWS + 1, CTX)
    steps = []
    reqs = [10, 11, 12, 13]
    for step in range(STEPS):
        if step == 4:
            reqs[1] = 21  # churn: row 1 now serves another request
        pair = [(0, 1), (1, 2), (3, 1), (0, 3), (1, 0), (2, 1), (1, 3)][step]
        rows = torch.tensor(list(pair) + [SINK], dtype=torch.int64)
        req = torch.tensor([reqs[r] for r in pair] + [-1], dtype=torch.int64)
        stable = torch.tensor([10 + 2 * step + r for r in pair] + [0], dtype=torch.int32)
        topk = []
        for _ in range(LAYERS):
            t = torch.full((BATCH, K), -1, dtype=torch.int32)
            for b in range(2):
                reach = int(stable[b]) + 2  # two speculative positions
                t[b] = torch.randperm(reach, generator=g)[:K].to(torch.int32)
            topk.append(t)
        q = [
            (
                torch.randn((BATCH, HEADS, LATENT), generator=g).to(torch.bfloat16),
                torch.randn((BATCH, HEADS, ROPE), generator=g).to(torch.bfloat16),
            )
            for _ in range(LAYERS)
        ]
        steps.append(
            (
                rows.to(device),
                req.to(device),
                stable.to(device),
                [t.to(device) for t in topk],
                [(a.to(device), b.to(device)) for a, b in q],
            )
        )
    host = torch.randn((200, LATENT + ROPE), generator=g).to(torch.bfloat16).to(device)
    return host, host_slots.to(device), steps


class Run:
    """Managers and hot buffers of ``LAYERS`` layers for one run."""

    def __init__(self, policy, impl, device="cpu", manage_op=None):
        kw = {} if manage_op is None else {"manage_op": manage_op}
        self.managers = [
            make_manager(policy, ROWS + 1, HOT, device, manage_impl=impl, max_positions=CTX, **kw)
            for _ in range(LAYERS)
        ]
        self.hot = [
            torch.zeros((ROWS + 1, HOT, LATENT + ROPE), dtype=torch.bfloat16, device=device) for _ in range(LAYERS)
        ]


def _state(mgr):
    return {k: v.clone() for k, v in mgr.state().items()}


CASES = [
    ("lru", "torch", "inductor"),
    ("lru_k2", "torch", "aot_eager"),
    ("lru_k2_guarded", "torch", "aot_eager"),
    ("lru", "kernel", "aot_eager"),
]


@pytest.mark.parametrize("policy,impl,backend", CASES, ids=[f"{p}-{i}-{b}" for p, i, b in CASES])
def test_decode_step_compiles_fullgraph_and_equals_eager(policy, impl, backend):
    host, table, steps = scenario()
    eager, comp = Run(policy, impl), Run(policy, impl)
    torch._dynamo.reset()
    compiled = torch.compile(decode_layer_step, fullgraph=True, dynamic=False, backend=backend)
    frames_before = None
    for step, (rows, req, stable, topks, qs) in enumerate(steps):
        step_t = torch.tensor(step, dtype=torch.int64)
        for layer in range(LAYERS):
            args = (rows, topks[layer], req, stable)
            tail = (table, qs[layer][0], qs[layer][1], SCALE, LATENT)
            out_e, res_e = decode_layer_step(eager.managers[layer], *args, step_t, host, eager.hot[layer], *tail)
            out_c, res_c = compiled(comp.managers[layer], *args, step_t, host, comp.hot[layer], *tail)
            for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
                assert torch.equal(getattr(res_c, name), getattr(res_e, name)), (step, layer, name)
            se, sc = _state(eager.managers[layer]), _state(comp.managers[layer])
            assert se.keys() == sc.keys()
            for name in se:
                assert torch.equal(sc[name], se[name]), (step, layer, name)
            assert torch.equal(comp.hot[layer], eager.hot[layer]), (step, layer, "hot buffer")
            diff = (out_c.float() - out_e.float()).abs()
            assert bool((diff <= TOL + TOL * out_e.float().abs()).all()), (step, layer, float(diff.max()))
            assert bool((out_e[2] == 0).all())  # the padding entry attends nothing
        if step == 0:
            frames_before = _compiled_frames()
    # no recompilation after the first step: shapes and guards are step-invariant
    assert _compiled_frames() == frames_before
    # the sink row never holds anything
    for mgr in comp.managers:
        assert bool((mgr.table.slot_token[SINK] == -1).all()) and int(mgr.table.row_req[SINK]) == -1


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ----------------------------------------------------------------------- devices
ON_NPU = platform.device_kind() == "npu"


class Static:
    """Input buffers a captured graph reads (copied into before every replay)."""

    def __init__(self, steps, dev):
        rows, req, stable, topks, qs = steps[0]
        self.rows, self.req, self.stable = rows.clone(), req.clone(), stable.clone()
        self.topk = [t.clone() for t in topks]
        self.q = [(a.clone(), b.clone()) for a, b in qs]
        self.step = torch.zeros((), dtype=torch.int64, device=dev)

    def load(self, step, rows, req, stable, topks, qs):
        self.rows.copy_(rows)
        self.req.copy_(req)
        self.stable.copy_(stable)
        self.step.fill_(step)
        for layer in range(LAYERS):
            self.topk[layer].copy_(topks[layer])
            self.q[layer][0].copy_(qs[layer][0])
            self.q[layer][1].copy_(qs[layer][1])


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu")
def test_decode_step_captured_in_an_npu_graph_replays_like_eager():  # pragma: no cover - NPU only
    import torch_npu  # noqa: F401

    dev = "npu"
    host, table, steps = scenario(dev)
    eager, graphed, warm = Run("lru", "torch", dev), Run("lru", "torch", dev), Run("lru", "torch", dev)
    st = Static(steps, dev)

    def layer_step(run, layer):
        return decode_layer_step(
            run.managers[layer],
            st.rows,
            st.topk[layer],
            st.req,
            st.stable,
            st.step,
            host,
            run.hot[layer],
            table,
            *st.q[layer],
            SCALE,
            LATENT,
        )

    for layer in range(LAYERS):  # warm-up outside the capture, on throw-away state
        layer_step(warm, layer)
    torch.npu.synchronize()
    graphs, outs = [], []
    for layer in range(LAYERS):
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g):
            outs.append(layer_step(graphed, layer))
        graphs.append(g)
    for step, inputs in enumerate(steps):
        st.load(step, *inputs)
        rows, req, stable, topks, qs = inputs
        for layer in range(LAYERS):
            graphs[layer].replay()
            out_e, res_e = decode_layer_step(
                eager.managers[layer],
                rows,
                topks[layer],
                req,
                stable,
                torch.tensor(step, device=dev),
                host,
                eager.hot[layer],
                table,
                *qs[layer],
                SCALE,
                LATENT,
            )
            out_g, res_g = outs[layer]
            for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
                assert torch.equal(getattr(res_g, name), getattr(res_e, name)), (step, layer, name)
            assert torch.equal(graphed.hot[layer], eager.hot[layer])
            assert bool(((out_g.float() - out_e.float()).abs() <= TOL + TOL * out_e.float().abs()).all())


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (captures the Triton rung in a CUDA graph)"
)
def test_triton_step_captured_in_a_cuda_graph_is_sync_free_and_bit_exact():  # pragma: no cover - CUDA only
    from sglang_ascend_offload.ops import registry

    registry.ensure_registered()
    manage = registry.select("residency_manage", "triton")
    copy = registry.select("copy_miss_rows", "triton")
    dev = "cuda"
    host, table, steps = scenario(dev)
    eager, graphed, warm = (Run("lru", "torch", dev, manage) for _ in range(3))
    st = Static(steps, dev)

    def layer_step(run, layer, rows, topk, req, stable, step):
        """Triton residency (rows form) + Triton miss copy (full-rows miss lists)."""
        res = run.managers[layer].step_rows(rows, topk, req, stable, step)
        count = torch.zeros((ROWS + 1,), dtype=torch.int32, device=dev).index_copy_(0, rows, res.miss_count)
        tok = torch.full((ROWS + 1, K), -1, dtype=torch.int32, device=dev).index_copy_(0, rows, res.miss_tokens)
        slot = torch.full((ROWS + 1, K), -1, dtype=torch.int32, device=dev).index_copy_(0, rows, res.miss_slots)
        copy(host, run.hot[layer], tok, slot, count, table)
        return res

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # JIT-compile the kernels outside the capture
        for layer in range(LAYERS):
            layer_step(warm, layer, st.rows, st.topk[layer], st.req, st.stable, st.step)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs, outs = [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(LAYERS):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(layer_step(graphed, layer, st.rows, st.topk[layer], st.req, st.stable, st.step))
            graphs.append(g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for step, inputs in enumerate(steps):
        rows, req, stable, topks, qs = inputs
        torch.cuda.set_sync_debug_mode("error")
        try:
            st.load(step, *inputs)
            for layer in range(LAYERS):
                graphs[layer].replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for layer in range(LAYERS):
            res_e = layer_step(eager, layer, rows, topks[layer], req, stable, step)
            for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
                assert torch.equal(getattr(outs[layer], name), getattr(res_e, name)), (step, layer, name)
            for k, v in eager.managers[layer].state().items():
                assert torch.equal(graphed.managers[layer].state()[k], v), (step, layer, k)
            assert torch.equal(graphed.hot[layer], eager.hot[layer]), (step, layer)
