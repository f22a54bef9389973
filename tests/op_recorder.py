"""Which operators ran: a recording wrapper around every implementation the ladder has.

:func:`record_ops` replaces, for the duration of a test, every registered implementation
of every op (``OpImpl.fn`` and its rows form, in the registry and in the module that
defines it), the engine's direct binding of the reference copy's rows form, the CPU
residency kernels' entry points, and every residency policy's own step with wrappers that
append ``(op, rung, via)`` to a list and call through (an op's own inner calls are not
recorded). Whatever a decode step calls -- through its operator plan or around it -- is
in the list, so a test can assert that the ops that ran are exactly the plan's
(``OpPlan.decode_stages``). The runtime has no seam for this: the wrappers replace the
registry's entries, module attributes and policy methods from the test
(``monkeypatch``), before the engine or backend under test is built (they bind their ops
at construction).

A policy other than ``lru`` records ``(residency_<policy>, rung, via)`` for the code path
that ran: its CPU kernel (``reference``, ``cpu kernel``), its Triton kernel (``triton``),
or its torch composition (``RankedManager.step`` / ``GuardedManager.step``), recorded as
``npu`` when its state is on an npu device and the engine handed it a rung other than
the reference (the npu rung of ``residency_manage`` is that same composition on the
device), else ``reference``. A guarded policy's ghost ``residency_manage`` call runs
inside its step, so it is the policy's, not recorded apart.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from typing import Callable, Dict, List, Optional, Set, Tuple

Call = Tuple[str, str, str]  # (op, rung, via): via "cpu kernel" for the CPU kernels


_depth = threading.local()


def _recording(fn: Callable, what: Call, calls: List[Call]) -> Callable:
    """``fn`` that records ``what`` when called from outside any recorded op (an op's own
    inner calls -- the npu stand-in computing torch_npu's attention with the reference op,
    a composition calling its sub-steps -- are that op's, not the step's)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_depth, "value", 0)
        if depth == 0:
            calls.append(what)
        _depth.value = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.value = depth

    return wrapper


def _recording_policy(fn: Callable, describe: Callable, calls: List[Call]) -> Callable:
    """A policy method ``fn(self, ...)`` that records ``describe(self)`` as
    :func:`_recording` records (outermost calls only)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return _recording(functools.partial(fn, self), describe(self), calls)(*args, **kwargs)

    return wrapper


def _torch_rung(manager) -> str:
    on_npu = manager.table.slot_token.device.type == "npu"
    return "npu" if on_npu and getattr(manager.manage_op, "rung", "reference") != "reference" else "reference"


def _record_policies(monkeypatch, calls: List[Call]) -> None:
    """Wrap each policy's own step paths (module docstring)."""
    from sglang_ascend_offload.sparse_decode.policies import base, guarded, residency_op, score_rank
    from sglang_ascend_offload.sparse_decode.policies.score_rank_guarded import ScoreGuardedManager

    for cls in (base.RankedManager, guarded.GuardedManager):  # the torch compositions
        monkeypatch.setattr(
            cls, "step", _recording_policy(cls.step, lambda m: (residency_op(m.policy), _torch_rung(m), ""), calls)
        )
    for cls in (score_rank.ScoreRankManager, ScoreGuardedManager):  # the score-aware CPU kernel
        kernel = cls.__dict__["kernel_step_rows"]
        describe = lambda m: (residency_op(m.policy), "reference", "cpu kernel")  # noqa: E731
        monkeypatch.setattr(cls, "kernel_step_rows", _recording_policy(kernel, describe, calls))
    from sglang_ascend_offload import platform

    if platform.device_kind() == "npu":  # no Triton here (triton-ascend is not in the npu tests' runs)
        return
    try:  # score_rank's Triton kernel (imported by the policy at call time)
        from sglang_ascend_offload.triton_ops import score_rank as triton_score_rank
    except ImportError:
        return
    what = (residency_op("score_rank"), "triton", "")
    monkeypatch.setattr(
        triton_score_rank, "score_rank_manage", _recording(triton_score_rank.score_rank_manage, what, calls)
    )


def record_ops(monkeypatch, originals: Optional[Dict[Tuple[str, str], object]] = None) -> List[Call]:
    """Install the recorders (undone with ``monkeypatch``); returns the list they fill.
    ``originals``: filled with each ``(op, rung)``'s unrecorded ``OpImpl`` (for a
    comparison path whose calls are not the subject)."""
    from sglang_ascend_offload.ops import registry
    from sglang_ascend_offload.sparse_decode import cpu_kernel
    from sglang_ascend_offload.sparse_decode import engine as engine_mod

    registry.ensure_registered()
    calls: List[Call] = []
    for key, impl in list(registry._REGISTRY.impls.items()):
        if originals is not None:
            originals[key] = impl
        what = (impl.op, impl.rung, "")
        fn = _recording(impl.fn, what, calls)
        rows = _recording(impl.rows_form, what, calls) if impl.rows_form is not None else None
        monkeypatch.setitem(registry._REGISTRY.impls, key, dataclasses.replace(impl, fn=fn, rows_form=rows))
        for original, wrapped in ((impl.fn, fn), (impl.rows_form, rows)):
            if original is not None:  # a call through the defining module, around the registry
                monkeypatch.setattr(sys.modules[original.__module__], original.__name__, wrapped)
    reference_copy = registry._REGISTRY.impls[("copy_miss_rows", "reference")].rows_form
    monkeypatch.setattr(engine_mod, "copy_miss_rows_rows", reference_copy)  # bound at import in engine.py
    for name, op in (("lru_manage_rows", "residency_manage"), ("copy_miss_rows_rows", "copy_miss_rows")):
        original = getattr(cpu_kernel, name)
        monkeypatch.setattr(cpu_kernel, name, _recording(original, (op, "reference", "cpu kernel"), calls))
    _record_policies(monkeypatch, calls)
    return calls


def planned(plan, stages=("indexer", "residency", "miss_copy", "attention")) -> Set[Call]:
    """``(op, rung, via)`` of ``plan``'s decode stages among ``stages``."""
    return {(op, rung, via) for stage, op, rung, via in plan.decode_stages() if stage in stages}
