"""The per-step sparse decode engine (engine-agnostic: tensors, layer ids, rows).

One decode step, per layer ``l``:

1. new-token rows are appended device -> host into the host pool
   (:meth:`SparseDecodeEngine.append`; TP rank 0 only, the others wait on the
   :class:`~.host_pool.AppendGate` before they read);
2. the residency manager classifies the row's logical top-k into hits and misses
   and assigns victim slots (op ``residency_manage`` for LRU, or another policy);
3. only the miss rows are copied host -> device (op ``copy_miss_rows``);
4. the top-k is remapped to hot-buffer rows ``r*H + slot`` in the same order;
5. sparse attention (op ``sparse_mla_attention``, ``layout_kv="flat"``) runs over
   the hot buffer.

Every op the engine calls comes from its :class:`~.op_selection.OpPlan` (``self.plan``,
from ``ops``, ``fused_copy_sfa`` and the rest of the config): the rung of each stage's op
(``ops=triton`` swaps in the Triton residency and copy kernels without touching this
file; what a rung lacks runs on the rung the plan names), and whether steps 3-5 run as
the one fused AscendC Copy-SFA operator. The plan is the only place that decides;
eager (:meth:`SparseDecodeEngine.run_layer`) and captured
(:meth:`SparseDecodeEngine.captured_layer_step`) steps run the same ops.

Engine state (residency tables, hot buffers) is indexed by stable *engine rows*
``0..R-1`` (in SGLang the ``req_to_token`` row, ``req_pool_idx``), sized for the
configured concurrency, plus one *sink* row ``R`` that serves padding entries. Each
step works on the batch's rows only (per-step work ``O(B)``, whatever ``R`` is):

Inputs of a step (:meth:`begin_step`): ``rows`` int64 ``[B]`` (engine row of each
batch entry, distinct; ``-1`` = a padding entry: it is run on the sink row, attends
nothing and never touches real residency), ``req_ids`` int64 ``[B]`` (``-1`` idle),
``token_table`` int32 ``[T, max_ctx]`` indexed by engine row (logical position ->
host slot; in SGLang ``req_to_token``), ``stable_len`` int32 ``[B]`` (positions
``>= stable_len`` may be rewritten and are never hits). Without ``rows`` the batch is
every engine row in order (``B = R``). Per layer (:meth:`run_layer`): ``topk`` int32
``[B, K]`` logical positions (``-1`` padding), ``query`` ``[B, N, latent]``,
``query_rope`` ``[B, N, rope]``; the output is ``[B, N, latent]``.

The per-layer path has static shapes and reads nothing from the device on the host
(miss lists are padded to ``K`` per row with device-side counts, statistics stay on
the device until :meth:`stats`). On CPU with policy ``lru`` the residency step and the
miss copy run on the CPU kernel (``cpu_kernel.py``; ``manage_impl``); elsewhere
through the op ladder, in the rows form (gather the batch rows, step, scatter back).
Rows must be stable per request across steps (index rows by ``req_pool_idx``, not by
batch position, or every batch reshuffle resets residency).

**Query rows per request** (``EngineConfig.rows_per_request`` = ``n``; speculative
verify rows, 1 without speculation): an engine row is a *request*, with one hot buffer
and one residency state per layer shared by its ``n`` query rows. ``begin_step`` takes
the ``G`` requests (``rows``, ``req_ids``, ``stable_len`` ``[G]``, the committed
length as the stable prefix), ``run_layer`` their ``G * n`` query rows request-major
(``topk`` ``[G*n, K]``, ``query`` ``[G*n, N, latent]``). The residency step runs on the
union of each request's rows' top-k (``ops/request_union.py``): a position several rows
select is one lookup and at most one copy, and each row's remapped indices follow its
own top-k order. A round whose union does not fit the request's ``hot_tokens`` serves
the positions beyond them from the overflow area (``overflow.py``), exactly, with no
host branch: ``hot_tokens >= top_k`` is all a request needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import platform, startup_phases
from ..ops import registry
from ..ops.contract import OpImpl, ResidencyStep, ResidencyTable
from ..ops.request_union import RequestUnion, merge_ranked, row_slots, union_of_rows
from ..ops.residency import copy_miss_rows_rows
from . import direct_rows, fused_indexer, op_selection, overflow
from .host_pool import AppendGate, HostKVPool
from .host_rows import is_tensor_backed
from .hot_buffer import HotBuffers, flat_hot_indices
from .policies import DEFAULT_POLICY, ResidencyManager, make_manager
from .shadow import ShadowVerifier
from .sizing import overflow_slots
from .stats import DecodeStats, StatsAccumulator

__all__ = [
    "EngineConfig",
    "LayerResult",
    "PhaseTimes",
    "SparseDecodeEngine",
    "decode_layer_step",
    "RequestStep",
    "step_requests",
]

logger = logging.getLogger(__name__)


@dataclass
class RequestStep:
    """One layer's residency step over a batch of requests, read back per query row.

    residency: the manager's step per request (``[B, K]``, or ``[B, n*K]`` over the union).
    slots: int32 ``[B*n, K]`` each query row's hot-buffer slots in its own top-k order.
    token_rows: int64 ``[B*n]`` the engine row of each query row.
    union: the union it looked up (``None`` with one row per request).
    """

    residency: ResidencyStep
    slots: torch.Tensor
    token_rows: torch.Tensor
    union: Optional[RequestUnion]

    def row_counts(self):
        """``(row_selected, row_hits)`` 0-d device counts of the query rows' entries, or
        ``(None, None)`` with one row per request (then they equal the lookups')."""
        if self.union is None:
            return None, None
        u = self.union
        row_hit = torch.gather(self.residency.hit_mask, 1, u.columns.reshape(u.positions.shape[0], -1))
        hit = row_hit.reshape_as(u.valid) & u.resident_entries
        return u.valid.sum(dtype=torch.int64), hit.sum(dtype=torch.int64)


def step_requests(
    manager: ResidencyManager,
    hot_rows: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step,
    rows_per_request: int = 1,
    capacity: Optional[int] = None,
) -> RequestStep:
    """The residency step of ``hot_rows`` (``[B]``) for their ``B * n`` query rows' ``topk``:
    the plain per-row step for ``n = 1``, else one step per request over the union
    (its resident part: ``capacity`` = the hot slots per request, beyond which a round's
    union overflows, ``ops/request_union.py``)."""
    n = int(rows_per_request)
    if n == 1:
        res = manager.step_rows(hot_rows, topk, req_ids, stable_len, step)
        return RequestStep(res, res.slots, hot_rows, None)
    union = union_of_rows(topk, n, capacity)
    res = manager.step_rows(hot_rows, union.positions, req_ids, stable_len, step)
    return RequestStep(res, row_slots(union, res.slots), hot_rows.repeat_interleave(n), union)


def fused_request_step(
    residency: ResidencyStep,
    hot_rows: torch.Tensor,
    topk: torch.Tensor,
    rows_per_request: int = 1,
    capacity: Optional[int] = None,
) -> RequestStep:
    """The batch's :class:`RequestStep` from the all-rows step a fused indexer took
    (``[R', ...]``; over each row's union with ``n > 1``, as the operator steps a row
    shared by ``n`` tokens): the batch rows' part, and with ``n > 1`` each query row's
    slots read back from the union of the batch's ``topk`` ``[B*n, K]`` (the same union
    the operator stepped on: distinct positions ascending; its resident part with
    ``capacity``, the hot slots per request)."""
    stepped = fused_indexer.batch_rows_step(residency, hot_rows)
    n = int(rows_per_request)
    if n == 1:
        return RequestStep(stepped, stepped.slots, hot_rows, None)
    union = union_of_rows(topk, n, capacity)
    return RequestStep(stepped, row_slots(union, stepped.slots), hot_rows.repeat_interleave(n), union)


def decode_layer_step(
    manager: ResidencyManager,
    hot_rows: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step,
    host: torch.Tensor,
    hot: torch.Tensor,
    token_table: torch.Tensor,
    query: torch.Tensor,
    query_rope: torch.Tensor,
    scale: float,
    latent_dim: int,
    attention: Optional[Callable] = None,
    rows_per_request: int = 1,
    residency: Optional[ResidencyStep] = None,
    copy_attention: Optional[Callable] = None,
    direct: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    copy: Optional[OpImpl] = None,
    overflow_view: Optional[overflow.OverflowView] = None,
) -> Tuple[torch.Tensor, ResidencyStep]:
    """One layer of the offloaded decode step on the torch path, as a function of tensors.

    manager: the layer's residency manager (any policy; its :meth:`step_rows`). hot_rows
    int64 ``[B]`` engine rows (real rows distinct; padding entries on a sink row with
    ``req_ids = -1``); topk int32 ``[B,K]``; req_ids int64 ``[B]``; stable_len int32
    ``[B]``; step an int or a 0-d int64 tensor; host ``[S,D]``; hot ``[R',H,D]`` (all
    engine rows); token_table int32 ``[T, max_ctx]`` by engine row; query ``[B,N,Dl]``,
    query_rope ``[B,N,Dr]``. Returns ``(output [B,N,Dl], ResidencyStep [B,...])``.
    With ``rows_per_request = n > 1`` the engine rows are requests: ``hot_rows``,
    ``req_ids``, ``stable_len`` are ``[G]``, ``topk`` / ``query`` / the output are the
    ``G * n`` query rows, and the residency step (``[G, n*K]``) is the union's.
    Static shapes, no host read of data: traceable by ``torch.compile(fullgraph=True)``
    and capturable in a device graph (what ``tests/sparse_decode/test_sync_free.py``
    holds). ``attention`` defaults to the reference ``sparse_mla_attention``, ``copy`` (the
    ``copy_miss_rows`` implementation, :func:`copy_stage`) to the reference's rows form; a
    served step passes its plan's (``engine.attention_op`` / ``engine.copy_op``).
    ``residency``: the all-rows step a fused indexer already took, used instead of
    stepping ``manager``. ``copy_attention``: the fused Copy-SFA op, run in place of the
    miss copy and ``attention`` (:func:`fused_copy_attention`).
    ``direct``: ``(mask bool [B], step_pos int64 [B, n], span_rows int64 [B, S])`` of
    ``residency = adaptive`` (:class:`~.direct_rows.DirectStep` of a captured step):
    direct entries are idle to the manager, read their positions through their spans,
    and get the step's new positions copied into their spans after the append.
    ``overflow_view``: the overflow area (:class:`~.overflow.OverflowView`) where a
    request's union may exceed ``hot``'s slots (``n * K > H``); required then.
    """
    capacity = hot.shape[1]
    if rows_per_request * topk.shape[1] > capacity and overflow_view is None:
        raise ValueError(
            f"{rows_per_request} rows x top-k {topk.shape[1]} may overflow {capacity} hot slots: pass the "
            "engine's overflow area (overflow_view)"
        )
    if residency is not None:
        req = fused_request_step(residency, hot_rows, topk, rows_per_request, capacity)
    elif direct is not None:
        query_mask, managed, owners = direct_rows.masked_step(direct[0], topk, req_ids, rows_per_request)
        req = step_requests(manager, hot_rows, managed, owners, stable_len, step, rows_per_request, capacity)
        direct_rows.copy_step_positions(host, hot, hot_rows, direct[1], token_table, direct[2])
    else:
        req = step_requests(manager, hot_rows, topk, req_ids, stable_len, step, rows_per_request, capacity)
    res = req.residency
    flat_idx = flat_hot_indices(req.slots, req.token_rows, hot.shape[1])
    if direct is not None:
        flat_idx = torch.where(
            query_mask[:, None, None],
            direct_rows.direct_flat(direct[2], topk, hot.shape[1], rows_per_request)[:, None, :],
            flat_idx,
        )

    def copy_rows(target: torch.Tensor, lists: ResidencyStep) -> None:
        if copy is None:
            misses = (lists.miss_tokens, lists.miss_slots, lists.miss_count)
            copy_miss_rows_rows(host, target, hot_rows, *misses, token_table)
        else:
            copy_stage(copy, host, target, hot_rows, lists, token_table)

    if copy_attention is not None:
        area = None
        if overflow_view is not None:  # copied beside the fused op, which reads the area's rows
            view = overflow.beside_copy_sfa(overflow_view, hot)
            flat_idx = overflow.serve(view, req.union, req.token_rows, flat_idx, copy_rows)
            area = view.area
        return fused_copy_attention(
            copy_attention, res, hot_rows, req_ids, host, hot, token_table, flat_idx, query, query_rope, scale, area
        ), res
    copy_rows(hot, res)
    kv = hot.view(-1, hot.shape[2])
    if overflow_view is not None:
        flat_idx = overflow.serve(overflow_view, req.union, req.token_rows, flat_idx, copy_rows)
        kv = overflow_view.kv
    if attention is None:
        from ..ops.reference import sparse_mla_attention as attention
    return attend_hot(attention, query, query_rope, kv, flat_idx, scale, latent_dim), res


def copy_stage(
    copy: OpImpl, host: torch.Tensor, hot: torch.Tensor, hot_rows: torch.Tensor, res: ResidencyStep, token_table
) -> None:
    """The miss-copy stage of the batch rows ``hot_rows`` int64 ``[B]`` with ``copy`` (the plan's
    ``copy_miss_rows``): its rows form where the rung has one (static shapes, the batch's
    rows only), else over every hot-buffer row's lists (:func:`full_rows_lists`, the
    other rows' counts zero). ``hot`` ``[R', H, D]``; ``res`` the batch's step."""
    if copy.rows_form is not None:
        copy.rows_form(host, hot, hot_rows, res.miss_tokens, res.miss_slots, res.miss_count, token_table)
        return
    tokens, slots, count, table = full_rows_lists(res, hot_rows, hot.shape[0], token_table)
    copy(host, hot, tokens, slots, count, table)


def attend_hot(
    attention: Callable,
    query: torch.Tensor,
    query_rope: torch.Tensor,
    flat_kv: torch.Tensor,
    flat_idx: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """Sparse MLA attention of ``query`` ``[B,N,latent]`` / ``query_rope`` ``[B,N,rope]``
    over the hot-buffer rows ``flat_idx`` int32 ``[B,1,K]`` of ``flat_kv`` ``[(R+1)*H,
    latent+rope]`` (latent columns first): the last stage of a decode layer step, eager
    or captured. Returns ``[B,N,latent]``."""
    return attention(
        query,
        flat_kv[:, :latent_dim],
        None,
        flat_idx,
        scale,
        query_rope=query_rope,
        key_rope=flat_kv[:, latent_dim:],
        layout_query="TND",
        layout_kv="flat",
    )


def full_rows_lists(res: ResidencyStep, hot_rows: torch.Tensor, state_rows: int, token_table: torch.Tensor):
    """Miss lists ``[R', K]`` / counts ``[R']`` / token table ``[R', max_ctx]`` over all
    ``R'`` state rows, from the batch rows' step (entry ``b`` of ``res`` for row ``hot_rows[b]``),
    for ops that index the hot buffer by their own row (the Triton copy, fused Copy-SFA):
    ``O(R)`` zeroed counts, ``O(B*K)`` scattered lists; static shapes."""
    k = res.miss_tokens.shape[1]
    dev = res.miss_count.device
    count = torch.zeros((state_rows,), dtype=torch.int32, device=dev).index_copy_(0, hot_rows, res.miss_count)
    tokens = torch.full((state_rows, k), -1, dtype=torch.int32, device=dev).index_copy_(0, hot_rows, res.miss_tokens)
    slots = torch.full((state_rows, k), -1, dtype=torch.int32, device=dev).index_copy_(0, hot_rows, res.miss_slots)
    table = token_table
    if table.shape[0] < state_rows:
        table = torch.cat([table, table.new_zeros((state_rows - table.shape[0], table.shape[1]))])
    return tokens, slots, count, table[:state_rows]


def fused_copy_attention(
    copy_sfa: Callable,
    res: ResidencyStep,
    hot_rows: torch.Tensor,
    req_ids: torch.Tensor,
    host: torch.Tensor,
    hot: torch.Tensor,
    token_table: torch.Tensor,
    flat: torch.Tensor,
    query: torch.Tensor,
    query_rope: torch.Tensor,
    scale: float,
    overflow_area: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Miss copy + attention of one layer as the fused Copy-SFA op: the batch rows' step
    ``res`` spread over all hot-buffer rows (``hot`` ``[R', H, D]``), padding entries
    (``req_ids < 0``) owning no row; with ``n = B*n / B`` query rows per entry (verify
    rows) all ``n`` own the entry's row. ``overflow_area`` ``[R', X, D]``: the overflow
    area (its rows already copied), which ``flat`` addresses from ``R' * H`` on
    (:func:`.overflow.beside_copy_sfa`). Static shapes; ``[B*n, N, latent]``."""
    tokens, slots, count, table = full_rows_lists(res, hot_rows, hot.shape[0], token_table)
    token_rows = torch.where(req_ids >= 0, hot_rows, torch.full_like(hot_rows, -1)).to(torch.int32)
    n = query.shape[0] // max(1, hot_rows.shape[0])
    if n > 1:
        token_rows = token_rows.repeat_interleave(n)
    # The extension takes contiguous tensors (the served queries are slices of q)
    return copy_sfa(
        query.contiguous(),
        host,
        hot,
        flat,
        scale,
        query_rope=query_rope.contiguous(),
        token_rows=token_rows,
        miss_tokens=tokens,
        miss_slots=slots,
        miss_count=count,
        token_table=table,
        overflow=None if overflow_area is None else overflow_area.view(-1, overflow_area.shape[-1]),
        tokens_per_row=max(1, n),
    )


@dataclass(frozen=True)
class EngineConfig:
    """Shape and choices of one engine (one DP rank's TP rank).

    rows: engine rows ``R`` (stable rows, e.g. ``req_to_token`` rows; a batch uses any
    subset). hot_tokens: slots per row and layer (``>= top_k``; a request's rows'
    union beyond them overflows into the overflow area, ``overflow.py``).
    rows_per_request: query rows per engine row and step (speculative verify rows;
    they share the row's hot buffer and residency). policy: residency
    policy name (``policies.POLICIES``). ops: operator-ladder choice. manage_impl:
    ``auto | kernel | torch`` (``policies.uses_cpu_kernel``). max_context: bound of the
    logical positions, sizes the CPU kernel's dense position map (default: the width
    of the first step's token table; a hash map beyond ``cpu_kernel.DENSE_MAP_LIMIT``).
    """

    layers: int
    rows: int
    hot_tokens: int
    top_k: int
    latent_dim: int = 512
    rope_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    policy: str = DEFAULT_POLICY
    ops: str = "auto"
    manage_impl: str = "auto"
    max_context: Optional[int] = None
    rows_per_request: int = 1
    #: shadow verification (:mod:`.shadow`): probability per layer step of checking one
    #: row against a recomputation over the host pool (0 = off), and what a mismatch does
    verify_sample_rate: float = 0.0
    verify_action: str = "log"
    #: the fused Copy-SFA operator for the step's miss copy + attention: ``True`` requires
    #: it (an error where it cannot serve), ``False`` runs the separate copy and attention,
    #: ``None``: fused with ``ops=fused``, and with ``ops=auto`` on an NPU where it can serve
    #: (one query token per hot-buffer row, a host pool with a tensor view); see
    #: :func:`.op_selection.select_ops`
    fused_copy_sfa: Optional[bool] = None
    #: the fused indexer (LIM / LIM-C8) for the indexer + residency stage, chosen as
    #: ``fused_copy_sfa`` is, where the caller runs the indexer (``caller_runs_indexer``):
    #: the engine does not run it; its caller runs the fused op with
    #: :meth:`SparseDecodeEngine.indexer_residency` and hands the step to
    #: :meth:`SparseDecodeEngine.run_layer` (``residency=``). A caller that hands the
    #: engine top-k from elsewhere (a trace replay) leaves ``caller_runs_indexer`` false.
    fused_lim: Optional[bool] = None
    caller_runs_indexer: bool = False
    #: the dtype of the index-K cache whose top-k the engine is given (``bf16`` or ``int8``,
    #: LIM-C8); the engine does not run the indexer, it names it in its logged operator plan
    indexer_dtype: str = "bf16"
    #: ``always``: every request reads its main KV through the residency (hot buffer + the
    #: policy); ``adaptive``: a request whose context fits its hot buffer is served from it
    #: directly, with no residency lookups or miss copies, and is demoted in place the step
    #: it outgrows it (:mod:`.direct_rows`; policy ``lru``, not with the fused indexer)
    residency: str = "always"

    def __post_init__(self):
        problems = []
        if self.residency not in direct_rows.RESIDENCY_MODES:
            problems.append(f"residency must be one of {direct_rows.RESIDENCY_MODES}, got {self.residency!r}")
        elif self.residency == "adaptive" and self.policy != "lru":
            problems.append(
                f"residency 'adaptive' demotes a request into the exact-LRU state; policy "
                f"{self.policy!r} is not lru: use policy lru or residency 'always'"
            )
        if not 0.0 <= self.verify_sample_rate <= 1.0:
            problems.append(f"verify_sample_rate must be in [0, 1], got {self.verify_sample_rate}")
        for name in ("layers", "rows", "hot_tokens", "top_k", "latent_dim", "rows_per_request"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.hot_tokens < self.top_k:
            problems.append(f"hot_tokens {self.hot_tokens} must be >= top_k {self.top_k}")
        if problems:
            raise ValueError("invalid sparse decode engine config: " + "; ".join(problems))

    @property
    def row_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def overflow_slots(self) -> int:
        """Overflow-area rows per engine row (``sizing.overflow_slots``; 0 = none)."""
        return overflow_slots(self.top_k, self.hot_tokens, self.rows_per_request)


@dataclass
class LayerResult:
    """Output of one layer step: attention output ``[B*n, N, latent]`` per query row,
    the residency step per request (``[B, ...]``; width ``K``, or ``n*K`` for the union
    when ``rows_per_request = n > 1``), and the remapped indices int32 ``[B*n, 1, K]``
    into the flat hot buffer of all ``R + 1`` rows (``rows[b] * H + slot`` for the
    query rows of request ``b``)."""

    output: torch.Tensor
    residency: ResidencyStep
    flat_indices: torch.Tensor


@dataclass
class PhaseTimes:
    """Wall seconds spent per phase (only measured when ``timing=True``)."""

    seconds: Dict[str, float] = field(
        default_factory=lambda: {"append": 0.0, "manage": 0.0, "copy": 0.0, "attention": 0.0}
    )

    def add(self, phase: str, dt: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + dt


class SparseDecodeEngine:
    """Hot buffers + residency managers + statistics for all layers of one rank.

    ``pool``: the DP rank's host pool (:class:`~.host_rows.HostRows`: a :class:`HostKVPool`,
    or a pool without a tensor view whose misses go through its ``gather_into``). ``tp_rank``: 0 writes new rows and
    publishes them on ``gate``; other ranks wait on ``gate`` (required when
    ``tp_rank > 0``) before reading the host pool.
    """

    def __init__(
        self,
        config: EngineConfig,
        pool: HostKVPool,
        device=None,
        *,
        tp_rank: int = 0,
        gate: Optional[AppendGate] = None,
        gate_timeout_s: float = 30.0,
        timing: bool = False,
    ):
        if pool.shape.layers != config.layers or pool.shape.row_dim != config.row_dim:
            raise ValueError(f"host pool {pool.shape} does not match engine config {config}")
        if pool.shape.dtype != config.dtype:
            raise ValueError(f"host pool dtype {pool.shape.dtype} != engine dtype {config.dtype}")
        if tp_rank > 0 and gate is None:
            raise ValueError("TP ranks > 0 read rows that TP rank 0 appends: pass the shared AppendGate")
        self.config = config
        self.pool = pool
        self.device = torch.device(device) if device is not None else platform.default_device()
        self.tp_rank = tp_rank
        self.gate = gate
        self.gate_timeout_s = gate_timeout_s
        self.timing = timing
        self.times = PhaseTimes()

        registry.ensure_registered()
        self._tensor_pool = is_tensor_backed(pool)
        self._copy_sfa_op = self._choose_copy_sfa(config)
        # Every op the engine calls is the plan's (op_selection.OpPlan.impl): nothing else decides.
        self._manage_op = self.plan.impl("residency_manage")
        self._copy_op = self.plan.impl("copy_miss_rows")
        self._attention_op = self.plan.impl("sparse_mla_attention")
        if self._tensor_pool and self._copy_sfa_op is None and self._copy_op.rung == "fused":
            self._register_for_fused_copy()
        self.hot = HotBuffers(
            config.layers,
            config.rows,
            config.hot_tokens,
            config.row_dim,
            config.dtype,
            self.device,
            overflow_slots=config.overflow_slots,
        )
        self.sink_row = self.hot.sink_row
        state_rows = config.rows + 1
        self.uses_cpu_kernel = self.plan.residency_stage().via == "cpu kernel"  # the policy's CPU kernel
        self.managers: List[ResidencyManager] = [
            make_manager(
                config.policy,
                state_rows,
                config.hot_tokens,
                self.device,
                self._manage_op,
                manage_impl="kernel" if self.uses_cpu_kernel else "torch",
                max_positions=config.max_context,
            )
            for _ in range(config.layers)
        ]
        if self.plan.rung("copy_miss_rows").via == "cpu kernel":
            # the reference rung's rows form on the CPU kernel: it copies exactly the misses
            # (bit-identical), eager and captured
            from . import cpu_kernel

            self._copy_op = replace(self._copy_op, rows_form=cpu_kernel.copy_miss_rows_rows)
        self.stats_acc = StatsAccumulator(config.layers, pool.shape.row_bytes, self.device)
        self.shadow: Optional[ShadowVerifier] = (
            ShadowVerifier(config.verify_sample_rate, config.verify_action, seed=tp_rank)
            if config.verify_sample_rate > 0
            else None
        )
        self.direct: Optional[direct_rows.DirectRows] = (
            direct_rows.DirectRows(state_rows, config.hot_tokens) if config.residency == "adaptive" else None
        )
        self._direct_step: Optional[direct_rows.DirectStep] = None
        self._empty_steps: Dict[Tuple[int, int], ResidencyStep] = {}
        self.step_index = -1
        self._hot_rows: Optional[torch.Tensor] = None
        self._req_ids: Optional[torch.Tensor] = None
        self._stable_len: Optional[torch.Tensor] = None
        self._token_table: Optional[torch.Tensor] = None
        self._batch = 0
        self._per_request = 1

    # ---------------------------------------------------------------------- a step
    def _choose_copy_sfa(self, config: EngineConfig):
        """The fused Copy-SFA op for the step's miss copy + attention, or ``None`` for the
        separate copy and attention: what :func:`.op_selection.select_ops` plans for this
        engine (``self.plan``; a plan with problems is an :class:`~.op_selection.OpSelectionError`)."""
        from ..ops import fused

        op = registry.implementations("copy_sparse_flash_attention")["fused"]
        kernels = op.fn is fused.copy_sparse_flash_attention_fused  # (not a test's stand-in)
        # the kernels' residency-shape limits (a stand-in registered in their place has its own)
        shape = dict(hot_tokens=config.hot_tokens, top_k=config.top_k) if kernels else {}
        self.plan = op_selection.select_ops(
            op_selection.platform_of(self.device),
            ops=config.ops,
            fused_lim=config.fused_lim,
            fused_copy_sfa=config.fused_copy_sfa,
            rows_per_request=config.rows_per_request,
            tensor_pool=self._tensor_pool,
            indexer_wired=config.caller_runs_indexer,
            policy=config.policy,
            indexer_dtype=config.indexer_dtype,
            residency=config.residency,
            manage_impl=config.manage_impl,
            **shape,
        ).check()
        op_selection.log_plan(self.plan, "sparse decode engine")
        if not self.plan.attention.fused:
            return None
        if self._tensor_pool and (kernels or self.plan.platform == "npu"):
            self._check_host_alignment()
        if self._tensor_pool and kernels:  # register every layer's slice now, outside any captured step
            self._register_host_layers()
        return op

    def _register_for_fused_copy(self) -> None:
        """The fused miss copy reads registered host memory as Copy-SFA does: the same
        alignment rule, and (the extension's kernel, not a test's stand-in) every layer's
        slice registered now, outside any captured step."""
        from ..ops import fused

        kernel = self._copy_op.fn is fused.copy_miss_rows_fused  # (not a test's stand-in)
        if kernel or self.plan.platform == "npu":
            self._check_host_alignment()
        if kernel:
            self._register_host_layers()

    def _register_host_layers(self) -> None:
        """Register each layer's host slice with the fused Copy-SFA's extension (startup
        phase ``host-pool registration``: ``aclrtHostRegister`` on an NPU, with progress)."""
        from ..ops import fused

        shape = self.pool.shape
        with startup_phases.phase(
            "host-pool registration",
            total_bytes=shape.nbytes,
            detail=f"{shape.layers} layer slices for the fused Copy-SFA",
            fix='check host registration (env --npu-check: host_register) or set "fused_copy_sfa": false',
        ) as progress:
            for layer in range(shape.layers):
                fused.register_host_memory(self.pool.layer(layer))
                progress.add(shape.tokens * shape.row_bytes)

    def _check_host_alignment(self) -> None:
        """The extension registers each layer's host slice with ``aclrtHostRegister`` (the
        functional model holds the same rule), which needs it to start 4 KiB-aligned."""
        shape = self.pool.shape
        if shape.tokens * shape.row_bytes % op_selection.HOST_ALIGN_BYTES:
            align = op_selection.host_rows_alignment(shape.row_bytes)
            raise ValueError(
                f"the fused Copy-SFA registers each layer's slice of the host pool, which must start "
                f"{op_selection.HOST_ALIGN_BYTES} B-aligned: {shape.tokens} rows per layer x "
                f"{shape.row_bytes} B is not; size the pool to a multiple of {align} rows "
                f"({op_selection.fused_host_pool_rows(shape.tokens, shape.row_bytes)}, "
                "op_selection.host_pool_rows) or set fused_copy_sfa to false"
            )

    def begin_step(
        self,
        req_ids: torch.Tensor,
        token_table: torch.Tensor,
        stable_len: torch.Tensor,
        step: Optional[int] = None,
        *,
        rows: Optional[torch.Tensor] = None,
        rows_per_request: Optional[int] = None,
        context_len: Optional[torch.Tensor] = None,
        captured: bool = False,
        free_rows: Optional[Callable[[], List[int]]] = None,
    ) -> int:
        """Set the batch of the next decode step; returns its step number.

        rows int64 ``[B]``: engine row per batch entry (``-1`` padding); default every
        engine row. req_ids int64 ``[B]``, stable_len int32 ``[B]``; token_table int32
        ``[T, max_ctx]`` indexed by engine row. rows_per_request: query rows per entry
        this step (``1 ..`` the configured ``rows_per_request``, its default; a plain
        decode step of a speculative server has 1). context_len int ``[B]``: the positions
        each entry's query rows may read (``residency = adaptive`` only; default
        ``stable_len``, or ``stable_len + n`` with ``n > 1`` verify rows). captured: the
        step's layers run as :func:`decode_layer_step` in a device graph (with
        ``residency = adaptive`` its direct rows' copies are split: :meth:`direct_step`).
        free_rows: returns the engine rows no request holds now (SGLang's free
        ``req_to_token`` rows), whose hot buffers a direct request may borrow
        (``residency = adaptive``; read only when needed; ``None``: none). Host-side metadata: the only place the
        step's shapes are checked.
        """
        n = self.config.rows_per_request if rows_per_request is None else int(rows_per_request)
        if not 1 <= n <= self.config.rows_per_request:
            raise ValueError(
                f"rows_per_request {n} is outside 1..{self.config.rows_per_request} (the engine's "
                "overflow area is sized for the union of at most that many rows' top-k)"
            )
        self._per_request = n
        r = self.config.rows
        if rows is None:
            rows = torch.arange(r, dtype=torch.int64)
        if rows.dim() != 1:
            raise ValueError(f"rows must be 1-D [B], got {tuple(rows.shape)}")
        b = rows.shape[0]
        if tuple(req_ids.shape) != (b,) or tuple(stable_len.shape) != (b,):
            raise ValueError(f"req_ids {tuple(req_ids.shape)} / stable_len {tuple(stable_len.shape)} must be [{b}]")
        if context_len is not None and tuple(context_len.shape) != (b,):
            raise ValueError(f"context_len {tuple(context_len.shape)} must be [{b}]")
        if token_table.dim() != 2:
            raise ValueError(f"token_table must be [rows, max_ctx], got {tuple(token_table.shape)}")
        step = self.step_index + 1 if step is None else int(step)
        if step <= self.step_index:
            raise ValueError(f"step {step} is not after the previous step {self.step_index}")
        if self.step_index < 0 and self.uses_cpu_kernel and self.config.max_context is None:
            # Nothing is resident yet: size the kernel's dense position map from the token
            # table's width (its positions' bound) now that it is known.
            self.managers = [
                make_manager(
                    self.config.policy,
                    self.config.rows + 1,
                    self.config.hot_tokens,
                    self.device,
                    self._manage_op,
                    manage_impl="kernel",
                    max_positions=token_table.shape[1],
                )
                for _ in range(self.config.layers)
            ]
        self.step_index = step
        rows = rows.to(torch.int64)
        pad = rows < 0
        padded = bool(pad.any())
        if padded:  # padding entries: the sink row, no owner, nothing stable
            self._hot_rows = torch.where(pad, torch.full_like(rows, self.sink_row), rows).to(self.device)
            self._req_ids = torch.where(pad, torch.full_like(rows, -1), req_ids.to(torch.int64)).to(self.device)
            self._stable_len = torch.where(pad, torch.zeros_like(rows), stable_len.to(torch.int64)).to(
                self.device, torch.int32
            )
        else:
            self._hot_rows = rows.to(self.device)
            self._req_ids = req_ids.to(self.device, torch.int64)
            self._stable_len = stable_len.to(self.device, torch.int32)
        self._token_table = token_table if token_table.dtype == torch.int32 else token_table.to(torch.int32)
        self._batch = b
        self.stats_acc.record_step()
        self._direct_step = None
        if self.direct is not None:
            if context_len is not None and padded:
                context_len = torch.where(pad, torch.zeros_like(rows), context_len.to(torch.int64))
            self._begin_direct(n, context_len, captured, free_rows)
        return step

    def _begin_direct(
        self, n: int, context_len: Optional[torch.Tensor], captured: bool, free_rows: Optional[Callable[[], List[int]]]
    ) -> None:
        """``residency = adaptive``: plan the step's direct rows (:mod:`.direct_rows`) and
        demote the requests that leave them (every layer, before the first). A captured
        step's direct rows then get the context the host pool already holds."""
        if context_len is None:
            context_len = direct_rows.context_lengths(self._stable_len.cpu().numpy(), n)
        # the fused Copy-SFA reads each query token's own hot-buffer row only: no spans there
        self.direct.max_span = (
            1
            if self._copy_sfa_op is not None
            else direct_rows.span_width(self._token_table.shape[1], self.config.hot_tokens)
        )
        d = self.direct.plan(
            self._hot_rows,
            self._req_ids,
            self._stable_len,
            context_len,
            self.device,
            captured_width=n if captured else 0,
            free_rows=free_rows,
        )
        self._direct_step = d
        if d.demote_heads.numel():
            self._demote(d)  # before any copy: a demoted span's rows may be refilled by their new request
        row_bytes = self.pool.shape.row_bytes
        before = (d.copy_rows.numel() + d.step_copies) * row_bytes if captured else 0  # (host counts)
        for layer in range(self.config.layers):
            if captured:
                self._copy_positions(layer, d)
            self.stats_acc.record_direct(layer, d.direct_count, before, 0, d.lent_now, d.reclaimed)

    @property
    def direct_step(self) -> Optional[direct_rows.DirectStep]:
        """The current step's direct-row plan (``residency = adaptive``; else ``None``). A
        captured step passes ``(mask, step_pos, span_rows)`` to :func:`decode_layer_step`
        (``direct``)."""
        return self._direct_step

    def _demote(self, d: direct_rows.DirectStep) -> None:
        """Hand each demoted request's kept positions (its most recent resident ones,
        ``demote_pos``, now at ``demote_src``) to its layer managers: one manager step on
        its row takes them as misses (stamped with the previous step, older than this
        step's), and the rows move on the device into the slots it chose. No host read."""
        heads = d.demote_heads.to(self.device)
        topk = d.demote_pos.to(self.device)
        src_all = d.demote_src.to(self.device)
        h = self.config.hot_tokens
        for layer, manager in enumerate(self.managers):
            res = manager.step_rows(
                heads,
                topk,
                d.demote_req.to(self.device),
                d.demote_stable.to(self.device, torch.int32),
                self.step_index - 1,
            )
            # the row was reset (its owner was idle to the manager), so every kept position is a
            # miss, in top-k order: miss j is demote_pos[:, j], now at demote_src[:, j]
            live = torch.arange(h, device=self.device)[None, :] < res.miss_count[:, None].to(self.device)
            src = src_all[live]
            dst = ((heads * h)[:, None] + res.miss_slots.to(self.device, torch.int64))[live]
            flat = self.hot.storage(layer).view(-1, self.config.row_dim)
            flat.index_copy_(0, dst, flat.index_select(0, src))
            self.stats_acc.record_direct(layer, 0, 0, int(heads.numel()))

    def _copy_positions(self, layer: int, d: direct_rows.DirectStep) -> None:
        """Host -> hot buffer: ``hot[copy_dst[i]] = pool[token_table[copy_rows[i], copy_pos[i]]]``
        (a direct request's context, into its span)."""
        if d.copy_rows.numel() == 0:
            return
        if d.copy_host is None:  # the same for every layer: looked up once per step
            table = self._token_table
            d.copy_host = table[d.copy_rows.to(table.device), d.copy_pos.to(table.device)].to(torch.int64)
        host_slots = d.copy_host
        hot = self.hot.storage(layer)
        dst = d.copy_dst.to(self.device)
        flat = hot.view(-1, hot.shape[-1])
        if self._tensor_pool:
            host = self.pool.layer(layer)
            flat.index_copy_(0, dst, host.index_select(0, host_slots.to(host.device)).to(self.device))
        else:
            self.pool.gather_into(layer, host_slots, flat, dst)

    def append(self, layer: int, host_slots: torch.Tensor, kv_rows: torch.Tensor) -> None:
        """New-token main-KV rows ``kv_rows`` ``[n, D]`` of ``layer`` -> host slots ``[n]``
        (TP rank 0 only; a no-op on other ranks, whose copy of the rows is TP rank 0's)."""
        if self.tp_rank != 0:
            return
        t0 = time.perf_counter()
        nbytes = self.pool.write_rows(layer, host_slots, kv_rows)
        self.stats_acc.record_d2h(layer, nbytes)
        if self.timing:
            self.times.add("append", time.perf_counter() - t0)

    def set_ranked(self, layer: int, ranked: torch.Tensor) -> None:
        """Hand a score policy this step's ranking of ``layer``: int32 ``[B*n, D]`` per
        query row (merged per request when ``rows_per_request = n > 1``)."""
        n = self._per_request
        ranked = ranked.to(self.device, torch.int32)
        self.managers[layer].set_ranked(ranked if n == 1 else merge_ranked(ranked, n))

    def indexer_residency(self, layer: int, num_tokens: int) -> fused_indexer.ResidencyArgs:
        """The residency arguments of a fused indexer call (LIM / LIM-C8) for ``layer`` of
        this step, over ``num_tokens`` query tokens (batch entries first). The operator
        steps the layer's state in place; pass its all-rows step to :meth:`run_layer`."""
        if self._req_ids is None:
            raise RuntimeError("begin_step() must be called before indexer_residency()")
        manager = self.managers[layer]
        fused_indexer.check_manager(manager)
        return fused_indexer.residency_args(
            manager, self._hot_rows, self._req_ids, self._stable_len, self.step_index, num_tokens, self._per_request
        )

    def run_layer(
        self,
        layer: int,
        topk: torch.Tensor,
        query: torch.Tensor,
        query_rope: torch.Tensor,
        scale: float,
        residency: Optional[ResidencyStep] = None,
    ) -> LayerResult:
        """Residency, miss copy, remap and sparse attention of ``layer`` for the batch rows.

        topk int32 ``[B*n, K]``, query ``[B*n, N, latent]`` (``n`` = the step's
        ``rows_per_request``, request-major); the residency step is per request.
        residency: the step a fused indexer already took (its all-rows ``[R+1, ...]``
        result, :meth:`indexer_residency`); ``None`` steps the layer's manager here."""
        if self._req_ids is None:
            raise RuntimeError("begin_step() must be called before run_layer()")
        cfg = self.config
        n = self._per_request
        if tuple(topk.shape) != (self._batch * n, cfg.top_k):
            raise ValueError(
                f"topk must be [{self._batch * n}, {cfg.top_k}] ({self._batch} requests x {n} rows), "
                f"got {tuple(topk.shape)}"
            )
        self._sync_with_writer(layer)

        t0 = self._tick()
        topk_dev = topk.to(self.device, torch.int32)
        d = self._direct_step
        if d is not None and d.step_pos is not None:
            raise RuntimeError(
                "this step was begun as a captured step: its layers run as decode_layer_step "
                "with the step's direct plan (direct_step)"
            )
        if d is not None and d.all_direct and residency is None:
            return self._run_direct_layer(layer, topk_dev, query, query_rope, scale, t0)
        h = cfg.hot_tokens
        if residency is not None:
            req = fused_request_step(residency, self._hot_rows, topk_dev, n, h)
        elif d is not None and d.any_direct:  # direct rows: idle to the manager, read through their spans
            query_direct, managed, owners = direct_rows.masked_step(d.mask, topk_dev, self._req_ids, n)
            req = step_requests(
                self.managers[layer], self._hot_rows, managed, owners, self._stable_len, self.step_index, n, h
            )
        else:
            req = step_requests(
                self.managers[layer], self._hot_rows, topk_dev, self._req_ids, self._stable_len, self.step_index, n, h
            )
        res = req.residency
        row_selected, row_hits = req.row_counts()
        if d is not None and d.copy_rows.numel():  # direct rows' positions not resident yet (after the append)
            self._copy_positions(layer, d)
            self.stats_acc.record_direct(layer, 0, d.copy_rows.numel() * self.pool.shape.row_bytes, 0)
        t1 = self._tick()
        flat = self.hot.flat_indices(req.slots, req.token_rows)
        if d is not None and d.any_direct:
            flat = torch.where(query_direct[:, None, None], d.flat_rows(topk_dev, cfg.hot_tokens, n)[:, None, :], flat)
        if self._copy_sfa_op is not None:  # fused Copy-SFA: copy + attention in one op (full-rows ABI)
            view, area = self.overflow_view(layer), None
            if view is not None:  # copied beside the fused op, which reads the area's rows
                view = overflow.beside_copy_sfa(view, self.hot.storage(layer))
                flat = overflow.serve(
                    view, req.union, req.token_rows, flat, lambda a, lists: self.copy_misses(layer, lists, into=a)
                )
                area = view.area
            out = self._fused_copy_attention(layer, res, flat, query, query_rope, scale, area)
            t2 = t1
        else:
            self.copy_misses(layer, res)
            flat = overflow.serve(
                self.overflow_view(layer),
                req.union,
                req.token_rows,
                flat,
                lambda area, lists: self.copy_misses(layer, lists, into=area),
            )
            t2 = self._tick()
            kv = self.hot.attention_flat(layer)
            out = attend_hot(self._attention_op, query, query_rope, kv, flat, scale, cfg.latent_dim)
        t3 = self._tick()
        if self.timing:
            self.times.add("manage", t1 - t0)
            self.times.add("copy", t2 - t1)
            self.times.add("attention", t3 - t2)

        hits = res.hit_mask.sum()
        misses = res.miss_count.sum(dtype=torch.int64)
        self.stats_acc.record_residency(layer, hits + misses, hits, misses, row_selected, row_hits)
        self.stats_acc.record_rows(layer, self._batch * n)
        if self.shadow is not None:
            self._shadow_check(layer, topk_dev, query, query_rope, scale, out)
        return LayerResult(output=out, residency=res, flat_indices=flat)

    def captured_layer_step(
        self,
        layer: int,
        rows: torch.Tensor,
        topk: torch.Tensor,
        req_ids: torch.Tensor,
        stable_len: torch.Tensor,
        step,
        host: torch.Tensor,
        token_table: torch.Tensor,
        query: torch.Tensor,
        query_rope: torch.Tensor,
        scale: float,
        *,
        rows_per_request: int = 1,
        residency: Optional[ResidencyStep] = None,
        direct=None,
    ) -> Tuple[torch.Tensor, ResidencyStep]:
        """:func:`decode_layer_step` of ``layer`` over this engine's residency state and hot
        buffer with its plan's ops (residency, miss copy, attention, or Copy-SFA): the
        captured form of :meth:`run_layer` (static shapes, no host reads; what a device
        graph records). Arguments as :func:`decode_layer_step`'s. A separate miss copy that
        reads the miss rows' host slots back (the npu / reference rung over host memory on a
        device) cannot be captured: refused with the fix (:meth:`_check_capturable_copy`)."""
        self._check_capturable_copy()
        return decode_layer_step(
            self.managers[layer],
            rows,
            topk,
            req_ids,
            stable_len,
            step,
            host,
            self.hot.storage(layer),
            token_table,
            query,
            query_rope,
            scale,
            self.config.latent_dim,
            attention=self._attention_op,
            rows_per_request=rows_per_request,
            residency=residency,
            copy_attention=self._copy_sfa_op,
            direct=direct,
            copy=self._copy_op,
            overflow_view=self.overflow_view(layer),
        )

    def _check_capturable_copy(self) -> None:
        """A captured step copies its misses (or, beside the fused Copy-SFA, its overflow
        rows) with the plan's ``copy_miss_rows``; on a device, over a host pool in host
        memory, its ``npu`` / ``reference`` rung gathers on the host with host slots read
        back from the device (torch_npu has no device-side read of host memory), which a
        graph capture refuses: say so, and what to do, before any capture starts."""
        uses_copy = self._copy_sfa_op is None or self.hot.overflow is not None
        rung = self._copy_op.rung
        if self.device.type == "cpu" or not self._tensor_pool or not uses_copy or rung not in ("npu", "reference"):
            return
        raise RuntimeError(
            f"a captured decode step on {self.device} cannot run the separate miss copy on the {rung} rung over "
            "a host pool in host memory: it reads the miss rows' host slots back to gather them on the host (a "
            "device->host read a graph capture refuses; torch_npu has no device-side read of host memory). Use "
            'the fused miss copy ("ops": "auto" or "fused" with the AscendC extension built: bash '
            "ascendc_ops/build.sh --install), or decode without graphs (--disable-cuda-graph)"
        )

    def overflow_view(self, layer: int) -> Optional[overflow.OverflowView]:
        """The overflow area as ``layer``'s step reads it (``None`` when no round can
        overflow: ``rows_per_request x top_k <= hot_tokens``); counted in the stats."""
        if self.hot.overflow is None:
            return None
        return overflow.OverflowView(
            area=self.hot.overflow,
            kv=self.hot.attention_flat(layer),
            base=self.hot.overflow_base(layer),
            counters=self.stats_acc.overflow_counters(layer),
        )

    def _run_direct_layer(
        self, layer: int, topk: torch.Tensor, query: torch.Tensor, query_rope: torch.Tensor, scale: float, t0: float
    ) -> LayerResult:
        """:meth:`run_layer` when every batch entry is direct (``residency = adaptive``): no
        residency manager at all (a direct request was never in its state), the copies into
        the spans, attention through them. The residency step returned is empty."""
        cfg, d, n = self.config, self._direct_step, self._per_request
        if d.copy_rows.numel():
            self._copy_positions(layer, d)
            self.stats_acc.record_direct(layer, 0, d.copy_rows.numel() * self.pool.shape.row_bytes, 0)
        t1 = self._tick()
        flat = d.flat_rows(topk, cfg.hot_tokens, n)[:, None, :]
        res = self._empty_step(self._batch, topk.shape[1] * n)
        if self._copy_sfa_op is not None:
            out = self._fused_copy_attention(layer, res, flat, query, query_rope, scale)
        else:
            out = attend_hot(self._attention_op, query, query_rope, self.hot.flat(layer), flat, scale, cfg.latent_dim)
        if self.timing:
            self.times.add("copy", t1 - t0)
            self.times.add("attention", self._tick() - t1)
        self.stats_acc.record_rows(layer, self._batch * n)
        if self.shadow is not None:
            self._shadow_check(layer, topk, query, query_rope, scale, out)
        return LayerResult(output=out, residency=res, flat_indices=flat)

    def _empty_step(self, batch: int, width: int) -> ResidencyStep:
        """:func:`.direct_rows.empty_step` of this shape, made once (nothing writes it) and
        shared by the layers and steps of an all-direct batch of that shape."""
        key = (batch, width)
        step = self._empty_steps.get(key)
        if step is None:
            if len(self._empty_steps) >= 64:  # batch sizes vary: keep the few in use
                self._empty_steps.clear()
            step = self._empty_steps[key] = direct_rows.empty_step(batch, width, self.device)
        return step

    def _shadow_check(
        self,
        layer: int,
        topk: torch.Tensor,
        query: torch.Tensor,
        query_rope: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Shadow verification of one sampled query row of this layer step (:mod:`.shadow`;
        a padding entry drawn is skipped)."""
        row = self.shadow.sample(out.shape[0])
        if row is None:
            return
        entry = row // self._per_request
        engine_row, owner = int(self._hot_rows[entry]), int(self._req_ids[entry])
        if engine_row < 0 or owner < 0:
            return
        result = self.shadow.check(
            layer=layer,
            batch_row=row,
            engine_row=engine_row,
            owner=owner,
            attention_op=self._attention_op,
            read_rows=lambda slots: self.pool.read_rows(layer, slots),
            latent_dim=self.config.latent_dim,
            topk_row=topk[row],
            token_row=self._token_table[engine_row],
            query=query[row],
            query_rope=query_rope[row],
            scale=scale,
            served=out[row],
            exact=self._copy_sfa_op is None,
        )
        self.stats_acc.record_shadow(layer, result.ok, result.seconds)

    def copy_misses(self, layer: int, res: ResidencyStep, into: Optional[torch.Tensor] = None) -> None:
        """Copy this step's misses of ``layer`` host -> hot buffer (rows form); ``into``
        ``[R', X, D]``: another target with the same row space (the overflow area)."""
        target = self.hot.storage(layer) if into is None else into
        if not self._tensor_pool:
            return self._gather_misses(layer, res, target)
        copy_stage(self._copy_op, self.pool.layer(layer), target, self._hot_rows, res, self._token_table)

    def _gather_misses(self, layer: int, res: ResidencyStep, hot: torch.Tensor) -> None:
        """Misses of ``layer`` through the pool's own gather (a pool without a tensor
        view): ``hot[rows[b], miss_slots[b, i]] = pool[token_table[rows[b], miss_tokens[b,
        i]]]`` for ``i < miss_count[b]``, exactly the entries the kernels write with a
        value change. Reads the miss lists on the host (eager only)."""
        k = res.miss_tokens.shape[1]
        table = self._token_table
        count = res.miss_count.to(table.device, torch.int64)
        live = torch.arange(k, device=table.device)[None, :] < count[:, None]
        rows = self._hot_rows.to(table.device)[:, None].expand(-1, k)[live]
        tokens = res.miss_tokens.to(table.device, torch.int64)[live]
        slots = res.miss_slots.to(table.device, torch.int64)[live]
        host_slots = table[rows, tokens].to(torch.int64)
        self.pool.gather_into(layer, host_slots, hot.view(-1, hot.shape[-1]), rows * hot.shape[1] + slots)

    def _fused_copy_attention(self, layer, res, flat, query, query_rope, scale, overflow_area=None):
        return fused_copy_attention(
            self._copy_sfa_op,
            res,
            self._hot_rows,
            self._req_ids,
            self.pool.layer(layer),
            self.hot.storage(layer),
            self._token_table,
            flat,
            query,
            query_rope,
            scale,
            overflow_area,
        )

    def _sync_with_writer(self, layer: int) -> None:
        if self.gate is None:
            return
        if self.tp_rank == 0:
            platform.synchronize()  # the D2H appends of this layer have landed
            self.gate.publish(self.step_index, layer)
        else:
            self.gate.wait(self.step_index, layer, self.gate_timeout_s)

    def _tick(self) -> float:
        if self.timing:
            platform.synchronize()
        return time.perf_counter()

    # ---------------------------------------------------------------------- views
    @property
    def attention_op(self) -> OpImpl:
        """The plan's ``sparse_mla_attention`` (the separate attention stage)."""
        return self._attention_op

    @property
    def copy_op(self) -> OpImpl:
        """The plan's ``copy_miss_rows`` (the separate miss-copy stage)."""
        return self._copy_op

    @property
    def copy_sfa_op(self) -> Optional[Callable]:
        """The fused Copy-SFA op the plan runs (``None``: the separate copy and attention)."""
        return self._copy_sfa_op

    @property
    def token_table(self) -> torch.Tensor:
        return self._token_table

    @property
    def batch_rows(self) -> Optional[torch.Tensor]:
        """int64 ``[B]`` engine rows of the current step (padding entries: the sink row)."""
        return self._hot_rows

    def table(self, layer: int) -> ResidencyTable:
        """Residency state of ``layer``'s real rows (views ``[R, ...]``, without the sink)."""
        t = self.managers[layer].table
        r = self.config.rows
        return ResidencyTable(t.slot_token[:r], t.slot_stamp[:r], t.row_req[:r])

    def stats(self, wait: bool = True) -> DecodeStats:
        """The counters (``wait=False``: without waiting for the device, see
        :meth:`.stats.StatsAccumulator.snapshot`)."""
        return self.stats_acc.snapshot(wait)
