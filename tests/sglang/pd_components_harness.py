"""Pools and a connected prefill/decode pair of the ascend_offload P/D backend at the tiny DSA
shapes, shared by the P/D component tests (backend, int8 indexer, layerwise publish).
"""

from __future__ import annotations

import time

import torch
from dsa_harness import INDEX_DIM, LATENT, ROPE, TOPK, hot_plan_for

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.testing.ports import reserve_port
from sglang_ascend_offload.transfer.status import TransferState

PAGE = 16


SLOTS = 16 * PAGE  # 16 pages (+ SGLang's padding page)


LAYERS = 3  # > 2 staging slots: the packing slots are reused under their gates


def free_port() -> int:
    return reserve_port()  # reserved across processes, below the ephemeral range


def _common(page=PAGE, layers=LAYERS, device="cpu"):
    return dict(
        page_size=page,
        dtype=torch.bfloat16,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        layer_num=layers,
        device=device,
        enable_memory_saver=False,
        index_head_dim=INDEX_DIM,
    )


def device_pool(page=PAGE, layers=LAYERS, fill_seed=None, start_layer=None, slots=SLOTS, device="cpu"):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool

    pool = DeviceDSAPool(
        slots, index_size=slots, index_page_size=page, start_layer=start_layer, **_common(page, layers, device)
    )
    if fill_seed is not None:  # drawn on the host: the same numbers on every device
        gen = torch.Generator().manual_seed(fill_seed)
        for buf in (pool.k_buffer, pool.v_buffer, pool.index_k_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    return pool


def draft_pool(fill_seed=None, **kw):
    """The NextN draft model's pool: one layer, numbered after the target's (SGLang's
    draft layer id is the target's layer count)."""
    pool = device_pool(layers=1, fill_seed=fill_seed, start_layer=LAYERS, **kw)
    pool.is_draft_worker = True
    return pool


def host_pool(page=PAGE, layers=LAYERS, device="cpu"):
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

    sd = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK)
    common = _common(page, layers, device)
    return HostMainKVPool(SLOTS, hot_plan=hot_plan_for(common, sd, top_k=TOPK, req_slots=4), offload=sd, **common)


def pd_config(**kw):
    """A CPU P/D config; the 30 s layer deadline only fires when a test stalls a transfer
    (tests of the deadline pass their own): a loaded machine's slow answer is no failure."""
    base = dict(
        engine="mooncake",
        kv_port=free_port(),
        host="127.0.0.1",
        layer_timeout_s=30.0,
        handshake_timeout_s=10.0,
        read_retries=1,
    )
    base.update(kw)
    return cfg.PDTransferConfig(**base)


class Pair:
    """One prefill rank and one decode rank, each with its own engine."""

    def __init__(self, decode_pool, prefill_pool=None, config=None, p_draft=None, d_draft=None):
        from sglang_ascend_offload.transfer.decode_sink import DecodeSink
        from sglang_ascend_offload.transfer.engine import create_engine
        from sglang_ascend_offload.transfer.prefill_links import PrefillLinks

        self.config = config or pd_config()
        self.p_pool = prefill_pool if prefill_pool is not None else device_pool(fill_seed=1)
        self.d_pool = decode_pool
        self.p_draft, self.d_draft = p_draft, d_draft
        self.p_engine = create_engine(self.config, "prefill")
        self.d_engine = create_engine(self.config, "decode")
        self.sink = DecodeSink(
            self.config, d_tp=1, d_rank=0, dp_rank=0, pool=decode_pool, engine=self.d_engine, draft_pool=d_draft
        )
        self.links = PrefillLinks(
            self.config, p_tp=1, p_rank=0, pool=self.p_pool, engine=self.p_engine, max_blocks=8, draft_pool=p_draft
        )
        self.links.note_peer("decode-session", self.sink.advert())

    def transfer_all(self, jobs, check, also=None):
        """Queue every ``room: (src pages, dst pages)`` back to back (slots and gates reused
        across requests), then per room: both sides done, claimed, ``check(p_pool, d_pool,
        src, dst)`` and ``also(src, dst)`` when given."""
        for room, (src, dst) in jobs.items():
            self.sink.expect(room, dst)
            self.links.submit(room, ["decode-session"], src)
        for room, (src, dst) in jobs.items():
            p, d = self.wait(room)
            assert p.state is TransferState.DONE and d.state is TransferState.DONE, (p, d)
            self.sink.claim(room)
            check(self.p_pool, self.d_pool, src, dst)
            if also is not None:
                also(src, dst)

    def transfer(self, room, src_pages, dst_pages, timeout=30.0):
        self.sink.expect(room, dst_pages)
        self.links.submit(room, ["decode-session"], src_pages)
        return self.wait(room, timeout)

    def wait(self, room, timeout=30.0, decode=True):
        """Both sides terminal (prefill only with ``decode=False``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p, d = self.links.status(room), self.sink.status(room)
            if p is not None and p.terminal and (not decode or d is None or d.terminal):
                return p, d
            time.sleep(0.01)
        raise AssertionError(
            f"room {room} not terminal after {timeout}s: prefill {self.links.status(room)}, "
            f"decode {self.sink.status(room)}"
        )

    def close(self):
        self.links.close()
        self.sink.close()
        self.p_engine.close()
        self.d_engine.close()


def assert_idle(link, timeout=5.0):
    """Every published batch answered (later layers' answers may still be on their way) and
    no slot gated."""
    deadline = time.monotonic() + timeout
    while link.sender.open_batches() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.sender.open_batches() == 0
    assert link.gates.busy_slots() == []


def assert_split_equal(p_pool, d_pool, src, dst):
    """The decode pool's pages ``dst`` equal the prefill pool's ``src`` (compared on the host:
    the pools may be on a device)."""
    for layer in range(LAYERS):
        for buf in ("k_buffer", "v_buffer"):
            got, want = getattr(d_pool, buf)[layer].cpu()[dst], getattr(p_pool, buf)[layer].cpu()[src]
            assert torch.equal(got, want), (layer, buf)
        got, want = d_pool.index_k_buffer[layer].cpu()[dst], p_pool.index_k_buffer[layer].cpu()[src]
        assert torch.equal(got, want), layer


def assert_host_rows_equal(p_pool, d_pool, src, dst):
    """The decode host pool's page blocks / rows ``dst`` and device index K equal the prefill
    pool's pages ``src`` (compared on the host)."""
    for layer in range(LAYERS):
        want = torch.cat(
            (
                p_pool.k_buffer[layer].cpu()[src].reshape(len(src), PAGE, LATENT),
                p_pool.v_buffer[layer].cpu()[src].reshape(len(src), PAGE, ROPE),
            ),
            dim=-1,
        )
        assert torch.equal(d_pool.host_page_blocks(layer).cpu()[dst], want), layer
        slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in dst])
        assert torch.equal(d_pool.host_rows(layer).cpu()[slots], want.reshape(-1, LATENT + ROPE)), layer
        got = d_pool.index_k_buffer[layer].cpu()[dst]
        assert torch.equal(got, p_pool.index_k_buffer[layer].cpu()[src]), layer
