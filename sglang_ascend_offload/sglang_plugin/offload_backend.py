"""The ``ascend_offload`` backend with sparse decode offload on.

Same indexer and metadata as :class:`~.backend.AscendOffloadAttnBackend`; the main
KV lives in :class:`~.offload_pool.HostMainKVPool`'s host pool:

* every forward stores the new tokens' latent+rope rows in the host pool (the
  pool's ``set_kv_buffer`` is the engine's device->host append);
* **extend / prefill**: attention needs the selected rows of the prompt and of any
  cached prefix. The union of the selected host slots of the batch is gathered from
  the host pool once per layer (one host->device copy of distinct rows) and the
  sparse attention runs over that staging buffer (``layout_kv="flat"``) with the
  logical top-k remapped into it. No full-prefix reload;
* **decode**: the sparse decode engine (``sparse_decode/engine.py``): residency
  (hits / misses / victims), miss-row copy host->device into the per-row hot
  buffers, remap, sparse attention over the hot buffer. Engine rows are
  ``req_to_token`` rows (``req_pool_idx``), so a request keeps its hot buffer across
  steps; a row whose request changes (tracked by SGLang's request id) is reset.
  Each step the engine works on the batch's rows only (``rows = req_pool_indices``,
  padding entries on the engine's sink row): residency, copies, statistics and
  trace rows cost ``O(batch)``, whatever ``--max-running-requests`` is.

Both paths compute each token's attention from the same rows in the same order as
the device-KV path, so outputs are bit-identical to offload off (tests hold it).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple

import torch

from . import carrier, speculative
from .backend import AscendOffloadAttnBackend
from .metadata import real_batch_size
from .metrics import OffloadMetrics
from .offload_pool import HostMainKVPool
from .trace_recorder import TraceRecorder, trace_path

logger = logging.getLogger(__name__)


class RowOwners:
    """Request identity per engine row: a new integer id whenever a row's SGLang
    request id (``rid``) changes, so the engine resets that row's residency."""

    def __init__(self, rows: int):
        self._rid: List[Optional[str]] = [None] * rows
        self._ids = torch.full((rows,), -1, dtype=torch.int64)
        self._next = 0

    def ids_for(self, rows: List[int], rids: Optional[List[str]]) -> torch.Tensor:
        """int64 ``[len(rows)]``: the owner id of each batch row (the batch order)."""
        out = torch.empty(len(rows), dtype=torch.int64)
        for i, row in enumerate(rows):
            rid = rids[i] if rids is not None else self._rid[row]
            if rid is None or rid != self._rid[row] or self._ids[row] < 0:
                self._rid[row] = rid
                self._ids[row] = self._next
                self._next += 1
            out[i] = self._ids[row]
        return out


def engine_identity(model_runner: Any) -> Tuple[bool, int, int]:
    """``(records, index, count)`` of this rank's engine among the server's engines.

    One engine (one host pool) per attention-DP group of each DP replica; its attention
    TP rank 0 records the trace. SGLang 0.5.23 keeps the attention ranks in its
    parallel context (``attn_tp_rank``, ``attn_dp_rank``, ``attn_dp_size``; DP attention
    is ``attn_dp_size > 1``) and the replica in ``model_runner.dp_rank``; outside a
    server (component tests) the model runner's ``tp_rank`` decides.
    """
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        attn_tp_rank, attn_dp_rank, attn_dp = int(par.attn_tp_rank), int(par.attn_dp_rank), int(par.attn_dp_size)
    except Exception:  # noqa: BLE001 - no parallel context: a single engine
        attn_tp_rank, attn_dp_rank, attn_dp = int(getattr(model_runner, "tp_rank", 0) or 0), 0, 1
    server_args = getattr(model_runner, "server_args", None)
    replicas = int(getattr(server_args, "dp_size", 1) or 1)
    replica = int(getattr(model_runner, "dp_rank", None) or 0)
    return attn_tp_rank == 0, replica * attn_dp + attn_dp_rank, replicas * attn_dp


class SparseDecodeOffloadBackend(AscendOffloadAttnBackend):
    """Sparse decode offload inside SGLang (see module docstring)."""

    def __init__(self, model_runner: Any):
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        if not isinstance(pool, HostMainKVPool):
            raise RuntimeError("sparse decode offload needs the HostMainKVPool (the plugin's pool hook did "
                               f"not run: got {type(pool).__name__})")
        self.engine = pool.engine
        self.rows = RowOwners(self.engine.config.rows)
        self.start_layer = pool.start_layer
        config = carrier.active_config().sparse_decode
        server_args = getattr(model_runner, "server_args", None)
        labels = {"tp_rank": str(getattr(model_runner, "tp_rank", 0))}
        self.metrics = OffloadMetrics(
            self.engine.stats, self.engine.config.layers,
            prometheus=bool(getattr(server_args, "enable_metrics", False)),
            log_interval_s=config.metrics_log_interval_s, labels=labels,
        )
        self.recorder: Optional[TraceRecorder] = None
        leader, engine_index, engines = engine_identity(model_runner)
        if config.record_trace and leader:
            path = trace_path(config.record_trace, engine_index, engines)
            cfg = self.engine.config
            self.recorder = TraceRecorder(
                path, cfg.layers, cfg.rows, cfg.top_k, config.record_trace_max_steps,
                meta={"source": "sglang", "model": str(getattr(server_args, "model_path", "")),
                      "hot_tokens": cfg.hot_tokens, "top_k": cfg.top_k, "layers": cfg.layers,
                      "rows": cfg.rows, "page_size": self.page_size, "policy": cfg.policy},
            )
            logger.info("sparse decode offload: recording top-k traces to %s (at most %d steps)",
                        path, config.record_trace_max_steps)
        self._batch_rows: Optional[torch.Tensor] = None
        self._padding_seen = False
        self._verify = False  # this forward is a TARGET_VERIFY batch served by the engine (speculative.py)
        speculative.attach(self)

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self._verify = speculative.note_forward(self, forward_batch)
        if self._verify:  # MTP verify rows attend through the residency (speculative.begin_verify)
            self._batch_rows = speculative.begin_verify(self, forward_batch)
            return
        md = self.forward_metadata
        if md is None or not md.is_decode:
            self._batch_rows = None
            return
        real = real_batch_size(forward_batch)  # DP-attention padding rows alias row 0: never engine rows
        if real < int(forward_batch.batch_size) and not self._padding_seen:
            self._padding_seen = True
            logger.info("sparse decode offload: DP-attention padding seen (%d of %d decode rows are padding; "
                        "they never reach the engine)", int(forward_batch.batch_size) - real,
                        int(forward_batch.batch_size))
        rows_list = [int(r) for r in forward_batch.req_pool_indices[:real].tolist()]
        if len(set(rows_list)) != len(rows_list):
            raise RuntimeError(f"decode batch names req_to_token rows {rows_list} more than once")
        rids = getattr(forward_batch, "rids", None)
        req_ids = self.rows.ids_for(rows_list, list(rids[:real]) if rids is not None else None)
        stable = forward_batch.seq_lens_cpu[:real].to(torch.int32)
        batch_rows = torch.tensor(rows_list, dtype=torch.int64)
        self.engine.begin_step(req_ids, self.req_to_token_pool.req_to_token, stable, rows=batch_rows)
        if self.recorder is not None:
            self.recorder.begin_step(stable, req_ids)
        self._batch_rows = batch_rows

    # ------------------------------------------------------------------ attention
    def attend(self, layer, forward_batch, q_nope, q_pe, topk_indices) -> torch.Tensor:
        if self.forward_metadata is not None and (self.forward_metadata.is_decode or self._verify):
            return self._attend_decode(layer, q_nope, q_pe, topk_indices)
        return self._attend_extend(layer, forward_batch, q_nope, q_pe, topk_indices)

    def _attend_decode(self, layer, q_nope, q_pe, topk_indices) -> torch.Tensor:
        if topk_indices is None:
            raise RuntimeError(f"layer {layer.layer_id}: sparse decode offload needs the indexer's top-k "
                               "on every layer (dense layers cannot be served from the hot buffer)")
        cfg = self.engine.config
        real = self._batch_rows.numel()  # the batch's first ``real`` entries; the rest is DP-attention padding
        local = layer.layer_id - self.start_layer
        dev = self.engine.device
        topk_rows = topk_indices[:real, : cfg.top_k].to(dev, torch.int32)
        copy_before = self.engine.times.seconds.get("copy", 0.0)
        self.engine.timing = self.metrics.needs_copy_timing
        result = self.engine.run_layer(local, topk_rows, q_nope[:real], q_pe[:real], layer.scaling)
        self.metrics.add_copy_time(local, self.engine.times.seconds.get("copy", 0.0) - copy_before)
        if self.recorder is not None and not self._verify:  # traces hold decode steps (one row per request)
            self.recorder.record_layer(local, topk_rows)
        if local == cfg.layers - 1:
            self.metrics.on_step_end()
        if real == q_nope.shape[0]:
            return result.output
        out = result.output.new_zeros((q_nope.shape[0],) + tuple(result.output.shape[1:]))
        out[:real] = result.output  # padding rows attend nothing (their outputs are discarded)
        return out

    def _attend_extend(self, layer, forward_batch, q_nope, q_pe, topk_indices) -> torch.Tensor:
        md = self.forward_metadata
        tokens = q_nope.shape[0]
        device = q_nope.device
        if topk_indices is None:
            topk_indices = self.dense_indices(tokens, md, device)
        logical = topk_indices.reshape(tokens, -1).to(torch.int64)
        q_lens = torch.tensor(md.q_lens_cpu, dtype=torch.int64, device=device)
        req_of_token = torch.repeat_interleave(torch.arange(md.batch_size, device=device), q_lens)
        visible = forward_batch.positions.to(device=device, dtype=torch.int64)[:tokens] + 1
        valid = (logical >= 0) & (logical < visible[:, None])
        table = self.req_to_token_pool.req_to_token
        pool_rows = md.req_pool_indices.to(table.device)[req_of_token.to(table.device)]
        slots = table[pool_rows[:, None], logical.clamp(min=0).to(table.device)].to(torch.int64).to(device)
        wanted = slots[valid]
        unique, inverse = torch.unique(wanted, return_inverse=True)
        host = self.token_to_kv_pool.host_rows(layer.layer_id)
        staged = host.index_select(0, unique.cpu()).to(device)  # one H2D copy of distinct rows
        flat = torch.full_like(logical, -1)
        flat[valid] = inverse
        dl = self.kv_lora_rank
        return self.attention_op(
            q_nope, staged[:, :dl], None, flat.to(torch.int32).unsqueeze(1), layer.scaling,
            query_rope=q_pe, key_rope=staged[:, dl:], layout_query="TND", layout_kv="flat",
        )

    # ------------------------------------------------------------------ graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Graph capture is not supported with offload yet: the engine's residency
        step has data-dependent control on the host (see docs/sglang_integration.md)."""
        raise RuntimeError("sparse decode offload runs decode eagerly: pass --disable-cuda-graph "
                           "(or --cuda-graph-backend-decode=disabled)")
