"""The ``ascend_offload`` attention backend: DSA (MLA + indexer + top-k) attention.

One backend serves two memory layouts:

* main KV on the device (:class:`~..mem_cache.pool.device.DeviceDSAPool`, SGLang's NPU MLA layout):
  the DSA execution path on any device; on a CPU it is how SGLang serves a
  DeepSeek-V3.2-style model at all (SGLang has no CPU DSA path);
* main KV in the host pool (:class:`~..mem_cache.pool.sparse_decode.HostMainKVPool`): sparse decode
  offload (:mod:`.sparse_decode`).

Per layer and forward:

1. the indexer (SGLang's ``Indexer`` module; on a CPU through the plugin's
   ``forward_native`` hook, on an NPU through SGLang's own ``forward_npu``, or the
   plugin's where the backend owns the indexer: :meth:`owns_npu_indexer`) stores
   the new tokens' index K and returns logical top-k positions ``[T, K]`` (``-1``
   padded) with :meth:`run_indexer`;
2. :meth:`forward_extend` / :meth:`forward_decode` store the new tokens' latent and
   rope rows and run sparse MLA attention (absorbed form) over the selected
   positions with the op ladder's ``sparse_mla_attention``.

Shapes (N heads, Dl = kv_lora_rank = 512, Dr = rope = 64): ``q`` is either
``[T, N, Dl + Dr]`` (DeepSeek's concatenated path) or ``q_nope [T, N, Dl]`` with
``q_rope=[T, N, Dr]`` (absorb-core path); ``k`` is ``[T, 1, Dl + Dr]`` or
``k_nope [T, 1, Dl]`` with ``k_rope``; the output is ``[T, N * Dl]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ...ops.hadamard import rotate_and_quantize
from ...sparse_decode import op_selection
from ..args import carrier
from ..names import BACKEND_NAME  # noqa: F401 - re-exported; its home is names.py
from ..speculative import cpu_graph as cpu_spec_graph
from ..speculative import eagle as speculative
from .dsa_metadata import DSAForwardMetadata, build_metadata, real_batch_size
from .native_indexer import IndexerInputs, indexer_query_key_weights

logger = logging.getLogger(__name__)
_BOUND_LOGGED: set = set()


@dataclass
class GraphBuffers:
    """Static metadata buffers for graph capture/replay of decode batches up to ``max_bs``.

    seq_lens / seq_lens_cpu_int / actual_seq_lengths_q: int32 [max_bs];
    block_tables: int32 [max_bs, max_blocks]; req_pool_indices: int64 [max_bs].
    """

    max_bs: int
    seq_lens: torch.Tensor
    seq_lens_cpu_int: torch.Tensor
    actual_seq_lengths_q: torch.Tensor
    block_tables: torch.Tensor
    req_pool_indices: torch.Tensor
    block_columns: torch.Tensor  # int64 [max_blocks]: first position of each page


@dataclass
class LayerRanking:
    """The indexer's ranking of one layer for the current decode step, kept for the
    residency manager: ``ranked`` int32 ``[T, D]`` positions in descending indexer-score
    order (``-1`` padding; its first ``k`` columns are the step's top-k), T the batch's
    query tokens (decode: one per request, DP-attention padding after the real rows)."""

    layer_id: int
    ranked: torch.Tensor


class AscendOffloadAttnBackend(AttentionBackend):
    """DSA attention over the plugin's pools with the op ladder (see module doc)."""

    def __init__(self, model_runner: Any):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(model_runner.page_size)
        self.max_context_len = int(model_runner.model_config.context_len)
        hf = model_runner.model_config.hf_config
        self.kv_lora_rank = int(model_runner.model_config.kv_lora_rank)
        self.qk_rope_head_dim = int(model_runner.model_config.qk_rope_head_dim)
        self.index_topk = getattr(hf, "index_topk", None)  # an HF config field: None for MLA models without DSA
        self.offload_config = carrier.active_config().sparse_decode
        # An int8 index-K cache (indexer_dtype int8, the sparse decode pool only): LIM-C8 scoring
        # over Hadamard-rotated int8 keys + fp16 scales; every other pool keeps bf16 keys.
        self.index_int8 = getattr(self.token_to_kv_pool, "indexer_dtype", "bf16") == "int8"
        self.bind_ops(self._separate_ops_plan())
        self.forward_metadata: Optional[DSAForwardMetadata] = None
        self.graph: Optional[GraphBuffers] = None
        self._graph_batch: Optional[int] = None
        self.ranking: Optional[LayerRanking] = None  # the last layer's top-D ranking (score policies)

    def _separate_ops_plan(self) -> op_selection.OpPlan:
        """The operator plan of this backend's separate indexer and attention (the device-KV
        path, and every extend): the rungs :mod:`~...sparse_decode.op_rungs` resolves for the
        ``ops`` setting on this device. The fused operators are the offload engine's plan's."""
        ops_choice = self.offload_config.ops if self.offload_config is not None else "auto"
        return op_selection.select_ops(
            op_selection.platform_of(self.device),
            ops=ops_choice,
            fused_lim=False,
            fused_copy_sfa=False,
            indexer_dtype="int8" if self.index_int8 else "bf16",
        )

    def bind_ops(self, plan: op_selection.OpPlan) -> None:
        """Take the separate indexer (``lightning_indexer``, or ``quant_lightning_indexer``
        over an int8 cache) and attention from ``plan`` (:meth:`~...sparse_decode.op_selection.OpPlan.impl`:
        a stage that cannot run raises, naming what to set); log their rungs once."""
        self.op_plan = plan
        indexer, attention = plan.rungs[0], plan.rung("sparse_mla_attention")
        self.indexer_op = plan.impl(indexer.op)
        self.attention_op = plan.impl(attention.op)
        key = (type(self).__name__, indexer.label(), attention.label())
        if key not in _BOUND_LOGGED:
            _BOUND_LOGGED.add(key)
            logger.info(
                "%s: indexer %s (%s), attention %s (%s)",
                type(self).__name__,
                indexer.label(),
                indexer.reason,
                attention.label(),
                attention.reason,
            )

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Host-side metadata. Decode batches that fit the graph buffers use static
        views (filled by :meth:`init_forward_metadata_in_graph`); others are eager."""
        mode = forward_batch.forward_mode
        bs = int(forward_batch.batch_size)
        if cpu_spec_graph.verify_graph_fits(self, forward_batch):  # CPU verify graph: bs x n decode rows
            cpu_spec_graph.verify_graph_metadata(self, bs, graph_seq_lens_cpu(forward_batch))
            return
        if self.graph is not None and mode.is_decode() and bs <= self.graph.max_bs:
            self._graph_decode_metadata(bs, graph_seq_lens_cpu(forward_batch))
            return
        self._graph_batch = None
        if mode.is_idle():
            self.forward_metadata = None
            return
        q_lens = None if mode.is_decode() else forward_batch.extend_seq_lens_cpu
        seq_lens_cpu = forward_batch.seq_lens_cpu
        spec = speculative.speculative_lens(forward_batch, getattr(self, "speculative_step_id", None))
        if spec is not None:  # TARGET_VERIFY (n rows per request) or a draft decode step
            q_lens, seq_lens_cpu = spec
        self.forward_metadata = build_metadata(
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            seq_lens_cpu,
            q_lens,
            self.page_size,
            forward_batch.seq_lens.device,
            is_decode=mode.is_decode(),
        )
        self.forward_metadata.real_batch_size = real_batch_size(forward_batch)

    def _graph_decode_metadata(self, bs: int, seq_lens_cpu: torch.Tensor) -> None:
        """Metadata of a graph decode batch of ``bs`` rows: views ``[:bs]`` of the static
        buffers (the same tensors at capture and at every replay of the bucket)."""
        g = self.graph
        g.seq_lens_cpu_int[:bs].copy_(seq_lens_cpu.to(torch.int32))
        self._graph_batch = bs
        self.forward_metadata = DSAForwardMetadata(
            seq_lens=g.seq_lens[:bs],
            seq_lens_cpu_int=g.seq_lens_cpu_int[:bs],
            actual_seq_lengths_q=g.actual_seq_lengths_q[:bs],
            block_tables=g.block_tables[:bs],
            q_lens_cpu=[1] * bs,
            req_pool_indices=g.req_pool_indices[:bs],
            is_decode=True,
        )

    def init_forward_metadata_in_graph(self, forward_batch):
        """Static-shape device copies into the graph buffers (recordable; no host syncs)."""
        bs = self._graph_batch
        if bs is None:
            return
        if forward_batch.forward_mode.is_target_verify():
            cpu_spec_graph.fill_verify_graph_buffers(self, forward_batch.req_pool_indices, forward_batch.seq_lens)
            return
        self._fill_graph_buffers(bs, forward_batch.req_pool_indices, forward_batch.seq_lens)

    def _fill_graph_buffers(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        g = self.graph
        g.req_pool_indices[:bs].copy_(req_pool_indices[:bs])
        g.seq_lens[:bs].copy_(seq_lens[:bs])
        slots = self.req_to_token_pool.req_to_token[g.req_pool_indices[:bs]][:, g.block_columns]
        g.block_tables[:bs].copy_(torch.div(slots, self.page_size, rounding_mode="floor"))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Allocate static metadata buffers for decode graphs of up to ``max_bs`` requests."""
        max_blocks = -(-self.max_context_len // self.page_size)
        dev = self.req_to_token_pool.req_to_token.device
        cols = (torch.arange(max_blocks, device=dev) * self.page_size).clamp(
            max=self.req_to_token_pool.req_to_token.shape[1] - 1
        )
        self.graph = GraphBuffers(
            max_bs=max_bs,
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            seq_lens_cpu_int=torch.ones(max_bs, dtype=torch.int32),
            actual_seq_lengths_q=torch.arange(1, max_bs + 1, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev),
            req_pool_indices=torch.zeros(max_bs, dtype=torch.long, device=dev),
            block_columns=cols,
        )

    # SGLang's CPU graph runner (``model_executor/cpu_graph_runner.py``; SGLang captures
    # CPU decode graphs only with --enable-torch-compile) compiles ``model.forward``
    # per batch bucket with ``torch.compile(dynamic=False)``. Replays go through
    # :meth:`init_forward_metadata` (out_graph + in_graph) on the runner's batch.
    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int):
        """The CPU graph runner's state hook: the same static buffers as device graphs
        (CPU verify graphs, :mod:`..speculative.cpu_graph`: one buffer entry per verify row)."""
        rows = max_num_tokens if cpu_spec_graph.verify_width_of(self) else max_bs
        self.init_cuda_graph_state(rows, max_num_tokens)

    def init_forward_metadata_capture_cpu_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc,
        encoder_lens,
        forward_mode,
        spec_info,
    ):
        """Metadata of the CPU graph runner's capture batch (``bs`` decode rows on the
        reserved ``req_to_token`` row 0 with the fill length): static views, as at replay.
        ``TARGET_VERIFY`` buckets (``bs`` requests x ``n`` rows) with :mod:`..speculative.cpu_graph`."""
        n = cpu_spec_graph.verify_width_of(self)
        if n and forward_mode.is_target_verify() and num_tokens == bs * n:
            cpu_spec_graph.verify_graph_metadata(self, bs, seq_lens.to("cpu"))
            cpu_spec_graph.fill_verify_graph_buffers(self, req_pool_indices, seq_lens)
            return
        if not forward_mode.is_decode() or num_tokens != bs:
            raise RuntimeError(
                f"ascend_offload captures decode graphs only (one token per request); got "
                f"{forward_mode} with {num_tokens} tokens for {bs} requests"
            )
        self._graph_decode_metadata(bs, seq_lens.to("cpu"))
        self._fill_graph_buffers(bs, req_pool_indices, seq_lens)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def get_cpu_graph_seq_len_fill_value(self):
        """Sequence length of padding rows on CPU (DP attention pads batches to a common size)."""
        return 1

    def support_triton(self):
        return False

    # ------------------------------------------------------------------ indexer
    def run_indexer(
        self, indexer: Any, x, q_lora, positions, forward_batch, layer_id: int, return_indices: bool = True
    ) -> Optional[torch.Tensor]:
        """Store the new tokens' index K and return int32 ``[T, index_topk]`` logical
        positions (``-1`` padded), or ``None`` when ``return_indices`` is False."""
        md = self.forward_metadata
        if md is None:  # idle batch
            return q_lora.new_full((q_lora.shape[0], indexer.index_topk), -1, dtype=torch.int32)
        inputs = self.store_index_inputs(indexer, x, q_lora, positions, forward_batch, layer_id)
        pool = self.token_to_kv_pool
        if not return_indices:
            return None
        if self._graph_batch is not None:  # graph decode: static shapes, no host reads
            return self._graph_index_topk(inputs, pool, layer_id, md, int(indexer.index_topk))
        # Rank depth D > k: the indexer selects top-D; the reference indexer returns positions in
        # descending score order, so its first k columns are the top-k the model attends to
        # (unchanged). Two readers of the ranking (offload backend only): a trace recorder with
        # record_trace_rank_depth (the decode steps it records) and a score-aware residency
        # policy with the serving rank_depth (every eager decode step, kept in self.ranking).
        recorder = getattr(self, "recorder", None)
        record_depth = recorder.rank_depth_now() if recorder is not None else 0
        serve_depth = self.serving_rank_depth(md)
        k = int(indexer.index_topk)
        depth = max(record_depth, serve_depth)
        topk = self._index_topk(inputs, pool, layer_id, md, max(k, depth))
        if depth > k:
            if record_depth > k:
                recorder.record_ranked(layer_id - getattr(self, "start_layer", 0), topk)
            if serve_depth > 0:
                self.ranking = LayerRanking(layer_id, topk[:, :serve_depth])
            topk = topk[:, :k].contiguous()
        return topk

    def store_index_inputs(self, indexer: Any, x, q_lora, positions, forward_batch, layer_id: int) -> IndexerInputs:
        """The indexer's query, key and weights of the new tokens; their keys stored in the
        layer's index-K cache (the int8 cache rotates and quantises them, with their scales)."""
        inputs = indexer_query_key_weights(indexer, x, q_lora, positions)
        if self.index_int8:
            self.token_to_kv_pool.store_index_k(layer_id, forward_batch.out_cache_loc, inputs.key)
        else:
            self.token_to_kv_pool.set_index_k_buffer(layer_id, forward_batch.out_cache_loc, inputs.key)
        return inputs

    def index_operands(self, inputs: IndexerInputs, layer_id: int) -> Tuple[torch.Tensor, ...]:
        """The leading operands of the layer's indexer call: ``(query, key, weights)`` for the
        bf16 cache; ``(int8 query, int8 key, weights, query scale, key scale)`` for the int8
        cache, the query rotated and quantised per token and head."""
        pool = self.token_to_kv_pool
        if not self.index_int8:
            return inputs.query, pool.get_index_k_buffer(layer_id), inputs.weights
        q_values, q_scales = rotate_and_quantize(inputs.query)
        return (
            q_values,
            pool.get_index_k_buffer(layer_id),
            inputs.weights,
            q_scales,
            pool.get_index_k_scale_buffer(layer_id),
        )

    def _index_topk(self, inputs, pool, layer_id: int, md: DSAForwardMetadata, count: int) -> torch.Tensor:
        """The op ladder's indexer over the layer's index-K cache: int32 ``[T, count]``
        logical positions. bf16 cache: ``lightning_indexer`` on the bf16 query ``[T, H, D]``;
        int8 cache: the query rotated and quantised per token and head (int8 ``[T, H, D]``,
        fp16 ``[T, H]``) and ``quant_lightning_indexer`` over the int8 keys
        ``[pages, page, 1, D]`` with their fp16 scales ``[pages, page, 1]``."""
        topk = self.indexer_op(*self.index_operands(inputs, layer_id), **indexer_metadata(md), sparse_count=count)
        return topk.reshape(topk.shape[0], -1)

    def _graph_index_topk(self, inputs, pool, layer_id: int, md: DSAForwardMetadata, top_k: int) -> torch.Tensor:
        """:func:`graph_decode_topk` over the layer's cache (the int8 cache with the rotated,
        quantised query and both scales); int32 ``[B, top_k]``."""
        operands = self.index_operands(inputs, layer_id)
        scales = dict(query_scale=operands[3], key_scale=operands[4]) if self.index_int8 else {}
        return graph_decode_topk(*operands[:3], md.block_tables, md.seq_lens, top_k, **scales)

    def serving_rank_depth(self, md: DSAForwardMetadata) -> int:
        """Top-D the indexer selects for a score-aware residency policy on this forward
        (0 = top-k only). The plain backend has no residency manager: 0."""
        return 0

    def owns_npu_indexer(self) -> bool:
        """Whether this backend runs the indexer itself on an NPU (:func:`forward_npu_around`)
        instead of SGLang's ``forward_npu``: where the fused LIM / LIM-C8 serves. The
        plain backend: never."""
        return False

    # ------------------------------------------------------------------ attention
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _split_inputs(self, q, k, layer, q_rope, k_rope) -> Tuple[torch.Tensor, ...]:
        heads = layer.tp_q_head_num
        dl, dr = self.kv_lora_rank, self.qk_rope_head_dim
        if q_rope is not None:
            q_nope = q.reshape(-1, heads, dl)
            q_rope = q_rope.reshape(-1, heads, dr)
        else:
            q_full = q.reshape(-1, heads, dl + dr)
            q_nope, q_rope = q_full[..., :dl], q_full[..., dl:]
        k_nope = k_pe = None
        if k is not None:
            if k_rope is not None:
                k_nope, k_pe = k.reshape(-1, dl), k_rope.reshape(-1, dr)
            else:
                k_full = k.reshape(-1, dl + dr)
                k_nope, k_pe = k_full[:, :dl], k_full[:, dl:]
        return q_nope, q_rope, k_nope, k_pe

    def _forward(
        self, q, k, v, layer, forward_batch, save_kv_cache: bool, topk_indices=None, q_rope=None, k_rope=None, **unused
    ):
        q_nope, q_pe, k_nope, k_pe = self._split_inputs(q, k, layer, q_rope, k_rope)
        if save_kv_cache and k_nope is not None:
            self.store_kv(layer, forward_batch, k_nope, k_pe)
        out = self.attend(layer, forward_batch, q_nope, q_pe, topk_indices)
        return out.reshape(q_nope.shape[0], layer.tp_q_head_num * self.kv_lora_rank)

    def store_kv(self, layer, forward_batch, k_nope: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Write the new tokens' latent [T, Dl] and rope [T, Dr] rows at ``out_cache_loc``."""
        self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k_nope, k_pe)

    def dense_indices(self, num_tokens: int, md: DSAForwardMetadata, device) -> torch.Tensor:
        """All positions (``[T, max_seq_len]``): attention for layers without an indexer."""
        # graph decode: the static width (every position a request can have; others masked)
        width = self.max_context_len if self._graph_batch is not None else max(1, int(md.seq_lens_cpu_int.max()))
        return torch.arange(width, dtype=torch.int32, device=device).expand(num_tokens, width)

    def attend(self, layer, forward_batch, q_nope, q_pe, topk_indices) -> torch.Tensor:
        """Sparse MLA attention over the device pool; ``[T, N, Dl]`` in q's dtype."""
        md = self.forward_metadata
        if topk_indices is None:
            topk_indices = self.dense_indices(q_nope.shape[0], md, q_nope.device)
        pool = self.token_to_kv_pool
        if self._graph_batch is not None:  # graph decode: flat rows from the static block tables
            latent, rope = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
            rows = graph_decode_rows(topk_indices, md.block_tables, md.seq_lens, latent.shape[1])
            return self.attention_op(
                q_nope,
                latent.reshape(-1, latent.shape[-1]),
                None,
                rows,
                layer.scaling,
                query_rope=q_pe,
                key_rope=rope.reshape(-1, rope.shape[-1]),
                layout_query="TND",
                layout_kv="flat",
            )
        return self.attention_op(
            q_nope,
            pool.get_key_buffer(layer.layer_id),
            None,
            topk_indices,
            layer.scaling,
            block_table=md.block_tables,
            actual_seq_lengths_query=md.actual_seq_lengths_q,
            actual_seq_lengths_kv=md.seq_lens,
            query_rope=q_pe,
            key_rope=pool.get_value_buffer(layer.layer_id),
            layout_query="TND",
            layout_kv="PA_BSND",
            sparse_mode=3,
        )


# ---------------------------------------------------------------------- graph decode
def indexer_metadata(md: DSAForwardMetadata) -> dict:
    """The indexer ops' TND / PA_BSND metadata keywords of a forward (all but ``sparse_count``)."""
    return dict(
        actual_seq_lengths_query=md.actual_seq_lengths_q,
        actual_seq_lengths_key=md.seq_lens,
        block_table=md.block_tables,
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_mode=3,
    )


def graph_seq_lens_cpu(forward_batch) -> torch.Tensor:
    """int ``[B]`` host sequence lengths of a decode batch a graph runner hands over.

    SGLang's CPU graph runner replays a padded bucket on its own captured batch, which
    carries no ``seq_lens_cpu`` (``None``): its ``seq_lens`` are then read, a free host
    read there (CPU tensors). Device graph runners always fill ``seq_lens_cpu``.
    """
    lens = forward_batch.seq_lens_cpu
    return lens if lens is not None else forward_batch.seq_lens.to("cpu")


def graph_decode_rows(
    topk: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> torch.Tensor:
    """int64 ``[B, 1, K]`` flat rows (``page * page_size + offset``) of the logical top-k
    ``[B, K]`` (or ``[B, 1, K]``) of a decode batch; ``-1`` where an entry is padding or
    beyond the request's length ``seq_lens [B]``. Static shapes, no host reads: the
    rows the ``PA_BSND`` path gathers, in the same order, so ``layout_kv="flat"``
    attention over them is the same arithmetic."""
    idx = topk.reshape(topk.shape[0], -1).to(torch.int64)
    valid = (idx >= 0) & (idx < seq_lens.to(torch.int64)[:, None])
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    pages = torch.gather(block_tables.to(torch.int64), 1, torch.div(safe, page_size, rounding_mode="floor"))
    rows = pages * page_size + safe % page_size
    return torch.where(valid, rows, torch.full_like(rows, -1)).unsqueeze(1)


def graph_decode_topk(
    query: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    query_scale: Optional[torch.Tensor] = None,
    key_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Lightning-indexer top-k of a decode batch (one query token per request) with
    static shapes: every position the block tables can address is scored and those
    ``>= seq_lens`` are masked, so the work does not depend on the lengths (a graph
    replays it for any lengths); chunks of the reference indexer's width are merged
    with its stable descending sort, so the selection rule is the reference's
    (descending score, ties to the lower position, ``-1`` when fewer are visible).

    query [B, H, D]; index_k [blocks, page, 1, D]; weights [B, H]; block_tables int32
    [B, max_blocks]; seq_lens int [B]. Returns int32 ``[B, top_k]``.
    C8 (LIM-C8): int8 ``query`` and ``index_k`` with ``query_scale`` fp16 [B, H] and
    ``key_scale`` fp16 [blocks, page, 1]; each logit is the exact integer dot times
    ``query_scale * key_scale``, the arithmetic of the reference ``quant_lightning_indexer``.
    """
    from ...ops.reference import INDEXER_CONTEXT_CHUNK

    if (query_scale is None) != (key_scale is None):
        raise ValueError("graph_decode_topk: the C8 indexer needs both query_scale and key_scale")
    b, heads, dim = query.shape
    page = index_k.shape[1]
    keys = index_k.reshape(-1, dim)
    q32 = query.to(torch.float32)
    q_scale = query_scale.to(torch.float32).unsqueeze(2) if query_scale is not None else None
    k_scale = key_scale.reshape(-1).to(torch.float32) if key_scale is not None else None
    w32 = weights.to(torch.float32).unsqueeze(2)
    visible = seq_lens.to(torch.int64).unsqueeze(1)
    width_total = block_tables.shape[1] * page
    best_score = torch.full((b, top_k), float("-inf"), dtype=torch.float32, device=query.device)
    best_pos = torch.full((b, top_k), -1, dtype=torch.int64, device=query.device)
    tables = block_tables.to(torch.int64)
    for c0 in range(0, width_total, INDEXER_CONTEXT_CHUNK):
        width = min(INDEXER_CONTEXT_CHUNK, width_total - c0)
        pos = torch.arange(c0, c0 + width, dtype=torch.int64, device=query.device)
        rows = tables[:, pos // page] * page + (pos % page)  # [B, width]
        logits = torch.bmm(q32, keys[rows].to(torch.float32).transpose(1, 2))  # [B, H, width]
        if k_scale is not None:  # C8: exact integer dots, then the dequantisation scales
            logits = logits * (q_scale * k_scale[rows].unsqueeze(1))
        score = (torch.relu(logits) * w32).sum(dim=1).masked_fill(pos.unsqueeze(0) >= visible, float("-inf"))
        cand_score = torch.cat((best_score, score), dim=1)
        cand_pos = torch.cat((best_pos, pos.expand(b, width)), dim=1)
        order = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :top_k]
        best_score = torch.gather(cand_score, 1, order)
        best_pos = torch.gather(cand_pos, 1, order)
    return torch.where(torch.isneginf(best_score), torch.full_like(best_pos, -1), best_pos).to(torch.int32)


def handle_deepseek_attention(attn: Any, forward_batch: Any):
    """DeepSeek ``AttentionBackendRegistry`` handler for ``ascend_offload``: always the
    absorbed MLA method (the backend runs the indexer's top-k through ``topk_indices``).

    Without it SGLang falls back to the ``triton`` handler, which picks MHA for
    prefill and fails on the 576-wide latent cache.
    """
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    return AttnForwardMethod.MLA


def create_backend(model_runner: Any) -> AttentionBackend:
    """Attention backend factory registered under :data:`BACKEND_NAME`."""
    if carrier.sparse_decode_enabled() and not speculative.is_draft_runner(model_runner):  # draft KV: device
        from .sparse_decode import SparseDecodeOffloadBackend

        return SparseDecodeOffloadBackend(model_runner)
    return AscendOffloadAttnBackend(model_runner)


def forward_native_around(
    original, self, x, q_lora, positions, forward_batch, layer_id, return_indices: bool = True, **kwargs
):
    """HookRegistry AROUND ``Indexer.forward_native``: inside a forward of the
    ``ascend_offload`` backend, the backend's indexer (:meth:`run_indexer`); otherwise
    SGLang's own method, unchanged."""
    from sglang.srt.model_executor.forward_context import get_attn_backend

    try:
        backend = get_attn_backend()
    except Exception:  # noqa: BLE001 - no forward context: not our forward
        backend = None
    if isinstance(backend, AscendOffloadAttnBackend):
        return backend.run_indexer(self, x, q_lora, positions, forward_batch, layer_id, return_indices)
    return original(self, x, q_lora, positions, forward_batch, layer_id, return_indices, **kwargs)


def forward_npu_around(
    original,
    self,
    x,
    q_lora,
    positions,
    forward_batch,
    layer_id,
    input_on_attn_tp_slices: bool = False,
    dynamic_scale=None,
    **kwargs,
):
    """HookRegistry AROUND ``DSANPUIndexerMixin.forward_npu``: where the ``ascend_offload``
    backend of this forward owns the indexer (:meth:`~AscendOffloadAttnBackend.owns_npu_indexer`:
    the fused LIM / LIM-C8 serves its decode steps), the backend's :meth:`run_indexer`;
    otherwise SGLang's own NPU indexer, unchanged. The backend's indexer takes whole
    (not attention-TP-sliced) unquantised hidden states: anything else is an error naming
    what to change, never a silent wrong top-k."""
    from sglang.srt.model_executor.forward_context import get_attn_backend

    try:
        backend = get_attn_backend()
    except Exception:  # noqa: BLE001 - no forward context: not our forward
        backend = None
    if not (isinstance(backend, AscendOffloadAttnBackend) and backend.owns_npu_indexer()):
        return original(
            self, x, q_lora, positions, forward_batch, layer_id, input_on_attn_tp_slices, dynamic_scale, **kwargs
        )
    problems = []
    if input_on_attn_tp_slices:
        problems.append("the hidden states arrive as attention-TP slices (the plugin's indexer needs them whole)")
    if dynamic_scale is not None:
        problems.append("the hidden states arrive quantised with a dynamic scale")
    if problems:
        raise RuntimeError(
            "the fused indexer (LIM / LIM-C8) cannot take this forward: "
            + "; ".join(problems)
            + '; serve with "fused_lim": false and "indexer_dtype": "bf16" (SGLang\'s NPU indexer)'
        )
    return backend.run_indexer(self, x, q_lora, positions, forward_batch, layer_id, True)
