"""Shared setup of the SGLang plugin tests.

* SGLang picks its platform when it is first imported; ``SGLANG_USE_CPU_ENGINE=1``
  selects its CPU platform (what serving on a machine without an NPU needs), so it is
  set here, before any test module imports SGLang, unless an NPU is present.
* :class:`ServerProcess` (``sglang_ascend_offload.testing.servers``, shared with the
  served benchmarks) launches ``python -m sglang.launch_server`` on 127.0.0.1 on a
  reserved port in its own session, waits for ``/health`` with a deadline, restarts on
  a fresh port if the log reports a bind failure, and stops its process group.

Do not add an ``__init__.py`` to this folder: a package named ``sglang`` would
shadow the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List

import pytest

from sglang_ascend_offload.testing.ports import reserve_port

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
from npu_requirements import npu_present  # noqa: E402 - tests/conftest.py put tests/ on sys.path

if not npu_present():  # an NPU runner tests SGLang's NPU platform; servers set their own (testing/servers.py)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ascend_offload.testing.servers import (  # noqa: E402,F401 - re-exported for the test modules
    CPU_SERVER_ARGS, IDLE_SLEEP, REPO, STARTUP_TIMEOUT_S, TINY_DSA, PortInUse, ServerProcess, server_env, start_all,
    stop_all, stop_process_group)


def free_port(span: int = 1) -> int:
    """A port reserved for this test process (see ``sglang_ascend_offload.testing.ports``:
    below the ephemeral range, locked across processes, never handed out twice)."""
    return reserve_port(span)


def run_launcher(extra_args: List[str], timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Run ``launch_server`` to completion (for --help and startup failures)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", *CPU_SERVER_ARGS,
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=server_env(), cwd=REPO)


@pytest.fixture(scope="session")
def plugins_loaded():
    """SGLang's own ``load_plugins()`` in this process (what every SGLang process does)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ascend_offload.sglang_plugin import entry

    assert entry.is_registered()
    return True


@pytest.fixture
def clean_state():
    """No remembered plugin flags and no published config before and after the test."""
    from sglang_ascend_offload.sglang_plugin.args import carrier, flags

    flags.forget()
    carrier.clear()
    yield
    flags.forget()
    carrier.clear()
