"""Answer SGLang's CUDA capability probes with "no CUDA" while resolving on a CPU.

For DeepSeek-family DSA models, SGLang 0.5.23's argument resolution calls
``torch.cuda.get_device_capability()`` on every platform that is neither NPU nor
XPU (``arg_groups/model_hook.py:341``, ``arg_groups/overrides.py:512`` and
``:631``); on a CPU-only torch that raises ``AssertionError: Torch not compiled with
CUDA enabled``. The plugin registers an AROUND hook on
``torch.cuda.get_device_capability`` through SGLang's HookRegistry which, only
inside :func:`no_cuda_capability` (entered by the plugin's wrapper of the
``handle_model_specific_adjustments`` resolution step on ``--device cpu``) and only
when CUDA is really unavailable, returns ``(0, 0)``. SGLang reads that as a
pre-Hopper device: the DSA KV cache defaults to bfloat16 and the CUDA-only DSA
kernel choices it records are never used by the ``ascend_offload`` backend.
Everywhere else the probe behaves exactly as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Tuple

import torch

NO_CUDA_CAPABILITY: Tuple[int, int] = (0, 0)
_active: contextvars.ContextVar[bool] = contextvars.ContextVar("sglang_ascend_offload_no_cuda", default=False)


@contextlib.contextmanager
def no_cuda_capability() -> Iterator[None]:
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def capability_around(original: Callable, *args, **kwargs):
    """HookRegistry AROUND hook for ``torch.cuda.get_device_capability``."""
    if _active.get() and not torch.cuda.is_available():
        return NO_CUDA_CAPABILITY
    return original(*args, **kwargs)
