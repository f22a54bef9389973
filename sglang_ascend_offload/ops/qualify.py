"""Kernel qualification: every fused op a plan selects, run on this node before serving.

The fused AscendC kernels (LIM, LIM-C8, Copy-SFA) match the separate operators on a
functional model of the AscendC API, which cannot show a node's own rounding, ``Sort``
tie order, pipeline synchronisation or cube/vector messaging (``docs/fused_ops.md``). So a
server that selects a fused op runs it once, at the served shapes, on a small
deterministic problem (:mod:`.qualify_problem`: two requests, three decode steps, a first
fill and a full row that evicts), and compares it with the separate operators on the same
inputs:

==========  ==============================================  =====================================
fused op    compared with                                   compared how
==========  ==============================================  =====================================
LIM         ``lightning_indexer`` + ``residency_manage``     top-k and sparse indices, every
LIM-C8      ``quant_lightning_indexer`` + ``residency_...``  residency output and the state: exact
Copy-SFA    ``copy_miss_rows`` + ``sparse_mla_attention``    hot buffer after the miss copies:
                                                             bit-exact; attention within
                                                             ``ATTENTION_ATOL + ATTENTION_RTOL * |ref|``
==========  ==============================================  =====================================

The separate operators run on the rung the node would serve them on (:func:`separate_rung`:
``auto`` on an NPU, the torch_npu ops first; ``reference`` elsewhere, where the fused rung is
the kernels on their functional model); the separate indexer's top-k is put in the
contract's order (score descending: torch_npu's indexer need not sort its selection, and
the problem knows every score exactly), so the fused top-k must equal its set in that
order; the residency half is the reference ``residency_manage`` (the contract; it has no
arithmetic). A fused op that differs, or
raises, fails; :func:`qualify_at_startup` then raises :class:`KernelQualificationError`
naming the op, the shape, the step, the first differing element with both values, and the
fix. Nothing is substituted: the server does not start.

:func:`qualify_plan` returns one :class:`OpQualification` per fused op (``bench kernels
--qualify``, ``env --npu-check``). The plan is any object with ``platform`` and the
``indexer`` / ``attention`` choices of ``sparse_decode.op_selection.OpPlan``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .. import platform as _platform
from . import fused, registry
from .contract import IndexerManageResult, ResidencyTable
from .qualify_problem import REQUESTS, STEPS, Problem, ServedShape, StepInputs

__all__ = [
    "Difference",
    "OpQualification",
    "KernelQualificationError",
    "fused_ops_of",
    "separate_rung",
    "qualify_plan",
    "qualify_at_startup",
    "fix_for",
    "LABELS",
]

logger = logging.getLogger(__name__)

LABELS = {
    "lightning_indexer_manage": "LIM",
    "quant_lightning_indexer_manage": "LIM-C8",
    "copy_sparse_flash_attention": "Copy-SFA",
}
_KERNEL = {
    "lightning_indexer_manage": fused.LIM_KERNEL,
    "quant_lightning_indexer_manage": fused.LIM_C8_KERNEL,
    "copy_sparse_flash_attention": fused.COPY_SFA_KERNEL,
}
_SEPARATE = {
    "lightning_indexer_manage": ("lightning_indexer", "residency_manage"),
    "quant_lightning_indexer_manage": ("quant_lightning_indexer", "residency_manage"),
    "copy_sparse_flash_attention": ("copy_miss_rows", "sparse_mla_attention"),
}
_SETTING = {
    "lightning_indexer_manage": "fused_lim",
    "quant_lightning_indexer_manage": "fused_lim",
    "copy_sparse_flash_attention": "fused_copy_sfa",
}
REBUILD_HINT = (
    "rebuild the extension with bash ascendc_ops/build.sh --install (on CPU the functional model is "
    "rebuilt from ascendc_ops/kernels at the next start)"
)


@dataclass(frozen=True)
class Difference:
    """Where a fused op first differs from the separate operators: step (0-based), the
    tensor, the element's index, both values (as text), how many elements differ, and a
    note (the tolerance, or the error the fused op raised)."""

    step: int
    tensor: str
    index: Tuple[int, ...]
    fused: str
    separate: str
    count: int
    note: str = ""

    def describe(self) -> str:
        where = f"{self.tensor}{list(self.index)}" if self.index else self.tensor
        text = f"step {self.step + 1} of {STEPS}: {where}: fused {self.fused}, separate {self.separate}"
        if self.count > 1:
            text += f" ({self.count} elements differ)"
        return text + (f"; {self.note}" if self.note else "")


@dataclass
class OpQualification:
    """One fused op's qualification: ``qualified`` (every step equal, or within the stated
    tolerance for attention), ``seconds`` (its fused calls, the separate operators of its
    stage and the comparisons), ``against`` (the separate ops and their rung), the worst
    attention error, what the problem exercised (``coverage``) and the first ``difference``."""

    op: str
    label: str
    kernel: str
    qualified: bool = True
    seconds: float = 0.0
    steps: int = 0
    against: str = ""
    max_abs_err: float = 0.0
    coverage: Dict[str, int] = field(default_factory=dict)
    difference: Optional[Difference] = None

    def as_dict(self) -> dict:
        out = asdict(self)
        out["difference"] = asdict(self.difference) if self.difference else None
        if out["difference"]:
            out["difference"]["index"] = list(self.difference.index)
        return out


class KernelQualificationError(RuntimeError):
    """Fused ops that failed their qualification; the message names each with the shape,
    the first difference and the fix."""

    def __init__(self, failures: List[OpQualification], shape: ServedShape, platform: str):
        self.failures = failures
        self.shape = shape
        parts = [
            f"fused {f.label} ({f.op}, kernel {f.kernel}) at {shape.describe()}: "
            f"{f.difference.describe() if f.difference else 'failed'} (separate = {f.against}); "
            f"fix: {fix_for(f.op)}"
            for f in failures
        ]
        super().__init__(
            f"kernel qualification failed on this {platform} ({_backend(platform)}): "
            + " | ".join(parts)
            + ". The separate operators are not substituted: the server does not start."
        )


def fix_for(op: str) -> str:
    """What an operator does when the fused ``op`` fails its qualification."""
    return (
        f'set "{_SETTING[op]}": false in the sparse decode config (the separate '
        f"{' + '.join(_SEPARATE[op])} serve), or {REBUILD_HINT}"
    )


def _backend(platform: str) -> str:
    if platform == "npu":
        return "the AscendC extension _C_ascend"
    return "the AscendC kernels on their CPU functional model"


def fused_ops_of(plan) -> Tuple[str, ...]:
    """The fused ops ``plan`` selects, indexer first."""
    return tuple(c.ops[0] for c in (plan.indexer, plan.attention) if c.fused)


def separate_rung(platform: str) -> str:
    """The rung the separate operators are compared on: what the node serves them on
    (``auto``: on an NPU the torch_npu ops first), ``reference`` off the NPU."""
    return "auto" if platform == "npu" else "reference"


# ------------------------------------------------------------------ comparisons
def _value(t: torch.Tensor, index) -> str:
    v = t[tuple(index)].item()
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _exact_difference(step: int, name: str, fused_t: torch.Tensor, sep_t: torch.Tensor) -> Optional[Difference]:
    """The first element where two tensors differ (shape or dtype too), ``None`` if equal."""
    a, b = fused_t.detach().cpu(), sep_t.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return Difference(step, name, (), f"{a.dtype}{tuple(a.shape)}", f"{b.dtype}{tuple(b.shape)}", 1, "shape/dtype")
    if a.is_floating_point():  # bit patterns (NaN garbage included)
        words = {2: torch.int16, 4: torch.int32}[a.element_size()]
        differs = a.view(words) != b.view(words)
    else:
        differs = a != b
    idx = torch.nonzero(differs)
    if idx.shape[0] == 0:
        return None
    first = idx[0].tolist()
    return Difference(step, name, tuple(first), _value(a, first), _value(b, first), int(idx.shape[0]))


def _lim_differences(step: int, got: IndexerManageResult, want: IndexerManageResult, t_got, t_want):
    pairs = [
        ("topk_indices", got.topk_indices, want.topk_indices),
        ("sparse_indices", got.sparse_indices, want.sparse_indices),
        ("hit_mask", got.residency.hit_mask.to(torch.bool), want.residency.hit_mask.to(torch.bool)),
        ("slots", got.residency.slots, want.residency.slots),
        ("miss_count", got.residency.miss_count, want.residency.miss_count),
        ("miss_tokens", got.residency.miss_tokens, want.residency.miss_tokens),
        ("miss_slots", got.residency.miss_slots, want.residency.miss_slots),
        ("slot_token", t_got.slot_token, t_want.slot_token),
        ("slot_stamp", t_got.slot_stamp, t_want.slot_stamp),
        ("row_req", t_got.row_req, t_want.row_req),
    ]
    return next((d for d in (_exact_difference(step, *p) for p in pairs) if d is not None), None)


def _attention_difference(step: int, got: torch.Tensor, want: torch.Tensor) -> Tuple[Optional[Difference], float]:
    """First output element outside the stated tolerance (NaN included), and the worst error."""
    a, b = got.detach().float().cpu(), want.detach().float().cpu()
    if a.shape != b.shape:
        return Difference(step, "attention output", (), str(tuple(a.shape)), str(tuple(b.shape)), 1, "shape"), 0.0
    err = (a - b).abs()
    tol = fused.ATTENTION_ATOL + fused.ATTENTION_RTOL * b.abs()
    bad = ~(err <= tol)
    worst = float(err[torch.isfinite(err)].max()) if bool(torch.isfinite(err).any()) else float("inf")
    idx = torch.nonzero(bad)
    if idx.shape[0] == 0:
        return None, worst
    first = idx[0].tolist()
    note = f"tolerance {fused.ATTENTION_ATOL:g} + {fused.ATTENTION_RTOL:g} x |separate|, max abs error {worst:.3g}"
    diff = Difference(step, "attention output", tuple(first), _value(a, first), _value(b, first), idx.shape[0], note)
    return diff, worst


def _raised(step: int, exc: Exception) -> Difference:
    return Difference(step, "the fused op raised", (), type(exc).__name__, "(ran)", 1, str(exc)[:400])


# ------------------------------------------------------------------ the run
class _Run:
    """One pass over the problem's steps: per step the separate indexer stage (the spec,
    which moves the state on), the fused LIM against it when selected, and the fused
    Copy-SFA against the separate copy + attention on that step's residency when selected."""

    def __init__(self, plan, shape: ServedShape, device, seed: int):
        self.problem = Problem(shape, device, seed)
        self.shape = shape
        self.rung = separate_rung(plan.platform)
        self.indexer_op = _SEPARATE[
            "quant_lightning_indexer_manage" if shape.indexer_dtype == "int8" else "lightning_indexer_manage"
        ][0]
        self.results: Dict[str, OpQualification] = {}
        for op in fused_ops_of(plan):
            names = [f"{name}[{self._rung_of(name)}]" for name in _SEPARATE[op]]
            self.results[op] = OpQualification(op, LABELS[op], _KERNEL[op], against=" + ".join(names))
        self.lim = next((self.results[o] for o in self.results if o != "copy_sparse_flash_attention"), None)
        self.sfa = self.results.get("copy_sparse_flash_attention")

    def _rung_of(self, op: str) -> str:
        if op == "residency_manage":
            return "reference"
        return registry.select(op, self.rung).rung

    def run(self) -> List[OpQualification]:
        table, hot = self.problem.initial_state()
        for index in range(STEPS):
            inp = self.problem.step(index)
            t0 = _now()
            before = table.clone()
            want = self._separate_indexer(inp, table)
            spent = _now() - t0
            if self.lim is not None:
                self._fused_indexer(inp, before, want, table, spent)
            elif self.sfa is not None:
                self.sfa.seconds += spent
            if self.sfa is not None:
                hot = self._copy_sfa(inp, hot, want)
            for r in self.results.values():
                r.steps += 1
                _count(r.coverage, before, want, inp)
        return list(self.results.values())

    def _indexer_args(self, inp: StepInputs) -> tuple:
        p = self.problem
        head = [inp.query, p.key, inp.weights]
        if self.shape.indexer_dtype == "int8":
            head += [inp.query_scale, p.key_scale]
        kwargs = dict(
            actual_seq_lengths_query=inp.cu,
            actual_seq_lengths_key=inp.kv_len,
            block_table=p.block_table,
            sparse_count=self.shape.top_k,
            sparse_mode=3,
        )
        return head, kwargs

    def _state_args(self, inp: StepInputs, table: ResidencyTable) -> dict:
        return dict(
            token_rows=inp.token_rows,
            req_ids=inp.req_ids,
            stable_len=inp.stable,
            step=inp.step,
            slot_token=table.slot_token,
            slot_stamp=table.slot_stamp,
            row_req=table.row_req,
            tokens_per_row=self.shape.rows_per_request,
        )

    def _separate_indexer(self, inp: StepInputs, table: ResidencyTable) -> IndexerManageResult:
        """The separate indexer stage, in place on ``table``: the separate indexer's top-k,
        put in the contract's score order (:meth:`~.qualify_problem.Problem.in_score_order`),
        then the reference residency step."""
        head, kwargs = self._indexer_args(inp)
        topk = self.problem.in_score_order(registry.select(self.indexer_op, self.rung).fn(*head, **kwargs))
        return fused.residency_after_indexer(topk, **self._state_args(inp, table))

    def _fused_indexer(self, inp, before: ResidencyTable, want, t_want: ResidencyTable, spent: float) -> None:
        r, t0 = self.lim, _now()
        t_got = before.clone()
        head, kwargs = self._indexer_args(inp)
        try:
            got = registry.select(r.op, "fused").fn(*head, **kwargs, **self._state_args(inp, t_got))
            diff = _lim_differences(inp.index, got, want, t_got, t_want)
        except Exception as exc:  # noqa: BLE001 - a fused op that raises fails its qualification
            diff = _raised(inp.index, exc)
        r.seconds += spent + _now() - t0
        if diff is not None and r.difference is None:
            r.qualified, r.difference = False, diff

    def _separate_attention(self, inp, hot: torch.Tensor, want: IndexerManageResult) -> torch.Tensor:
        p, res = self.problem, want.residency
        registry.select("copy_miss_rows", self.rung).fn(
            p.host, hot, res.miss_tokens, res.miss_slots, res.miss_count, p.token_table
        )
        rows, hot_tokens, dim = hot.shape
        flat = hot.view(rows * hot_tokens, dim)
        latent = self.shape.latent_dim
        return registry.select("sparse_mla_attention", self.rung).fn(
            inp.attn_query,
            flat[:, :latent],
            None,
            want.sparse_indices,
            p.scale,
            query_rope=inp.attn_rope,
            key_rope=flat[:, latent:],
            layout_query="TND",
            layout_kv="flat",
            attention_mode=2,
        )

    def _copy_sfa(self, inp: StepInputs, hot: torch.Tensor, want: IndexerManageResult) -> torch.Tensor:
        """Copy-SFA against the separate copy + attention; returns the separate hot buffer."""
        r, p, res, t0 = self.sfa, self.problem, want.residency, _now()
        hot_want, hot_got = hot.clone(), hot.clone()
        out_want = self._separate_attention(inp, hot_want, want)
        try:
            out_got = registry.select(r.op, "fused").fn(
                inp.attn_query,
                p.host,
                hot_got,
                want.sparse_indices,
                p.scale,
                query_rope=inp.attn_rope,
                token_rows=inp.token_rows,
                miss_tokens=res.miss_tokens,
                miss_slots=res.miss_slots,
                miss_count=res.miss_count,
                token_table=p.token_table,
                tokens_per_row=self.shape.rows_per_request,
            )
            diff = _exact_difference(inp.index, "hot buffer", hot_got, hot_want)
            attn_diff, worst = _attention_difference(inp.index, out_got, out_want)
            r.max_abs_err = max(r.max_abs_err, worst)
            diff = diff or attn_diff
        except Exception as exc:  # noqa: BLE001 - a fused op that raises fails its qualification
            diff = _raised(inp.index, exc)
        r.seconds += _now() - t0
        if diff is not None and r.difference is None:
            r.qualified, r.difference = False, diff
        return hot_want


def _now() -> float:
    _platform.synchronize()
    return time.monotonic()


def _count(coverage: Dict[str, int], before: ResidencyTable, want: IndexerManageResult, inp: StepInputs) -> None:
    """What a step exercised: hits, misses, misses that evicted a resident position, rows
    filled for a new request."""
    res = want.residency
    width = res.miss_slots.shape[1]
    taken = torch.arange(width, device=res.miss_slots.device)[None, :] < res.miss_count[:, None]
    victims = torch.gather(before.slot_token, 1, res.miss_slots.clamp(min=0).long())
    add = {
        "hits": int(res.hit_mask.sum()),
        "misses": int(res.miss_count.sum()),
        "evictions": int((taken & (victims >= 0)).sum()),
        "first_fill_rows": int((before.row_req != inp.req_ids.to(before.row_req.device)).sum()),
        "query_tokens": int(inp.token_rows.shape[0]),
    }
    for key, n in add.items():
        coverage[key] = coverage.get(key, 0) + n


def qualify_plan(plan, shape: ServedShape, *, device=None, seed: int = 0) -> List[OpQualification]:
    """Qualify every fused op ``plan`` selects at ``shape`` on ``device`` (default: the
    platform's); one :class:`OpQualification` each, indexer first (none: empty list)."""
    if not fused_ops_of(plan):
        return []
    return _Run(plan, shape, device, seed).run()


def qualify_at_startup(plan, shape: ServedShape, *, device=None, enabled: bool = True) -> List[OpQualification]:
    """What a server runs before it accepts requests: :func:`qualify_plan`, each op's
    result logged with its time; any failure raises :class:`KernelQualificationError`.
    ``enabled`` false (``"qualify_kernels": false``) skips it with a warning."""
    ops = fused_ops_of(plan)
    if not ops:
        return []
    labels = ", ".join(LABELS[op] for op in ops)
    if not enabled:
        logger.warning(
            "kernel qualification is off (qualify_kernels: false): the fused %s serve on this %s without being "
            "compared with the separate operators (%s)",
            labels,
            plan.platform,
            _backend(plan.platform),
        )
        return []
    t0 = time.monotonic()
    results = qualify_plan(plan, shape, device=device)
    for r in results:
        (logger.info if r.qualified else logger.error)(
            "kernel qualification: fused %s %s %s at %s: %d steps, %s; %.3f s",
            r.label,
            "equals" if r.qualified else "DIFFERS FROM",
            r.against,
            shape.describe(),
            r.steps,
            ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.coverage.items()),
            r.seconds,
        )
    failed = [r for r in results if not r.qualified]
    if failed:
        raise KernelQualificationError(failed, shape, plan.platform)
    logger.info(
        "kernel qualification: %s qualified in %.2f s on this %s (%s; %d requests x %d query tokens, %d steps)",
        labels,
        time.monotonic() - t0,
        plan.platform,
        _backend(plan.platform),
        REQUESTS,
        shape.rows_per_request,
        STEPS,
    )
    return results
