"""A small real attention model for tests and the prefill benchmark.

Per layer ``l``: ``q, k, v = h @ Wq[l], h @ Wk[l], h @ Wv[l]`` for the new tokens,
``k``/``v`` written into the layer's KV buffer (two main parts, ``[T, d]`` each),
causal attention of each new token over the request's prefix + new rows, and
``h += softmax(q k^T / sqrt(d)) v @ Wo[l]``. Only new tokens are computed; the
prefix K/V come from the cache. All float32 on the CPU by default.

:meth:`TinyAttentionModel.compute_layer` has the signature the pipeline's
:func:`~.pipeline.run_forward` expects; :class:`FullCacheRunner` runs the same
model without offload (a dedicated KV cache per layer, prefix reuse by block key)
so outputs can be compared bit for bit.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

from sglang_ascend_offload.layerwise_prefill.pipeline import ForwardLayout, PrefillRequest, RequestRows
from sglang_ascend_offload.layerwise_prefill.planner import LayerKVSpec, TensorSpec, uniform_specs
from sglang_ascend_offload.layerwise_prefill.store import block_keys

__all__ = ["TinyAttentionModel", "FullCacheRunner"]


class TinyAttentionModel:
    """``num_layers`` attention layers of width ``dim``; deterministic weights from ``seed``."""

    def __init__(
        self, num_layers: int, dim: int = 16, vocab: int = 101, seed: int = 0, dtype: torch.dtype = torch.float32
    ):
        g = torch.Generator().manual_seed(seed)
        s = 1.0 / math.sqrt(dim)
        self.num_layers, self.dim, self.dtype = num_layers, dim, dtype
        self.embedding = torch.randn(vocab, dim, generator=g).to(dtype)
        self.w = [
            tuple((torch.randn(dim, dim, generator=g) * s).to(dtype) for _ in range(4)) for _ in range(num_layers)
        ]
        self.hidden: Dict[str, torch.Tensor] = {}
        self.rows_computed = 0

    def specs(self, token_rows: int, num_mtp_layers: int = 0) -> List[LayerKVSpec]:
        dt = str(self.dtype).replace("torch.", "")
        main = (TensorSpec((token_rows, self.dim), dt), TensorSpec((token_rows, self.dim), dt))
        return uniform_specs(self.num_layers - num_mtp_layers, main, num_mtp_layers=num_mtp_layers)

    def start(self, requests: Sequence[PrefillRequest], layout: ForwardLayout) -> None:
        """Embed the new tokens of every request (call before the first layer)."""
        self.hidden = {}
        for req, rows in zip(requests, layout.requests):
            self.hidden[rows.rid] = self.embed(req.token_ids[rows.prefix_len :])

    def embed(self, token_ids) -> torch.Tensor:
        """``[n, dim]`` embeddings (token ids taken modulo the vocabulary)."""
        ids = torch.tensor(token_ids, dtype=torch.long) % self.embedding.shape[0]
        return self.embedding[ids].clone()

    def attend(
        self, layer: int, h: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, prefix_len: int
    ) -> torch.Tensor:
        """New hidden states; ``k_all``/``v_all`` hold prefix + new rows (new rows already written)."""
        wq, _, _, wo = self.w[layer]
        q = h @ wq
        scores = (q @ k_all.T) / math.sqrt(self.dim)
        n, total = h.shape[0], k_all.shape[0]
        pos = torch.arange(n).unsqueeze(1) + prefix_len
        mask = torch.arange(total).unsqueeze(0) > pos
        scores = scores.masked_fill(mask, float("-inf"))
        return h + (torch.softmax(scores, dim=-1) @ v_all) @ wo

    def new_kv(self, layer: int, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        _, wk, wv, _ = self.w[layer]
        return h @ wk, h @ wv

    def compute_layer(self, layer: int, buffer: List[torch.Tensor], layout: ForwardLayout) -> None:
        """Write the new K/V rows of every request into ``buffer`` and attend."""
        k_buf, v_buf = buffer[0], buffer[1]
        for r in layout.requests:
            h = self.hidden[r.rid]
            k, v = self.new_kv(layer, h)
            lo, mid, hi = r.row0, r.row0 + r.prefix_len, r.row0 + r.total_len
            k_buf[mid:hi].copy_(k)
            v_buf[mid:hi].copy_(v)
            self.hidden[r.rid] = self.attend(layer, h, k_buf[lo:hi], v_buf[lo:hi], r.prefix_len)
            self.rows_computed += r.new_len


class FullCacheRunner:
    """The same model without offload: every layer keeps its own KV (no sharing, no
    host store); a cached prefix is reused by block key, like a radix cache."""

    def __init__(self, model: TinyAttentionModel, block_tokens: int, namespace: str = ""):
        self.model, self.block_tokens, self.namespace = model, block_tokens, namespace
        self.cache: Dict[Tuple[str, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def kv_block(self, digest: str, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.cache[(digest, layer)]

    def run(self, req: PrefillRequest, prefix_len: int) -> torch.Tensor:
        """Hidden states of the new tokens after the last layer; fills the cache."""
        m, bt = self.model, self.block_tokens
        blocks = block_keys(req.token_ids, bt, self.namespace)
        assert prefix_len % bt == 0
        h = m.embed(req.token_ids[prefix_len:])
        total = len(req.token_ids)
        for layer in range(m.num_layers):
            k_all = torch.empty(total, m.dim, dtype=m.dtype)
            v_all = torch.empty(total, m.dim, dtype=m.dtype)
            for b in blocks[: prefix_len // bt]:
                k_all[b.start : b.start + b.tokens], v_all[b.start : b.start + b.tokens] = self.cache[(b.digest, layer)]
            k, v = m.new_kv(layer, h)
            k_all[prefix_len:], v_all[prefix_len:] = k, v
            h = m.attend(layer, h, k_all, v_all, prefix_len)
            for b in blocks[prefix_len // bt :]:
                self.cache[(b.digest, layer)] = (
                    k_all[b.start : b.start + b.tokens].clone(),
                    v_all[b.start : b.start + b.tokens].clone(),
                )
        return h


def rows_of(layout: ForwardLayout, rid: str) -> RequestRows:
    return next(r for r in layout.requests if r.rid == rid)
