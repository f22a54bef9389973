"""Triton kernels of the sparse decode path, installed as ``sglang_ascend_offload.triton_ops``.

The same kernel source runs on Ascend NPUs (triton-ascend), on CUDA (upstream
Triton) and on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set
before the first kernel module is imported). See ``docs/triton_kernels.md``.

Importing this package imports neither triton nor torch; the public functions are
resolved lazily:

* :func:`residency_manage` (op ``residency_manage``, rung ``triton``) and
  :func:`launch_residency_manage` / :class:`ResidencyKernelConfig` (tile sizes);
* :func:`copy_miss_rows` (op ``copy_miss_rows``, rung ``triton``) and
  :func:`launch_copy_miss_rows` / :class:`CopyKernelConfig`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "residency_manage": ".residency",
    "launch_residency_manage": ".residency",
    "ResidencyKernelConfig": ".residency",
    "copy_miss_rows": ".copy_rows",
    "launch_copy_miss_rows": ".copy_rows",
    "CopyKernelConfig": ".copy_rows",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
