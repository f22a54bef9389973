"""CPU graphs (``torch.compile``) for the target's verify forward of speculative decoding.

SGLang 0.5.23's CPU engine refuses decode graphs with speculative decoding:
``CPUGraphRunner.__init__`` (``model_executor/cpu_graph_runner.py``) asserts
``model_runner.spec_algorithm.is_none()`` ("CPUGraphRunner does not support
speculative inference yet"), its capture width is fixed at one token per request
(``captured_req_width = 1``, ``capture_forward_mode = DECODE``), ``ModelRunner._forward_raw``
replays a CPU graph only for ``ForwardMode.is_cpu_graph()`` (``DECODE`` only), and the
EAGLE worker's verify preparation (``eagle_utils.eagle_prepare_for_verify``) calls the
runner's ``load_batch``, which the CPU runner lacks. Under the EAGLE / NextN worker
(``speculative/eagle_worker_v2.py``) the target model only runs extend and
``TARGET_VERIFY`` forwards, and the draft (NextN) model's decode steps stay eager on a
CPU (``EAGLEWorkerV2._capture_cuda_graphs`` returns at once under ``is_cpu()``).

With the ``ascend_offload`` attention backend the plugin serves the verify forward in a
CPU graph, through HookRegistry (no SGLang file changed):

=====================================================  ==================================
target                                                 what
=====================================================  ==================================
REPLACE ``cpu_graph_runner.CPUGraphRunner``            :class:`PluginCPUGraphRunner`: for
                                                       the target model of an EAGLE / NextN
                                                       server on ``ascend_offload`` it
                                                       captures ``TARGET_VERIFY`` buckets of
                                                       ``bs`` requests x ``n`` =
                                                       ``--speculative-num-draft-tokens``
                                                       rows; every other runner is SGLang's
                                                       own class, unchanged
AROUND ``ForwardMode.is_cpu_graph``                    ``TARGET_VERIFY`` is replayable once a
                                                       verify runner exists in the process
=====================================================  ==================================

The attention backend captures the verify batch as a decode batch of ``bs * n`` rows:
verify row ``j`` of a request with committed length ``L`` is a row with the request's
block table and KV length ``L + j + 1`` (the chain is causal), so the static-shape
indexer (:func:`..attention.dsa_backend.graph_decode_topk`) and attention rows
(:func:`..attention.dsa_backend.graph_decode_rows`) of decode graphs serve it unchanged
(:func:`verify_graph_metadata`, :func:`fill_verify_graph_buffers`). With sparse decode
offload the host side of each verify step (:func:`begin_graph_verify`: one engine row
per request, shared by its verify rows; owners, committed lengths, the engine's
``begin_step``) runs before every replay (the CPU runner calls the backend's
``init_forward_metadata`` outside the graph) and fills static row buffers that the
graph's per-layer step reads (the residency over the union of each request's rows'
top-k). Padding entries of a bucket run on the engine's sink row and attend nothing.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


_verify_graphs_active = False  # a verify runner was built in this process


def is_cpu_graph_around(original: Callable, self) -> bool:
    """``DECODE`` (SGLang's rule), and ``TARGET_VERIFY`` once this process built a
    :class:`PluginCPUGraphRunner` for verify (its ``can_run_graph`` then decides)."""
    if original(self):
        return True
    return _verify_graphs_active and self.is_target_verify()


def serves_verify(model_runner: Any) -> bool:
    """True when ``model_runner`` is the target model of an EAGLE / NextN server whose
    attention backend is ``ascend_offload`` (the runner this module captures)."""
    from sglang.srt.runtime_context import attention_backends

    from ..names import BACKEND_NAME

    spec = model_runner.spec_algorithm
    _, decode = attention_backends()
    return bool(
        spec.is_speculative() and spec.is_eagle() and not model_runner.is_draft_worker and decode == BACKEND_NAME
    )


_RUNNER_CLASS = None


def runner_class():
    """:class:`PluginCPUGraphRunner`, built once on SGLang's ``CPUGraphRunner`` (imported
    lazily: the module imports torch.compile helpers)."""
    global _RUNNER_CLASS
    if _RUNNER_CLASS is None:
        from sglang.srt.model_executor import cpu_graph_runner as cgr

        _RUNNER_CLASS = _make_runner_class(cgr.CPUGraphRunner)
    return _RUNNER_CLASS


def _make_runner_class(base: type) -> type:
    class PluginCPUGraphRunner(base):
        """SGLang's ``CPUGraphRunner``; for the target model of an EAGLE / NextN server
        on ``ascend_offload`` (:func:`serves_verify`) it captures ``TARGET_VERIFY``
        buckets (``bs`` requests x ``n`` verify rows) instead of decode buckets."""

        def __init__(self, model_runner):
            self.verify_width = 0
            if not serves_verify(model_runner):
                super().__init__(model_runner)
                return
            _init_verify_runner(self, model_runner)

        def can_run_graph(self, forward_batch) -> bool:
            if not self.verify_width:
                return super().can_run_graph(forward_batch)
            if not forward_batch.forward_mode.is_target_verify():
                return False
            spec = forward_batch.spec_info
            if spec is None or int(spec.draft_token_num) != self.verify_width:
                return False
            bs = int(forward_batch.batch_size)
            return bs in self.graphs if self.disable_padding else 0 < bs <= self.max_bs

        def load_batch(self, forward_batch):
            """The EAGLE worker's verify preparation hands the batch over here when
            :meth:`can_run_graph` holds; the CPU runner copies it into its captured batch
            and plans the metadata at replay (:meth:`prepare_replay`)."""
            return forward_batch

        def prepare_replay(self, forward_batch, skip: bool = False):
            if not self.verify_width:
                return super().prepare_replay(forward_batch, skip)
            return _prepare_verify_replay(self, forward_batch)

    return PluginCPUGraphRunner


def _init_verify_runner(runner: Any, model_runner: Any) -> None:
    """Set up ``runner`` (a :class:`PluginCPUGraphRunner`) to capture verify buckets:
    the attributes SGLang's ``CPUGraphRunner`` methods (``capture``,
    ``capture_one_batch_size``, ``get_spec_info``, ``execute``) read, with
    ``captured_req_width = n`` and ``capture_forward_mode = TARGET_VERIFY``; then capture."""
    global _verify_graphs_active
    from sglang.srt.model_executor import cpu_graph_runner as cgr
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    n = int(spec.speculative_num_draft_tokens)
    _refuse_unsupported_verify_graphs(model_runner, spec)
    _set_verify_runner_state(runner, model_runner, spec, n)
    runner.capture_bs = cgr.get_batch_sizes_to_capture(model_runner)
    runner.max_bs = max(runner.capture_bs)
    runner.max_num_token = runner.max_bs * n
    backend = model_runner.attn_backend
    backend.cpu_graph_verify_width = n  # the backend sizes its graph rows for bs x n verify rows
    backend.init_cpu_graph_state(runner.max_bs, runner.max_num_token)
    runner.encoder_len_fill_value = 0
    runner.seq_len_fill_value = backend.get_cpu_graph_seq_len_fill_value()
    if runner.enable_torch_compile:
        cgr.register_fake_ops(runner.tp_size)
        cgr.set_torch_compile_config()
    _allocate_verify_inputs(runner, n)
    logger.info(
        "ascend_offload: capturing CPU verify graphs (TARGET_VERIFY) for batch sizes %s x %d verify rows "
        "per request; the draft (NextN) model's steps run eagerly (SGLang's CPU engine captures no draft "
        "graphs)",
        runner.capture_bs,
        n,
    )
    _verify_graphs_active = True
    try:
        runner.capture()
    except RuntimeError as e:
        raise RuntimeError(f"Capture CPU verify graph failed: {e}\n{cgr.CPU_GRAPH_CAPTURE_FAILED_MSG}") from e


def _refuse_unsupported_verify_graphs(model_runner: Any, spec: Any) -> None:
    """Verify graphs serve an EAGLE / NextN chain on one DP / PP rank, without LoRA,
    two-batch overlap, gathered buffers or an encoder-decoder model; anything else is
    an error naming every unsupported part."""
    from sglang.srt.runtime_context import get_exec, get_lora, get_parallel
    from sglang.srt.utils import require_gathered_buffer, require_mlp_sync, require_mlp_tp_gather

    if int(spec.speculative_eagle_topk) != 1:
        raise RuntimeError(
            f"ascend_offload CPU verify graphs serve EAGLE chains only; got --speculative-eagle-topk "
            f"{spec.speculative_eagle_topk}"
        )
    problems = []
    if get_lora().enable_lora:
        problems.append("LoRA")
    if get_exec().overlap.enable_two_batch_overlap:
        problems.append("two-batch overlap")
    if require_mlp_tp_gather() or require_mlp_sync() or require_gathered_buffer():
        problems.append("DP attention / MLP sync (gathered buffers)")
    par = get_parallel()
    if par.num_dp_ranks != 1 or par.pp_size != 1:
        problems.append("data or pipeline parallelism")
    if model_runner.model_config.is_encoder_decoder:
        problems.append("an encoder-decoder model")
    if problems:
        raise RuntimeError(
            "ascend_offload CPU verify graphs (--enable-torch-compile with speculative decoding) do "
            f"not support {', '.join(problems)}; drop --enable-torch-compile to verify eagerly"
        )


def _set_verify_runner_state(runner: Any, model_runner: Any, spec: Any, n: int) -> None:
    """The ``CPUGraphRunner`` attributes its capture and replay read, for ``n`` verify
    rows per request (``TARGET_VERIFY``), none of SGLang's gathered / overlapped paths."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode, get_server_return_hidden_states_mode
    from sglang.srt.runtime_context import get_exec, get_flags, get_parallel

    runner.model_runner = model_runner
    runner.device = model_runner.device
    runner.return_hidden_states_mode = get_server_return_hidden_states_mode()
    runner.enable_return_hidden_states = runner.return_hidden_states_mode.need_capture()
    runner.graphs, runner.graphs_cross, runner.output_buffers = {}, {}, {}
    runner.captured_forward_batches, runner.captured_forward_batches_cross = {}, {}
    runner.enable_torch_compile = get_flags().capture.enable_torch_compile
    runner.disable_padding = get_exec().graph.disable_cuda_graph_padding
    runner.is_encoder_decoder = False
    runner.require_gathered_buffer = runner.require_mlp_tp_gather = runner.require_mlp_sync = False
    runner.require_attn_tp_gather = False
    runner.enable_two_batch_overlap = False
    runner.speculative_algorithm = spec.speculative_algorithm
    runner.enable_profile_cuda_graph = get_exec().graph.enable_profile_cuda_graph
    runner.tp_size, runner.num_dp_ranks, runner.pp_size = get_parallel().tp_size, 1, 1
    runner.capture_forward_mode = ForwardMode.TARGET_VERIFY
    runner.capture_hidden_mode = runner.return_hidden_states_mode
    runner.captured_req_width = n
    runner.verify_width = n
    runner.replay_kinds_seen = set()  # (bucket, padded) pairs logged once


def _allocate_verify_inputs(runner: Any, n: int) -> None:
    """The static input buffers every captured bucket reads (``max_bs`` requests x ``n`` rows)."""
    dev = runner.device
    runner.input_ids = torch.zeros((runner.max_num_token,), dtype=torch.int64, device=dev)
    runner.req_pool_indices = torch.zeros((runner.max_bs,), dtype=torch.int64, device=dev)
    runner.seq_lens = torch.full((runner.max_bs,), runner.seq_len_fill_value, dtype=torch.int64, device=dev)
    runner.out_cache_loc = torch.zeros((runner.max_num_token,), dtype=torch.int64, device=dev)
    runner.positions = torch.zeros((runner.max_num_token,), dtype=torch.int64, device=dev)
    runner.mrope_positions = torch.zeros((3, runner.max_num_token), dtype=torch.int64, device=dev)
    runner.num_token_non_padded = torch.zeros((1,), dtype=torch.int64, device=dev)
    # The verify input's tree mask (unused by ascend_offload: chains attend causally by position).
    mask_len = (runner.max_bs * runner.seq_len_fill_value + runner.max_num_token) * n
    runner.custom_mask = torch.ones((mask_len,), dtype=torch.bool, device=dev)
    runner.encoder_lens = None


def _prepare_verify_replay(runner: Any, forward_batch: Any):
    """Copy a verify batch of ``raw_bs`` requests into the captured batch of the smallest
    bucket ``bs >= raw_bs`` (padding: request row 0, the fill length, slot 0) and plan
    the backend's metadata on it (outside the graph). The captured batch is replayed
    for every size, also an exact fit (one compiled graph per bucket, no re-trace).
    ``rids`` (the offload engine's row owners) come from the live batch."""
    raw_bs = int(forward_batch.batch_size)
    n = runner.verify_width
    bs = runner.capture_bs[bisect.bisect_left(runner.capture_bs, raw_bs)]
    raw_tokens = raw_bs * n
    runner.raw_bs, runner.raw_num_token, runner.bs = raw_bs, raw_tokens, bs
    cfb = runner.captured_forward_batches[bs]
    cfb.seq_lens.fill_(runner.seq_len_fill_value)
    cfb.out_cache_loc.zero_()
    cfb.req_pool_indices.zero_()
    cfb.input_ids[:raw_tokens].copy_(forward_batch.input_ids[:raw_tokens])
    cfb.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices[:raw_bs])
    cfb.seq_lens[:raw_bs].copy_(forward_batch.seq_lens[:raw_bs])
    cfb.out_cache_loc[:raw_tokens].copy_(forward_batch.out_cache_loc[:raw_tokens])
    cfb.positions[:raw_tokens].copy_(forward_batch.positions[:raw_tokens])
    if cfb.num_token_non_padded is not None:
        cfb.num_token_non_padded.fill_(raw_tokens)
    # The backend's host-side planning reads the live batch's request ids and host lengths; they are set on
    # the captured batch only for that call, so the object the compiled graph was traced on (and guards)
    # is the same at every replay.
    saved = (cfb.seq_lens_cpu, cfb.rids)
    rids = getattr(forward_batch, "rids", None)
    cfb.seq_lens_cpu = cfb.seq_lens.to("cpu")
    cfb.rids = list(rids[:raw_bs]) if rids is not None else None
    try:
        runner.model_runner.attn_backend.init_forward_metadata(cfb)
    finally:
        cfb.seq_lens_cpu, cfb.rids = saved
    kind = (bs, raw_bs < bs)
    if kind not in runner.replay_kinds_seen:
        runner.replay_kinds_seen.add(kind)
        logger.info(
            "ascend_offload: CPU verify graph bucket %d replayed for %d request(s) x %d verify rows%s",
            bs,
            raw_bs,
            n,
            " (padding entries)" if raw_bs < bs else "",
        )
    return cfb


# ---------------------------------------------------------------------- backend side
def verify_width_of(backend: Any) -> int:
    """Verify rows per request of the backend's CPU verify graphs (0: none)."""
    return int(getattr(backend, "cpu_graph_verify_width", 0) or 0)


def verify_graph_fits(backend: Any, forward_batch: Any) -> bool:
    """A ``TARGET_VERIFY`` batch the backend's graph buffers serve (static views)."""
    n = verify_width_of(backend)
    return bool(
        n
        and backend.graph is not None
        and forward_batch.forward_mode.is_target_verify()
        and int(forward_batch.batch_size) * n <= backend.graph.max_bs
    )


def verify_graph_metadata(backend: Any, bs: int, seq_lens_cpu: torch.Tensor) -> None:
    """Metadata of a graph verify batch of ``bs`` requests x ``n`` rows: the decode
    graph metadata of ``bs * n`` rows (one query token each; views of the static
    buffers), row ``i * n + j`` with KV length ``L_i + j + 1``."""
    n = verify_width_of(backend)
    backend._graph_decode_metadata(bs * n, row_lens(seq_lens_cpu[:bs], n))


def row_lens(committed: torch.Tensor, n: int) -> torch.Tensor:
    """int ``[B * n]``: KV length of each verify row (``L + j + 1`` for row ``j``) from the
    committed lengths ``[B]``."""
    steps = torch.arange(1, n + 1, dtype=committed.dtype, device=committed.device)
    return (committed.reshape(-1, 1) + steps).reshape(-1)


def fill_verify_graph_buffers(backend: Any, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Static-shape copies into the graph buffers for a verify batch (``bs * n`` rows;
    ``req_pool_indices`` / ``seq_lens`` ``[>= bs]`` per request): each row's request row
    and KV length; block tables from them."""
    n = verify_width_of(backend)
    rows = backend._graph_batch
    bs = rows // n
    req_rows = req_pool_indices[:bs].repeat_interleave(n)
    backend._fill_graph_buffers(rows, req_rows, row_lens(seq_lens[:bs], n))


def begin_graph_verify(backend: Any, forward_batch: Any) -> None:
    """Host side of a graph verify step with sparse decode offload (outside the graph):
    each request's engine row (its ``req_to_token`` row, shared by its ``n`` verify
    rows), owner and stable length (the committed length ``L``) in the static row
    buffers (entries ``[:bs]`` for the bucket's ``bs`` requests), and the engine's
    ``begin_step``. Entries beyond the live requests (or on ``req_to_token`` row 0, the
    padding row of SGLang's graph runners) go to the sink row with owner ``-1`` and
    stable length 0: their rows select, copy and attend nothing."""
    from ..attention.dsa_metadata import free_request_rows, real_batch_size

    n = backend.verify_rows_per_request
    bs = backend._graph_batch // n
    real = real_batch_size(forward_batch) if getattr(forward_batch, "rids", None) is not None else bs
    pool_rows = [int(r) for r in forward_batch.req_pool_indices[:bs].tolist()]
    live = [i < real and r != 0 for i, r in enumerate(pool_rows)]
    reqs = [r for r, ok in zip(pool_rows, live) if ok]
    if len(set(reqs)) != len(reqs):
        raise RuntimeError(f"verify batch names req_to_token rows {reqs} more than once")
    lens = forward_batch.seq_lens[:bs].to("cpu", torch.int64)
    rids = getattr(forward_batch, "rids", None)
    live_rids = [rids[i] for i, ok in enumerate(live) if ok] if rids is not None else None
    owners = backend.rows.ids_for(reqs, live_rids)
    mask = torch.tensor(live, dtype=torch.bool)
    rows = torch.full((bs,), -1, dtype=torch.int64)
    req_ids = torch.full((bs,), -1, dtype=torch.int64)
    rows[mask] = torch.tensor(reqs, dtype=torch.int64)
    req_ids[mask] = owners
    stable = torch.where(mask, lens, torch.zeros_like(lens)).to(torch.int32)
    step = backend.engine.begin_step(
        req_ids,
        backend.req_to_token_pool.req_to_token,
        stable,
        rows=rows,
        rows_per_request=n,
        captured=True,
        free_rows=free_request_rows(backend.engine, backend.req_to_token_pool),
    )
    g = backend.offload_graph
    g.rows[:bs].copy_(torch.where(mask, rows, torch.full_like(rows, backend.engine.sink_row)))
    g.req_ids[:bs].copy_(req_ids)
    g.stable[:bs].copy_(stable)
    g.step.fill_(step)
    g.fill_direct(backend.engine, bs)
    live_count = len(reqs) * n
    row_bytes = backend.engine.pool.shape.row_bytes
    for layer in range(backend.engine.config.layers):  # host counts: live verify rows stepped and appended
        backend.engine.stats_acc.record_rows(layer, live_count)
        backend.engine.stats_acc.record_d2h(layer, live_count * row_bytes)
    backend._batch_rows = None
    backend.metrics.on_step_end()
