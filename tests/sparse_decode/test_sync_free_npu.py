"""Sync-free on the NPU path: what a decode layer step moves between host and device.

* Captured (the graph path): the engine's layer step (``captured_layer_step``, the
  plan's ops) captured in an NPU graph per layer and replayed over the workload of
  ``npu_pair.py``, with the fused Copy-SFA (the NPU default) and with the separate ops
  (``fused_copy_sfa: false``: the fused miss copy, then torch_npu's attention): the
  replays do 0 device->host reads, 0 host waits and no host->device copy other than the
  miss rows (the AscendC kernel reads them from registered host memory, one transfer of
  the misses' bytes per layer step), and every replay equals an eager engine (residency,
  hot buffer, attention) bit for bit. A device->host read inside the step would already
  fail the capture (the stand-in refuses it, as a device does).
* The torch_npu miss copy (``ops="npu"``: torch_npu has no device-side read of host
  memory, so ``copy_miss_rows_rows`` reads the miss rows' host slots back) cannot be
  captured: the engine refuses the captured step with the fix before a capture starts.
* Eager (``run_layer``): the count per layer step is stated per plan
  (:data:`EAGER_PER_LAYER`) and held: an added read or copy fails the test with its call
  site. With the fused Copy-SFA or the fused miss copy a layer step reads nothing back;
  the torch_npu miss copy (``ops="npu"``) and adaptive residency's direct-row copy gather
  from host memory with host-side indices, one device->host read of the slots per layer
  step each.

npu-marked: on an NPU runner on the device (the counts come from the stand-in's
transfer log, so there the counting assertions skip and the equality holds); in CI on
the stand-in.
"""

from __future__ import annotations

import npu_standin
import pytest
import torch
from npu_requirements import npu_present, require_npu, require_npu_extension, requires

from sglang_ascend_offload.ops import fused

from . import npu_pair

pytestmark = [pytest.mark.npu, pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN")]

STEPS = 5
COPY_SFA_READ = fused.COPY_SFA_KERNEL + ": miss rows read from registered host memory"
COPY_ROWS_READ = fused.COPY_ROWS_KERNEL + ": miss rows read from registered host memory"
#: device->host reads / host->device copies / host waits of one eager ``run_layer`` on an
#: NPU, per engine setting: Copy-SFA reads the misses itself (the one h2d), as does the fused
#: miss copy beside the separate attention; the torch_npu copy reads the miss rows' host
#: slots back (d2h) and copies the staged rows (h2d); adaptive residency's direct rows do
#: the same once more for the positions they copy
EAGER_PER_LAYER = {
    "auto": {"d2h": 0, "h2d": 1, "sync": 0},
    "auto-separate": {"d2h": 0, "h2d": 1, "sync": 0},
    "npu": {"d2h": 1, "h2d": 1, "sync": 0},
    "adaptive": {"d2h": 1, "h2d": 2, "sync": 0},
}
CONFIGS = {
    "auto": dict(ops="auto"),
    "auto-separate": dict(ops="auto", fused_copy_sfa=False),
    "npu": dict(ops="npu"),
    "adaptive": dict(ops="auto", residency="adaptive"),
}
#: what the captured step's replays may copy to the device: the misses, read by the kernel
CAPTURED = {"auto": COPY_SFA_READ, "auto-separate": COPY_ROWS_READ}


def _ready():
    require_npu()
    require_npu_extension(fused.COPY_SFA_KERNEL)


class Static:
    """The device buffers a captured layer step reads, refilled before each replay."""

    def __init__(self, first: npu_pair.Step, layer: int, table: torch.Tensor):
        dev = "npu"
        self.layer = layer
        self.rows = torch.arange(npu_pair.ROWS, dtype=torch.int64, device=dev)
        self.req = first.req_ids.to(dev)
        self.stable = first.stable_len.to(dev)
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.topk = first.topk[layer].to(dev)
        self.query = first.query[layer].to(dev)
        self.rope = first.query_rope[layer].to(dev)
        self.table = table.to(dev)

    def load(self, index: int, s: npu_pair.Step) -> None:
        self.req.copy_(s.req_ids)
        self.stable.copy_(s.stable_len)
        self.step.fill_(index)
        self.topk.copy_(s.topk[self.layer])
        self.query.copy_(s.query[self.layer])
        self.rope.copy_(s.query_rope[self.layer])


@requires(_ready)
@pytest.mark.parametrize("name", list(CAPTURED))
def test_the_captured_layer_step_replays_without_host_traffic_and_equals_eager(name):
    from npu_standin import transfers

    steps = npu_pair.workload(STEPS)
    table = npu_pair.token_table()
    graphed, eager = npu_pair.engine("npu", **CONFIGS[name]), npu_pair.engine("npu", **CONFIGS[name])
    # the NPU default: the fused Copy-SFA; or the separate ops with the fused miss copy
    assert graphed.plan.attention.fused == (name == "auto")
    assert graphed.copy_op.rung == "fused"
    statics = [Static(steps[0], layer, table) for layer in range(npu_pair.LAYERS)]
    graphs, outs = [], []
    for st in statics:
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g):
            outs.append(
                graphed.captured_layer_step(
                    st.layer, st.rows, st.topk, st.req, st.stable, st.step,
                    graphed.pool.layer(st.layer), st.table, st.query, st.rope, npu_pair.SCALE,
                )
            )  # fmt: skip
        graphs.append(g)
    for index, s in enumerate(steps):
        npu_pair.begin(eager, s, index, table)
        for layer, st in enumerate(statics):
            for engine in (graphed, eager):
                engine.append(layer, s.append_slots, s.append_rows[layer].to("npu"))
            st.load(index, s)
            with transfers.counting() as seen:
                graphs[layer].replay()
            inputs = (s.topk[layer].to("npu"), s.query[layer].to("npu"), s.query_rope[layer].to("npu"))
            want = eager.run_layer(layer, *inputs, npu_pair.SCALE)
            out, res = outs[layer]
            where = f"step {index} layer {layer}"
            assert torch.equal(out.cpu(), want.output.cpu()), where
            for field in npu_pair.RESIDENCY_FIELDS:
                assert torch.equal(getattr(res, field).cpu(), getattr(want.residency, field).cpu()), (where, field)
            assert torch.equal(graphed.hot.layer(layer).cpu(), eager.hot.layer(layer).cpu()), where
            if npu_standin.installed():
                assert seen.count("d2h") == 0 and seen.count("sync") == 0, seen.seen
                assert {t.what for t in seen.of("h2d")} <= {CAPTURED[name]}, seen.seen
                misses = int(want.residency.miss_count.sum())
                row_bytes = (npu_pair.LATENT + npu_pair.ROPE) * 2
                assert sum(t.nbytes for t in seen.of("h2d")) == misses * row_bytes, where


@requires(_ready)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_eager_layer_step_moves_what_is_stated(name):
    if not npu_standin.installed():
        pytest.skip("the transfer counts come from the npu stand-in's transfer log")
    from npu_standin import transfers

    config = CONFIGS[name]
    npu = npu_pair.engine("npu", **config)
    ref = npu_pair.engine("cpu", ops="reference", **{k: v for k, v in config.items() if k != "ops"})
    counts = []

    def counted(step, layer, fn):
        with transfers.counting() as seen:
            out = fn()
        counts.append(({k: seen.count(k) for k in ("d2h", "h2d", "sync")}, seen.seen))
        return out

    tol = fused.ATTENTION_ATOL if npu.plan.attention.fused or not npu_standin.installed() else 0.0
    npu_pair.run_pair(npu, ref, npu_pair.workload(STEPS), tol, on_layer=counted)
    for per_kind, seen in counts:
        assert per_kind == EAGER_PER_LAYER[name], seen


@requires(_ready)
def test_the_torch_npu_copy_refuses_capture_with_the_fix():
    """The torch_npu miss copy (``ops="npu"``) over a host pool in host memory: the captured
    step is refused before a capture starts, saying why and what to set (it used to read
    the miss rows' host slots back inside the capture, which a device refuses)."""
    engine = npu_pair.engine("npu", ops="npu")
    assert engine.copy_op.rung == "npu"
    st = Static(npu_pair.workload(1)[0], 0, npu_pair.token_table())
    with pytest.raises(RuntimeError, match=r"separate miss copy on the npu rung.*ascendc_ops/build.sh --install"):
        engine.captured_layer_step(
            0, st.rows, st.topk, st.req, st.stable, st.step,
            engine.pool.layer(0), st.table, st.query, st.rope, npu_pair.SCALE,
        )  # fmt: skip


@requires(_ready)
def test_the_eager_count_sees_a_host_read_in_the_step():
    """Negative control: a layer step that reads its miss count on the host (what the
    engine never does) is one device->host read more than stated."""
    if not npu_standin.installed():
        pytest.skip("the transfer counts come from the npu stand-in's transfer log")
    from npu_standin import transfers

    npu, ref = npu_pair.engine("npu", ops="auto"), npu_pair.engine("cpu", ops="reference")
    counts = []

    def reading(step, layer, fn):
        with transfers.counting() as seen:
            out = fn()
            int(out.residency.miss_count.sum())  # the planted host read
        counts.append({k: seen.count(k) for k in ("d2h", "h2d", "sync")})
        return out

    npu_pair.run_pair(npu, ref, npu_pair.workload(1), fused.ATTENTION_ATOL, on_layer=reading)
    stated = EAGER_PER_LAYER["auto"]
    assert all(c == dict(stated, d2h=stated["d2h"] + 1) for c in counts), counts
