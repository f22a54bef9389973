"""Layerwise prefill pool with real SGLang objects: results equal the device pool bit for bit.

Real: ``ReqToTokenPool``, ``PagedTokenToKVPoolAllocator``, ``ForwardBatch`` /
``ForwardMode``, SGLang's DSA ``Indexer`` (random weights), SGLang's forward context,
the plugin's ``DeviceDSAPool`` (reference) and ``LayerwisePrefillPool``, the
``ascend_offload`` backend over each. Per forward and layer both backends get the
same inputs (the indexer's hidden states, q, k); outputs (top-k and attention) must be
``torch.equal``. The layerwise pool is driven only through SGLang's per-layer hooks
(``layer_transfer_counter.wait_until`` in the accessors, ``set_kv_buffer``).

Checks: prefill with a radix-style cached prefix (loaded from the host store, not
recomputed), chunked prefill, decode steps with churn (the colocated debug path),
the device main-KV footprint (``I + min(B, R)`` buffers), saves that always read the
layer's own rows although the next layer reuses the buffer (slow, jittered store; a
negative control with the gates bypassed shows the check catches reuse), the P/D
hooks (listener, extra consumers, a missing answer times out), stale objects removed,
Memcache inside the pool (``npu`` marker).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Dict, List

import pytest
import torch
from dsa_harness import (
    INDEX_DIM,
    LATENT,
    ROPE,
    published_context,
)
from layerwise_harness import (
    LAYERS,
    PAGE,
    LayerwiseHarness,
    assert_same,
    lw_config,
    reference_rows,
)
from npu_requirements import npu_present, require_package, requires

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload import platform
from sglang_ascend_offload.layerwise_prefill.gates import GateTimeout
from sglang_ascend_offload.layerwise_prefill.store import object_key
from sglang_ascend_offload.layerwise_prefill.store_local import LocalHostKVStore

pytestmark = pytest.mark.usefixtures("plugins_loaded")


@pytest.fixture
def ctx():
    with published_context():
        yield


def run_scenario(h: LayerwiseHarness, decode_steps: int = 12) -> None:
    """Prefill, radix-style prefix hit, chunked prefill, decode with churn; all bit-exact."""
    a = h.new_request("a")
    assert_same(h.extend([a], [40]), "prefill a")
    b = h.new_request("b", prefix_from="a", prefix_len=32)  # two cached pages of a
    c = h.new_request("c")
    assert_same(h.extend([b, c], [9, 23]), "prefill b (cached prefix) + c")
    d = h.new_request("d")
    assert_same(h.extend([d], [20]), "chunk 1 of d")  # ends inside a page
    assert_same(h.extend([d], [13]), "chunk 2 of d")  # continues the partial page
    for step in range(decode_steps):
        batch = [r for r in (a, b, c, d) if r.rid in h.requests]
        assert_same(h.decode(batch), f"decode step {step}")
        if step == 4:
            h.finish("c")  # churn: c's pages go back to the allocator and get reused
            e = h.new_request("e")
            assert_same(h.extend([e], [37]), "prefill e (reused pages)")
            c = e


# ------------------------------------------------------------------ results
@pytest.mark.parametrize("shared_buffers", [1, 2])
def test_results_equal_device_pool_with_prefix_chunks_and_decode(ctx, shared_buffers):
    h = LayerwiseHarness(lw_config(shared_buffers))
    try:
        run_scenario(h)
        h.pool.flush()
        stats = h.pool.stats
        assert stats.forwards > 0 and stats.bytes_saved > 0 and stats.bytes_loaded > 0
        # the host store holds every live page of every pipelined layer, equal to the reference rows
        store, book = h.pool.store, h.pool.pagebook
        checked = 0
        for req in h.requests.values():
            pages = (h.req_to_token_pool.req_to_token[req.row, : req.length : PAGE] // PAGE).tolist()
            for page in pages:
                gen, n = book.state(page)
                for layer in h.pool.pipelined:
                    key = object_key(book.key(page), layer)
                    got = [torch.empty_like(t) for t in reference_rows(h, layer, page, n)]
                    store.get_into([key], [got])
                    assert all(torch.equal(g, r) for g, r in zip(got, reference_rows(h, layer, page, n))), key
                    checked += 1
        assert checked > 0
        # superseded objects (shorter tails, previous page owners) were removed
        live = {object_key(book.key(p), l) for p in book.pages() for l in h.pool.pipelined}
        assert set(store._objects) == live
    finally:
        h.pool.close()


def test_dp_attention_padding_rows_are_never_planned_or_saved(ctx):
    """A padding entry aliasing live request ``a`` must not plan a 1-token save of ``a``'s
    first page (it would replace the stored page with a shorter, wrong tail)."""
    h = LayerwiseHarness(lw_config(1))
    try:
        a, b = h.new_request("a"), h.new_request("b")
        assert_same(h.extend([a, b], [40, 21]), "prefill")
        for step in range(4):
            pairs = h.decode([a, b], pad_to=3, pad_row=a.row)
            for layer, ((t_ref, o_ref), (t_lw, o_lw)) in enumerate(pairs):
                assert torch.equal(t_ref[:2], t_lw[:2]) and torch.equal(o_ref[:2], o_lw[:2]), (step, layer)
        h.pool.flush()
        first_page = int(h.req_to_token_pool.req_to_token[a.row, 0]) // PAGE
        assert h.pool.pagebook.state(first_page)[1] == PAGE  # still the whole page, not the padding's 1 row
        for layer in h.pool.pipelined:
            got = [torch.empty_like(t) for t in reference_rows(h, layer, first_page, PAGE)]
            h.pool.store.get_into([object_key(h.pool.pagebook.key(first_page), layer)], [got])
            assert all(torch.equal(g, r) for g, r in zip(got, reference_rows(h, layer, first_page, PAGE)))
    finally:
        h.pool.close()


def test_cached_prefix_is_loaded_not_recomputed(ctx):
    h = LayerwiseHarness(lw_config(1))
    try:
        a = h.new_request("a")
        assert_same(h.extend([a], [48]), "prefill a")
        h.pool.flush()
        before = h.pool.stats.bytes_loaded
        b = h.new_request("b", prefix_from="a", prefix_len=32)
        assert_same(h.extend([b], [5]), "prefill b")
        h.pool.flush()
        row_bytes = (LATENT + ROPE + INDEX_DIM) * 2
        # exactly the two cached pages of every pipelined layer came from the host store
        assert h.pool.stats.bytes_loaded - before == 32 * row_bytes * len(h.pool.pipelined)
        assert h.pool.stats.prefix_rows >= 32
    finally:
        h.pool.close()


@pytest.mark.parametrize(
    "shared_buffers,independent,expected",
    [(1, [0], 2), (2, [0], 3), (3, [0], 4), (None, [0], 4), (1, [0, 3], 3), (1, "all", 4)],
)
def test_device_main_kv_footprint_is_independent_plus_shared(ctx, shared_buffers, independent, expected):
    h = LayerwiseHarness(lw_config(shared_buffers, independent_layers=independent))
    try:
        pool = h.pool
        n_indep = LAYERS if independent == "all" else len(independent)
        reusable = LAYERS - n_indep
        assert expected == n_indep + min(shared_buffers or reusable, reusable)
        distinct = {pool.get_key_buffer(l).data_ptr() for l in range(LAYERS)}
        assert len(distinct) == pool.physical_buffers == expected
        assert len({pool.get_value_buffer(l).data_ptr() for l in range(LAYERS)}) == expected
        assert len({pool.get_index_k_buffer(l).data_ptr() for l in range(LAYERS)}) == expected
        per_layer = h.dense_pool.get_kv_size_bytes() // LAYERS
        assert pool.get_kv_size_bytes() == expected * per_layer
        assert pool.plan.footprint_ratio == pytest.approx(expected / LAYERS)
        assert all(pool.get_key_buffer(l).shape == h.dense_pool.get_key_buffer(l).shape for l in range(LAYERS))
        assert (pool.store is None) == (not pool.pipelined)  # no shared buffer: no host store
    finally:
        h.pool.close()


# ------------------------------------------------------------------ reuse safety
class CheckingStore(LocalHostKVStore):
    """Local store with random delays; ``put`` compares each source with the layer's
    reference rows recorded before the layer ran (``expected``)."""

    def __init__(self, seed: int, max_delay_s: float = 0.004, min_delay_s: float = 0.0):
        super().__init__()
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.min_delay_s = min_delay_s
        self.expected: Dict[str, List[torch.Tensor]] = {}
        self.violations: List[str] = []
        self.checked = 0
        self._lock2 = threading.Lock()

    def _delay(self):
        with self._lock2:
            d = self.min_delay_s + self.rng.random() * (self.max_delay_s - self.min_delay_s)
        time.sleep(d)

    def put(self, keys, parts):
        self._delay()  # the next layer may try to reuse the slot meanwhile
        for key, ps in zip(keys, parts):
            want = self.expected.get(key)
            if want is None:
                self.violations.append(f"{key}: no reference recorded")
            elif not all(torch.equal(p, w) for p, w in zip(ps, want)):
                self.violations.append(f"{key}: saved rows are not the layer's own rows")
            self.checked += 1
        super().put(keys, parts)

    def get_into(self, keys, parts):
        self._delay()
        super().get_into(keys, parts)


def record_expected(store: CheckingStore):
    """``between`` hook: the reference rows of every page this forward saves for ``layer``."""

    def between(layer: int, h: LayerwiseHarness) -> None:
        fwd = h.pool._fwd
        if layer not in h.pool.pipelined or fwd is None or fwd.pages is None:
            return
        for e in fwd.pages.entries:
            if e.save is not None:
                store.expected[object_key(e.save, layer)] = [
                    t.clone() for t in reference_rows(h, layer, e.page, e.save.tokens)
                ]

    return between


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reuse_never_overwrites_unsaved_content(ctx, seed):
    store = CheckingStore(seed)
    h = LayerwiseHarness(
        lw_config(1 + seed % 2, prefetch_depth=1), store=store, seed=seed, between=record_expected(store)
    )
    try:
        run_scenario(h, decode_steps=4)
        h.pool.flush()
        assert store.checked > 0
        assert store.violations == []
    finally:
        h.pool.close()


def test_negative_control_without_gates_the_check_fails(ctx):
    """Same check with the slot gates bypassed: the next layer overwrites rows before the save.

    Every save waits at least 0.3 s before it reads its rows, far longer than the next
    layer takes to write the shared buffer even on a loaded machine, so without the
    gates the overwrite always happens first (a random short delay made this flaky)."""
    store = CheckingStore(0, max_delay_s=0.35, min_delay_s=0.3)
    h = LayerwiseHarness(lw_config(1, prefetch_depth=1), store=store, between=record_expected(store))
    try:
        gates = h.pool.gates
        gates.wait_free = lambda slot, timeout_s=None: None
        real_begin = gates.begin

        def begin(slot, layer, consumers):  # reopen the slot even while consumers are pending
            with gates._lock:
                gates._pending[slot].clear()
            real_begin(slot, layer, consumers)

        gates.begin = begin
        real_done = gates.done

        def done(slot, layer, consumer, error=None):  # the slot may already hold the next layer
            try:
                real_done(slot, layer, consumer, error)
            except ValueError:
                pass

        gates.done = done
        a = h.new_request("a")
        h.extend([a], [40])
        h.pool.flush()
        assert store.violations, "the check did not notice reuse without gates"
    finally:
        h.pool.close()


# ------------------------------------------------------------------ P/D hooks
def test_pd_hooks_listener_and_extra_consumers_gate_reuse(ctx):
    store = LocalHostKVStore()
    h = LayerwiseHarness(lw_config(1), store=store)
    events: List[tuple] = []
    lock = threading.Lock()
    pool = h.pool

    def listener(item):
        with lock:
            events.append(("written", item.forward.forward_id, item.layer, item.pipelined))
        if item.pipelined:  # the decode reads the rows later and then answers

            def answer():
                time.sleep(0.02)
                with lock:
                    events.append(("read_done", item.forward.forward_id, item.layer))
                pool.gates.done(item.slot, item.layer, "decode:0")

            threading.Thread(target=answer, daemon=True).start()

    pool.add_layer_listener(listener)
    pool.set_extra_consumers(lambda info: ["decode:0"])
    original_wait = pool.pipe.wait_until_ready

    def wait_until_ready(layer, timeout_s=None):
        original_wait(layer, timeout_s)
        with lock:
            events.append(("ready", layer))

    pool.pipe.wait_until_ready = wait_until_ready
    try:
        a = h.new_request("a")
        b = h.new_request("b")
        assert_same(h.extend([a, b], [21, 40]), "prefill with decode consumers")
        pool.flush()
        written = [e for e in events if e[0] == "written"]
        assert sorted(e[2] for e in written) == list(range(LAYERS))  # every layer once
        assert {e[2] for e in written if e[3]} == set(pool.pipelined)
        order = [e[:1] + e[2:3] if e[0] != "ready" else e for e in events]
        for earlier, later in zip(pool.pipelined, pool.pipelined[1:]):  # one shared buffer (B = 1)
            assert order.index(("read_done", earlier)) < order.index(("ready", later)), order
    finally:
        pool.close()


def test_pd_missing_answer_times_out_naming_the_consumer(ctx):
    h = LayerwiseHarness(lw_config(1, wait_timeout_s=0.5))
    h.pool.set_extra_consumers(lambda info: {h.pool.pipelined[0]: ["decode:7"]})
    try:
        a = h.new_request("a")
        with pytest.raises(GateTimeout, match="decode:7"):
            h.extend([a], [20])
    finally:
        h.pool.close()  # aborts the open forward


# ------------------------------------------------------------------ page book
def test_page_book_plans_loads_saves_and_stale_objects():
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.layerwise_pages import (
        BatchRequest,
        PageBook,
        PageBookError,
    )

    book = PageBook(page_size=4, namespace="ns")
    first = book.plan([BatchRequest(0, 0, 6, (3, 5))])  # pages 3 (full) and 5 (2 rows), both fresh
    assert [(e.page, e.load, e.save.tokens) for e in first.entries] == [(3, None, 4), (5, None, 2)]
    assert first.stale == ()
    # a radix hit on page 3 plus a continued partial page 5 in one batch
    second = book.plan([BatchRequest(0, 6, 7, (3, 5)), BatchRequest(1, 4, 9, (3, 8, 9))])
    by_page = {e.page: e for e in second.entries}
    assert set(by_page) == {3, 5, 8, 9}  # page 3 is loaded once for both requests
    assert by_page[3].load.tokens == 4 and by_page[3].save is None
    assert by_page[5].load.tokens == 2 and by_page[5].save.tokens == 3
    assert by_page[5].load.digest == by_page[5].save.digest  # same owner, same generation
    assert [b.tokens for b in second.stale] == [2]  # the 2-row object of page 5 is superseded
    assert second.prefix_rows == 6 and second.new_rows == 1 + 5
    # page 8 is freed and reused by a new owner: new generation, the old object is stale
    gen8 = book.state(8)[0]
    third = book.plan([BatchRequest(2, 0, 3, (8,))])
    assert book.state(8) == (book.state(8)[0], 3) and book.state(8)[0] != gen8
    assert [b.digest for b in third.stale] == [f"ns/p8g{gen8}"]
    rows = third.entries[0].request_rows(4)
    assert (rows.row0, rows.cached_blocks, rows.new_len) == (32, 0, 3)
    with pytest.raises(PageBookError, match="page 11"):  # cached page never saved: no silent recompute
        book.plan([BatchRequest(3, 4, 6, (11, 12))])
    with pytest.raises(PageBookError, match="page 5 should hold 2"):  # wrong row count
        book.plan([BatchRequest(0, 6, 8, (3, 5))])


def test_page_book_loads_a_rejected_speculative_tail_that_the_forward_rewrites():
    """A verify saved 3 rows of page 5 (committed 1 + 2 candidates); one candidate was
    rejected, so the next verify continues from 2 cached rows and rewrites rows 2-3:
    the 3-row object is loaded whole. Without speculation the same plan is refused, and
    a saved tail longer than what the forward rewrites is refused either way."""
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.layerwise_pages import (
        BatchRequest,
        PageBook,
        PageBookError,
    )

    for speculative in (True, False):
        book = PageBook(page_size=4, namespace="ns", speculative_tails=speculative)
        book.plan([BatchRequest(0, 0, 7, (3, 5))])  # page 5: 3 rows saved
        if not speculative:
            with pytest.raises(PageBookError, match="page 5 should hold 2"):
                book.plan([BatchRequest(0, 6, 8, (3, 5))])
            continue
        with pytest.raises(PageBookError, match="page 5 should hold 1"):  # rewrites only row 1: tail of 3 > 2
            book.plan([BatchRequest(0, 5, 6, (3, 5))])
        plan = book.plan([BatchRequest(0, 6, 8, (3, 5))])
        page5 = {e.page: e for e in plan.entries}[5]
        assert page5.load.tokens == 3 and page5.save.tokens == 4
        assert [b.tokens for b in plan.stale] == [3]


# ------------------------------------------------------------------ Memcache (Ascend)
@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and memcache-hybrid")
@requires(lambda: require_package("memcache_hybrid", "the [npu] extra"))
def test_npu_memcache_store_inside_the_pool(ctx, tmp_path):
    """The pool on an NPU with the Memcache host store (meta service started from a conf
    on free ports): same scenario, bit-exact against the device pool."""
    from sglang_ascend_offload.layerwise_prefill.store_memcache import write_mmc_conf
    from sglang_ascend_offload.testing.ports import reserve_port

    ports = [reserve_port() for _ in range(3)]
    meta, local = tmp_path / "mmc-meta.conf", tmp_path / "mmc-local.conf"
    write_mmc_conf(
        str(meta),
        {
            "ock.mmc.meta_service_url": f"tcp://127.0.0.1:{ports[0]}",
            "ock.mmc.meta_service.config_store_url": f"tcp://127.0.0.1:{ports[1]}",
            "ock.mmc.meta_service.metrics_url": f"http://127.0.0.1:{ports[2]}",
            "ock.mmc.log_path": str(tmp_path / "logs"),
        },
    )
    write_mmc_conf(
        str(local),
        {
            "ock.mmc.meta_service_url": f"tcp://127.0.0.1:{ports[0]}",
            "ock.mmc.local_service.config_store_url": f"tcp://127.0.0.1:{ports[1]}",
            "ock.mmc.local_service.dram.size": "256MB",
        },
    )
    lw = cfg.LayerwisePrefillOffloadConfig(
        shared_buffers=1,
        store_backend="memcache",
        wait_timeout_s=60.0,
        memcache=cfg.MemcacheConfig(
            meta_config=str(meta), local_config=str(local), start_meta_service=True, protocol="device_sdma"
        ),
    )
    device = str(platform.default_device())
    h = LayerwiseHarness(lw, device=device)
    try:
        assert h.pool.store.name == "memcache"
        run_scenario(h, decode_steps=4)
        h.pool.flush()
        assert h.pool.stats.bytes_loaded > 0 and h.pool.stats.bytes_saved > 0
    finally:
        h.pool.close()
