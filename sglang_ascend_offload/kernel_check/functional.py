"""The kernels' logic on CPU: the functional model against the reference compositions.

Each case builds the inputs of one decode step, runs the kernel in the functional model
(:mod:`.model`: the kernel's own C++, its host tiling, its per-core loops and branches)
and the reference composition of ``sglang_ascend_offload/ops/fused.py`` on copies of
the same state, and compares:

* LIM / LIM-C8: ``topk_indices``, ``sparse_indices``, every residency output and the
  mutated state (``slot_token``, ``slot_stamp``, ``row_req``) **bit-exactly** (the
  residency half is given the reference indexer's top-k only through the comparison:
  the kernel computes its own). Indexer inputs are drawn on a grid where float32
  arithmetic is exact in any order (bf16 values ``i/4``, ``|i| <= 4``; int8 values
  ``|i| <= 15`` with power-of-two fp16 scales; weights ``j/8``, ``-4 <= j <= 8``), so the kernel's scores
  equal the reference's exactly and its top-k order, ties included, must too.
* Copy-SFA: the hot buffer after the miss copies bit-exactly (as int16 words, NaN
  garbage in unselected slots included), the attention output within
  ``ATTN_ATOL + ATTN_RTOL * |ref|`` (bf16 probabilities before P.V and a different
  summation order; ``max_abs_err`` is reported).

Scenarios: several steps of rows that churn between requests, go idle, keep a
speculative last position, rows shared by up to ``n`` query tokens (a request's
speculative verify rows: the row steps on the union of their top-k; Copy-SFA copies the
row's misses once for all of them), unions larger than the hot buffer (the step keeps the
first ``Hh`` positions by priority, the rest overflow; Copy-SFA then also reads rows of
the overflow area, ``R * Hh`` on), with padding query tokens (``token_rows == -1`` and tokens
past the last cumulative length), a repeated step (rows with no misses), ``sparse_mode``
0 and 3, a few simulated core counts (cores taking several tokens / rows) and vector
cores run in forward and reversed order (the result must not change), and one case per
kernel at the largest shape the tiling allows. See docs/fused_ops.md for what this does
not prove.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..ops import fused
from ..ops.contract import IndexerManageResult, ResidencyTable
from . import model as km
from .decode_rows import DecodeRows

ATTN_ATOL = fused.ATTENTION_ATOL  # the fused attention's stated tolerance (one home: ops/fused.py)
ATTN_RTOL = fused.ATTENTION_RTOL


@dataclass
class KernelResult:
    """Functional result of one kernel: ``cases`` compared, all bit-exact comparisons
    held (``bit_exact``), worst attention error (``max_abs_err``, 0.0 for index-only
    kernels), ``failures`` (human-readable), ``seconds``."""

    name: str
    cases: int = 0
    bit_exact: bool = True
    max_abs_err: float = 0.0
    failures: List[str] = field(default_factory=list)
    seconds: float = 0.0
    coverage: Dict[str, int] = field(default_factory=dict)

    def count(self, key: str, n: int) -> None:
        self.coverage[key] = self.coverage.get(key, 0) + int(n)

    @property
    def ok(self) -> bool:
        return self.cases > 0 and self.bit_exact and not self.failures


# ------------------------------------------------------------------ scenario
@dataclass(frozen=True)
class LimDims:
    rows: int = 6
    hot_tokens: int = 160
    top_k: int = 128
    index_heads: int = 8
    index_dim: int = 128
    block_size: int = 32
    max_len: int = 300
    padding_tokens: int = 2
    quantized: bool = False
    sparse_mode: int = 3
    tokens_per_row: int = 1  # n > 1: each request has up to n query tokens (verify rows) sharing its row
    min_len: Optional[int] = None  # shortest context (default: top_k / 2; 4200 at the largest shape)


@dataclass
class LimInputs:
    """One decode step's LIM / LIM-C8 inputs (CPU tensors), as the reference takes them.

    query bf16 ``[T, Hi, Di]`` (C8: int8); key bf16 ``[blocks, bs, 1, Di]`` (C8: int8);
    weights bf16 ``[T, Hi]``; query_scale fp16 ``[T, Hi]`` and key_scale fp16
    ``[blocks, bs, 1]`` (C8 only, else None); cu int32 ``[B]`` cumulative query lengths;
    kv_len int32 ``[B]``; block_table int32 ``[B, max_blocks]``; token_rows int32 ``[T]``
    (-1 = padding token); req_ids int64 ``[R]`` (-1 = idle row); stable int32 ``[R]``;
    step int; token_table int32 ``[R, max_len]`` (position -> host row, for Copy-SFA).
    """

    query: torch.Tensor
    key: torch.Tensor
    weights: torch.Tensor
    query_scale: Optional[torch.Tensor]
    key_scale: Optional[torch.Tensor]
    cu: torch.Tensor
    kv_len: torch.Tensor
    block_table: torch.Tensor
    token_rows: torch.Tensor
    req_ids: torch.Tensor
    stable: torch.Tensor
    step: int
    token_table: torch.Tensor


class Scenario:
    """Multi-step decode scenario with exact-arithmetic indexer inputs (module docstring);
    the rows churn as :class:`~.decode_rows.DecodeRows` does."""

    def __init__(
        self,
        dims: LimDims,
        seed: int,
        churn: float = 0.25,
        idle: float = 0.2,
        spec: float = 0.3,
        min_len: Optional[int] = None,
    ):
        self.d = dims
        self.g = torch.Generator().manual_seed(seed)
        min_len = min_len if min_len is not None else max(1, dims.top_k // 2)
        nb = -(-dims.max_len // dims.block_size)
        n_blocks = nb * dims.rows * 3 + 1
        shape = (n_blocks, dims.block_size, 1, dims.index_dim)
        if dims.quantized:
            self.key = torch.randint(-15, 16, shape, generator=self.g, dtype=torch.int8)
            exp = torch.randint(-7, -2, (n_blocks, dims.block_size, 1), generator=self.g)
            self.key_scale = torch.pow(2.0, exp.to(torch.float32)).to(torch.float16)
        else:
            self.key = (torch.randint(-4, 5, shape, generator=self.g).to(torch.float32) / 4).to(torch.bfloat16)
            self.key_scale = None
        self.host_rows = 4 * dims.rows * dims.max_len
        self.rows = DecodeRows(
            self.g,
            rows=dims.rows,
            max_len=dims.max_len,
            block_size=dims.block_size,
            n_blocks=n_blocks,
            host_slots=self.host_rows,
            churn=churn,
            idle=idle,
            spec=spec,
            first_rid=10,
            draw_length=lambda g: int(torch.randint(min_len, max(min_len + 1, dims.max_len * 2 // 3), (), generator=g)),
        )
        self.step = -1

    def advance(self) -> None:
        self.rows.advance()

    def inputs(self) -> LimInputs:
        """The next step's inputs (call :meth:`advance` first to move the rows on)."""
        d = self.d
        self.step += 1
        order = self.rows.token_order()
        n_tok = len(order) + d.padding_tokens
        # padding tokens: unmanaged tokens past the last cumulative length (token_rows == -1)
        lay = self.rows.layout(order, d.padding_tokens)
        query, query_scale, weights = self._draw_queries(n_tok)
        req_ids, stable, token_table = self.rows.row_state()
        inp = LimInputs(
            query=query,
            key=self.key,
            weights=weights,
            query_scale=query_scale,
            key_scale=self.key_scale,
            cu=lay.cu,
            kv_len=lay.kv_len,
            block_table=lay.block_table,
            token_rows=lay.token_rows,
            req_ids=req_ids,
            stable=stable,
            step=self.step,
            token_table=token_table,
        )
        return self._verify_rows(inp, len(order)) if d.tokens_per_row > 1 else inp

    def _draw_queries(self, n_tok: int):
        """``(query, query_scale, weights)`` of ``n_tok`` tokens on the exact-arithmetic grid
        (module docstring); ``query_scale`` is ``None`` for the bf16 indexer. Negative
        weights too: negative scores are real positions (only the sentinel is not)."""
        d = self.d
        hi, di = d.index_heads, d.index_dim
        if d.quantized:
            query = torch.randint(-15, 16, (n_tok, hi, di), generator=self.g, dtype=torch.int8)
            exp = torch.randint(-7, -2, (n_tok, hi), generator=self.g)
            query_scale = torch.pow(2.0, exp.to(torch.float32)).to(torch.float16)
        else:
            query = (torch.randint(-4, 5, (n_tok, hi, di), generator=self.g).to(torch.float32) / 4).to(torch.bfloat16)
            query_scale = None
        weights = (torch.randint(-4, 9, (n_tok, hi), generator=self.g).to(torch.float32) / 8).to(torch.bfloat16)
        return query, query_scale, weights

    def _verify_rows(self, inp: LimInputs, n_real: int) -> LimInputs:
        """The step with speculative verify rows: request ``b`` gets ``c_b`` query tokens
        (``n``, one random request ``n - 1``, at least 1), all owning its row, the last one
        seeing the whole context and each earlier one a position less (``sparse_mode`` 3);
        the row's committed length leaves its last ``c_b - 1`` positions speculative (one
        more, sometimes). Queries and weights are drawn again for the new tokens."""
        d, n = self.d, self.d.tokens_per_row
        counts = [n] * n_real
        if n_real:
            counts[int(torch.randint(n_real, (), generator=self.g))] = max(1, n - 1)
        rows_of = inp.token_rows[:n_real].tolist()
        token_rows = [r for r, c in zip(rows_of, counts) for _ in range(c)] + [-1] * d.padding_tokens
        n_tok = len(token_rows)
        cu = torch.cumsum(torch.tensor(counts or [0], dtype=torch.int32), 0).to(torch.int32)
        query, query_scale, weights = self._draw_queries(n_tok)
        stable = inp.stable.clone()
        for b, (r, c) in enumerate(zip(rows_of, counts)):
            length = int(inp.kv_len[b])
            stable[r] = max(0, length - (c - 1) - int(torch.rand((), generator=self.g) < 0.3))
        return dataclasses.replace(
            inp,
            query=query,
            weights=weights,
            query_scale=query_scale,
            cu=cu,
            token_rows=torch.tensor(token_rows, dtype=torch.int32),
            stable=stable,
        )


# ------------------------------------------------------------------- LIM
def _reference_lim(inp: LimInputs, table: ResidencyTable, dims: LimDims) -> IndexerManageResult:
    common = dict(
        actual_seq_lengths_query=inp.cu,
        actual_seq_lengths_key=inp.kv_len,
        block_table=inp.block_table,
        token_rows=inp.token_rows,
        req_ids=inp.req_ids,
        stable_len=inp.stable,
        step=inp.step,
        slot_token=table.slot_token,
        slot_stamp=table.slot_stamp,
        row_req=table.row_req,
        sparse_count=dims.top_k,
        sparse_mode=dims.sparse_mode,
        tokens_per_row=dims.tokens_per_row,
    )
    if dims.quantized:
        return fused.quant_lightning_indexer_manage(
            inp.query, inp.key, inp.weights, inp.query_scale, inp.key_scale, **common
        )
    return fused.lightning_indexer_manage(inp.query, inp.key, inp.weights, **common)


_POISON = -7  # outputs start as this; a value the kernel forgot to write shows up


def _model_lim(
    m: km.KernelModel, inp: LimInputs, table: ResidencyTable, dims: LimDims, core_order: Optional[List[int]] = None
) -> Tuple[Dict[str, torch.Tensor], km.Launch]:
    t = inp.token_rows.shape[0]
    r, hh = table.slot_token.shape
    k, w = dims.top_k, fused.union_width(hh, dims.top_k, dims.tokens_per_row)
    launch = m.tile_lim(
        tokens=t,
        requests=inp.cu.shape[0],
        index_heads=dims.index_heads,
        index_dim=dims.index_dim,
        block_size=dims.block_size,
        max_blocks=inp.block_table.shape[1],
        rows=r,
        hot_tokens=hh,
        top_k=k,
        sparse_mode=dims.sparse_mode,
        quantized=dims.quantized,
        tokens_per_row=dims.tokens_per_row,
    )
    i32 = torch.int32
    out = dict(
        topk=torch.full((t, 1, k), _POISON, dtype=i32),
        sparse=torch.full((t, 1, k), _POISON, dtype=i32),
        hit_mask=torch.full((r, w), 7, dtype=torch.uint8),
        slots=torch.full((r, w), _POISON, dtype=i32),
        miss_count=torch.full((r,), _POISON, dtype=i32),
        miss_tokens=torch.full((r, w), _POISON, dtype=i32),
        miss_slots=torch.full((r, w), _POISON, dtype=i32),
    )
    step = torch.tensor([inp.step], dtype=torch.int64)
    head = [inp.query, inp.key, inp.weights]
    if dims.quantized:
        head += [inp.query_scale.contiguous(), inp.key_scale.contiguous()]
    args = head + [
        inp.cu,
        inp.kv_len,
        inp.block_table,
        inp.token_rows,
        inp.req_ids,
        inp.stable,
        step,
        table.slot_token,
        table.slot_stamp,
        table.row_req,
        out["topk"],
        out["sparse"],
        out["hit_mask"],
        out["slots"],
        out["miss_count"],
        out["miss_tokens"],
        out["miss_slots"],
    ]
    m.run(km.LIM_C8 if dims.quantized else km.LIM, args, launch, core_order)
    return out, launch


def _compare_lim(
    got: Dict[str, torch.Tensor], ref: IndexerManageResult, t_got: ResidencyTable, t_ref: ResidencyTable
) -> List[str]:
    bad = []
    pairs = [
        ("topk_indices", got["topk"], ref.topk_indices),
        ("sparse_indices", got["sparse"], ref.sparse_indices),
        (
            "hit_mask",
            got["hit_mask"].to(torch.bool) if got["hit_mask"].max() <= 1 else got["hit_mask"],
            ref.residency.hit_mask,
        ),
        ("slots", got["slots"], ref.residency.slots),
        ("miss_count", got["miss_count"], ref.residency.miss_count),
        ("miss_tokens", got["miss_tokens"], ref.residency.miss_tokens),
        ("miss_slots", got["miss_slots"], ref.residency.miss_slots),
        ("slot_token", t_got.slot_token, t_ref.slot_token),
        ("slot_stamp", t_got.slot_stamp, t_ref.slot_stamp),
        ("row_req", t_got.row_req, t_ref.row_req),
    ]
    for name, a, b in pairs:
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            where = ""
            if a.shape == b.shape and a.dtype == b.dtype:
                idx = torch.nonzero(a != b)
                where = (
                    f" first difference at {idx[0].tolist()}: kernel {a[tuple(idx[0])].item()} vs "
                    f"reference {b[tuple(idx[0])].item()} ({idx.shape[0]} entries differ)"
                )
            else:
                where = f" kernel {a.dtype}{tuple(a.shape)} vs reference {b.dtype}{tuple(b.shape)}"
            bad.append(f"{name} differs:{where}")
    return bad


def _lim_configs(quantized: bool, seed: int, largest: bool) -> List[Tuple[LimDims, int, int]]:
    """``(dims, cube cores, seed)`` of every LIM / LIM-C8 scenario (module docstring)."""
    q = quantized
    configs = [
        (LimDims(quantized=q), 24, seed),  # many cores: one token each
        (LimDims(quantized=q, sparse_mode=0, block_size=64, hot_tokens=128), 1, seed + 1),  # 2 cores
        (LimDims(quantized=q, top_k=32, hot_tokens=64, rows=5, max_len=120, index_heads=16), 2, seed + 2),
        # verify rows: up to n query tokens share a row, which steps on the union of their top-k
        (LimDims(quantized=q, tokens_per_row=2, hot_tokens=256), 24, seed + 4),
        (
            LimDims(quantized=q, tokens_per_row=3, top_k=32, hot_tokens=128, rows=5, max_len=120, sparse_mode=0),
            2,
            seed + 5,
        ),
        # unions beyond the hot buffer: 4 rows x top-k 64 over 128 slots (plain decode's 2 x top-k), and
        # 3 x 32 over 32 (the least): the first W = Hh positions by priority, the rest overflow
        (LimDims(quantized=q, tokens_per_row=4, top_k=64, hot_tokens=128, rows=5, max_len=300), 24, seed + 7),
        (LimDims(quantized=q, tokens_per_row=3, top_k=32, hot_tokens=32, rows=4, max_len=120), 2, seed + 8),
    ]
    if largest:
        big = dict(quantized=q, rows=2, hot_tokens=4096, top_k=2048, index_heads=64, block_size=128, max_len=6144)
        configs.append((LimDims(**big, padding_tokens=1), 1, seed + 3))
        # DeepSeek-V3.2 with one draft token: two verify rows per request, union 4096 = Hh
        configs.append((LimDims(**big, padding_tokens=1, tokens_per_row=2), 1, seed + 6))
        # DeepSeek-V3.2 at MTP-3: four verify rows over plain decode's 4096 slots; 6400-position contexts, so
        # the rows' unions (~4,300-4,900 positions) exceed the buffer and overflow
        mtp3 = dict(big, max_len=8192)
        configs.append((LimDims(**mtp3, padding_tokens=1, tokens_per_row=4, min_len=6400), 1, seed + 9))
    return configs


def _count_lim_step(res: KernelResult, inp: LimInputs, table: ResidencyTable, ref: IndexerManageResult, dims) -> None:
    """What one step exercised (``res.coverage``), from the reference's result."""
    fresh = (inp.req_ids != table.row_req) & (inp.req_ids >= 0)
    owned = torch.zeros(dims.rows, dtype=torch.bool)
    owned[inp.token_rows[inp.token_rows >= 0].long()] = True
    rr = ref.residency
    res.count("hits", rr.hit_mask.sum())
    res.count("misses", rr.miss_count.clamp(min=0).sum())
    res.count("topk_minus_one", (ref.topk_indices == -1).sum())
    res.count("first_fill_rows", (fresh & owned).sum())
    res.count("steady_rows", (~fresh & owned & (inp.req_ids >= 0)).sum())
    res.count("owned_rows_without_misses", (owned & (rr.miss_count == 0)).sum())
    res.count("unowned_rows", (~owned).sum())
    res.count("padding_tokens", (inp.token_rows < 0).sum())
    if dims.tokens_per_row > 1:
        shared = torch.bincount(inp.token_rows[inp.token_rows >= 0].long(), minlength=dims.rows) > 1
        res.count("shared_rows", shared.sum())
        # rows whose union held more positions than their hot buffer (the rest overflowed)
        topk = ref.topk_indices.reshape(inp.token_rows.shape[0], -1)
        for row in torch.nonzero(owned).flatten().tolist():
            picked = topk[inp.token_rows == row]
            res.count("overflow_rows", int(torch.unique(picked[picked >= 0]).numel() > dims.hot_tokens))


def _lim_scenario(m: km.KernelModel, res: KernelResult, dims: LimDims, aic: int, seed: int, steps: int) -> None:
    """One scenario: ``steps`` steps (2 at the largest shape) and the last one repeated, each
    launched with the vector cores in forward and reversed order against the reference."""
    big = dims.top_k == 2048
    m.aic = aic
    min_len = dims.min_len or (4200 if big else None)
    sc = Scenario(dims, seed, churn=0.0 if big else 0.25, idle=0.0 if big else 0.2, min_len=min_len)
    table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    n_steps = 2 if big else steps
    prev = None
    for st in range(n_steps + 1):
        if st < n_steps:
            sc.advance()
            inp = sc.inputs()
        else:  # the same step again (next step id), nothing speculative: every selected position hits
            stable = torch.tensor([r.length if r is not None else 0 for r in sc.rows.rows], dtype=torch.int32)
            inp = dataclasses.replace(prev, step=prev.step + 1, stable=stable)
        prev = inp
        t_ref, t_fwd, t_rev = table.clone(), table.clone(), table.clone()
        ref = _reference_lim(inp, t_ref, dims)
        _count_lim_step(res, inp, table, ref, dims)
        label = f"{'C8 ' if dims.quantized else ''}dims={dims} aic={aic} step={inp.step}"
        try:
            got, launch = _model_lim(m, inp, t_fwd, dims)
            cores = launch.block_dim * km.TASK_RATION
            got_rev, _ = _model_lim(m, inp, t_rev, dims, list(reversed(range(cores))))
        except km.ModelFault as exc:
            res.failures.append(f"{label}: model fault: {exc}")
            res.bit_exact = False
            return
        bad = _compare_lim(got, ref, t_fwd, t_ref)
        bad += [f"reversed core order: {b}" for b in _compare_lim(got_rev, ref, t_rev, t_ref)]
        if st == n_steps and int(ref.residency.miss_count.clamp(min=0).sum()) != 0:
            bad.append("repeated step still has misses (scenario error)")
        if bad:
            res.bit_exact = False
            res.failures += [f"{label}: {b}" for b in bad[:4]]
        res.cases += 1
        table = t_ref


def check_lim(
    m: km.KernelModel, quantized: bool, *, seed: int = 0, steps: int = 4, largest: bool = True
) -> KernelResult:
    """LIM (or LIM-C8) over the scenarios of the module docstring."""
    res = KernelResult("sao_quant_lightning_indexer_manage" if quantized else "sao_lightning_indexer_manage")
    t0 = time.monotonic()
    for dims, aic, s in _lim_configs(quantized, seed, largest):
        _lim_scenario(m, res, dims, aic, s, steps)
    res.seconds = time.monotonic() - t0
    return res


# --------------------------------------------------------------- Copy-SFA
_SFA_LATENT_DIM = 512
_SFA_ROPE_DIM = 64


@dataclass
class _SfaInputs:
    """One Copy-SFA launch's inputs (LIM-like, built directly): the host pool, the hot buffer
    holding each row's resident rows, every token's selected slots and every row's misses."""

    host: torch.Tensor  # [host_rows, latent + rope] bf16
    hot: torch.Tensor  # [rows, hot_tokens, latent + rope] bf16; garbage (NaN words too) where not resident
    overflow: Optional[torch.Tensor]  # [O, latent + rope] bf16: the overflow area's rows (None: no area)
    token_table: torch.Tensor  # [rows, max_ctx] int32: position -> host row
    token_rows: torch.Tensor  # [tokens] int32 row of each query token (-1: padding)
    sparse: torch.Tensor  # [tokens, 1, top_k] int32 flat hot-buffer index (-1: none)
    miss_tokens: torch.Tensor  # [rows, W] int32 positions to copy in (W = K, or min(n x K, Hh))
    miss_slots: torch.Tensor  # [rows, W] int32 the slots they land in
    miss_count: torch.Tensor  # [rows] int32
    query: torch.Tensor  # [tokens, heads, latent] bf16
    query_rope: torch.Tensor  # [tokens, heads, rope] bf16
    max_ctx: int
    scale: float
    tokens_per_row: int = 1


def _sfa_resident(g: torch.Generator, rows: int, hot_tokens: int, max_ctx: int):
    """``(host, hot, token_table)``: a host pool and a hot buffer where every resident slot
    holds its host row (the invariant the engine keeps) and everything else is garbage."""
    d = _SFA_LATENT_DIM + _SFA_ROPE_DIM
    host_rows = rows * max_ctx
    host = torch.randn(host_rows, d, generator=g).to(torch.bfloat16)
    # hot buffer: garbage everywhere (NaN words included) except what is resident
    hot = torch.randint(-32768, 32767, (rows, hot_tokens, d), generator=g, dtype=torch.int16).view(torch.bfloat16)
    token_table = torch.randperm(host_rows, generator=g)[: rows * max_ctx].reshape(rows, max_ctx).to(torch.int32)
    # resident slots hold their host rows (the invariant the engine keeps)
    slot_pos = torch.stack([torch.randperm(max_ctx, generator=g)[:hot_tokens] for _ in range(rows)])
    for r in range(rows):
        hot[r] = host[token_table[r, slot_pos[r]].long()]
    return host, hot, token_table


def _sfa_selection(
    g: torch.Generator,
    *,
    rows: int,
    tokens: int,
    top_k: int,
    hot_tokens: int,
    max_ctx: int,
    pad_rows_with_no_miss: bool,
):
    """``(token_rows, sparse, miss_tokens, miss_slots, miss_count)``: tokens owned by distinct
    rows (the rest padding), each selecting some hot slots (``-1`` entries interleaved), some
    of them misses of new positions (none for every fourth token with
    ``pad_rows_with_no_miss``)."""
    token_rows = torch.full((tokens,), -1, dtype=torch.int32)
    owners = torch.randperm(rows, generator=g)[: min(tokens, rows)]
    token_rows[: owners.numel()] = owners.to(torch.int32)
    token_rows = token_rows[torch.randperm(tokens, generator=g)]
    sparse = torch.full((tokens, 1, top_k), -1, dtype=torch.int32)
    miss_tokens = torch.full((rows, top_k), -1, dtype=torch.int32)
    miss_slots = torch.full((rows, top_k), -1, dtype=torch.int32)
    miss_count = torch.zeros(rows, dtype=torch.int32)
    for t in range(tokens):
        r = int(token_rows[t])
        if r < 0:
            continue
        n_valid = int(torch.randint(0, top_k + 1, (), generator=g)) if t % 3 else top_k
        slots = torch.randperm(hot_tokens, generator=g)[:n_valid]
        n_miss = 0 if (pad_rows_with_no_miss and t % 4 == 1) else int(torch.randint(0, n_valid + 1, (), generator=g))
        # misses: new positions (not resident) land in some of the selected slots
        miss_sel = slots[:n_miss]
        new_pos = torch.arange(hot_tokens, max_ctx)[torch.randperm(max_ctx - hot_tokens, generator=g)][:n_miss]
        if n_miss > new_pos.numel():
            n_miss = new_pos.numel()
            miss_sel = slots[:n_miss]
        miss_tokens[r, :n_miss] = new_pos[:n_miss].to(torch.int32)
        miss_slots[r, :n_miss] = miss_sel.to(torch.int32)
        miss_count[r] = n_miss
        order = torch.randperm(top_k, generator=g)[:n_valid]  # -1 entries interleaved
        sparse[t, 0, order] = (r * hot_tokens + slots).to(torch.int32)
    return token_rows, sparse, miss_tokens, miss_slots, miss_count


def _sfa_shared_selection(
    g: torch.Generator,
    *,
    rows: int,
    tokens: int,
    top_k: int,
    hot_tokens: int,
    max_ctx: int,
    tokens_per_row: int,
    overflow_rows: int = 0,
):
    """As :func:`_sfa_selection` with up to ``n = tokens_per_row`` tokens per row (a request's
    verify rows): row ``r``'s step selects up to ``W = min(n * K, Hh)`` of its slots, some of
    them misses (miss lists ``[R, W]``), and each of its tokens attends to a random
    ``K``-subset of them, so a token other than the row's first reads rows copied for the
    row; with ``overflow_rows`` a token's picks include rows of the overflow area too
    (indices ``R * Hh`` on: the positions its row's union could not keep)."""
    n = tokens_per_row
    width = min(n * top_k, hot_tokens)
    # the first row gets n - 1 tokens (a row with fewer than n), the others n; one token or
    # more is left as padding
    owners = torch.randperm(rows, generator=g)[: max(1, min(rows, tokens // n))].tolist()
    token_rows = [r for i, r in enumerate(owners) for _ in range(max(1, n - 1) if i == 0 else n)][: tokens - 1]
    owners = sorted(set(token_rows), key=owners.index)
    token_rows += [-1] * (tokens - len(token_rows))
    token_rows = torch.tensor(token_rows, dtype=torch.int32)[torch.randperm(tokens, generator=g)]
    sparse = torch.full((tokens, 1, top_k), -1, dtype=torch.int32)
    miss_tokens = torch.full((rows, width), -1, dtype=torch.int32)
    miss_slots = torch.full((rows, width), -1, dtype=torch.int32)
    miss_count = torch.zeros(rows, dtype=torch.int32)
    for r in owners:
        selected = torch.randperm(hot_tokens, generator=g)[: int(torch.randint(top_k, width + 1, (), generator=g))]
        n_miss = int(torch.randint(1, selected.numel() + 1, (), generator=g))
        new_pos = torch.arange(hot_tokens, max_ctx)[torch.randperm(max_ctx - hot_tokens, generator=g)][:n_miss]
        n_miss = new_pos.numel()
        miss_tokens[r, :n_miss] = new_pos.to(torch.int32)
        miss_slots[r, :n_miss] = selected[:n_miss].to(torch.int32)
        miss_count[r] = n_miss
        flat = r * hot_tokens + selected
        if overflow_rows:  # this row's union beyond its buffer: some rows of the overflow area
            extra = torch.randperm(overflow_rows, generator=g)[: int(torch.randint(1, top_k + 1, (), generator=g))]
            flat = torch.cat([flat, rows * hot_tokens + extra])
        for t in torch.nonzero(token_rows == r).flatten().tolist():
            n_valid = int(torch.randint(1, top_k + 1, (), generator=g))
            picks = flat[torch.randperm(flat.numel(), generator=g)[:n_valid]]
            order = torch.randperm(top_k, generator=g)[: picks.numel()]  # -1 entries interleaved
            sparse[t, 0, order] = picks.to(torch.int32)
    return token_rows, sparse, miss_tokens, miss_slots, miss_count


def _sfa_inputs(
    *,
    seed: int,
    heads: int,
    top_k: int,
    hot_tokens: int,
    rows: int,
    tokens: int,
    pad_rows_with_no_miss: bool,
    tokens_per_row: int = 1,
    overflow_rows: int = 0,
) -> _SfaInputs:
    """The inputs of one Copy-SFA case, all drawn from ``seed`` (``overflow_rows``: an
    overflow area of that many random rows, which shared rows' tokens also read)."""
    g = torch.Generator().manual_seed(seed)
    dl, dr = _SFA_LATENT_DIM, _SFA_ROPE_DIM
    max_ctx = hot_tokens + tokens_per_row * top_k
    host, hot, token_table = _sfa_resident(g, rows, hot_tokens, max_ctx)
    overflow = torch.randn(overflow_rows, dl + dr, generator=g).to(torch.bfloat16) if overflow_rows else None
    if tokens_per_row > 1:
        selection = _sfa_shared_selection(
            g,
            rows=rows,
            tokens=tokens,
            top_k=top_k,
            hot_tokens=hot_tokens,
            max_ctx=max_ctx,
            tokens_per_row=tokens_per_row,
            overflow_rows=overflow_rows,
        )
    else:
        selection = _sfa_selection(
            g,
            rows=rows,
            tokens=tokens,
            top_k=top_k,
            hot_tokens=hot_tokens,
            max_ctx=max_ctx,
            pad_rows_with_no_miss=pad_rows_with_no_miss,
        )
    query = (torch.randn(tokens, heads, dl, generator=g) * 0.5).to(torch.bfloat16)
    query_rope = (torch.randn(tokens, heads, dr, generator=g) * 0.5).to(torch.bfloat16)
    scale = float(dl + dr) ** -0.5
    return _SfaInputs(host, hot, overflow, token_table, *selection, query, query_rope, max_ctx, scale, tokens_per_row)


def _sfa_model_runs(
    m: km.KernelModel, inp: _SfaInputs, *, heads: int, top_k: int, hot_tokens: int, rows: int, tokens: int, aic: int
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``(hot buffer, attention output)`` of the kernel model, cores in forward then reversed
    order (``km.ModelFault`` propagates). The host side of torch_ops.cpp zero-pads fewer
    than 8 heads; the output is cut back to ``heads``."""
    dl, dr = _SFA_LATENT_DIM, _SFA_ROPE_DIM
    np_ = max(heads, 8)
    q, qr = inp.query, inp.query_rope
    if np_ != heads:
        q = torch.cat([inp.query, torch.zeros(tokens, np_ - heads, dl, dtype=inp.query.dtype)], 1).contiguous()
        qr = torch.cat([inp.query_rope, torch.zeros(tokens, np_ - heads, dr, dtype=inp.query.dtype)], 1).contiguous()
    m.aic = aic
    outs = []
    for reverse in (False, True):
        hot_k = inp.hot.clone()
        out = torch.full((tokens, np_, dl), float("nan"), dtype=torch.bfloat16)
        launch = m.tile_copy_sfa(
            tokens=tokens,
            heads=np_,
            latent_dim=dl,
            rope_dim=dr,
            rows=rows,
            hot_tokens=hot_tokens,
            top_k=top_k,
            max_ctx=inp.max_ctx,
            scale=inp.scale,
            miss_width=inp.miss_tokens.shape[1],
            row_tokens=inp.tokens_per_row,
        )
        cores = launch.block_dim * km.TASK_RATION
        order = list(reversed(range(cores))) if reverse else None
        m.run(
            km.COPY_SFA,
            [
                q,
                qr,
                inp.host,
                hot_k,
                inp.overflow,
                inp.sparse,
                inp.token_rows,
                inp.miss_tokens,
                inp.miss_slots,
                inp.miss_count,
                inp.token_table,
                out,
            ],
            launch,
            order,
        )
        outs.append((hot_k, out[:, :heads]))
    return outs


def _sfa_compare(
    outs: List[Tuple[torch.Tensor, torch.Tensor]], hot_ref: torch.Tensor, ref: torch.Tensor, res: KernelResult
) -> List[str]:
    """What differs from the reference: the hot buffer bit-exactly (as int16 words), the
    attention output within tolerance and identical for both core orders. Records the
    worst attention error and a bit-exactness failure in ``res``."""
    bad = []
    for (hot_k, out), tag in zip(outs, ("", "reversed core order: ")):
        if not torch.equal(hot_k.view(torch.int16), hot_ref.view(torch.int16)):
            n = int((hot_k.view(torch.int16) != hot_ref.view(torch.int16)).any(-1).sum())
            bad.append(f"{tag}hot buffer differs from the reference copy in {n} rows")
            res.bit_exact = False
        err = (out.float() - ref.float()).abs()
        if not torch.isfinite(out.float()).all():
            bad.append(f"{tag}attention output has non-finite values")
        else:
            res.max_abs_err = max(res.max_abs_err, float(err.max()) if err.numel() else 0.0)
            tol = ATTN_ATOL + ATTN_RTOL * ref.float().abs()
            if bool((err > tol).any()):
                bad.append(f"{tag}attention out of tolerance: max abs err {float(err.max()):.3g}")
    if not torch.equal(outs[0][1].view(torch.int16), outs[1][1].view(torch.int16)):
        bad.append("attention output depends on the core order")
    return bad


def _sfa_case(
    m: km.KernelModel,
    *,
    seed: int,
    heads: int,
    top_k: int,
    hot_tokens: int,
    rows: int,
    tokens: int,
    aic: int,
    res: KernelResult,
    label: str,
    pad_rows_with_no_miss: bool = True,
    tokens_per_row: int = 1,
    overflow_rows: int = 0,
) -> None:
    """One Copy-SFA launch on LIM-like inputs built directly (slots drawn per row)."""
    inp = _sfa_inputs(
        seed=seed,
        heads=heads,
        top_k=top_k,
        hot_tokens=hot_tokens,
        rows=rows,
        tokens=tokens,
        pad_rows_with_no_miss=pad_rows_with_no_miss,
        tokens_per_row=tokens_per_row,
        overflow_rows=overflow_rows,
    )
    hot_ref = inp.hot.clone()
    ref = fused.copy_sparse_flash_attention(
        inp.query,
        inp.host,
        hot_ref,
        inp.sparse,
        inp.scale,
        query_rope=inp.query_rope,
        token_rows=inp.token_rows,
        miss_tokens=inp.miss_tokens,
        miss_slots=inp.miss_slots,
        miss_count=inp.miss_count,
        token_table=inp.token_table,
        overflow=inp.overflow,
        tokens_per_row=tokens_per_row,
    )
    try:
        outs = _sfa_model_runs(
            m, inp, heads=heads, top_k=top_k, hot_tokens=hot_tokens, rows=rows, tokens=tokens, aic=aic
        )
    except km.ModelFault as exc:
        res.failures.append(f"{label}: model fault: {exc}")
        res.bit_exact = False
        return
    res.failures += [f"{label}: {b}" for b in _sfa_compare(outs, hot_ref, ref, res)]
    res.cases += 1
    res.count("misses_copied", inp.miss_count.sum())
    res.count("sparse_minus_one", (inp.sparse == -1).sum())
    res.count(
        "owned_rows_without_misses", ((inp.miss_count == 0) & (torch.isin(torch.arange(rows), inp.token_rows))).sum()
    )
    res.count("padding_tokens", (inp.token_rows < 0).sum())
    if tokens_per_row > 1:
        res.count("shared_rows", (torch.bincount(inp.token_rows[inp.token_rows >= 0].long(), minlength=rows) > 1).sum())
    res.count("overflow_reads", (inp.sparse >= rows * hot_tokens).sum())


def check_copy_sfa(m: km.KernelModel, *, seed: int = 0, largest: bool = True) -> KernelResult:
    res = KernelResult("sao_scatter_copy_sparse_flash_attention")
    t0 = time.monotonic()
    cases = [
        dict(heads=8, top_k=128, hot_tokens=160, rows=5, tokens=6, aic=24),  # padding token, one token per core
        dict(heads=16, top_k=256, hot_tokens=256, rows=4, tokens=5, aic=1),  # 2 cores: several tokens each
        dict(heads=4, top_k=128, hot_tokens=128, rows=3, tokens=3, aic=2),  # heads padded to 8 on the host
        dict(heads=32, top_k=128, hot_tokens=192, rows=3, tokens=4, aic=24),  # two head groups
        # verify rows: up to n tokens per row, the row's misses copied once before any attends
        dict(heads=8, top_k=128, hot_tokens=256, rows=4, tokens=7, aic=24, tokens_per_row=2),
        dict(heads=16, top_k=128, hot_tokens=384, rows=3, tokens=6, aic=1, tokens_per_row=3),
        # unions beyond the hot buffer: miss lists min(n x K, Hh) wide, tokens reading the overflow area too
        dict(heads=8, top_k=128, hot_tokens=256, rows=4, tokens=7, aic=24, tokens_per_row=4, overflow_rows=320),
        dict(heads=16, top_k=128, hot_tokens=128, rows=3, tokens=6, aic=1, tokens_per_row=3, overflow_rows=96),
    ]
    if largest:
        cases.append(dict(heads=128, top_k=2048, hot_tokens=2048, rows=1, tokens=1, aic=24))
        # DeepSeek-V3.2 at MTP-3 (16 heads a rank at TP 8): 4 verify rows over plain decode's 4096 slots
        cases.append(
            dict(heads=16, top_k=2048, hot_tokens=4096, rows=1, tokens=4, aic=24, tokens_per_row=4, overflow_rows=4096)
        )
    for i, c in enumerate(cases):
        _sfa_case(m, seed=seed * 100 + i, res=res, label=f"Copy-SFA {c}", **c)
    res.seconds = time.monotonic() - t0
    return res


def run(
    seed: int = 0, largest: bool = True, use_cache: bool = True, model: Optional[km.KernelModel] = None
) -> List[KernelResult]:
    """All three kernels; ``model`` defaults to the model built from ``ascendc_ops/kernels``."""
    m = model or km.KernelModel(km.build(use_cache))
    return [
        check_lim(m, False, seed=seed, largest=largest),
        check_lim(m, True, seed=seed, largest=largest),
        check_copy_sfa(m, seed=seed, largest=largest),
    ]
