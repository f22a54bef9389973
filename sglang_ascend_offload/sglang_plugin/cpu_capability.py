"""CUDA calls that SGLang makes unconditionally, answered without CUDA inside a scope.

:class:`NoCudaScope` is the one helper: a context variable set by :meth:`NoCudaScope.active`
and an AROUND hook (:meth:`NoCudaScope.around`, registered through SGLang's HookRegistry on
a ``torch.cuda`` function) that, only inside the scope and only when CUDA is really
unavailable, returns a fixed answer instead of calling the function. Everywhere else
the hooked function behaves exactly as before. Two scopes use it:

* here, ``torch.cuda.get_device_capability``: for DeepSeek-family DSA models, SGLang
  0.5.23's argument resolution calls it on every platform that is neither NPU nor XPU
  (in ``arg_groups/model_hook.py`` and twice in ``arg_groups/overrides.py``; locations
  in docs/design/sglang_hooks.md); on a CPU-only torch that raises ``AssertionError: Torch not compiled with CUDA
  enabled``.
  Inside :func:`no_cuda_capability` (entered by the plugin's wrapper of the
  ``handle_model_specific_adjustments`` resolution step on ``--device cpu``) it returns
  ``(0, 0)``. SGLang reads that as a pre-Hopper device: the DSA KV cache defaults to
  bfloat16 and the CUDA-only DSA kernel choices it records are never used by the
  ``ascend_offload`` backend.
* ``speculative/eagle.py``: ``torch.cuda.synchronize`` inside ``set_embed_and_head``
  (``speculative.eagle.no_cuda_sync``) returns ``None``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Tuple

import torch

__all__ = ["NoCudaScope", "NO_CUDA_CAPABILITY", "no_cuda_capability", "capability_around"]


class NoCudaScope:
    """A context-var scope in which a hooked CUDA function returns ``answer`` without CUDA.

    name: the context variable's name (for debugging). answer: what the hooked function
    returns inside the scope when ``torch.cuda.is_available()`` is false. Scopes nest and
    are per thread / per asyncio task (``contextvars``); leaving one restores the outer state.
    """

    def __init__(self, name: str, answer: Any):
        self.answer = answer
        self._active: contextvars.ContextVar[bool] = contextvars.ContextVar(name, default=False)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside: the hooked function answers :attr:`answer` when CUDA is unavailable."""
        token = self._active.set(True)
        try:
            yield
        finally:
            self._active.reset(token)

    def is_active(self) -> bool:
        return self._active.get()

    def around(self, original: Callable, *args, **kwargs):
        """HookRegistry AROUND hook: :attr:`answer` inside the scope without CUDA, else ``original``."""
        if self._active.get() and not torch.cuda.is_available():
            return self.answer
        return original(*args, **kwargs)


NO_CUDA_CAPABILITY: Tuple[int, int] = (0, 0)
_CAPABILITY = NoCudaScope("sglang_ascend_offload_no_cuda", NO_CUDA_CAPABILITY)

#: Scope of the ``handle_model_specific_adjustments`` resolution step on a CPU.
no_cuda_capability = _CAPABILITY.active
#: HookRegistry AROUND hook for ``torch.cuda.get_device_capability``.
capability_around = _CAPABILITY.around
