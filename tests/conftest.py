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
import worker_schedule  # noqa: E402

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


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (the suite's default, ``pyproject.toml``): two on a machine
    without an NPU, where the served half and the unit half run side by side
    (``tests/worker_schedule.py``); none (one serial process) on an NPU runner, whose
    tests share the device. ``SAO_TEST_WORKERS=N`` overrides, ``-n N`` / ``-n 0`` too."""
    override = os.environ.get("SAO_TEST_WORKERS")
    if override is not None:
        try:
            return max(0, int(override))
        except ValueError:
            raise pytest.UsageError(f"SAO_TEST_WORKERS={override!r}: expected a whole number (0 = serial)") from None
    if npu_present():
        return 0
    return min(2, os.cpu_count() or 1)


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope``: a module, or the modules sharing a server, per worker,
    longest first (``tests/worker_schedule.py``)."""
    if config.getoption("dist") == "loadscope":
        return worker_schedule.make_scheduler(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: see tests/worker_schedule.py
        worker_schedule.order_for_workers(items, worker_schedule.units())
    import sys; print("DBG", getattr(config.option, "loadgroup", None), [m.args for m in items[0].iter_markers("xdist_group")], items[0].nodeid, file=sys.stderr)
    if npu_present():
        return
    skip = pytest.mark.skip(reason="needs an Ascend NPU with CANN + torch_npu (run on an NPU runner: "
                                   "bash scripts/setup_npu_env.sh && python -m pytest -m npu)")
    for item in items:
        if "npu" in item.keywords:
            item.add_marker(skip)


