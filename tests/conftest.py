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
* Test servers on a machine without an NPU start from processes that imported SGLang once
  (the harness's ``forkserver`` seam and the test zygote: ``sglang_ascend_offload/testing/
  harness.py``, ``zygote.py``; docs/testing.md): ~5 CPU-s a start instead of ~21. A test
  that needs SGLang's own spawn asks for ``forkserver: false``; on an NPU runner every
  server starts as users start it.
* ``SAO_NPU_STANDIN=1``: this process runs on the CPU-backed ``npu`` stand-in
  (``tests/npu_standin``): ``import torch_npu`` finds the stand-in, so the platform probe
  says ``npu``; npu-marked tests run on it (those it cannot run skip, each with its
  reason: ``npu_standin/limits.py``), every other test skips (CPU tests run without it).
"""

import os

import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import npu_standin  # noqa: E402

if npu_standin.requested():
    npu_standin.put_site_on_path()
    import torch_npu  # noqa: E402, F401 - installs the stand-in device, as torch_npu registers the NPU

from npu_requirements import npu_present  # noqa: E402

from sglang_ascend_offload import platform  # noqa: E402

if not npu_present():
    # SGLang on a machine without an NPU: its CPU engine paths (set before SGLang is imported).
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

if not npu_present():
    from sglang_ascend_offload.testing import harness  # noqa: E402

    os.environ.setdefault(harness.FORKSERVER_ENV, "1")

if platform.device_kind() == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Import triton now, in interpreter mode: its @jit library functions (tl.cumsum, ...)
    # keep the mode of the first import, and a test that unsets TRITON_INTERPRET must
    # not be the first to import it.
    try:
        import triton  # noqa: F401
    except ImportError:
        pass


def pytest_ignore_collect(collection_path, config):
    """A stand-in process collects only test modules that hold npu-marked tests: the
    others are CPU tests (and importing some, e.g. SGLang's NPU-only paths, is not
    what they test)."""
    if not npu_standin.installed() or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.npu" not in collection_path.read_text(encoding="utf-8", errors="replace") or None


def pytest_collection_modifyitems(config, items):
    if npu_standin.installed():
        from npu_standin import limits

        limits.mark_collected(items)
        return
    if npu_present():
        return
    skip = pytest.mark.skip(
        reason="needs an Ascend NPU with CANN + torch_npu (run on an NPU runner: "
        "bash scripts/setup_npu_env.sh && python -m pytest -m npu)"
    )
    for item in items:
        if "npu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _standin_api_hazards(request):
    """On the stand-in: an npu test that leaves an API hazard behind (an event waited on
    before it was ever recorded: ``npu_standin/npu_module.py``) fails."""
    if not npu_standin.installed():
        yield
        return
    from npu_standin.npu_module import HAZARDS

    before = len(HAZARDS)
    yield
    new = HAZARDS[before:]
    if new:
        pytest.fail("stream/event API hazards on the npu stand-in: " + "; ".join(new), pytrace=False)
