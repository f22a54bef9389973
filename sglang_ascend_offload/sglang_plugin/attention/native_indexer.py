"""The DSA indexer's projections in plain torch: the CPU execution path.

SGLang 0.5.23's ``Indexer`` (``layers/attention/dsa/dsa_indexer.py``) has device
forwards only: ``forward_cuda`` / ``forward_xpu`` / ``forward_npu``; its
``forward_native`` raises ``NotImplementedError``, and that is what the fused-op
dispatch (``kernels/fused_op.py``) falls back to on a CPU without AMX. The plugin
fills ``forward_native`` through a HookRegistry AROUND hook
(``dsa_backend.forward_native_around``) that routes to the ``ascend_offload``
attention backend, which calls :func:`indexer_query_key_weights` here, then stores K
in the index-K cache and runs the ``lightning_indexer`` op.

The math mirrors SGLang's NPU indexer (``dsa/dsa_npu_indexer.py::forward_npu``), the
production target: bf16 query/key (no Hadamard rotation, which only the fp8 CUDA
cache uses), head weights ``weights_proj(x)`` rounded to bf16 as the NPU indexer hands
them to its operators (and as the fused LIM / LIM-C8 take them), without extra scaling
(a positive constant factor does not change a top-k), and the indexer rope applied to the first
``rope_head_dim`` dims. The rope is computed from ``rotary_emb.cos_sin_cache``
directly: ``DeepseekScalingRotaryEmbedding.forward_native``'s neox branch calls
``cos.repeat(1, 1, 2)`` on the 2-D ``[T, d/2]`` slice and produces a ``[1, T, d]``
tensor that broadcasts wrongly (``layers/rotary_embedding/rope_variant.py``).

See docs/design/sglang_hooks.md for where in SGLang's source these behaviours sit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IndexerInputs:
    """What the lightning indexer consumes for ``T`` new tokens.

    query:   bf16 [T, H, D]  indexer queries (rope applied to the first R dims)
    key:     bf16 [T, D]     indexer keys of the new tokens (to store in the cache)
    weights: bf16 [T, H]     per-head gates (the indexers compute in fp32 from them)
    """

    query: torch.Tensor
    key: torch.Tensor
    weights: torch.Tensor


def apply_indexer_rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox: bool
) -> torch.Tensor:
    """Rotate ``x [T, ..., R]`` by the positions' angles; float32 math, ``x.dtype`` out.

    cos_sin_cache: [max_pos, R] with cos in the first R/2 columns and sin in the
    last R/2 (SGLang's layout). neox: rotate halves (``[-x2, x1]``); otherwise rotate
    interleaved pairs (GPT-J style).
    """
    rope_dim = x.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions.to(torch.long)).to(torch.float32)
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, R/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xf = x.to(torch.float32)
    if neox:
        x1, x2 = xf[..., : rope_dim // 2], xf[..., rope_dim // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


def indexer_query_key_weights(
    indexer: torch.nn.Module, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor
) -> IndexerInputs:
    """Project hidden states into the indexer's query, key and head weights.

    indexer: SGLang's ``Indexer`` module (``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``, ``rotary_emb``, ``n_heads``, ``head_dim``, ``rope_head_dim``).
    x: [T, hidden] hidden states; q_lora: [T, q_lora_rank]; positions: int [T].
    """
    if isinstance(x, tuple):  # fused rms+quant producers hand (fp8, scale, bf16)
        x = x[-1]
    if not hasattr(indexer, "wk"):
        raise NotImplementedError(
            "the CPU indexer path needs the unfused wk/weights_proj projections "
            "(SGLANG_DISABLE_DSA_INDEXER_FUSION=1); the fused wk_weights_proj is CUDA-only"
        )
    tokens = q_lora.shape[0]
    heads, head_dim, rope_dim = indexer.n_heads, indexer.head_dim, indexer.rope_head_dim
    neox = bool(indexer.rotary_emb.is_neox_style)
    cache = indexer.rotary_emb.cos_sin_cache

    query = indexer.wq_b(q_lora)[0].view(tokens, heads, head_dim)
    q_rope = apply_indexer_rope(query[..., :rope_dim], positions, cache, neox)
    query = torch.cat((q_rope, query[..., rope_dim:]), dim=-1).to(torch.bfloat16)

    x2d = x.reshape(-1, x.shape[-1])
    key = indexer.k_norm(indexer.wk(x2d)[0])
    k_rope = apply_indexer_rope(key[..., :rope_dim], positions, cache, neox)
    key = torch.cat((k_rope.to(key.dtype), key[..., rope_dim:]), dim=-1).to(torch.bfloat16)

    weights = indexer.weights_proj(x2d)[0].to(torch.bfloat16)
    return IndexerInputs(query=query.contiguous(), key=key.contiguous(), weights=weights.contiguous())
