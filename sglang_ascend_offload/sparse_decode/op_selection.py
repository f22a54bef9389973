"""Which operators a sparse decode step runs: the one place the fused ops are chosen.

A decode layer step has four stages (indexer, residency, miss copy, attention), each
with a separate operator of the ladder whose rung :mod:`.op_rungs` resolves (the plan's
``rungs``: one :class:`~.op_rungs.StageRung` per stage, logged; on an NPU never the torch
reference unless ``ops`` is ``reference``). Fused AscendC operators can replace two pairs:

========== ================================================ ============================================
stage      separate operators                               fused operator (``_C_ascend``)
========== ================================================ ============================================
indexer    lightning indexer (bf16) or quant lightning      LIM (``lightning_indexer_manage``) or
           indexer (int8, C8), then ``residency_manage``    LIM-C8 (``quant_lightning_indexer_manage``)
attention  ``copy_miss_rows`` then ``sparse_mla_attention``   Copy-SFA (``copy_sparse_flash_attention``)
========== ================================================ ============================================

:func:`select_ops` turns the platform (``npu`` / ``cuda`` / ``cpu``), the settings
(``ops``, ``fused_lim``, ``fused_copy_sfa``, ``indexer_dtype``) and what the fused rung
provides into an :class:`OpPlan`: per stage, fused or separate, and why. The rule, per
stage (``fused_lim`` for the indexer, ``fused_copy_sfa`` for the attention):

* the setting ``true``: fused, whatever ``ops`` says (``ops`` then picks the rung of the
  other, separate ops);
* the setting ``false``: the separate ops (on an NPU, where fused is the default, this is
  logged once);
* unset: fused with ``ops=fused`` on any platform, and with ``ops=auto`` on an NPU (the
  NPU default); separate otherwise (``ops=reference|triton|npu``, or ``auto`` off the NPU).

A fused stage that cannot run is a :class:`SelectionProblem` (a registered rule id, the
problem, the fix), never a silent fallback: a fused rung missing from the extension (every
missing op listed, with the build command), no fused rung on this platform, a
``fused_copy_sfa: true`` / ``ops=fused`` Copy-SFA the engine's layout excludes, or
``fused_lim: true`` where the fused indexer cannot serve (``sglang.fused_not_wired``: the
caller does not call it, a residency policy other than exact LRU, which is what the
fused kernels implement, or more than ``MAX_TOKENS_PER_ROW`` (14) verify rows sharing a
request's hot buffer, more than the kernels step as one row). Only two choices give way
to the separate operators, each with its reason in the plan (and logged): a default
Copy-SFA (setting unset, ``ops`` ``auto`` on an NPU) where the engine's layout excludes it
(more than 14 verify rows per request, a pool without a tensor view), and a default or
``ops=fused`` indexer where it cannot serve.

Fused Copy-SFA reads the host pool through each layer's slice, which the extension
registers with ``aclrtHostRegister``: each slice must start 4 KiB-aligned, so the rows per
layer must be a multiple of :func:`host_rows_alignment` (32 for 576 bf16 columns);
:func:`fused_host_pool_rows` rounds a pool size up to it, and :func:`host_pool_rows`
does so where the plan runs the fused Copy-SFA on an NPU.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Tuple

import torch

from .. import platform as _platform
from ..ops.fused import MAX_TOKENS_PER_ROW, fused_shape_obstacles
from .op_rungs import StageRung, policy_stage, resolve_rungs

__all__ = [
    "OpChoice",
    "OpPlan",
    "SelectionProblem",
    "OpSelectionError",
    "select_ops",
    "select_for_config",
    "registry_availability",
    "extension_availability",
    "host_rows_alignment",
    "fused_host_pool_rows",
    "host_pool_rows",
    "platform_of",
    "log_plan",
    "StageRung",
    "FUSED_KERNELS_OF",
    "HOST_ALIGN_BYTES",
]

logger = logging.getLogger(__name__)

#: The extension kernels each fused op needs (``torch.ops.sglang_ascend_offload.*``).
FUSED_KERNELS_OF: Dict[str, Tuple[str, ...]] = {
    "lightning_indexer_manage": ("npu_fused_lightning_indexer_manage",),
    "quant_lightning_indexer_manage": ("npu_fused_quant_lightning_indexer_manage",),
    "copy_sparse_flash_attention": ("npu_fused_scatter_copy_sparse_flash_attention", "npu_fused_register_host_memory"),
}
_SEPARATE_INDEXER = {"bf16": "lightning_indexer", "int8": "quant_lightning_indexer"}
_FUSED_INDEXER = {"bf16": "lightning_indexer_manage", "int8": "quant_lightning_indexer_manage"}
_LABEL = {
    "lightning_indexer_manage": "LIM",
    "quant_lightning_indexer_manage": "LIM-C8",
    "copy_sparse_flash_attention": "Copy-SFA",
}
#: Alignment ``aclrtHostRegister`` needs of each host pool slice the extension registers.
HOST_ALIGN_BYTES = 4096

#: Why a fused op cannot run here (``None``: it can): op name -> reason.
Availability = Callable[[str], Optional[str]]
#: ``select_ops(extension=REGISTERED)``: ask the registry's fused rungs (the default).
REGISTERED = "registered fused rungs"


@dataclass(frozen=True)
class OpChoice:
    """One stage's operators. stage: ``indexer`` or ``attention``; fused: the fused op
    runs; ops: the operator-ladder ops the stage runs, in order (one fused op, or the
    separate ops); kernels: the extension kernels it needs (empty when separate); source:
    what decided it (``setting`` = fused_lim / fused_copy_sfa, ``ops``, ``default``,
    ``engine`` = the engine's layout, ``consumer`` = what the caller wires); reason: why,
    in a sentence (logged)."""

    stage: str
    fused: bool
    ops: Tuple[str, ...]
    kernels: Tuple[str, ...]
    source: str
    reason: str


@dataclass(frozen=True)
class SelectionProblem:
    """A fused stage that cannot run: the registered rule id (``rules.py``), the problem, the fix."""

    rule: str
    problem: str
    fix: str


class OpSelectionError(ValueError):
    """The plan has problems; the message lists every one with its rule id and fix."""

    def __init__(self, problems: Tuple[SelectionProblem, ...]):
        self.problems = problems
        super().__init__(
            "sparse decode operator selection: " + "; ".join(f"[{p.rule}] {p.problem} (fix: {p.fix})" for p in problems)
        )


@dataclass(frozen=True)
class OpPlan:
    """The operators of one sparse decode setup.

    platform: ``npu`` / ``cuda`` / ``cpu``; ops: the ``ops`` setting; indexer / attention:
    the :class:`OpChoice` of each fused-or-separate pair; rungs: the
    :class:`~.op_rungs.StageRung` of each stage's separate op (which rung runs it, and
    why); problems: every reason the plan cannot run (empty: it can). :meth:`check`
    raises them. residency: the residency stage as the policy runs it
    (:func:`~.op_rungs.policy_stage`: ``residency_manage``'s own stage for ``lru``, the
    policy's step for another policy; ``None``: ``residency_manage``'s). The engine and
    the attention backend take every op they call from the plan (:meth:`impl`): what a
    decode step runs is :meth:`decode_stages`."""

    platform: str
    ops: str
    indexer: OpChoice
    attention: OpChoice
    problems: Tuple[SelectionProblem, ...] = ()
    rungs: Tuple[StageRung, ...] = ()
    residency: Optional[StageRung] = None

    def check(self) -> "OpPlan":
        """This plan, or :class:`OpSelectionError` listing every problem."""
        if self.problems:
            raise OpSelectionError(self.problems)
        return self

    def rung(self, op: str) -> StageRung:
        """The :class:`~.op_rungs.StageRung` of separate op ``op``."""
        for r in self.rungs:
            if r.op == op:
                return r
        raise KeyError(f"op {op!r} is not a separate op of this plan ({', '.join(r.op for r in self.rungs)})")

    def impl(self, op: str):
        """The ladder implementation (``OpImpl``) the plan runs ``op`` with: the fused rung
        of a fused op, the resolved rung of a separate one. A stage that cannot run is an
        :class:`OpSelectionError`; a rung not usable here an ``OpUnavailableError``."""
        from ..ops import registry

        if op in FUSED_KERNELS_OF:
            return registry.select(op, "fused")
        r = self.rung(op)
        if r.problem is not None:
            raise OpSelectionError((SelectionProblem(*r.problem),))
        return registry.select(op, r.rung)

    def residency_stage(self) -> StageRung:
        """The residency stage as the policy runs it (``residency_manage``'s for ``lru``)."""
        return self.residency if self.residency is not None else self.rung("residency_manage")

    def decode_stages(self) -> Tuple[Tuple[str, str, str, str], ...]:
        """``(stage, op, rung, via)`` of what one decode layer step runs, in stage order: a
        fused operator for the two stages it replaces, else each stage's separate op (the
        residency stage: :meth:`residency_stage`, the policy's)."""
        out = []
        for stage, choice, pair in (
            ("indexer", self.indexer, ("indexer", "residency")),
            ("attention", self.attention, ("miss_copy", "attention")),
        ):
            if choice.fused:
                out += [(s, choice.ops[0], "fused", "") for s in pair]
            else:
                stages = [self.residency_stage() if r.stage == "residency" else r for r in self.rungs]
                out += [(r.stage, r.op, r.rung, r.via) for r in stages if r.stage in pair]
        order = ("indexer", "residency", "miss_copy", "attention")
        return tuple(sorted(out, key=lambda t: order.index(t[0])))

    def describe(self) -> str:
        return "; ".join(_choice_text(self, c) for c in (self.indexer, self.attention))


def _choice_text(plan: OpPlan, choice: OpChoice) -> str:
    """``indexer: lightning_indexer[npu] + residency_manage[npu] (reason; ...)`` of one pair."""
    if choice.fused:
        return f"{choice.stage}: {choice.ops[0]}[fused] ({choice.reason})"
    rungs = [plan.residency_stage() if op == "residency_manage" else plan.rung(op) for op in choice.ops]
    rungs = rungs if plan.rungs else []
    ops = " + ".join(r.label() for r in rungs) or "+".join(choice.ops)
    why = "; ".join([choice.reason] + [f"{r.op}: {r.reason}" for r in rungs])
    return f"{choice.stage}: {ops} ({why})"


# ------------------------------------------------------------------ availability
def registry_availability(platform: str) -> Availability:
    """Availability on ``platform`` of the registered ``fused`` rungs: on CPU selected as
    the registry selects them (which registers the AscendC kernels' functional-model ops,
    built on first use); on an NPU the built ``_C_ascend`` extension, naming every kernel
    it lacks. A rung registered in their place (a test's stand-in) answers for itself."""
    from ..ops import ascendc_cpu_ops, npu_impls, registry

    def why_not(op: str) -> Optional[str]:
        impl = registry.implementations(op).get("fused")
        if impl is None:
            return "no fused rung is registered"
        if impl.fn.__module__ != "sglang_ascend_offload.ops.fused":
            return impl.unavailable()
        if platform == "cpu":
            try:
                registry.select(op, "fused")
                return None
            except registry.OpUnavailableError as exc:
                return str(exc).split("cannot run here: ", 1)[-1]
        if ascendc_cpu_ops.registered():
            return f"the fused ops loaded in this process are the CPU functional model, which does not serve {platform}"
        if platform != "npu":
            return f"the AscendC extension {npu_impls.FUSED_EXTENSION_MODULE} serves Ascend NPUs only"
        reason = npu_impls._npu_extension_unavailable()
        if reason is not None:
            return reason
        namespace = getattr(torch.ops, npu_impls.FUSED_OP_NAMESPACE)
        missing = [k for k in FUSED_KERNELS_OF[op] if not hasattr(namespace, k)]
        return (
            (
                f"the AscendC extension {npu_impls.FUSED_EXTENSION_MODULE} does not provide {', '.join(missing)} "
                "(built from an older source tree)"
            )
            if missing
            else None
        )

    return why_not


def extension_availability(module, platform: str = "npu") -> Availability:
    """Availability from an extension module object: its attributes are the kernels it
    provides (``None``: the extension is not built or does not import here)."""
    from ..ops.npu_impls import FUSED_EXTENSION_MODULE

    def why_not(op: str) -> Optional[str]:
        if module is None:
            return f"the AscendC extension {FUSED_EXTENSION_MODULE} is not available on {platform}"
        missing = [k for k in FUSED_KERNELS_OF[op] if not hasattr(module, k)]
        return f"the extension does not provide {', '.join(missing)}" if missing else None

    return why_not


def _strip_hint(reason: str) -> str:
    from ..ops.npu_impls import FUSED_BUILD_HINT

    return reason.replace("; on an Ascend node: " + FUSED_BUILD_HINT, "").replace("; " + FUSED_BUILD_HINT, "")


# ------------------------------------------------------------------ choices
def _wanted(setting: Optional[bool], name: str, ops: str, platform: str) -> Tuple[bool, bool, str, str]:
    """``(fused, explicit, source, reason)`` of one stage from its setting and ``ops``."""
    if setting is True:
        return True, True, "setting", f"{name}=true"
    if setting is False:
        return False, True, "setting", f"{name}=false selects the separate operators"
    if ops == "fused":
        return True, True, "ops", "ops=fused"
    if ops == "auto" and platform == "npu":
        return True, False, "default", f"the default on an Ascend NPU ({name} unset, ops=auto)"
    if ops == "auto":
        return False, False, "default", f"no fused default off the NPU (ops=auto on {platform})"
    return False, False, "ops", f"ops={ops} runs the separate operators on the {ops} rung"


def _missing(choice: OpChoice, available: Availability) -> Optional[str]:
    """What the fused op of ``choice`` lacks here, in a sentence (``None``: nothing)."""
    op = choice.ops[0]
    reason = available(op)
    if reason is None:
        return None
    return (
        f"{choice.reason} cannot run: fused {_LABEL[op]} ({op}, kernels {', '.join(FUSED_KERNELS_OF[op])}): "
        f"{_strip_hint(reason)}"
    )


def select_ops(
    platform: Optional[str] = None,
    *,
    ops: str = "auto",
    fused_lim: Optional[bool] = None,
    fused_copy_sfa: Optional[bool] = None,
    indexer_dtype: str = "bf16",
    rows_per_request: int = 1,
    tensor_pool: bool = True,
    indexer_wired: bool = True,
    policy: str = "lru",
    residency: str = "always",
    extension=REGISTERED,
    available: Optional[Availability] = None,
    hot_tokens: Optional[int] = None,
    top_k: Optional[int] = None,
    manage_impl: str = "torch",
) -> OpPlan:
    """The :class:`OpPlan` for these settings (module docstring for the rule).

    platform: default :func:`platform.device_kind`. rows_per_request: query rows sharing
    a hot buffer (speculative verify rows). tensor_pool: the host pool has a tensor view
    (not MemFabric global addresses). indexer_wired: the caller runs the fused indexer
    when the plan selects it. policy: the residency policy (the fused indexer's residency
    step is exact LRU: ``lru`` only). residency: ``always`` or ``adaptive`` (the fused
    indexer steps every row's residency, so it cannot serve ``adaptive``'s direct rows).
    hot_tokens, top_k: the residency shape, when known (the engine, the served pool): a
    shape outside the fused kernels' limits (:func:`~..ops.fused.fused_shape_obstacles`)
    is one more reason a stage cannot run fused. extension: :data:`REGISTERED` (the default:
    the registry's fused rungs, :func:`registry_availability`), or an extension module
    object whose attributes are its kernels (``None``: not built); available: an
    :data:`Availability`, which takes precedence. manage_impl: the engine's ``manage_impl``
    (``auto`` / ``kernel``: the residency step and the miss copy on the CPU kernels where
    :func:`~.policies.uses_cpu_kernel` says so; the plan's rungs name them). The separate
    ops' rungs (:func:`.op_rungs.resolve_rungs`) probe this machine for ``ops=auto``
    unless ``extension`` or ``available`` describe another one. Problems are in
    ``plan.problems``; :meth:`OpPlan.check` raises.
    """
    platform = platform or _platform.device_kind()
    rungs = resolve_rungs(platform, ops, indexer_dtype, probe=available is None and extension is REGISTERED)
    rungs, kernel = _with_cpu_kernels(rungs, platform, policy, manage_impl, tensor_pool)
    policy_step = policy_stage(policy, next(r for r in rungs if r.stage == "residency"), platform, kernel)
    if available is None:
        available = (
            registry_availability(platform) if extension is REGISTERED else extension_availability(extension, platform)
        )
    problems = []
    shape_lim, shape_sfa = (
        ("", "")
        if hot_tokens is None or top_k is None
        else fused_shape_obstacles(int(hot_tokens), int(top_k), rows_per_request)
    )
    indexer = _indexer_choice(
        platform,
        ops,
        fused_lim,
        indexer_dtype,
        _indexer_obstacle(indexer_wired, policy, rows_per_request, residency) or shape_lim,
        problems,
    )
    attention = _attention_choice(platform, ops, fused_copy_sfa, rows_per_request, tensor_pool, problems, shape_sfa)
    missing = [m for m in (_missing(c, available) for c in (indexer, attention) if c.fused) if m]
    if missing:
        problems.append(_missing_problem(platform, missing))
    problems += [SelectionProblem(*r.problem) for r in rungs if r.problem is not None]
    return OpPlan(platform, ops, indexer, attention, tuple(problems), rungs, policy_step)


def _with_cpu_kernels(rungs, platform: str, policy: str, manage_impl: str, tensor_pool: bool):
    """``(rungs, kernel)``: ``kernel`` whether the engine steps the policy's CPU kernel
    (:func:`~.policies.uses_cpu_kernel`); ``rungs`` with ``via="cpu kernel"`` on
    ``residency_manage`` where that kernel is the LRU one (policy ``lru``) and, over a
    host pool with a tensor view, on the miss copy (the reference rung's CPU kernel)."""
    from types import SimpleNamespace

    from .policies import DEFAULT_POLICY, uses_cpu_kernel

    by_stage = {r.stage: r for r in rungs}
    residency, copy = by_stage["residency"], by_stage["miss_copy"]
    if platform != "cpu" or not uses_cpu_kernel(policy, manage_impl, "cpu", SimpleNamespace(rung=residency.rung)):
        return rungs, False
    kernel = {"residency": policy == DEFAULT_POLICY, "miss_copy": copy.rung == "reference" and tensor_pool}
    return tuple(replace(r, via="cpu kernel") if kernel.get(r.stage) else r for r in rungs), True


def _missing_problem(platform: str, missing) -> SelectionProblem:
    from ..ops.npu_impls import FUSED_BUILD_HINT

    if platform != "npu":
        cpu = (
            "on CPU the fused rung is the AscendC kernels on their functional model, built on first use "
            "(needs g++; scripts/setup_cpu_env.sh prebuilds it); "
            if platform == "cpu"
            else ""
        )
        return SelectionProblem(
            "sparse_decode.fused_device",
            f"no fused rung on {platform}: " + "; ".join(missing),
            f"{cpu}or use ops=auto|reference|triton with fused_lim / fused_copy_sfa unset or false; on an Ascend "
            f"node: {FUSED_BUILD_HINT}",
        )
    return SelectionProblem(
        "sglang.fused_unavailable",
        "; ".join(missing),
        f'{FUSED_BUILD_HINT} (or bash scripts/setup_npu_env.sh); or set "fused_lim": false / '
        '"fused_copy_sfa": false for the separate torch_npu operators',
    )


def _indexer_obstacle(wired: bool, policy: str, rows_per_request: int, residency: str = "always") -> str:
    """Why the fused indexer cannot serve this caller, in a clause ("" when it can)."""
    if not wired:
        return "this caller does not call the fused indexer"
    if policy != "lru":
        return (
            f"policy {policy!r}: the fused indexer's residency step is exact LRU (policy lru); the separate "
            "indexer feeds the policy's own residency step"
        )
    if rows_per_request > MAX_TOKENS_PER_ROW:
        return (
            f"{rows_per_request} verify rows share each request's hot buffer and the fused indexer steps a row "
            f"shared by at most {MAX_TOKENS_PER_ROW} query tokens"
        )
    if residency == "adaptive":
        return (
            "residency 'adaptive' serves the requests that fit their hot buffer outside the residency step, "
            "and the fused indexer steps every row's residency itself"
        )
    return ""


def _indexer_choice(platform, ops, fused_lim, indexer_dtype, why_not, problems) -> OpChoice:
    fused, _, source, reason = _wanted(fused_lim, "fused_lim", ops, platform)
    label = _LABEL[_FUSED_INDEXER[indexer_dtype]]
    if fused and why_not:
        # Only fused_lim=true insists on the fused indexer; ops=fused asks for the fused rung
        # of the ops that have one, and the default is the fused indexer where it can serve.
        if source == "setting":
            problems.append(
                SelectionProblem(
                    "sglang.fused_not_wired",
                    f"{reason} selects the fused {label} operator, which cannot serve here: {why_not}",
                    'drop "fused_lim" (or set it to false)',
                )
            )
        else:
            fused, source = False, "consumer"
            reason = f"{reason} would be fused {label}, but {why_not}: the separate indexer runs"
    if fused:
        op = _FUSED_INDEXER[indexer_dtype]
        return OpChoice("indexer", True, (op,), FUSED_KERNELS_OF[op], source, reason)
    return OpChoice("indexer", False, (_SEPARATE_INDEXER[indexer_dtype], "residency_manage"), (), source, reason)


def _attention_choice(
    platform, ops, fused_copy_sfa, rows_per_request, tensor_pool, problems, shape_obstacle: str = ""
) -> OpChoice:
    fused, explicit, source, reason = _wanted(fused_copy_sfa, "fused_copy_sfa", ops, platform)
    why_not = shape_obstacle
    if not tensor_pool:
        why_not = "the host pool has no tensor view (MemFabric global addresses): it is read by its own gather"
    elif rows_per_request > MAX_TOKENS_PER_ROW:
        why_not = (
            f"{rows_per_request} verify rows share each request's hot buffer and the fused Copy-SFA "
            f"operator serves a row shared by at most {MAX_TOKENS_PER_ROW} query tokens"
        )
    if fused and why_not:
        if explicit:
            problems.append(
                SelectionProblem(
                    "sparse_decode.fused_copy_sfa_engine",
                    f"{reason} selects the fused Copy-SFA operator, which cannot serve this engine: {why_not}",
                    'set "fused_copy_sfa": false, or ops=auto|reference|triton',
                )
            )
        else:
            fused, source, reason = False, "engine", f"{reason}, but {why_not}: the separate operators run"
    op = "copy_sparse_flash_attention"
    if fused:
        return OpChoice("attention", True, (op,), FUSED_KERNELS_OF[op], source, reason)
    return OpChoice("attention", False, ("copy_miss_rows", "sparse_mla_attention"), (), source, reason)


def select_for_config(sd, platform: Optional[str] = None, **kw) -> OpPlan:
    """:func:`select_ops` for a :class:`~sglang_ascend_offload.config.SparseDecodeOffloadConfig`
    (``hot_tokens`` / ``top_k``: the residency shape, where the caller knows it)."""
    kw.setdefault("policy", sd.policy)
    kw.setdefault("residency", sd.residency)
    return select_ops(
        platform,
        ops=sd.ops,
        fused_lim=sd.fused_lim,
        fused_copy_sfa=sd.fused_copy_sfa,
        indexer_dtype=sd.indexer_dtype,
        **kw,
    )


_LOGGED: set = set()


def log_plan(plan: OpPlan, what: str = "sparse decode") -> None:
    """Log each stage pair's choice, with the rung of every separate op and why, once per
    process (the opt-out of an NPU default, a rung that runs an op the ``ops`` rung lacks)."""
    for choice in (plan.indexer, plan.attention):
        key = (what, plan.platform, plan.ops, choice, plan.rungs)
        if key in _LOGGED:
            continue
        _LOGGED.add(key)
        logger.info("%s %s", what, _choice_text(plan, choice))


# ------------------------------------------------------------------ host pool alignment
def host_rows_alignment(row_bytes: int) -> int:
    """Rows per layer that make every layer slice of a host pool start 4 KiB-aligned."""
    return HOST_ALIGN_BYTES // math.gcd(HOST_ALIGN_BYTES, int(row_bytes))


def fused_host_pool_rows(rows: int, row_bytes: int) -> int:
    """``rows`` rounded up to :func:`host_rows_alignment` (what fused Copy-SFA needs)."""
    align = host_rows_alignment(row_bytes)
    return -(-int(rows) // align) * align


def platform_of(device) -> str:
    """``npu`` / ``cuda`` / ``cpu`` of a device (``torch.device`` or a string like ``npu:0``)."""
    kind = str(device).split(":")[0]
    return kind if kind in ("npu", "cuda") else "cpu"


def host_pool_rows(sd, rows: int, row_bytes: int, platform: str, rows_per_request: int = 1) -> int:
    """Rows per layer of a sparse decode host pool asked to hold ``rows``: rounded up to
    :func:`host_rows_alignment` where the plan for ``sd`` (a ``SparseDecodeOffloadConfig``)
    runs the fused Copy-SFA or the fused miss copy, whose extension registers each layer's
    slice with ``aclrtHostRegister`` (logged when it rounds); ``rows`` otherwise."""
    plan = select_for_config(sd, platform, rows_per_request=rows_per_request, available=lambda op: None)
    registers = plan.attention.fused or plan.rung("copy_miss_rows").rung == "fused"
    if not registers:  # (on CPU the kernels' functional model holds the same requirement)
        return int(rows)
    aligned = fused_host_pool_rows(rows, row_bytes)
    if aligned != rows:
        logger.info(
            "sparse decode host pool: %d rows per layer rounded up to %d (a multiple of %d): the fused "
            "Copy-SFA / miss copy registers each layer's slice, which must start 4 KiB-aligned",
            rows,
            aligned,
            host_rows_alignment(row_bytes),
        )
    return aligned
