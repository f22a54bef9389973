"""A layerwise prefill offload pool driven like SGLang's scheduler (prefix chunks, decode, page
book), beside a plain device pool, for the layerwise pool and P/D layerwise publish tests.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import torch
from dsa_harness import (
    HEADS,
    HIDDEN,
    INDEX_DIM,
    LATENT,
    Q_LORA,
    ROPE,
    TOPK,
    forward_batch,
    make_indexer,
    pad_like_dp_attention,
)

from sglang_ascend_offload import config as cfg

LAYERS, PAGE, SLOTS, ROWS, MAX_CONTEXT = 4, 16, 1024, 6, 256


class Req:
    def __init__(self, rid: str, row: int):
        self.rid, self.row, self.length = rid, row, 0


class LayerwiseHarness:
    """A device pool and a layerwise pool over one allocator / req_to_token (see module doc).

    ``between(layer, harness)`` runs after the reference layer and before the layerwise
    one (the reference pool then holds the layer's final rows of this forward).
    """

    def __init__(
        self,
        lw: cfg.LayerwisePrefillOffloadConfig,
        *,
        store=None,
        device: str = "cpu",
        seed: int = 0,
        between: Optional[Callable[[int, "LayerwiseHarness"], None]] = None,
    ):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_ascend_offload.sglang_plugin.attention.dsa_backend import AscendOffloadAttnBackend
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool.layerwise_prefill import LayerwisePrefillPool

        self.device = device
        self.gen = torch.Generator().manual_seed(seed)
        self.req_to_token_pool = ReqToTokenPool(
            size=ROWS, max_context_len=MAX_CONTEXT, device=device, enable_memory_saver=False
        )
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
        self.dense_pool = DeviceDSAPool(SLOTS, index_size=SLOTS, index_page_size=PAGE, **common)
        self.pool = LayerwisePrefillPool(SLOTS, offload=lw, store=store, namespace="test", **common)
        self.allocator = PagedTokenToKVPoolAllocator(
            SLOTS, PAGE, torch.bfloat16, device, self.dense_pool, need_sort=False
        )
        model_config = SimpleNamespace(
            context_len=MAX_CONTEXT,
            kv_lora_rank=LATENT,
            qk_rope_head_dim=ROPE,
            hf_config=SimpleNamespace(index_topk=TOPK),
        )

        def runner(pool):
            return SimpleNamespace(
                device=device,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool=pool,
                page_size=PAGE,
                model_config=model_config,
            )

        self.dense = AscendOffloadAttnBackend(runner(self.dense_pool))
        self.layerwise = AscendOffloadAttnBackend(runner(self.pool))
        self.indexers = [make_indexer(layer, seed=layer).to(device) for layer in range(LAYERS)]
        self.attn_layers = [SimpleNamespace(layer_id=l, tp_q_head_num=HEADS, scaling=0.125) for l in range(LAYERS)]
        self.requests: Dict[str, Req] = {}
        self.between = between

    # ------------------------------------------------------------------ requests
    def new_request(self, rid: str, prefix_from: Optional[str] = None, prefix_len: int = 0) -> Req:
        req = Req(rid, self.req_to_token_pool.alloc_rows(1)[0])
        if prefix_from is not None:  # what the radix cache hands a request: the owner's pages
            table = self.req_to_token_pool.req_to_token
            table[req.row, :prefix_len] = table[self.requests[prefix_from].row, :prefix_len]
            req.length = prefix_len
        self.requests[rid] = req
        return req

    def finish(self, rid: str, free_pages: bool = True) -> None:
        req = self.requests.pop(rid)
        if free_pages:
            slots = self.req_to_token_pool.req_to_token[req.row, : req.length].to(torch.int64)
            self.allocator.free(slots[slots % PAGE == 0])  # page-aligned free, as SGLang does
        self.req_to_token_pool.free_rows([req.row])

    # ------------------------------------------------------------------ forwards
    def _rand(self, *shape):
        return torch.randn(shape, generator=self.gen).to(torch.bfloat16).to(self.device)

    def extend(self, reqs: List[Req], new_tokens: List[int]):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        table = self.req_to_token_pool.req_to_token
        prefix = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        seq = prefix + torch.tensor(new_tokens, dtype=torch.int64)
        last = torch.tensor([int(table[r.row, r.length - 1]) if r.length else -1 for r in reqs], dtype=torch.int64)
        dev = self.device
        out = self.allocator.alloc_extend(prefix.to(dev), prefix, seq.to(dev), seq, last.to(dev), int(sum(new_tokens)))
        assert out is not None, "allocator ran out of pages"
        offset, positions = 0, []
        for r, n in zip(reqs, new_tokens):
            table[r.row, r.length : r.length + n] = out[offset : offset + n].to(torch.int32)
            positions.append(torch.arange(r.length, r.length + n))
            offset += n
            r.length += n
        return self._forward(self._batch(ForwardMode.EXTEND, reqs, out, torch.cat(positions), seq, prefix, new_tokens))

    def decode(self, reqs: List[Req], pad_to: int = 0, pad_row: int = 0):
        """One decode step; ``pad_to`` > len(reqs): ``dsa_harness.pad_like_dp_attention``."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        table = self.req_to_token_pool.req_to_token
        seq = torch.tensor([r.length + 1 for r in reqs], dtype=torch.int64)
        last = torch.tensor([int(table[r.row, r.length - 1]) for r in reqs], dtype=torch.int64)
        out = self.allocator.alloc_decode(seq.to(self.device), seq, last.to(self.device))
        assert out is not None, "allocator ran out of pages"
        positions = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        for r, loc in zip(reqs, out.tolist()):
            table[r.row, r.length] = loc
            r.length += 1
        fb = self._batch(ForwardMode.DECODE, reqs, out, positions, seq, None, None)
        return self._forward(pad_like_dp_attention(fb, pad_to, pad_row))

    def _batch(self, mode, reqs, out_cache_loc, positions, seq, prefix, new_tokens):
        return forward_batch(mode, reqs, out_cache_loc, positions, seq, prefix, new_tokens, self.device)

    def _forward(self, fb):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self.dense.init_forward_metadata(fb)
        self.layerwise.init_forward_metadata(fb)
        tokens = int(fb.positions.numel())
        decode = fb.forward_mode.is_decode()
        pairs = []
        for layer in range(LAYERS):
            x, q_lora = self._rand(tokens, HIDDEN), self._rand(tokens, Q_LORA)
            q, k = self._rand(tokens, HEADS, LATENT + ROPE), self._rand(tokens, 1, LATENT + ROPE)
            ix, att = self.indexers[layer], self.attn_layers[layer]
            outs = []
            for name, backend in (("dense", self.dense), ("layerwise", self.layerwise)):
                if name == "layerwise" and self.between is not None:
                    self.between(layer, self)
                run = backend.forward_decode if decode else backend.forward_extend
                with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
                    topk = backend.run_indexer(ix, x, q_lora, fb.positions, fb, layer)
                    outs.append((topk, run(q, k, k[..., :LATENT], att, fb, topk_indices=topk)))
            pairs.append(outs)
        return pairs


def assert_same(pairs, what: str) -> None:
    for layer, ((t_ref, o_ref), (t_lw, o_lw)) in enumerate(pairs):
        assert torch.equal(t_ref, t_lw), f"{what}: layer {layer} top-k differs"
        assert torch.equal(o_ref, o_lw), f"{what}: layer {layer} attention output differs"


def reference_rows(h: LayerwiseHarness, layer: int, page: int, rows: int) -> List[torch.Tensor]:
    """The reference pool's [latent, rope, index K] rows of ``page`` for ``layer``."""
    lo = page * PAGE
    return [
        h.dense_pool.k_buffer[layer].view(-1, LATENT)[lo : lo + rows],
        h.dense_pool.v_buffer[layer].view(-1, ROPE)[lo : lo + rows],
        h.dense_pool.index_k_buffer[layer].view(-1, INDEX_DIM)[lo : lo + rows],
    ]


def lw_config(shared_buffers, **kw) -> cfg.LayerwisePrefillOffloadConfig:
    return cfg.LayerwisePrefillOffloadConfig(
        shared_buffers=shared_buffers, store_backend="local", wait_timeout_s=kw.pop("wait_timeout_s", 20.0), **kw
    )
