"""The operator ladder: op name -> implementations, with explicit selection.

Every compute step with a fused NPU kernel is an *op* with one semantics (its
``reference`` implementation, plain torch) and possibly faster rungs:

=========  =====================================================================
rung       meaning
=========  =====================================================================
reference  torch, any device. The specification every other rung is tested against.
triton     Triton kernels (triton-ascend on NPU, upstream on CUDA, interpreter on CPU)
npu        torch_npu built-in operators
fused      this project's AscendC operators (LIM, LIM-C8, Copy-SFA)
=========  =====================================================================

Selection is by rung name (``auto | reference | triton | npu | fused``):

* an explicit rung uses that rung for every op that *has* it, and the reference for
  ops that have no implementation on that rung at all (e.g. attention has no Triton
  implementation); the resolved table is logged once, so nothing is silent;
* an explicit rung that exists for an op but is not usable here (missing package,
  wrong device) is an :class:`OpUnavailableError` naming what is missing;
* ``auto`` picks, per op, the first usable rung in the device's preference order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from .. import platform

logger = logging.getLogger(__name__)

RUNGS = ("reference", "triton", "npu", "fused")
CHOICES = ("auto",) + RUNGS

# Fastest first, per device kind. The Triton interpreter on CPU is far slower than
# torch, so ``auto`` never picks it there.
_AUTO_ORDER = {
    "npu": ("fused", "npu", "triton", "reference"),
    "cuda": ("triton", "reference"),
    "cpu": ("reference",),
}


class OpUnavailableError(RuntimeError):
    """An explicitly requested implementation cannot run here."""


@dataclass(frozen=True)
class OpImpl:
    """One implementation of one op.

    ``unavailable`` returns ``None`` when the implementation can run here, else a
    sentence saying what is missing and how to get it.
    """

    op: str
    rung: str
    fn: Callable
    unavailable: Callable[[], Optional[str]]

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@dataclass
class _Registry:
    impls: Dict[Tuple[str, str], OpImpl] = field(default_factory=dict)
    loaded: bool = False


_REGISTRY = _Registry()
_LOGGED: set = set()


def _always_available() -> Optional[str]:
    return None


def register(op: str, rung: str, unavailable: Callable[[], Optional[str]] = _always_available):
    """Decorator: register ``fn`` as the ``rung`` implementation of ``op``."""
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; expected one of {RUNGS}")

    def deco(fn: Callable) -> Callable:
        _REGISTRY.impls[(op, rung)] = OpImpl(op=op, rung=rung, fn=fn, unavailable=unavailable)
        return fn

    return deco


def _ensure_loaded() -> None:
    """Import the modules that register implementations (lazy, NPU-safe)."""
    if _REGISTRY.loaded:
        return
    _REGISTRY.loaded = True
    from . import reference  # noqa: F401  (registers the reference rung)

    try:
        from . import triton_impls  # noqa: F401  (imports triton lazily inside)
    except ImportError as exc:  # pragma: no cover - triton_impls guards its own imports
        logger.debug("triton implementations not registered: %s", exc)
    from . import npu_impls  # noqa: F401  (imports torch_npu lazily inside)


def ops() -> Tuple[str, ...]:
    _ensure_loaded()
    return tuple(sorted({op for op, _ in _REGISTRY.impls}))


def implementations(op: str) -> Dict[str, OpImpl]:
    _ensure_loaded()
    return {rung: impl for (o, rung), impl in _REGISTRY.impls.items() if o == op}


def select(op: str, choice: str = "auto") -> OpImpl:
    """Resolve ``op`` under ``choice``; raises :class:`OpUnavailableError`."""
    if choice not in CHOICES:
        raise ValueError(f"ops choice {choice!r}: expected one of {CHOICES}")
    impls = implementations(op)
    if not impls:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(ops())}")
    if choice == "auto":
        for rung in _AUTO_ORDER[platform.device_kind()]:
            impl = impls.get(rung)
            if impl is not None and impl.unavailable() is None:
                return _log_once(impl, choice)
        raise OpUnavailableError(f"op {op!r}: no implementation usable on this machine")
    impl = impls.get(choice)
    if impl is None:
        # This rung has no implementation of this op at all: the reference is the op.
        return _log_once(impls["reference"], choice)
    reason = impl.unavailable()
    if reason is not None:
        raise OpUnavailableError(f"op {op!r} with ops={choice!r} cannot run here: {reason}")
    return _log_once(impl, choice)


def resolve_all(choice: str = "auto") -> Dict[str, OpImpl]:
    """Resolve every op; collects *all* unavailable ones into one error."""
    resolved: Dict[str, OpImpl] = {}
    problems = []
    for op in ops():
        try:
            resolved[op] = select(op, choice)
        except OpUnavailableError as exc:
            problems.append(str(exc))
    if problems:
        raise OpUnavailableError("; ".join(problems))
    return resolved


def _log_once(impl: OpImpl, choice: str) -> OpImpl:
    key = (impl.op, impl.rung, choice)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("op %s: using %s implementation (ops=%s)", impl.op, impl.rung, choice)
    return impl
