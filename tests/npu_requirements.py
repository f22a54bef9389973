"""What an ``npu`` test needs, and what happens when it is missing.

Contract: on a machine with an Ascend NPU (:func:`npu_present`) a missing package,
extension or op FAILS the test that needs it, so an NPU runner never reports green
over tests it did not run; without an NPU the same test is skipped with the reason.

An NPU is present when torch_npu sees one, or when the Ascend driver's device nodes
(``/dev/davinci<N>``) exist: the second case is a runner whose Python environment is
broken or incomplete, which must fail loudly rather than skip.

On the CPU-backed stand-in (``SAO_NPU_STANDIN=1``, ``tests/npu_standin``) the probe says
``npu`` as well, but what the stand-in does not provide (a package's data path that
needs the Ascend driver, ...) skips with the reason: the stand-in is not a runner whose
environment is broken.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
from typing import Callable, Optional

import npu_standin
import pytest

from sglang_ascend_offload import platform


@functools.lru_cache(maxsize=1)
def npu_present() -> bool:
    if platform.device_kind() == "npu":
        return True
    return bool(glob.glob("/dev/davinci[0-9]*"))


def require(reason: Optional[str], what: str = "") -> None:
    """Nothing when ``reason`` is ``None``; otherwise fail (NPU present) or skip (no NPU)."""
    if reason is None:
        return
    text = f"{what}: {reason}" if what else reason
    if npu_standin.installed():
        pytest.skip(f"not provided by the npu stand-in: {text}")
    if npu_present():
        pytest.fail(f"missing on an NPU runner: {text} (bash scripts/setup_npu_env.sh installs it)", pytrace=False)
    pytest.skip(text)


def require_npu() -> None:
    """An NPU with a working torch_npu."""
    require(None if platform.device_kind() == "npu" else "needs an Ascend NPU with CANN and torch_npu")


def require_package(module: str, install: str) -> None:
    """An importable ``module`` (``install`` says which distribution provides it)."""
    require(None if importlib.util.find_spec(module) is not None else f"{module} is not installed ({install})")


def require_npu_extension(kernel: str) -> None:
    """The AscendC extension ``_C_ascend`` with ``kernel`` registered."""
    from sglang_ascend_offload.ops.npu_impls import fused_op_unavailable

    require(fused_op_unavailable(kernel), "fused rung not built")


def requires(check: Callable[[], None]) -> Callable:
    """Decorator form: run ``check()`` when the test starts (pytest sees the test's
    own signature, so fixtures still resolve)."""

    def wrap(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            check()
            return test(*args, **kwargs)

        return run

    return wrap
