"""KVPP pool in SGLang, across real processes over gloo, without a server.

Every rank of a group of ``N`` (3 with active-block broadcast, then 2 with full-layer broadcast) builds, like
:mod:`dsa_harness`, SGLang's
``ReqToTokenPool`` / paged allocator / ``ForwardBatch``, the DSA ``Indexer`` and the
plugin's backend twice: over the plain :class:`DeviceDSAPool` (the reference: every
layer on every rank) and over :class:`KVPPPool` (owned layers + two scratch buffers,
broadcasts over a gloo group). All ranks feed the same seeded inputs (as TP ranks
see the same batch). Scenario: first prefill of two requests (no history: nothing is
broadcast), decode steps, a radix-style prefix hit, a chunked prefill, churn (a
request freed, its pages reused), more decode steps. Checked on every rank:

* every layer's top-k and attention output are bit-identical to the reference;
* forwards without history broadcast nothing; with history each layer is broadcast
  once, carrying exactly the active pages (``active``) or the whole bundle (``full``);
  active-block bytes <= active / allocated pages x full-layer bytes;
* the owner keeps the updated KV: its persistent rows equal the reference's rows of
  every live slot;
* the allocation (storage bytes) is owned bundles + two 2 MiB-aligned scratch buffers;
* negative control: with the broadcast suppressed the outputs differ (the check can fail).
"""

from __future__ import annotations

import os
import traceback
from types import SimpleNamespace

import pytest
import torch
from dsa_harness import HEADS, HIDDEN, INDEX_DIM, LATENT, Q_LORA, ROPE, TOPK, forward_batch, make_indexer
from npu_requirements import npu_present

LAYERS, PAGE, SLOTS, ROWS, MAX_CONTEXT = 5, 16, 512, 6, 256


def _free_port() -> int:
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port()  # reserved across processes, below the ephemeral range


class _Req:
    def __init__(self, rid: str, row: int):
        self.rid, self.row, self.length = rid, row, 0


class _Rank:
    """One rank: reference backend + KVPP backend over one slot space."""

    def __init__(self, rank: int, group_size: int, broadcast: str, process_group, device: str = "cpu"):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_ascend_offload import config as cfg
        from sglang_ascend_offload.sglang_plugin.attention.dsa_backend import AscendOffloadAttnBackend
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool.kvpp import KVPPGroup, KVPPPool

        self.device = device
        self.gen = torch.Generator().manual_seed(1234)  # same inputs on every rank
        self.rtp = ReqToTokenPool(size=ROWS, max_context_len=MAX_CONTEXT, device=device, enable_memory_saver=False)
        common = dict(
            page_size=PAGE,
            dtype=torch.bfloat16,
            kv_lora_rank=LATENT,
            qk_rope_head_dim=ROPE,
            layer_num=LAYERS,
            device=device,
            enable_memory_saver=False,
            index_head_dim=INDEX_DIM,
        )
        self.ref_pool = DeviceDSAPool(SLOTS, index_size=SLOTS, index_page_size=PAGE, **common)
        group = KVPPGroup(rank, group_size, tuple(range(group_size)), process_group)
        self.pool = KVPPPool(SLOTS, kvpp=cfg.KVPPConfig(broadcast=broadcast), group=group, **common)
        self.allocator = PagedTokenToKVPoolAllocator(
            SLOTS, PAGE, torch.bfloat16, device, self.ref_pool, need_sort=False
        )
        mc = SimpleNamespace(
            context_len=MAX_CONTEXT,
            kv_lora_rank=LATENT,
            qk_rope_head_dim=ROPE,
            hf_config=SimpleNamespace(index_topk=TOPK),
        )

        def runner(pool):
            return SimpleNamespace(
                device=device, req_to_token_pool=self.rtp, token_to_kv_pool=pool, page_size=PAGE, model_config=mc
            )

        self.ref = AscendOffloadAttnBackend(runner(self.ref_pool))
        self.kvpp = AscendOffloadAttnBackend(runner(self.pool))
        self.indexers = [make_indexer(layer, seed=layer).to(device) for layer in range(LAYERS)]
        self.layers = [SimpleNamespace(layer_id=l, tp_q_head_num=HEADS, scaling=0.125) for l in range(LAYERS)]
        self.reqs = {}
        self.log = []  # (has_history, active pages, bytes broadcast in the forward, mismatching layers)

    def new(self, rid, prefix_from=None, prefix_len=0):
        req = _Req(rid, self.rtp.alloc_rows(1)[0])
        if prefix_from is not None:  # the radix cache hands the request the owner's pages
            t = self.rtp.req_to_token
            t[req.row, :prefix_len] = t[self.reqs[prefix_from].row, :prefix_len]
            req.length = prefix_len
        self.reqs[rid] = req
        return req

    def finish(self, rid):
        req = self.reqs.pop(rid)
        slots = self.rtp.req_to_token[req.row, : req.length].to(torch.int64)
        self.allocator.free(slots[slots % PAGE == 0])
        self.rtp.free_rows([req.row])

    def _rand(self, *shape):
        return torch.randn(shape, generator=self.gen).to(torch.bfloat16).to(self.device)

    def extend(self, reqs, new_tokens):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        t = self.rtp.req_to_token
        prefix = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        seq = prefix + torch.tensor(new_tokens, dtype=torch.int64)
        last = torch.tensor([int(t[r.row, r.length - 1]) if r.length else -1 for r in reqs], dtype=torch.int64)
        dev = self.device
        out = self.allocator.alloc_extend(prefix.to(dev), prefix, seq.to(dev), seq, last.to(dev), int(sum(new_tokens)))
        assert out is not None
        off, pos = 0, []
        for r, n in zip(reqs, new_tokens):
            t[r.row, r.length : r.length + n] = out[off : off + n].to(torch.int32)
            pos.append(torch.arange(r.length, r.length + n))
            off += n
            r.length += n
        return self._forward(
            forward_batch(ForwardMode.EXTEND, reqs, out, torch.cat(pos), seq, prefix, new_tokens, self.device)
        )

    def decode(self, reqs):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        t = self.rtp.req_to_token
        seq = torch.tensor([r.length + 1 for r in reqs], dtype=torch.int64)
        last = torch.tensor([int(t[r.row, r.length - 1]) for r in reqs], dtype=torch.int64)
        out = self.allocator.alloc_decode(seq.to(self.device), seq, last.to(self.device))
        assert out is not None
        pos = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        for r, loc in zip(reqs, out.tolist()):
            t[r.row, r.length] = loc
            r.length += 1
        return self._forward(forward_batch(ForwardMode.DECODE, reqs, out, pos, seq, None, None, self.device))

    def _forward(self, fb):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self.ref.init_forward_metadata(fb)
        self.kvpp.init_forward_metadata(fb)
        n = int(fb.positions.numel())
        decode = fb.forward_mode.is_decode()
        before = self.pool.transport.bytes_broadcast
        bad = []
        for layer in range(LAYERS):
            x, q_lora = self._rand(n, HIDDEN), self._rand(n, Q_LORA)
            q, k = self._rand(n, HEADS, LATENT + ROPE), self._rand(n, 1, LATENT + ROPE)
            outs = []
            for backend in (self.ref, self.kvpp):
                run = backend.forward_decode if decode else backend.forward_extend
                with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
                    topk = backend.run_indexer(self.indexers[layer], x, q_lora, fb.positions, fb, layer)
                    outs.append((topk, run(q, k, k[..., :LATENT], self.layers[layer], fb, topk_indices=topk)))
            (t0, o0), (t1, o1) = outs
            if not (torch.equal(t0, t1) and torch.equal(o0, o1)):
                bad.append(layer)
        self.pool.scheduler.complete_forward()
        md = self.kvpp.forward_metadata
        blocks = self.pool.history_blocks(md, self.rtp.req_to_token)
        self.log.append(
            (
                blocks is not None,
                0 if blocks is None else int(blocks.numel()),
                self.pool.transport.bytes_broadcast - before,
                bad,
            )
        )


def _scenario(r: _Rank) -> None:
    a, b = r.new("a"), r.new("b")
    r.extend([a, b], [40, 20])  # first prefill: no history
    for _ in range(3):
        r.decode([a, b])
    c = r.new("c", prefix_from="a", prefix_len=32)  # radix-cache hit on two of a's pages
    r.extend([c], [10])
    d = r.new("d")
    r.extend([d], [20])  # chunked prefill: first chunk ...
    r.extend([d], [15])  # ... the second reads the first
    r.finish("b")  # churn: b's pages go back to the allocator
    e = r.new("e")
    r.extend([e], [30])
    for _ in range(3):
        r.decode([a, c, d, e])


def _run(rank, group_size, broadcast, process_group, device) -> dict:
    r = _Rank(rank, group_size, broadcast, process_group, device)
    _scenario(r)
    pool = r.pool
    # the owner keeps the updated KV: persistent rows == reference rows of every live slot
    live = torch.cat([r.rtp.req_to_token[q_.row, : q_.length].long() for q_ in r.reqs.values()]).to(device)
    owner_ok = all(
        torch.equal(pool.k_buffer[l].view(-1, LATENT)[live], r.ref_pool.k_buffer[l].view(-1, LATENT)[live])
        and torch.equal(pool.v_buffer[l].view(-1, ROPE)[live], r.ref_pool.v_buffer[l].view(-1, ROPE)[live])
        and torch.equal(
            pool.index_k_buffer[l].view(-1, INDEX_DIM)[live], r.ref_pool.index_k_buffer[l].view(-1, INDEX_DIM)[live]
        )
        for l in pool.owned_layers
    )
    # negative control: suppress the broadcast (every rank, so the collectives stay paired)
    # after clearing the scratch buffers (as another layer's use would)
    for buf in pool.storage.scratch:
        buf.zero_()
    pool.transport.broadcast = lambda layer, cache_ready=None: None
    r.decode([r.reqs["a"], r.reqs["c"]])
    control_bad = r.log.pop()[3]
    pool.close()
    return dict(
        rank=rank,
        log=r.log,
        owner_ok=owner_ok,
        owned=list(pool.owned_layers),
        allocated=pool.allocated_bytes,
        slot_rows=pool.slot_rows,
        control_bad=control_bad,
        num_blocks=pool.num_blocks,
    )


def _worker_env(port: int, device_kind: str) -> dict:
    """What a worker adds to its environment before it imports SGLang: the rendezvous, and
    on CPU SGLang's CPU engine; an NPU worker keeps what it inherits, so SGLang takes its
    NPU branches with the NPU tensors."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_kind == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def _worker(rank, world, port, runs, q, device_kind="cpu"):
    """``runs``: (group size, broadcast mode); a group is ranks ``0..size-1`` of the world.
    ``device_kind`` ``npu``: rank ``r`` on ``npu:r``, HCCL instead of gloo."""
    try:
        os.environ.update(_worker_env(port, device_kind))
        torch.set_num_threads(1)
        import torch.distributed as dist
        from dsa_harness import published_context
        from sglang.srt.plugins import load_plugins

        load_plugins()
        device = "cpu"
        if device_kind == "npu":
            import torch_npu  # noqa: F401

            device = f"npu:{rank}"
            torch.npu.set_device(rank)
        dist.init_process_group("gloo" if device == "cpu" else "hccl", rank=rank, world_size=world)
        groups = [dist.new_group(list(range(size))) for size, _ in runs]  # every rank creates every group
        out = []
        with published_context("cpu" if device == "cpu" else "npu"):
            for (size, broadcast), pg in zip(runs, groups):
                if rank < size:
                    out.append(dict(_run(rank, size, broadcast, pg, device), group=size, broadcast=broadcast))
        q.put(dict(rank=rank, results=out))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        q.put(dict(rank=rank, error=traceback.format_exc()))


def _spawn(world, runs, device_kind="cpu"):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, runs, q, device_kind)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        replies = sorted((q.get(timeout=240) for _ in procs), key=lambda d: d["rank"])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [d["error"] for d in replies if "error" in d]
    assert not errors, errors[0]
    for size, broadcast in runs:
        _check([res for d in replies for res in d["results"] if res["group"] == size], broadcast)
    return replies


def test_kvpp_pool_equals_replicated_pool_across_ranks():
    """Three processes over gloo: a group of 3 with active-block broadcast, then ranks
    0-1 as a group of 2 with full-layer broadcast."""
    replies = _spawn(3, [(3, "active"), (2, "full")])
    assert len(replies[2]["results"]) == 1  # rank 2 is outside the group of 2


def test_npu_workers_do_not_force_sglangs_cpu_engine():
    """``SGLANG_USE_CPU_ENGINE=1`` makes SGLang take its CPU branches: an NPU worker must not
    set it (its NPU tensors would go through them); a CPU worker needs it."""
    assert "SGLANG_USE_CPU_ENGINE" not in _worker_env(1, "npu")
    assert _worker_env(1, "cpu")["SGLANG_USE_CPU_ENGINE"] == "1"


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs 2 Ascend NPUs with CANN and torch_npu (HCCL)")
def test_kvpp_pool_over_hccl_on_npu():
    """The same scenario on two NPUs: pools on ``npu:0`` / ``npu:1``, broadcasts over HCCL
    on the transfer stream (events), both broadcast modes."""
    if torch.npu.device_count() < 2:
        pytest.skip("needs 2 NPUs")
    _spawn(2, [(2, "active"), (2, "full")], device_kind="npu")


def _check(results, broadcast):
    bundle_row = (LATENT + ROPE + INDEX_DIM) * 2  # bytes per slot row of one layer
    align = 2 * 1024 * 1024
    owned_all = []
    for d in results:
        owned_all += d["owned"]
        for i, (history, active, sent, bad) in enumerate(d["log"]):
            assert bad == [], f"rank {d['rank']} forward {i}: layers {bad} differ from the replicated pool"
            if not history:
                assert sent == 0, f"forward {i} has no history but broadcast {sent} bytes"
                continue
            full = LAYERS * bundle_row * d["slot_rows"]
            if broadcast == "full":
                assert sent == full
            else:
                assert sent == LAYERS * bundle_row * PAGE * active
                assert sent * d["num_blocks"] <= active * full  # active / allocated x full-layer bytes
        assert [h for h, *_ in d["log"]][:2] == [False, True]  # first prefill no, decode yes
        assert d["owner_ok"], f"rank {d['rank']}: owner's persistent KV differs from the reference"
        scratch = -(-bundle_row * d["slot_rows"] // align) * align
        assert d["allocated"] == len(d["owned"]) * bundle_row * d["slot_rows"] + 2 * scratch
        assert d["control_bad"], f"rank {d['rank']}: suppressing the broadcast changed nothing"
    assert sorted(owned_all) == list(range(LAYERS))  # every layer has exactly one owner
