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

* an explicit rung is that rung's implementation of the op; a rung without one (e.g.
  attention has no Triton implementation) is an :class:`OpUnavailableError`: nothing is
  substituted here. Which rung runs an op that the configured ``ops`` rung lacks is the
  decode step's operator plan's decision (``sparse_decode/op_selection.py``), which
  names it per stage and logs it;
* an explicit rung that exists for an op but is not usable here (missing package,
  wrong device) is an :class:`OpUnavailableError` naming what is missing;
* ``auto`` picks, per op, the first usable rung in the device's preference order
  (:data:`AUTO_ORDER`);
* ``fused`` on a CPU platform registers the AscendC kernels run on their functional
  model (``ops/ascendc_cpu_ops.py``) as the fused ops first: a correctness path.

Registration is explicit: the implementation modules only *mark* their functions
(:func:`~sglang_ascend_offload.ops.contract.implements`, which also checks each one
against the op's contract signature); :func:`ensure_registered` imports the fixed
list :data:`IMPL_MODULES` once and collects the marked functions. Every query of the
registry (:func:`ops`, :func:`implementations`, :func:`select`) calls it first, so
no caller depends on import order. Rung names, :class:`OpImpl` and the op signatures
live in ``ops/contract.py``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Dict, Tuple

from .. import platform
from .contract import CHOICES, IMPL_ATTR, OpImpl

logger = logging.getLogger(__name__)

#: Modules whose :func:`~sglang_ascend_offload.ops.contract.implements`-marked
#: functions make up the ladder. None imports torch_npu or triton at import time.
IMPL_MODULES = (
    "sglang_ascend_offload.ops.reference",
    "sglang_ascend_offload.ops.residency",
    "sglang_ascend_offload.ops.triton_impls",
    "sglang_ascend_offload.ops.npu_impls",
    "sglang_ascend_offload.ops.fused",
)

# Fastest first, per device kind. The Triton interpreter on CPU is far slower than
# torch, so ``auto`` never picks it there.
AUTO_ORDER = {
    "npu": ("fused", "npu", "triton", "reference"),
    "cuda": ("triton", "reference"),
    "cpu": ("reference",),
}


class OpUnavailableError(RuntimeError):
    """An explicitly requested implementation cannot run here."""


@dataclass
class _Registry:
    impls: Dict[Tuple[str, str], OpImpl] = field(default_factory=dict)
    loaded: bool = False


_REGISTRY = _Registry()
_LOGGED: set = set()


def ensure_registered() -> None:
    """Collect every implementation of :data:`IMPL_MODULES` (once; idempotent).

    Two implementations of the same op and rung are an error naming both.
    """
    if _REGISTRY.loaded:
        return
    impls: Dict[Tuple[str, str], OpImpl] = {}
    for name in IMPL_MODULES:
        module = importlib.import_module(name)
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            impl = getattr(fn, IMPL_ATTR, None)
            if impl is None or fn.__module__ != name:
                continue
            key = (impl.op, impl.rung)
            other = impls.get(key)
            if other is not None and other.fn is not fn:
                raise RuntimeError(
                    f"op {impl.op!r} rung {impl.rung!r} implemented twice: "
                    f"{other.fn.__module__}.{other.fn.__qualname__} and {name}.{fn.__qualname__}"
                )
            impls[key] = impl
    _REGISTRY.impls.update(impls)
    _REGISTRY.loaded = True


def ops() -> Tuple[str, ...]:
    ensure_registered()
    return tuple(sorted({op for op, _ in _REGISTRY.impls}))


def implementations(op: str) -> Dict[str, OpImpl]:
    ensure_registered()
    return {rung: impl for (o, rung), impl in _REGISTRY.impls.items() if o == op}


def select(op: str, choice: str = "auto") -> OpImpl:
    """Resolve ``op`` under ``choice``; raises :class:`OpUnavailableError`."""
    if choice not in CHOICES:
        raise ValueError(f"ops choice {choice!r}: expected one of {CHOICES}")
    impls = implementations(op)
    if not impls:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(ops())}")
    _prepare_rung(choice)
    if choice == "auto":
        for rung in AUTO_ORDER[platform.device_kind()]:
            impl = impls.get(rung)
            if impl is not None and impl.unavailable() is None:
                return _log_once(impl, choice)
        raise OpUnavailableError(f"op {op!r}: no implementation usable on this machine")
    impl = impls.get(choice)
    if impl is None:
        raise OpUnavailableError(
            f"op {op!r} has no {choice!r} implementation (it has: {', '.join(sorted(impls))}); a decode "
            "setup's operator plan (sparse_decode/op_selection.py) names the rung each of its ops runs on"
        )
    reason = impl.unavailable()
    if reason is not None:
        raise OpUnavailableError(f"op {op!r} with ops={choice!r} cannot run here: {reason}")
    return _log_once(impl, choice)


def _prepare_rung(choice: str) -> None:
    """An explicit ``fused`` on a CPU platform is the AscendC kernels on the functional
    model: register those ops (build on first use, logged). A failed build (or a namespace
    owned by the extension) is an :class:`OpUnavailableError` saying what to install;
    nothing falls back."""
    from . import ascendc_cpu_ops
    from .npu_impls import FUSED_BUILD_HINT

    try:
        ascendc_cpu_ops.ensure_for_choice(choice)
    except RuntimeError as exc:  # ModelBuildError, or the namespace is not the model's to take
        raise OpUnavailableError(
            f"ops={choice!r} on CPU runs the AscendC kernels on their functional model, "
            f"which cannot be registered here: {exc}; on an Ascend node: "
            f"{FUSED_BUILD_HINT}"
        ) from exc


def _log_once(impl: OpImpl, choice: str) -> OpImpl:
    key = (impl.op, impl.rung, choice)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("op %s: using %s implementation (ops=%s)", impl.op, impl.rung, choice)
    return impl
