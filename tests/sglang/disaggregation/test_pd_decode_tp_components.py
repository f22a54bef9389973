"""P/D into two decode TP ranks that share one sparse-decode host pool, in one process.

Decode: two ``HostMainKVPool`` objects over the *same* shared mapping (rank 0 creates it,
rank 1 attaches, as ``shared_host_pool.open_group_pool`` does across processes), one
``DecodeSink`` per rank (``d_tp = 2``). Prefill: ``p_tp`` ``PrefillLinks`` (2 or 4) over
identical device pools (MLA's main KV and the indexer are replicated over prefill TP),
each linked to decode rank ``p // ratio`` as SGLang pairs them. Each engine is a real
Mooncake engine over TCP on 127.0.0.1.

Checked: after both ranks are done, *each* rank's view of the host pool holds every page
of the request (rank 0 pulled the first range, rank 1 the rest) and each rank's own
index-K cache holds the whole indexer; a read failure on decode rank 1 fails the request
there with the cause while rank 0 completes, and the status over the ranks (what
SGLang's MIN all-reduce of the polls gives) is failed; a per-rank pool at ``d_tp = 2`` is
refused before anything listens.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
from dsa_harness import INDEX_DIM, LATENT, ROPE, TOPK, hot_plan_for, published_context

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.testing.ports import reserve_port
from sglang_ascend_offload.transfer.status import TransferState, combine_rank_statuses

pytestmark = [
    pytest.mark.usefixtures("plugins_loaded"),
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)",
    ),
    pytest.mark.timeout(180),
]

PAGE = 16
SLOTS = 16 * PAGE
LAYERS = 3


def _common():
    return dict(
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        index_head_dim=INDEX_DIM,
    )


def device_pool(fill_seed=None):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool

    pool = DeviceDSAPool(SLOTS, index_size=SLOTS, index_page_size=PAGE, **_common())
    if fill_seed is not None:
        gen = torch.Generator().manual_seed(fill_seed)
        for buf in (pool.k_buffer, pool.v_buffer, pool.index_k_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    return pool


def host_pool():
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

    sd = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK)
    return HostMainKVPool(SLOTS, hot_plan=hot_plan_for(_common(), sd, top_k=TOPK, req_slots=4), offload=sd, **_common())


@pytest.fixture
def shared_pools(tmp_path, monkeypatch):
    """Two decode ranks' ``HostMainKVPool`` over one shared mapping (rank 0 creates, rank 1 attaches)."""
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool import sparse_decode as offload_pool
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp

    made = []

    def allocate(shape, kind, **_):
        if not made:
            shared = shp.create_pool(shape, group_size=2, directory=tmp_path)
        else:
            first = made[0]
            shared = shp.attach_pool(shape, first.path, first.session, rank=1)
        made.append(shared)
        return shp.RankPool(shared.pool, shared.order, shared.rank, None, shared)

    monkeypatch.setattr(offload_pool, "allocate_rank_pool", allocate)
    with published_context():
        pools = [host_pool(), host_pool()]
        yield pools
    for s in reversed(made):
        s.pool.close()


def pd_config():
    return cfg.PDTransferConfig(
        engine="mooncake",
        kv_port=reserve_port(span=2),
        host="127.0.0.1",
        layer_timeout_s=30.0,
        handshake_timeout_s=10.0,
        read_retries=0,
    )


class Group:
    """``p_tp`` prefill ranks and two decode ranks over ``pools`` (one engine each)."""

    def __init__(self, p_tp, pools, faulty_rank=None):
        from sglang_ascend_offload.testing.pd_faults import FaultInjector, FaultPlan, FaultyEngine
        from sglang_ascend_offload.transfer.decode_sink import DecodeSink
        from sglang_ascend_offload.transfer.engine import create_engine
        from sglang_ascend_offload.transfer.prefill_links import PrefillLinks

        self.config = pd_config()
        self.p_tp, self.ratio = p_tp, p_tp // 2
        self.p_pool = device_pool(fill_seed=7)  # replicated over prefill TP: same content on every rank
        self.p_pools = [self.p_pool] + [device_pool() for _ in range(p_tp - 1)]
        for p in self.p_pools[1:]:
            for name in ("k_buffer", "v_buffer", "index_k_buffer"):
                getattr(p, name).copy_(getattr(self.p_pool, name))
        self.engines = []
        self.sinks = []
        for d, pool in enumerate(pools):
            eng = create_engine(self.config, "decode")
            self.engines.append(eng)
            if d == faulty_rank:
                eng = FaultyEngine(eng, FaultInjector(FaultPlan(fail_reads=100)))
            self.sinks.append(DecodeSink(self.config, d_tp=2, d_rank=d, dp_rank=0, pool=pool, engine=eng))
        self.links = []
        for p in range(p_tp):
            eng = create_engine(self.config, "prefill")
            self.engines.append(eng)
            link = PrefillLinks(self.config, p_tp=p_tp, p_rank=p, pool=self.p_pools[p], engine=eng, max_blocks=8)
            link.note_peer(f"decode-{p // self.ratio}", self.sinks[p // self.ratio].advert())
            self.links.append(link)

    def transfer(self, room, src, dst, timeout=60.0):
        for sink in self.sinks:
            sink.expect(room, dst)
        for p, link in enumerate(self.links):
            link.submit(room, [f"decode-{p // self.ratio}"], src)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            d = [s.status(room) for s in self.sinks]
            p = [link.status(room) for link in self.links]
            if all(x is not None and x.terminal for x in d + p):
                return d, p
            time.sleep(0.01)
        raise AssertionError(f"room {room} not terminal: decode {[s.status(room) for s in self.sinks]}")

    def close(self):
        for link in self.links:
            link.close()
        for sink in self.sinks:
            sink.close()
        for eng in self.engines:
            eng.close()


@pytest.mark.parametrize("p_tp", [2, 4])
def test_each_decode_rank_sees_the_whole_request(shared_pools, p_tp):
    g = Group(p_tp, shared_pools)
    try:
        assert [s.advert().main_kv for s in g.sinks] == ["tp_shared", "tp_shared"]
        src, dst = [3, 9, 1, 12, 6], [4, 11, 2, 14, 8]  # 5 pages: rank 0 pulls 3, rank 1 pulls 2
        d, p = g.transfer(42, src, dst)
        assert all(s.state is TransferState.DONE for s in d + p), (d, p)
        for s in g.sinks:
            s.claim(42)
        pp = g.p_pool
        for layer in range(LAYERS):
            want = torch.cat(
                (pp.k_buffer[layer][src].reshape(5, PAGE, LATENT), pp.v_buffer[layer][src].reshape(5, PAGE, ROPE)),
                dim=-1,
            )
            for rank, pool in enumerate(shared_pools):  # each rank's mapping: every page, both ranges
                assert torch.equal(pool.host_page_blocks(layer)[dst], want), (rank, layer)
                assert torch.equal(pool.index_k_buffer[layer][dst], pp.index_k_buffer[layer][src]), (rank, layer)
        assert shared_pools[0].host_pool.data.data_ptr() != shared_pools[1].host_pool.data.data_ptr()  # two maps
    finally:
        g.close()


def test_a_failed_read_on_one_decode_rank_fails_the_request_over_the_ranks(shared_pools):
    g = Group(2, shared_pools, faulty_rank=1)
    try:
        d, p = g.transfer(7, [1, 2, 3], [5, 6, 7])
        assert d[0].state is TransferState.DONE
        assert d[1].state is TransferState.FAILED and "injected" in d[1].reason.lower(), d[1]
        assert p[1].state is TransferState.FAILED
        over = combine_rank_statuses(d)  # what the MIN all-reduce of the polls makes of it
        assert over.state is TransferState.FAILED and over.reason.startswith("rank 1:")
        assert g.sinks[1].wait_released(7, 5.0)  # no read writes into the pages any more
        assert g.sinks[0].forget(7, "failed on another decode rank")  # rank 0 gives its part up too
    finally:
        g.close()


def test_a_per_rank_pool_at_decode_tp_2_is_refused():
    from sglang_ascend_offload.transfer.decode_sink import DecodeSink
    from sglang_ascend_offload.transfer.engine import create_engine
    from sglang_ascend_offload.transfer.pool_layouts import LayoutError

    config = pd_config()
    eng = create_engine(config, "decode")
    try:
        with published_context():
            for pool in (device_pool(), host_pool()):  # device pool; a private host pool (no append order)
                with pytest.raises(LayoutError, match="decode attention TP 2 with a per-rank main-KV pool"):
                    DecodeSink(config, d_tp=2, d_rank=0, dp_rank=0, pool=pool, engine=eng)
    finally:
        eng.close()
