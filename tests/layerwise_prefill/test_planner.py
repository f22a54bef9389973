"""Buffer planner: counts, round-robin assignment, predecessors, grouping, errors."""

import pytest

from sglang_ascend_offload.config import LayerwisePrefillOffloadConfig
from sglang_ascend_offload.layerwise_prefill.planner import (
    LayerKVSpec,
    LayoutError,
    TensorSpec,
    plan_buffers,
    plan_from_config,
    uniform_specs,
)

T = 64
MAIN = (TensorSpec((T, 512), "bfloat16"), TensorSpec((T, 64), "bfloat16"))
IDX = (TensorSpec((T, 128), "bfloat16"),)


def test_27_layers_b6_independent_0():
    plan = plan_buffers(uniform_specs(27, MAIN, IDX), shared_buffers=6, independent_layers=[0])
    assert plan.num_physical == 1 + 6
    assert plan.layers_of(0) == (0,)
    assert plan.layers_of(1) == (1, 7, 13, 19, 25)
    assert plan.buffer_of(7) == 1
    assert plan.wait_for(7) == 1
    assert plan.wait_for(1) is None and plan.wait_for(0) is None
    assert plan.wait_for(25) == 19
    # every layer is in exactly one buffer, and each buffer's layers are round-robin
    seen = sorted(l for b in plan.buffers for l in b.layers)
    assert seen == list(range(27))
    for b in plan.buffers[1:]:
        assert all(y - x == 6 for x, y in zip(b.layers, b.layers[1:]))
    assert plan.footprint_ratio == pytest.approx(7 / 27)


def test_independent_all_and_b_at_least_r():
    all_ind = plan_buffers(uniform_specs(5, MAIN), shared_buffers=2, independent_layers="all")
    assert all_ind.num_physical == 5 and all(b.independent for b in all_ind.buffers)
    assert all(all_ind.wait_for(l) is None for l in range(5)) and all_ind.footprint_ratio == 1.0
    big_b = plan_buffers(uniform_specs(5, MAIN), shared_buffers=100, independent_layers=[0])
    assert big_b.num_physical == 1 + 4 and big_b.footprint_ratio == 1.0
    assert all(len(b.layers) == 1 for b in big_b.buffers)
    none_b = plan_buffers(uniform_specs(5, MAIN), shared_buffers=None, independent_layers=[])
    assert none_b.num_physical == 5


def test_mixed_specs_never_share():
    other = (TensorSpec((T, 512), "bfloat16"),)  # different main spec
    specs = [LayerKVSpec(i, MAIN if i % 2 == 0 else other) for i in range(9)]
    plan = plan_buffers(specs, shared_buffers=2, independent_layers=[0])
    # groups in order of their first reusable layer: odd 1,3,5,7 then even 2,4,6,8; 2 buffers each
    assert plan.num_physical == 1 + 2 + 2
    for b in plan.buffers:
        sigs = {plan.specs[l].signature for l in b.layers}
        assert len(sigs) == 1
    assert plan.layers_of(1) == (1, 5) and plan.layers_of(2) == (3, 7)
    assert plan.layers_of(3) == (2, 6) and plan.layers_of(4) == (4, 8)
    assert plan.wait_for(5) == 1 and plan.wait_for(6) == 2
    # footprint in bytes: buffers of the smaller spec weigh less
    big, small = sum(t.nbytes for t in MAIN), sum(t.nbytes for t in other)
    assert plan.footprint_ratio == pytest.approx((3 * big + 2 * small) / (5 * big + 4 * small))
    # same main spec but a different indexer layout is a different group too
    specs2 = [LayerKVSpec(i, MAIN, IDX if i < 3 else ()) for i in range(6)]
    plan2 = plan_buffers(specs2, shared_buffers=4, independent_layers=[])
    assert [b.layers for b in plan2.buffers] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert {plan2.buffers[i].group for i in range(3)} != {plan2.buffers[i].group for i in range(3, 6)}


def test_mtp_layers_take_part_numbered_after_base():
    plan = plan_buffers(uniform_specs(6, MAIN, IDX, num_mtp_layers=1), shared_buffers=2, independent_layers=[0])
    assert plan.order == (0, 1, 2, 3, 4, 5, 6)
    assert plan.specs[6].mtp
    assert plan.layers_of(1) == (1, 3, 5) and plan.layers_of(2) == (2, 4, 6)
    assert plan.wait_for(6) == 4
    # the indexer follows the main buffer: the physical buffer's spec carries it
    assert plan.buffers[plan.buffer_of(6)].spec.indexer == IDX


def test_invalid_layouts_list_every_reason():
    specs = [
        LayerKVSpec(0, MAIN),
        LayerKVSpec(1, (TensorSpec((T, 0), "bfloat16"),)),  # bad dim
        LayerKVSpec(2, (TensorSpec((T, 8), "bfloat17"),)),  # bad dtype
        LayerKVSpec(3, MAIN, (TensorSpec((T + 1, 128), "bfloat16"),)),  # indexer rows mismatch
        LayerKVSpec(3, MAIN),  # duplicate
        LayerKVSpec(2, (), mtp=True),  # mtp before base + no main (+dup)
    ]
    with pytest.raises(LayoutError) as ei:
        plan_buffers(specs, shared_buffers=0, independent_layers=[0, 42])
    text = "\n".join(ei.value.reasons)
    for needle in (
        "positive int dims",
        "unknown dtype",
        "token rows",
        "duplicate layer ids",
        "MTP layers",
        "no main-KV",
        "shared_buffers=0",
        "independent layers [42]",
    ):
        assert needle in text, needle
    assert len(ei.value.reasons) >= 8


def test_plan_from_config():
    cfg = LayerwisePrefillOffloadConfig(shared_buffers=3, independent_layers=[0, 1])
    plan = plan_from_config(cfg, uniform_specs(10, MAIN))
    assert plan.num_physical == 2 + 3
    assert plan.layers_of(2) == (2, 5, 8)
    assert "footprint" in plan.summary()
