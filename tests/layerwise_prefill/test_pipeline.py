"""Pipeline: results with layerwise offload equal results without it; prefix reuse;
failures (save errors, consumers that never answer, bad buffers) are reported."""

import threading

import pytest
import torch

from sglang_ascend_offload.layerwise_prefill.gates import GateTimeout
from sglang_ascend_offload.layerwise_prefill.pipeline import (
    ForwardError,
    LayerwisePrefillPipeline,
    PrefillRequest,
    run_forward,
)
from sglang_ascend_offload.layerwise_prefill.planner import plan_buffers
from sglang_ascend_offload.layerwise_prefill.store import StoreError, block_keys, object_key
from sglang_ascend_offload.layerwise_prefill.store_local import LocalHostKVStore
from sglang_ascend_offload.testing.tiny_attention_model import FullCacheRunner, TinyAttentionModel

BT = 4
ROWS = 48


def _forward(pipe, model, reqs, **kw):
    stats = run_forward(pipe, reqs, model.compute_layer, on_begin=lambda lay: model.start(reqs, lay), **kw)
    return stats, {rid: h.clone() for rid, h in model.hidden.items()}


@pytest.mark.parametrize("shared,indep,mtp", [(2, [0], 0), (1, [], 0), (3, [0, 4], 1), (None, "all", 0)])
def test_offload_equals_full_cache_and_reuses_prefix(shared, indep, mtp):
    model = TinyAttentionModel(num_layers=7, seed=1)
    plan = plan_buffers(model.specs(ROWS, num_mtp_layers=mtp), shared, indep)
    store = LocalHostKVStore()
    ref = FullCacheRunner(model, BT)
    g = torch.Generator().manual_seed(5)
    a = PrefillRequest("a", tuple(torch.randint(0, 100, (10,), generator=g).tolist()))
    b = PrefillRequest("b", tuple(torch.randint(0, 100, (7,), generator=g).tolist()))
    with LayerwisePrefillPipeline(plan, store, block_tokens=BT, prefetch_depth=2) as pipe:
        s1, out1 = _forward(pipe, model, [a, b])
        assert s1.prefix_tokens == 0 and s1.bytes_loaded == 0 and s1.bytes_saved > 0
        # second forward: c extends a's first 8 tokens (2 full blocks), d is new
        c = PrefillRequest("c", a.token_ids[:8] + (3, 1, 4, 1, 5))
        d = PrefillRequest("d", (9, 9, 9))
        model.rows_computed = 0
        s2, out2 = _forward(pipe, model, [c, d])
    assert s2.prefix_tokens == 8 and s2.new_tokens == 5 + 3
    assert model.rows_computed == (5 + 3) * model.num_layers  # the prefix was not recomputed
    assert s2.bytes_loaded == 8 * 2 * model.dim * 4 * model.num_layers
    for req, prefix, out in ((a, 0, out1), (b, 0, out1), (c, 8, out2), (d, 0, out2)):
        assert torch.equal(out[req.rid], ref.run(req, prefix)), req.rid
    # the host store holds exactly the reference KV, block by block, every layer
    for req in (a, b, c, d):
        for blk in block_keys(req.token_ids, BT):
            for layer in range(model.num_layers):
                got = [torch.empty(blk.tokens, model.dim) for _ in range(2)]
                store.get_into([object_key(blk, layer)], [got])
                want = ref.kv_block(blk.digest, layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # prefix reuse vs recomputing everything: same result up to float rounding
    full = FullCacheRunner(model, BT).run(c, 0)
    torch.testing.assert_close(out2["c"], full[8:], rtol=1e-5, atol=1e-5)


class _FailingStore(LocalHostKVStore):
    def __init__(self, fail_layer_key):
        super().__init__()
        self.fail = fail_layer_key

    def put(self, keys, parts):
        if self.fail and any(k.endswith(self.fail) for k in keys):
            self.fail = None  # fail once
            raise StoreError("injected: host pool write failed")
        super().put(keys, parts)


def test_save_failure_is_reported_and_slot_is_reused():
    model = TinyAttentionModel(num_layers=4, seed=2)
    plan = plan_buffers(model.specs(ROWS), 1, [])
    with LayerwisePrefillPipeline(plan, _FailingStore("/L2"), block_tokens=BT, wait_timeout_s=5) as pipe:
        req = PrefillRequest("a", tuple(range(9)))
        with pytest.raises(ForwardError, match="layer 2 save failed: injected"):
            _forward(pipe, model, [req])
        # the next forward still runs (the failed save released its slot)
        stats, _ = _forward(pipe, model, [PrefillRequest("b", (1, 2, 3))])
        assert stats.layers == 4


def test_consumer_that_never_answers_times_out_with_names():
    model = TinyAttentionModel(num_layers=3, seed=3)
    plan = plan_buffers(model.specs(ROWS), 1, [])  # one slot for all layers
    # 2 s: long enough that the host save (the slot's other consumer) always answers in
    # time on a loaded 2-core machine, so the timeout can only name decode:1.
    with LayerwisePrefillPipeline(plan, LocalHostKVStore(), block_tokens=BT, wait_timeout_s=2.0) as pipe:
        req = PrefillRequest("a", (1, 2, 3, 4, 5))
        # The forward times out either waiting for the slot itself or for layer 1 to be
        # loaded into it (which one depends on thread timing); both name slot, layer, consumer.
        with pytest.raises(GateTimeout, match=r"slot 0 (\(layer 0\)|holds layer 0).*decode:1"):
            _forward(pipe, model, [req], extra_consumers={0: ["decode:1"]})
        # an answer (even late) frees the slot for the next forward; the host save of
        # layer 0 may still be running on a loaded machine: wait for it, not for 2 s
        pipe.gates.done(0, 0, "decode:1")
        pipe.wait_all_free(60.0)
        stats, _ = _forward(pipe, model, [req])
        assert stats.prefix_tokens == 0  # layers 1,2 of the aborted forward were never saved


def test_remote_consumer_gates_reuse_and_sees_complete_layer():
    """A P/D-style consumer answers from another thread after reading the slot."""
    model = TinyAttentionModel(num_layers=5, seed=4)
    plan = plan_buffers(model.specs(ROWS), 2, [0])
    seen = {}
    with LayerwisePrefillPipeline(plan, LocalHostKVStore(), block_tokens=BT) as pipe:

        def on_written(layer, slot):
            def read():
                seen[layer] = [t[:6].clone() for t in pipe.buffers[slot]]
                pipe.gates.done(slot, layer, "decode:0")

            threading.Timer(0.01, read).start()

        pipe.add_written_listener(on_written)
        req = PrefillRequest("a", (5, 4, 3, 2, 1, 0))
        _forward(pipe, model, [req], extra_consumers={l: ["decode:0"] for l in range(5)})
        pipe.drain()
        pipe.wait_all_free(5.0)
    ref = FullCacheRunner(model, BT)
    ref.run(req, 0)
    blocks = block_keys(req.token_ids, BT)
    for layer in range(5):
        want_k = torch.cat([ref.kv_block(b.digest, layer)[0] for b in blocks])
        assert torch.equal(seen[layer][0], want_k)


def test_buffers_and_capacity_are_checked():
    model = TinyAttentionModel(num_layers=3)
    plan = plan_buffers(model.specs(8), 1, [0])
    with pytest.raises(ValueError, match="do not match the plan"):
        LayerwisePrefillPipeline(
            plan, LocalHostKVStore(), block_tokens=BT, buffers=[[torch.zeros(8, 16)] * 2, [torch.zeros(8, 15)] * 2]
        )
    with LayerwisePrefillPipeline(plan, LocalHostKVStore(), block_tokens=BT) as pipe:
        with pytest.raises(ValueError, match="needs 9 token rows"):
            pipe.begin_forward([PrefillRequest("a", tuple(range(9)))])
