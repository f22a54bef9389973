"""The ``ascend_offload`` backend with sparse decode offload on.

Same indexer and metadata as :class:`~.dsa_backend.AscendOffloadAttnBackend`; the main
KV lives in :class:`~..mem_cache.pool.sparse_decode.HostMainKVPool`'s host pool:

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

* **fused indexer** (the engine's plan selects LIM / LIM-C8: the NPU default, ``ops``
  ``fused``, ``fused_lim: true``): on decode and verify steps the indexer hook runs the
  fused operator, which selects the top-k *and* steps the layer's residency
  (``sparse_decode/fused_indexer.py``; a request's verify rows share its row, stepped
  once on the union of their top-k); attention then takes that step instead of
  stepping the manager. Extend forwards run the separate indexer (an extend has no
  residency step).

* **verify** (speculative decoding, ``TARGET_VERIFY``): the same engine step; a
  request's ``n`` verify rows share its engine row and hot buffer (residency over the
  union of their top-k) with the committed length as the stable prefix
  (:func:`..speculative.eagle.begin_verify`); the draft (NextN) model runs the plain backend
  over its device pool.

Both paths compute each token's attention from the same rows in the same order as
the device-KV path, so outputs are bit-identical to offload off (tests hold it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from ...sparse_decode import direct_rows, fused_indexer
from .. import compat
from ..mem_cache.pool.sparse_decode import HostMainKVPool
from ..observability.metrics import OffloadMetrics
from ..observability.trace_recorder import TraceRecorder, trace_path
from ..speculative import cpu_graph as cpu_spec_graph
from ..speculative import eagle as speculative
from .dsa_backend import AscendOffloadAttnBackend, graph_seq_lens_cpu, indexer_metadata
from .dsa_metadata import FORWARD_BATCH, free_request_rows, real_batch_size

logger = logging.getLogger(__name__)


@dataclass
class OffloadGraphBuffers:
    """Static engine inputs of graph decode steps (device tensors, ``max_bs`` entries;
    bucket ``bs`` uses ``[:bs]``), filled before every replay outside the graph.

    rows int64: engine row per entry (padding: the sink row); req_ids int64: owner id
    (``-1`` padding); stable int32: stable length (0 for padding); step int64 0-d:
    the step number (residency stamps). With ``residency: adaptive``: direct bool (the
    entry is served from its hot buffer directly), direct_pos int64 ``[max_bs, n]``
    (its positions the step writes, ``-1`` none; ``n`` query rows per entry) and
    direct_span int64 ``[max_bs, S]`` (the hot-buffer rows its context spans).
    """

    rows: torch.Tensor
    req_ids: torch.Tensor
    stable: torch.Tensor
    step: torch.Tensor
    direct: Optional[torch.Tensor] = None
    direct_pos: Optional[torch.Tensor] = None
    direct_span: Optional[torch.Tensor] = None

    def fill_direct(self, engine, bs: int) -> None:
        """Copy the engine's direct plan of the step just begun into the bucket's entries."""
        if self.direct is None:
            return
        d = engine.direct_step
        n = d.step_pos.shape[1]
        self.direct[:bs].copy_(d.mask)
        self.direct_pos[:bs, :n].copy_(d.step_pos)
        self.direct_pos[:bs, n:].fill_(-1)
        self.direct_span[:bs].copy_(d.span_rows)

    def direct_args(self, bs: int, n: int):
        """``(mask, step_pos)`` of the bucket's ``bs`` entries with ``n`` query rows each, for
        :func:`~...sparse_decode.engine.decode_layer_step`, or ``None``."""
        return None if self.direct is None else (self.direct[:bs], self.direct_pos[:bs, :n], self.direct_span[:bs])


@dataclass
class _CaptureBatch:
    """The fields of a decode batch that :meth:`SparseDecodeOffloadBackend._begin_graph_step`
    reads, for the CPU graph runner's capture call (which passes tensors, not a batch)."""

    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    forward_mode: Any
    seq_lens_cpu: Optional[torch.Tensor] = None
    rids: Optional[List[str]] = None
    _original_num_tokens: Optional[int] = None


class RowOwners:
    """Request identity per engine row: a new integer id whenever a row's SGLang
    request id (``rid``) changes, so the engine resets that row's residency."""

    def __init__(self, rows: int):
        self._rid: List[Optional[str]] = [None] * rows
        self._ids: List[int] = [-1] * rows
        self._next = 0

    def ids_for(self, rows: List[int], rids: Optional[List[str]]) -> torch.Tensor:
        """int64 ``[len(rows)]``: the owner id of each batch row (the batch order)."""
        out: List[int] = []
        for i, row in enumerate(rows):
            rid = rids[i] if rids is not None else self._rid[row]
            if rid is None or rid != self._rid[row] or self._ids[row] < 0:
                self._rid[row] = rid
                self._ids[row] = self._next
                self._next += 1
            out.append(self._ids[row])
        return torch.tensor(out, dtype=torch.int64)


@dataclass(frozen=True)
class RankFacts:
    """This process's ranks: TP rank, attention TP / DP rank and size, and SGLang's
    ``dp_rank`` (0 when it is ``None``; see :func:`engine_identity` for what it names)."""

    tp_rank: int
    attn_tp_rank: int
    attn_tp_size: int
    attn_dp_rank: int
    attn_dp_size: int
    replica: int


def rank_facts(model_runner: Any) -> RankFacts:
    """The ranks of this process as SGLang 0.5.23 states them: its parallel context
    (``runtime_context.get_parallel()``; its ``ModelRunner`` has no ``tp_rank`` /
    ``dp_rank`` attributes). ``dp_rank`` is ``None`` without a data-parallel controller
    (``SpawnRanks``): replica 0. Outside a server nothing is published (reading raises
    ``RuntimeError``): a component test's stand-in model runner states its ``tp_rank``
    and is a single engine."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    try:
        tp_rank = int(par.tp_rank)
    except RuntimeError:  # no published parallel context: not a server process
        return RankFacts(int(model_runner.tp_rank), 0, 1, 0, 1, 0)
    return RankFacts(
        tp_rank,
        int(par.attn_tp_rank),
        int(par.attn_tp_size),
        int(par.attn_dp_rank),
        int(par.attn_dp_size),
        int(par.dp_rank) if par.dp_rank is not None else 0,
    )


def engine_identity(model_runner: Any) -> Tuple[bool, int, int]:
    """``(records, index, count)`` of this rank's engine among the server's engines.

    One engine (one host pool) per attention-DP group of each DP replica; its attention
    TP rank 0 records the trace (:func:`rank_facts`; replicas: ``--dp-size``). With
    DP attention SGLang's DP controller stamps the attention-DP rank as ``dp_rank`` on
    each group's processes (the served DP-attention test's log shows ``DP1`` on group
    1), so ``dp_rank`` names a separate replica only without DP attention.
    """
    ranks = rank_facts(model_runner)
    replicas = int(compat.arg_or(model_runner.server_args, "dp_size", 1))
    replica = ranks.replica if ranks.attn_dp_size == 1 else 0
    return (ranks.attn_tp_rank == 0, replica * ranks.attn_dp_size + ranks.attn_dp_rank, replicas * ranks.attn_dp_size)


class SparseDecodeOffloadBackend(AscendOffloadAttnBackend):
    """Sparse decode offload inside SGLang (see module docstring)."""

    def __init__(self, model_runner: Any):
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        if not isinstance(pool, HostMainKVPool):
            raise RuntimeError(
                "sparse decode offload needs the HostMainKVPool (the plugin's pool hook did "
                f"not run: got {type(pool).__name__})"
            )
        self.engine = pool.engine
        self.bind_ops(self.engine.plan)  # the separate indexer and attention: the engine's plan's
        self.rows = RowOwners(self.engine.config.rows)
        self.start_layer = pool.start_layer
        config = self.offload_config  # read once, by the base class's constructor
        server_args = model_runner.server_args
        self.ranks = rank_facts(model_runner)
        labels = {"tp_rank": str(self.ranks.tp_rank)}
        self.metrics = OffloadMetrics(
            self.engine.stats,
            self.engine.config.layers,
            prometheus=bool(compat.arg(server_args, "enable_metrics")),
            log_interval_s=config.metrics_log_interval_s,
            labels=labels,
            export_interval_s=config.metrics_export_interval_s,
            copy_timing=self.engine.device.type == "cpu",  # elsewhere timing would synchronise every layer
        )
        if not self.metrics.copy_timing and self.metrics.reports_copy_time:
            logger.info(
                "sparse decode offload: copy time is not measured on %s (it would synchronise the device "
                "at every layer step); copy_seconds stays 0",
                self.engine.device,
            )
        # a score policy's rank_depth is >= the top-k, any other policy's 0 (parse.range,
        # sparse_decode.rank_depth_topk: the launch validation's rules)
        self.rank_depth = int(config.rank_depth)
        if self.rank_depth > 0:
            logger.info(
                "sparse decode offload: policy %s reads the indexer's top-%d ranking (rank_depth %d, top-k "
                "%d) every decode step",
                self.engine.config.policy,
                self.rank_depth,
                self.rank_depth,
                self.engine.config.top_k,
            )
        self.recorder: Optional[TraceRecorder] = None
        leader, engine_index, engines = engine_identity(model_runner)
        if config.record_trace and leader:
            path = trace_path(config.record_trace, engine_index, engines)
            cfg = self.engine.config
            self.recorder = TraceRecorder(
                path,
                cfg.layers,
                cfg.rows,
                cfg.top_k,
                config.record_trace_max_steps,
                rank_depth=config.record_trace_rank_depth,
                rows_per_request=speculative.verify_rows_per_request(),
                meta={
                    "source": "sglang",
                    "model": str(compat.arg(server_args, "model_path")),
                    "hot_tokens": cfg.hot_tokens,
                    "top_k": cfg.top_k,
                    "layers": cfg.layers,
                    "rows": cfg.rows,
                    "page_size": self.page_size,
                    "policy": cfg.policy,
                },
            )
            logger.info(
                "sparse decode offload: recording top-k traces to %s (at most %d steps)",
                path,
                config.record_trace_max_steps,
            )
        self._batch_rows: Optional[torch.Tensor] = None
        self._padding_seen = False
        self.offload_graph: Optional[OffloadGraphBuffers] = None
        self._graph_kinds_seen: set = set()  # (bucket, padded) pairs logged once
        self._verify = False  # this forward is a TARGET_VERIFY batch served by the engine (speculative.py)
        speculative.attach(self)
        self.fused_indexer_op = None  # LIM / LIM-C8 when the engine's plan fuses the indexer stage
        self._fused_step: Optional[Tuple[int, Any]] = None  # (layer, all-rows ResidencyStep) it left
        self._fused_seen = False  # the first fused decode step is logged
        if self.engine.plan.indexer.fused:  # no record_trace_rank_depth (sparse_decode.trace_ranking_fused)
            self.fused_indexer_op = self.engine.plan.impl(self.engine.plan.indexer.ops[0])

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self._verify = speculative.note_forward(self, forward_batch)
        if self._verify:  # MTP verify rows attend through the residency (speculative.begin_verify)
            if self._graph_batch is not None:  # CPU verify graph: static row buffers (cpu_spec_graph)
                cpu_spec_graph.begin_graph_verify(self, forward_batch)
                return
            self._batch_rows = speculative.begin_verify(self, forward_batch)
            return
        md = self.forward_metadata
        if md is None or not md.is_decode:
            self._batch_rows = None
            if md is not None:
                self._own_extend_rows(forward_batch)
            return
        if self._graph_batch is not None:
            self._begin_graph_step(forward_batch)
            return
        real = real_batch_size(forward_batch)  # DP-attention padding rows alias row 0: never engine rows
        if real < int(forward_batch.batch_size) and not self._padding_seen:
            self._padding_seen = True
            logger.info(
                "sparse decode offload: DP-attention padding seen (%d of %d decode rows are padding; "
                "they never reach the engine)",
                int(forward_batch.batch_size) - real,
                int(forward_batch.batch_size),
            )
        rows_list = [int(r) for r in forward_batch.req_pool_indices[:real].tolist()]
        if len(set(rows_list)) != len(rows_list):
            raise RuntimeError(f"decode batch names req_to_token rows {rows_list} more than once")
        rids = compat.field(forward_batch, FORWARD_BATCH, "rids")
        req_ids = self.rows.ids_for(rows_list, list(rids[:real]) if rids is not None else None)
        stable = forward_batch.seq_lens_cpu[:real].to(torch.int32)
        batch_rows = torch.tensor(rows_list, dtype=torch.int64)
        self.engine.begin_step(
            req_ids,
            self.req_to_token_pool.req_to_token,
            stable,
            rows=batch_rows,
            rows_per_request=1,
            free_rows=self.free_rows(),
        )
        if self.recorder is not None:
            self.recorder.begin_step(stable, req_ids, batch_rows)
        self._batch_rows = batch_rows

    def _own_extend_rows(self, forward_batch) -> None:
        """Record which request each row of an extend batch serves (a row whose request
        changed gets a new owner id, so the engine resets it at its next decode step).
        Every request is prefilled (extended) before it decodes, so a graph replay of a
        padded bucket, whose batch carries no request ids, still sees each row's owner."""
        rids = compat.field(forward_batch, FORWARD_BATCH, "rids")  # None outside the scheduler
        if rids is None:
            return
        real = min(real_batch_size(forward_batch), len(rids))
        rows = [int(r) for r in forward_batch.req_pool_indices[:real].tolist()]
        self.rows.ids_for(rows, list(rids[:real]))

    def _begin_graph_step(self, forward_batch) -> None:
        """Host side of a graph decode step (outside the graph): fill the static row
        buffers of the bucket and start the engine's step.

        The bucket's ``bs`` entries: live rows first (their ``req_to_token`` rows), then
        padding. Padding entries (beyond the real batch, or on ``req_to_token`` row 0,
        which SGLang reserves: ``ReqToTokenPool.free_slots`` starts at 1, and its graph
        runners point padding at it) go to the engine's sink row with owner ``-1`` and
        stable length 0: they select nothing, copy nothing and attend nothing, and no
        real row's residency is touched.
        """
        bs = self._graph_batch
        real = real_batch_size(forward_batch)
        pool_rows = [int(r) for r in forward_batch.req_pool_indices[:bs].tolist()]
        live = [i < real and r != 0 for i, r in enumerate(pool_rows)]
        rows_list = [r for r, ok in zip(pool_rows, live) if ok]
        if len(set(rows_list)) != len(rows_list):
            raise RuntimeError(f"decode batch names req_to_token rows {rows_list} more than once")
        rids = compat.field(forward_batch, FORWARD_BATCH, "rids")  # None on a padded bucket's replay batch
        live_rids = None
        if rids is not None:
            live_rids = [rids[i] for i, ok in enumerate(live) if ok]
        owners = self.rows.ids_for(rows_list, live_rids)
        lens = graph_seq_lens_cpu(forward_batch)[:bs].to(torch.int64)
        mask = torch.tensor(live, dtype=torch.bool)
        rows = torch.full((bs,), -1, dtype=torch.int64)
        req_ids = torch.full((bs,), -1, dtype=torch.int64)
        rows[mask] = torch.tensor(rows_list, dtype=torch.int64)
        req_ids[mask] = owners
        stable = torch.where(mask, lens, torch.zeros_like(lens)).to(torch.int32)
        step = self.engine.begin_step(
            req_ids,
            self.req_to_token_pool.req_to_token,
            stable,
            rows=rows,
            rows_per_request=1,
            captured=True,
            free_rows=self.free_rows(),
        )
        g = self.offload_graph
        g.rows[:bs].copy_(torch.where(mask, rows, torch.full_like(rows, self.engine.sink_row)))
        g.req_ids[:bs].copy_(req_ids)
        g.stable[:bs].copy_(stable)
        g.step.fill_(step)
        g.fill_direct(self.engine, bs)
        live_count = len(rows_list)
        row_bytes = self.engine.pool.shape.row_bytes
        for layer in range(self.engine.config.layers):  # host counts: live rows stepped and appended
            self.engine.stats_acc.record_rows(layer, live_count)
            self.engine.stats_acc.record_d2h(layer, live_count * row_bytes)
        self._batch_rows = None
        kind = (bs, live_count < bs)
        if not isinstance(forward_batch, _CaptureBatch) and kind not in self._graph_kinds_seen:
            self._graph_kinds_seen.add(kind)
            logger.info(
                "sparse decode offload: decode graph bucket %d stepped with %d live rows%s",
                bs,
                live_count,
                " (padding entries on the sink row)" if live_count < bs else "",
            )
        self.metrics.on_step_end()  # the previous step's totals (the graph has no host hook at its end)

    def free_rows(self):
        """The engine's source of SGLang's free request rows (:func:`.dsa_metadata.free_request_rows`)."""
        return free_request_rows(self.engine, self.req_to_token_pool)

    def serving_rank_depth(self, md) -> int:
        """The serving rank depth on eager decode steps (not extend, not verify: speculative
        decoding is refused with score policies at startup); 0 otherwise."""
        return self.rank_depth if (md.is_decode and not self._verify) else 0

    def _feed_ranking(self, layer_id: int, real: int) -> None:
        """Hand this layer's top-D ranking (:meth:`run_indexer` kept it) to the layer's
        residency manager before its step: int32 ``[real, D]`` on the engine device, the
        batch's real rows in batch order (the rows of the engine step)."""
        ranking = self.ranking
        if ranking is None or ranking.layer_id != layer_id:
            raise RuntimeError(
                f"layer {layer_id}: policy {self.engine.config.policy!r} needs this step's indexer "
                "ranking, but the indexer did not leave one for this layer (rank_depth "
                f"{self.rank_depth}); the indexer hook must run before attention on every layer"
            )
        self.ranking = None
        local = layer_id - self.start_layer
        self.engine.managers[local].set_ranked(ranking.ranked[:real].to(self.engine.device, torch.int32))

    # ------------------------------------------------------------------ fused indexer
    def run_indexer(
        self, indexer: Any, x, q_lora, positions, forward_batch, layer_id: int, return_indices: bool = True
    ) -> Optional[torch.Tensor]:
        """On a decode or verify step with the fused indexer: LIM / LIM-C8 selects the top-k
        and steps the layer's residency (kept for :meth:`attend`); int32 ``[T, index_topk]``.
        A request's ``n`` verify rows share its row: the operator steps it once on the
        union of their top-k (``tokens_per_row = n``). Everything else: the base class's
        separate indexer."""
        md = self.forward_metadata
        if self.fused_indexer_op is None or not return_indices or md is None or not (md.is_decode or self._verify):
            return super().run_indexer(indexer, x, q_lora, positions, forward_batch, layer_id, return_indices)
        inputs = self.store_index_inputs(indexer, x, q_lora, positions, forward_batch, layer_id)
        local = layer_id - self.start_layer
        tokens = inputs.query.shape[0]
        if self._graph_batch is not None:  # the static row buffers the graph step reads
            n = self.verify_rows_per_request if self._verify else 1
            g, bs = self.offload_graph, self._graph_batch // n  # a verify graph: bs requests x n rows
            args = fused_indexer.residency_args(
                self.engine.managers[local], g.rows[:bs], g.req_ids[:bs], g.stable[:bs], g.step, tokens, n
            )
        else:
            args = self.engine.indexer_residency(local, tokens)
        result = self.fused_indexer_op(
            *self.index_operands(inputs, layer_id),
            **indexer_metadata(md),
            sparse_count=int(indexer.index_topk),
            **args.as_kwargs(),
        )
        self._fused_step = (local, result.residency)
        if not self._fused_seen:
            self._fused_seen = True
            logger.info(
                "sparse decode offload: decode steps select and manage residency with the fused %s",
                self.engine.plan.indexer.ops[0],
            )
        return result.topk_indices.reshape(tokens, -1)

    def owns_npu_indexer(self) -> bool:
        """On an NPU the backend runs the indexer itself where the fused LIM / LIM-C8 serves
        (SGLang's ``forward_npu`` calls the separate torch_npu indexer on a bf16 cache)."""
        return self.fused_indexer_op is not None

    def _take_fused_step(self, local: int):
        """The residency step the fused indexer took for layer ``local`` this step (``None``
        without the fused indexer); it is used once."""
        if self.fused_indexer_op is None:
            return None
        if self._fused_step is None or self._fused_step[0] != local:
            raise RuntimeError(
                f"layer {local}: the fused indexer left no residency step for this layer; the "
                "indexer hook must run before attention on every layer"
            )
        step, self._fused_step = self._fused_step[1], None
        return step

    # ------------------------------------------------------------------ attention
    def attend(self, layer, forward_batch, q_nope, q_pe, topk_indices) -> torch.Tensor:
        if self._graph_batch is not None:
            return self._attend_decode_graph(layer, q_nope, q_pe, topk_indices)
        if self.forward_metadata is not None and (self.forward_metadata.is_decode or self._verify):
            return self._attend_decode(layer, q_nope, q_pe, topk_indices)
        return self._attend_extend(layer, forward_batch, q_nope, q_pe, topk_indices)

    def _attend_decode(self, layer, q_nope, q_pe, topk_indices) -> torch.Tensor:
        if topk_indices is None:
            raise RuntimeError(
                f"layer {layer.layer_id}: sparse decode offload needs the indexer's top-k "
                "on every layer (dense layers cannot be served from the hot buffer)"
            )
        cfg = self.engine.config
        # the batch's first ``real`` query rows (n per request when verifying); the rest is DP-attention padding
        real = self._batch_rows.numel() * (self.verify_rows_per_request if self._verify else 1)
        local = layer.layer_id - self.start_layer
        dev = self.engine.device
        topk_rows = topk_indices[:real, : cfg.top_k].to(dev, torch.int32)
        copy_before = self.engine.times.seconds.get("copy", 0.0)
        self.engine.timing = self.metrics.needs_copy_timing
        if self.rank_depth > 0:
            self._feed_ranking(layer.layer_id, real)
        fused = self._take_fused_step(local)
        result = self.engine.run_layer(local, topk_rows, q_nope[:real], q_pe[:real], layer.scaling, residency=fused)
        self.metrics.add_copy_time(local, self.engine.times.seconds.get("copy", 0.0) - copy_before)
        if self.recorder is not None:  # decode steps, or verify rounds (n rows per request)
            self.recorder.record_layer(local, topk_rows)
        if local == cfg.layers - 1:
            self.metrics.on_step_end()
        if real == q_nope.shape[0]:
            return result.output
        out = result.output.new_zeros((q_nope.shape[0],) + tuple(result.output.shape[1:]))
        out[:real] = result.output  # padding rows attend nothing (their outputs are discarded)
        return out

    def _attend_decode_graph(self, layer, q_nope, q_pe, topk_indices) -> torch.Tensor:
        """One layer of a graph decode step: the engine's captured step (its plan's ops)
        over the static row buffers (static shapes, no host reads; the same residency,
        copies and attention arithmetic as the eager step). ``[bs, N, Dl]``."""
        if topk_indices is None:
            raise RuntimeError(
                f"layer {layer.layer_id}: sparse decode offload needs the indexer's top-k "
                "on every layer (dense layers cannot be served from the hot buffer)"
            )
        cfg = self.engine.config
        g = self.offload_graph
        n = self.verify_rows_per_request if self._verify else 1  # query rows per entry
        bs = q_nope.shape[0] // n
        local = layer.layer_id - self.start_layer
        out, res = self.engine.captured_layer_step(
            local,
            g.rows[:bs],
            topk_indices[:, : cfg.top_k].to(torch.int32),
            g.req_ids[:bs],
            g.stable[:bs],
            g.step,
            self.token_to_kv_pool.host_rows(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            q_nope,
            q_pe,
            layer.scaling,
            rows_per_request=n,
            residency=self._take_fused_step(local),
            direct=g.direct_args(bs, n),
        )
        hits = res.hit_mask.sum()
        misses = res.miss_count.sum(dtype=torch.int64)
        self.engine.stats_acc.record_residency(local, hits + misses, hits, misses)
        return out

    def store_kv(self, layer, forward_batch, k_nope: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Append the new tokens' rows to the host pool. In a graph decode step the write
        is one ``index_copy_`` at ``out_cache_loc`` (static shapes, nothing counted on the
        host: :meth:`_begin_graph_step` counts the step's appended bytes); padding entries
        write SGLang's reserved padding slot 0, as its device-KV backends do."""
        if self._graph_batch is None:
            return super().store_kv(layer, forward_batch, k_nope, k_pe)
        host = self.token_to_kv_pool.host_rows(layer.layer_id)
        rows = torch.cat((k_nope.reshape(-1, self.kv_lora_rank), k_pe.reshape(-1, self.qk_rope_head_dim)), dim=-1)
        loc = forward_batch.out_cache_loc.to(device=host.device, dtype=torch.int64)
        host.index_copy_(0, loc, rows.to(device=host.device, dtype=host.dtype))

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
        # one H2D copy of the distinct rows
        staged = self.token_to_kv_pool.read_host_rows(layer.layer_id, unique).to(device)
        flat = torch.full_like(logical, -1)
        flat[valid] = inverse
        dl = self.kv_lora_rank
        return self.attention_op(
            q_nope,
            staged[:, :dl],
            None,
            flat.to(torch.int32).unsqueeze(1),
            layer.scaling,
            query_rope=q_pe,
            key_rope=staged[:, dl:],
            layout_query="TND",
            layout_kv="flat",
        )

    # ------------------------------------------------------------------ graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Static buffers of decode graphs of up to ``max_bs`` requests: the base
        backend's metadata buffers plus the engine's row buffers (:class:`OffloadGraphBuffers`)."""
        if self.recorder is not None:
            raise RuntimeError(
                "sparse decode offload: record_trace needs eager decode (the recorder reads "
                "each layer's top-k on the host); drop record_trace or run decode eagerly"
            )
        if self.rank_depth > 0:
            raise RuntimeError(
                f"sparse decode offload: policy {self.engine.config.policy!r} (rank_depth "
                f"{self.rank_depth}) needs the indexer's ranking, which the graph decode path does "
                "not produce; run decode eagerly or serve lru / lru_k2_guarded with decode graphs"
            )
        if self.ranks.attn_tp_size > 1:
            raise RuntimeError(
                "sparse decode offload: decode graphs with a host pool shared by several TP ranks "
                "are not wired (TP rank 0 publishes each layer's appends from the host); run "
                "decode eagerly or with attention TP 1"
            )
        # A verify graph's entries are requests (their n verify rows share one engine row).
        requests = max_bs // max(1, cpu_spec_graph.verify_width_of(self))
        if requests > self.engine.config.rows:
            raise RuntimeError(
                f"decode graphs up to batch {requests} but the engine has {self.engine.config.rows} "
                "rows (--max-running-requests + 1): lower the graph batch sizes"
            )
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        dev = self.engine.device
        self.offload_graph = OffloadGraphBuffers(
            rows=torch.full((requests,), self.engine.sink_row, dtype=torch.int64, device=dev),
            req_ids=torch.full((requests,), -1, dtype=torch.int64, device=dev),
            stable=torch.zeros((requests,), dtype=torch.int32, device=dev),
            step=torch.zeros((), dtype=torch.int64, device=dev),
        )
        if self.engine.direct is not None:  # residency adaptive: the direct rows' mode and step positions
            width = max(1, cpu_spec_graph.verify_width_of(self))
            self.offload_graph.direct = torch.zeros((requests,), dtype=torch.bool, device=dev)
            self.offload_graph.direct_pos = torch.full((requests, width), -1, dtype=torch.int64, device=dev)
            spans = direct_rows.span_width(self.req_to_token_pool.req_to_token.shape[1], self.engine.config.hot_tokens)
            self.offload_graph.direct_span = torch.zeros((requests, spans), dtype=torch.int64, device=dev)

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
        """The CPU graph runner's capture batch: every entry is padding (row 0), so the
        capture runs the step on the sink row only."""
        super().init_forward_metadata_capture_cpu_graph(
            bs, num_tokens, req_pool_indices, seq_lens, out_cache_loc, encoder_lens, forward_mode, spec_info
        )
        self._verify = forward_mode.is_target_verify()
        if self._verify:  # a CPU verify graph bucket (cpu_spec_graph): bs x n rows, all padding
            cpu_spec_graph.begin_graph_verify(self, _CaptureBatch(bs, req_pool_indices, seq_lens, forward_mode))
            return
        self._begin_graph_step(_CaptureBatch(bs, req_pool_indices, seq_lens, forward_mode))
