"""Which rung runs each separate operator of a sparse decode setup, and why.

A decode layer step has four stages, each with one separate op of the operator ladder
(``ops/registry.py``): ``indexer`` (``lightning_indexer``, or ``quant_lightning_indexer``
over an int8 index-K cache), ``residency`` (``residency_manage``), ``miss_copy``
(``copy_miss_rows``) and ``attention`` (``sparse_mla_attention``). The fused operators
(``op_selection.py``) replace stages of a decode step, but the separate ops still run where
the fused ones do not (an extend's indexer and attention, a stage that gives way), so every
setup resolves a rung for each of the four. The rule, per op, from the ``ops`` setting:

* ``auto``: the first rung of :data:`~..ops.registry.AUTO_ORDER` on the platform that has
  the op (and, probing this machine, is usable);
* an explicit rung that implements the op: that rung;
* an explicit rung that does not (``fused`` has no separate ops, ``triton`` no indexer or
  attention): on an NPU the ``npu`` rung (torch_npu), elsewhere ``reference`` (CPU and CUDA
  have no other rung for those ops); the :class:`StageRung` says so and the plan's log
  names it.

On an NPU the torch reference never runs a decode stage unless asked for with ``ops:
"reference"``: a stage that would resolve to it is a :class:`~.op_selection.SelectionProblem`
(rule ``sglang.ops_unavailable``) saying what to set, at startup.

The residency stage runs ``residency_manage`` only for the exact-LRU policy (``lru``, the
contract). Another policy runs its own step (:func:`policy_stage`, op
``residency_<policy>``): its CPU kernel where the engine picks it, its Triton kernel on the
``triton`` rung where it has one, else its torch composition (the sub-steps of
``ops/residency.py`` with its own victim order) on the device, named like the
``residency_manage`` rung it sits beside (``npu``: torch_npu's kernels, as the npu rung of
``residency_manage`` is that composition; ``reference`` where asked for or off the NPU).
A guarded policy also steps its ghost exact-LRU table through ``residency_manage`` on the
resolved rung, inside its own step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["STAGES", "StageRung", "separate_ops", "resolve_rungs", "policy_stage"]

#: The stages of a decode layer step, in order.
STAGES = ("indexer", "residency", "miss_copy", "attention")
_SEPARATE_INDEXER = {"bf16": "lightning_indexer", "int8": "quant_lightning_indexer"}
_STAGE_OP = {"residency": "residency_manage", "miss_copy": "copy_miss_rows", "attention": "sparse_mla_attention"}


@dataclass(frozen=True)
class StageRung:
    """One stage's separate op and the rung that runs it.

    stage: one of :data:`STAGES`; op: the ladder op; rung: the rung whose implementation
    runs it (``None`` when none can: see ``problem``); reason: why, in a clause (logged);
    problem: ``(rule, problem, fix)`` when the stage cannot run as configured, else ``None``;
    via: ``cpu kernel`` where the engine runs the reference rung's CPU kernel
    (``sparse_decode/cpu_kernel.py``, bit-identical to it), else empty.
    """

    stage: str
    op: str
    rung: Optional[str]
    reason: str
    problem: Optional[Tuple[str, str, str]] = None
    via: str = ""

    def label(self) -> str:
        return f"{self.op}[{self.rung or '-'}{', ' + self.via if self.via else ''}]"


def separate_ops(indexer_dtype: str = "bf16") -> Tuple[Tuple[str, str], ...]:
    """``(stage, op)`` of each stage's separate op, in :data:`STAGES` order."""
    return (("indexer", _SEPARATE_INDEXER[indexer_dtype]),) + tuple((s, _STAGE_OP[s]) for s in STAGES[1:])


def resolve_rungs(platform: str, ops: str, indexer_dtype: str = "bf16", probe: bool = True) -> Tuple[StageRung, ...]:
    """The :class:`StageRung` of every stage (module docstring for the rule). ``probe``:
    ``auto`` picks the first rung usable on this machine (``False``: the first that exists,
    for a plan of another machine, e.g. ``check-config``)."""
    from ..ops import registry

    registry.ensure_registered()
    return tuple(
        _resolve(stage, op, platform, ops, registry.implementations(op), registry.AUTO_ORDER[platform], probe)
        for stage, op in separate_ops(indexer_dtype)
    )


def _resolve(stage: str, op: str, platform: str, ops: str, impls, order, probe: bool) -> StageRung:
    if ops == "auto":
        usable = [r for r in order if r in impls and (not probe or impls[r].unavailable() is None)]
        rung = usable[0] if usable else None
        reason = f"ops=auto: the first {'usable ' if probe else ''}rung of {', '.join(order)} on {platform}"
    elif ops in impls:
        rung, reason = ops, f"ops={ops}"
    else:
        stand_in = "npu" if platform == "npu" else "reference"
        rung = stand_in if stand_in in impls else None
        reason = f"ops={ops} has no {op}: the {stand_in} rung runs it"
        if stand_in == "reference":
            reason += f" (no other rung implements it on {platform})"
    if platform == "npu" and ops != "reference" and rung in (None, "reference"):
        return StageRung(stage, op, None, reason, _npu_problem(stage, op, ops, impls))
    return StageRung(stage, op, rung, reason)


def _npu_problem(stage: str, op: str, ops: str, impls) -> Tuple[str, str, str]:
    others = sorted(r for r in impls if r not in ("reference", "npu"))
    return (
        "sglang.ops_unavailable",
        f"ops={ops} on an Ascend NPU: the {stage} stage ({op}) has no usable npu rung, and the torch "
        'reference runs a decode stage on an NPU only when asked for with "ops": "reference"',
        'install torch_npu for the npu rung (bash scripts/setup_npu_env.sh), or set "ops": "reference" to run '
        "the torch reference" + (f', or "ops": "{others[0]}"' if others else ""),
    )


def policy_stage(policy: str, residency: StageRung, platform: str, kernel: bool) -> StageRung:
    """The residency stage as ``policy`` runs it (module docstring): ``residency`` itself for
    ``lru``; else a :class:`StageRung` of op ``residency_<policy>``. ``residency``: the
    resolved ``residency_manage`` stage (its rung decides the policy's, and a guarded
    policy's ghost runs on it); ``kernel``: the engine steps the policy's CPU kernel."""
    from .policies import DEFAULT_POLICY, POLICIES, residency_op

    if policy == DEFAULT_POLICY:
        return residency
    cls, op = POLICIES[policy], residency_op(policy)
    ghost = f"; its ghost exact LRU through residency_manage[{residency.rung}]" if cls.steps_ghost_lru else ""
    if kernel:
        return StageRung("residency", op, "reference", f"policy {policy}: its CPU kernel", via="cpu kernel")
    if residency.rung is None:
        return StageRung("residency", op, None, residency.reason, residency.problem)
    if residency.rung == "triton" and cls.has_triton_kernel:
        return StageRung("residency", op, "triton", f"policy {policy} on the triton rung: its Triton kernel{ghost}")
    rung = residency.rung if residency.rung in ("reference", "npu") else ("npu" if platform == "npu" else "reference")
    where = "torch_npu's kernels on the NPU" if rung == "npu" else "the torch reference"
    why = f"policy {policy}: its torch composition ({where}; {residency.reason}){ghost}"
    return StageRung("residency", op, rung, why)
