"""Test-session setup shared by every test.

* Triton kernels run through the Triton interpreter when there is no GPU/NPU; the
  variable must be set before any ``@triton.jit`` decorator runs, so it is set here,
  before test modules are imported.
* Tests marked ``npu`` need an Ascend NPU with CANN and torch_npu; on a machine without
  an NPU they are skipped with that reason. On a machine with one they all run, and a
  missing package, extension or op fails the test that needs it
  (``tests/npu_requirements.py``).
* SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) is selected only where there is no
  NPU; an NPU runner tests SGLang's NPU paths.
"""

import os

import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from npu_requirements import npu_present  # noqa: E402

from sglang_ascend_offload import platform  # noqa: E402

if not npu_present():
    # SGLang on a machine without an NPU: its CPU engine paths (set before SGLang is imported).
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

if platform.device_kind() == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Import triton now, in interpreter mode: its @jit library functions (tl.cumsum, ...)
    # keep the mode of the first import, and a test that unsets TRITON_INTERPRET must
    # not be the first to import it.
    try:
        import triton  # noqa: F401
    except ImportError:
        pass


def pytest_collection_modifyitems(config, items):
    if npu_present():
        return
    skip = pytest.mark.skip(
        reason="needs an Ascend NPU with CANN + torch_npu (run on an NPU runner: "
        "bash scripts/setup_npu_env.sh && python -m pytest -m npu)"
    )
    for item in items:
        if "npu" in item.keywords:
            item.add_marker(skip)
