"""Drive the plugin's pools and backends with real SGLang objects, without a server.

Real: ``ReqToTokenPool``, ``PagedTokenToKVPoolAllocator``, ``ForwardBatch`` /
``ForwardMode``, SGLang's DSA ``Indexer`` module (random weights), the plugin's
``DeviceDSAPool`` / ``HostMainKVPool`` and both backends. Stand-ins: the model runner
(a namespace with the attributes the backends read) and the attention layer (layer
id, head count, softmax scale). Both backends share one allocator and one
``req_to_token`` table, so the same slots back both; every forward feeds both
backends the same tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

HIDDEN, Q_LORA, HEADS, LATENT, ROPE = 256, 128, 4, 512, 64
INDEX_HEADS, INDEX_DIM, TOPK = 4, 128, 16
ROPE_SCALING = {
    "type": "yarn",
    "rope_type": "deepseek_yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@contextlib.contextmanager
def published_context(device: str = "cpu", **server_args_kw):
    """SGLang's runtime context for one rank (what pools and modules read), published from
    ``ServerArgs(model_path="dummy", device=device, **server_args_kw)``."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device=device, **server_args_kw)
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield server_args
    finally:
        reset_context()


def make_indexer(layer_id: int, neox: bool = True, seed: int = 0, index_heads: int = INDEX_HEADS, top_k: int = TOPK):
    """SGLang's DSA ``Indexer`` with random bf16 weights (tiny DeepSeek-V3.2 shapes)."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    ix = Indexer(
        hidden_size=HIDDEN,
        index_n_heads=index_heads,
        index_head_dim=INDEX_DIM,
        rope_head_dim=ROPE,
        index_topk=top_k,
        q_lora_rank=Q_LORA,
        max_position_embeddings=8192,
        rope_theta=10000,
        layer_id=layer_id,
        scale_fmt="ue8m0",
        block_size=128,
        rope_scaling=dict(ROPE_SCALING),
        is_neox_style=neox,
    )
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in ix.named_parameters():
            if name.endswith("k_norm.weight"):
                p.fill_(1.0)
            elif name.endswith("k_norm.bias"):
                p.zero_()
            else:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.2).to(p.dtype))
        ix.wq_b.weight.data = ix.wq_b.weight.data.to(torch.bfloat16)
        ix.wk.weight.data = ix.wk.weight.data.to(torch.bfloat16)
    return ix


def hot_plan_for(pool_kwargs: dict, offload, *, top_k: int, req_slots: int, verify_rows: int = 1):
    """The hot-buffer plan of a ``HostMainKVPool`` built with ``pool_kwargs`` (SGLang's pool
    arguments: page size, layers, MLA widths) whose request pool has ``req_slots`` rows
    (``req_to_token`` rows, SGLang's padding row included), as the served pool hook builds it."""
    from sglang_ascend_offload.sparse_decode.sizing import PADDING_REQ_SLOTS, HotBufferPlan

    return HotBufferPlan.build(
        configured_hot_tokens=offload.hot_tokens,
        top_k=top_k,
        page_size=pool_kwargs["page_size"],
        verify_rows=verify_rows,
        layers=pool_kwargs["layer_num"],
        row_dim=pool_kwargs["kv_lora_rank"] + pool_kwargs["qk_rope_head_dim"],
        running_requests=req_slots - PADDING_REQ_SLOTS,
    )


@dataclass
class Request:
    rid: str
    row: int
    length: int = 0  # tokens stored so far


@dataclass
class StepResult:
    """Per layer: both backends' top-k and attention outputs of one forward."""

    topk: List[torch.Tensor] = field(default_factory=list)
    dense_out: List[torch.Tensor] = field(default_factory=list)
    offload_out: List[torch.Tensor] = field(default_factory=list)
    offload_topk: List[torch.Tensor] = field(default_factory=list)
    inputs: List[Dict[str, torch.Tensor]] = field(default_factory=list)  # x, q_lora, q, k per layer
    forward_batch: object = None


def forward_batch(mode, reqs, out_cache_loc, positions, seq, prefix, new_tokens, device):
    """A real SGLang ``ForwardBatch`` for requests ``reqs`` (``.row``, ``.rid``): ``seq``
    lengths after the forward, ``prefix`` / ``new_tokens`` per request for an extend
    (``None`` for decode), ``out_cache_loc`` slots and ``positions`` of the new tokens."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    extend = new_tokens is not None
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(reqs),
        input_ids=torch.zeros(int(positions.numel()), dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=device),
        seq_lens=seq.to(device),
        out_cache_loc=out_cache_loc.to(device, torch.int64),
        seq_lens_sum=int(seq.sum()),
        seq_lens_cpu=seq.cpu().clone(),
        positions=positions.to(device),
        extend_seq_lens_cpu=list(new_tokens) if extend else None,
        extend_prefix_lens_cpu=prefix.tolist() if extend else None,
        extend_seq_lens=torch.tensor(new_tokens, device=device) if extend else None,
        extend_prefix_lens=prefix.to(device) if extend else None,
        rids=[r.rid for r in reqs],
    )


def pad_like_dp_attention(fb, pad_to: int, pad_row: int = 0):
    """Pad decode ForwardBatch ``fb`` to ``pad_to`` entries the way SGLang's DP attention
    does (``MAX_LEN``, ``ForwardBatch._pad_inputs_to_size``): entries naming
    ``req_to_token`` row ``pad_row`` (SGLang: 0), length 1, ``out_cache_loc`` 0, ``rids``
    not padded, ``_original_num_tokens`` = the real count. No-op when ``pad_to`` <= size."""
    real = int(fb.batch_size)
    if pad_to <= real:
        return fb
    n = pad_to - real

    def pad(t, value=0):
        return torch.cat((t, torch.full((n,) + tuple(t.shape[1:]), value, dtype=t.dtype, device=t.device)))

    fb._original_num_tokens, fb.batch_size = real, pad_to
    fb.input_ids, fb.positions, fb.out_cache_loc = pad(fb.input_ids), pad(fb.positions), pad(fb.out_cache_loc)
    fb.req_pool_indices = pad(fb.req_pool_indices, pad_row)
    fb.seq_lens, fb.seq_lens_cpu = pad(fb.seq_lens, 1), pad(fb.seq_lens_cpu, 1)
    fb.seq_lens_sum = int(fb.seq_lens_cpu.sum())
    return fb


class Harness:
    """Two backends (device KV / host KV) over one slot space; see module doc."""

    def __init__(
        self,
        *,
        layers: int = 2,
        rows: int = 4,
        page_size: int = 16,
        max_context: int = 256,
        slots: int = 1024,
        offload_config=None,
        seed: int = 0,
        device: str = "cpu",
        top_k: int = TOPK,
        index_heads: int = INDEX_HEADS,
    ):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_ascend_offload import config as cfg
        from sglang_ascend_offload.sglang_plugin.args import carrier
        from sglang_ascend_offload.sglang_plugin.attention.dsa_backend import AscendOffloadAttnBackend
        from sglang_ascend_offload.sglang_plugin.attention.sparse_decode import SparseDecodeOffloadBackend
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool
        from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

        self.layers, self.page_size, self.device = layers, page_size, device
        self.offload_config = offload_config or cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK)
        self.gen = torch.Generator().manual_seed(seed)
        self.req_to_token_pool = ReqToTokenPool(
            size=rows, max_context_len=max_context, device=device, enable_memory_saver=False
        )
        common = dict(
            page_size=page_size,
            dtype=torch.bfloat16,
            kv_lora_rank=LATENT,
            qk_rope_head_dim=ROPE,
            layer_num=layers,
            device=device,
            enable_memory_saver=False,
            index_head_dim=INDEX_DIM,
        )
        self.dense_pool = DeviceDSAPool(slots, index_size=slots, index_page_size=page_size, **common)
        self.hot_plan = hot_plan_for(
            common, self.offload_config, top_k=top_k, req_slots=self.req_to_token_pool.req_to_token.shape[0]
        )
        self.offload_pool = HostMainKVPool(slots, hot_plan=self.hot_plan, offload=self.offload_config, **common)
        self.allocator = PagedTokenToKVPoolAllocator(
            slots, page_size, torch.bfloat16, device, self.dense_pool, need_sort=False
        )
        model_config = SimpleNamespace(
            context_len=max_context,
            kv_lora_rank=LATENT,
            qk_rope_head_dim=ROPE,
            hf_config=SimpleNamespace(index_topk=top_k),
        )

        def runner(pool):
            return SimpleNamespace(
                device=device,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool=pool,
                page_size=page_size,
                model_config=model_config,
                tp_rank=0,
                dp_rank=None,
                server_args=SimpleNamespace(enable_metrics=False, dp_size=1, model_path="tiny"),
            )

        carrier.publish(cfg.OffloadConfig(sparse_decode=self.offload_config))
        try:
            self.dense = AscendOffloadAttnBackend(runner(self.dense_pool))
            self.offload = SparseDecodeOffloadBackend(runner(self.offload_pool))
        finally:
            carrier.clear()
        assert isinstance(self.offload_pool, HostMainKVPool)
        self.indexers = [
            make_indexer(layer, seed=layer, index_heads=index_heads, top_k=top_k).to(device) for layer in range(layers)
        ]
        self.attn_layers = [
            SimpleNamespace(layer_id=layer, tp_q_head_num=HEADS, scaling=0.125) for layer in range(layers)
        ]
        self.requests: Dict[str, Request] = {}

    # ------------------------------------------------------------------ requests
    def new_request(self, rid: str, prefix_from: Optional[str] = None, prefix_len: int = 0) -> Request:
        row = self.req_to_token_pool.alloc_rows(1)[0]
        req = Request(rid=rid, row=row)
        if prefix_from is not None:  # what the radix cache hands a request: the owner's slots
            src = self.requests[prefix_from]
            table = self.req_to_token_pool.req_to_token
            table[row, :prefix_len] = table[src.row, :prefix_len]
            req.length = prefix_len
        self.requests[rid] = req
        return req

    def finish(self, rid: str) -> None:
        req = self.requests.pop(rid)
        self.req_to_token_pool.free_rows([req.row])

    # ------------------------------------------------------------------ batches
    def _rand(self, *shape, scale=1.0):
        return (torch.randn(shape, generator=self.gen) * scale).to(torch.bfloat16).to(self.device)

    def extend(self, reqs: List[Request], new_tokens: List[int]) -> StepResult:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        table = self.req_to_token_pool.req_to_token
        prefix = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        seq = prefix + torch.tensor(new_tokens, dtype=torch.int64)
        last_loc = torch.tensor([int(table[r.row, r.length - 1]) if r.length else -1 for r in reqs], dtype=torch.int64)
        dev = self.device
        out = self.allocator.alloc_extend(
            prefix.to(dev), prefix, seq.to(dev), seq, last_loc.to(dev), int(sum(new_tokens))
        )
        assert out is not None, "allocator ran out of pages"
        offset = 0
        positions = []
        for r, n in zip(reqs, new_tokens):
            table[r.row, r.length : r.length + n] = out[offset : offset + n].to(torch.int32)
            positions.append(torch.arange(r.length, r.length + n, device=self.device))
            offset += n
            r.length += n
        fb = self._batch(ForwardMode.EXTEND, reqs, out, torch.cat(positions), seq, prefix, new_tokens)
        return self._forward(fb)

    def decode(self, reqs: List[Request], pad_to: int = 0, pad_row: int = 0) -> StepResult:
        """One decode step; ``pad_to`` > len(reqs): :func:`pad_like_dp_attention`."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        table = self.req_to_token_pool.req_to_token
        seq = torch.tensor([r.length + 1 for r in reqs], dtype=torch.int64)
        last_loc = torch.tensor([int(table[r.row, r.length - 1]) for r in reqs], dtype=torch.int64)
        out = self.allocator.alloc_decode(seq.to(self.device), seq, last_loc.to(self.device))
        assert out is not None, "allocator ran out of pages"
        positions = torch.tensor([r.length for r in reqs], dtype=torch.int64, device=self.device)
        for r, loc in zip(reqs, out.tolist()):
            table[r.row, r.length] = loc
            r.length += 1
        fb = self._batch(ForwardMode.DECODE, reqs, out, positions, seq, None, None)
        return self._forward(pad_like_dp_attention(fb, pad_to, pad_row))

    def _batch(self, mode, reqs, out_cache_loc, positions, seq, prefix, new_tokens):
        return forward_batch(mode, reqs, out_cache_loc, positions, seq, prefix, new_tokens, self.device)

    def _forward(self, fb) -> StepResult:
        self.dense.init_forward_metadata(fb)
        self.offload.init_forward_metadata(fb)
        tokens = int(fb.positions.numel())
        result = StepResult(forward_batch=fb)
        run = self.offload.forward_decode if fb.forward_mode.is_decode() else self.offload.forward_extend
        run_dense = self.dense.forward_decode if fb.forward_mode.is_decode() else self.dense.forward_extend
        for layer in range(self.layers):
            x = self._rand(tokens, HIDDEN)
            q_lora = self._rand(tokens, Q_LORA)
            q = self._rand(tokens, HEADS, LATENT + ROPE)
            k = self._rand(tokens, 1, LATENT + ROPE)
            ix = self.indexers[layer]
            with torch.no_grad():
                topk = self.dense.run_indexer(ix, x, q_lora, fb.positions, fb, layer)
                topk_off = self.offload.run_indexer(ix, x, q_lora, fb.positions, fb, layer)
                att = self.attn_layers[layer]
                result.dense_out.append(run_dense(q, k, k[..., :LATENT], att, fb, topk_indices=topk))
                result.offload_out.append(run(q, k, k[..., :LATENT], att, fb, topk_indices=topk_off))
            result.inputs.append({"x": x, "q_lora": q_lora, "q": q, "k": k})
            result.topk.append(topk)
            result.offload_topk.append(topk_off)
        return result
