"""Residency replacement policies behind one contract, and the one registry of them.

A :class:`ResidencyManager` (``base.py``) owns the residency state of one layer and
turns one step's inputs (``topk``, ``req_ids``, ``stable_len``, ``step``) into a
:class:`~sglang_ascend_offload.ops.contract.ResidencyStep`. One module per policy;
``policy`` in :class:`~sglang_ascend_offload.config.SparseDecodeOffloadConfig` names it:

* ``lru`` (the default): ``lru.py``; CPU kernel ``cpu_kernel.py`` (``csrc/lru_cpu.cpp``)
* ``lru_k2``: ``lru_k2.py``; torch only
* ``lru_k2_guarded``: ``guarded.py``; torch only
* ``score_rank`` and its variant ``score_rank_smooth``: ``score_rank.py``; CPU kernel
  ``score_kernel.py`` (``csrc/score_rank_cpu.cpp``) for ``score_rank`` only
* ``score_rank_guarded``: ``score_rank_guarded.py``; CPU kernel ``score_kernel.py``

A compiled CPU kernel is an implementation of the policy it accelerates, not a policy
of its own: the policy's class takes ``impl`` (``"torch"`` | ``"kernel"``) and steps
through one or the other with the same state and results. :func:`make_manager` maps
the engine's ``manage_impl`` setting onto it (:func:`uses_cpu_kernel`): ``torch``
never the kernel, ``kernel`` always (an error for a policy without one), ``auto`` the
kernel for a policy that has one on a CPU device on the reference rung. A kernel asked
for but not available is an error at construction saying how to build it, never a
silent fall back to torch.

What a decode step's residency stage runs is the policy's own step: an operator plan
names it ``residency_manage`` for ``lru`` (the ladder op) and ``residency_<policy>``
otherwise (:func:`residency_op`; ``op_rungs.policy_stage`` says on which rung, from
``has_cpu_kernel`` / ``has_triton_kernel`` / ``steps_ghost_lru``).
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import torch

from ...ops.residency import residency_manage
from .base import ManageOp, RankedManager, ResidencyManager
from .guarded import GuardedManager
from .lru import LRUManager
from .lru_k2 import LRU2Manager
from .score_rank import RankedInputError, ScoreRankManager, SmoothScoreRankManager, slot_ranks
from .score_rank_guarded import ScoreGuardedManager

__all__ = [
    "POLICIES",
    "DEFAULT_POLICY",
    "ResidencyManager",
    "RankedManager",
    "LRUManager",
    "LRU2Manager",
    "GuardedManager",
    "ScoreRankManager",
    "SmoothScoreRankManager",
    "ScoreGuardedManager",
    "RankedInputError",
    "MANAGE_IMPLS",
    "make_manager",
    "needs_ranked",
    "residency_op",
    "slot_ranks",
    "uses_cpu_kernel",
]

#: Every policy by name (the ``policy`` config value); each class knows whether it has a
#: CPU kernel (``has_cpu_kernel``).
POLICIES: Dict[str, Type[ResidencyManager]] = {
    cls.policy: cls
    for cls in (LRUManager, LRU2Manager, GuardedManager, ScoreRankManager, ScoreGuardedManager, SmoothScoreRankManager)
}

#: The contract itself (``docs/residency_contract.md``): the policy of the ``residency_manage``
#: op, which the operator ladder's rungs implement.
DEFAULT_POLICY = LRUManager.policy

#: ``manage_impl`` choices of :func:`make_manager` / the engine.
MANAGE_IMPLS = ("auto", "kernel", "torch")


def residency_op(policy: str) -> str:
    """What an operator plan names ``policy``'s residency step: the ladder op
    ``residency_manage`` for exact LRU (the contract, which the rungs implement), else
    ``residency_<policy>``, the policy's own step (its torch composition, or its CPU /
    Triton kernel)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown residency policy {policy!r}; known: {', '.join(POLICIES)}")
    return "residency_manage" if policy == DEFAULT_POLICY else f"residency_{policy}"


def needs_ranked(policy: str) -> bool:
    """Whether ``policy`` must be given the indexer's ranking every step."""
    return bool(getattr(POLICIES.get(policy), "needs_ranked", False))


def _kernel_policies():
    return [name for name, cls in POLICIES.items() if cls.has_cpu_kernel]


def uses_cpu_kernel(policy: str, manage_impl: str, device, manage_op: ManageOp) -> bool:
    """Whether :func:`make_manager` picks the policy's CPU kernel: ``kernel`` always
    (policies with one only: a ``ValueError`` naming them otherwise), ``auto`` for those
    policies on a CPU device when the op resolved to the reference rung, ``torch`` never."""
    if manage_impl not in MANAGE_IMPLS:
        raise ValueError(f"manage_impl {manage_impl!r}: expected one of {MANAGE_IMPLS}")
    has_kernel = getattr(POLICIES.get(policy), "has_cpu_kernel", False)
    if manage_impl == "kernel":
        if not has_kernel:
            raise ValueError(
                f"the CPU residency kernels implement policies {', '.join(_kernel_policies())} only, not {policy!r}"
            )
        return True
    cpu = device is None or torch.device(device).type == "cpu"
    return manage_impl == "auto" and has_kernel and cpu and getattr(manage_op, "rung", "reference") == "reference"


def make_manager(
    policy: str,
    rows: int,
    hot_tokens: int,
    device=None,
    manage_op: ManageOp = residency_manage,
    *,
    manage_impl: str = "torch",
    max_positions: Optional[int] = None,
) -> ResidencyManager:
    """A fresh manager of ``policy`` for one layer; unknown names list the known ones.

    ``manage_impl``: ``torch`` (default here: the op ladder / torch policies), ``kernel``
    (the policy's CPU kernel: ``lru``, ``score_rank``, ``score_rank_guarded``) or ``auto``
    (see :func:`uses_cpu_kernel`); it becomes the manager's ``impl``. ``max_positions``
    sizes the LRU kernel's dense position map (hash map without it).
    """
    cls = POLICIES.get(policy)
    if cls is None:
        raise ValueError(f"unknown residency policy {policy!r}; known: {', '.join(POLICIES)}")
    impl = "kernel" if uses_cpu_kernel(policy, manage_impl, device, manage_op) else "torch"
    return cls(rows, hot_tokens, device, manage_op, impl=impl, max_positions=max_positions)
