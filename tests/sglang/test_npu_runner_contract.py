"""The npu-marked SGLang tests on an NPU runner: a missing piece fails, it does not skip.

``test_npu_path.py``'s served test needs a model named by ``SGLANG_ASCEND_OFFLOAD_NPU_MODEL``.
Here pytest runs it in a child process that takes itself for an NPU runner
(``npu_requirements.npu_present`` answers yes, loaded with ``-p`` before the conftest
files): without the variable the test must fail with what to set (a skip would let an NPU
runner report green over a test it never ran).
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NPU_PATH = "tests/sglang/e2e/test_npu_path.py::test_served_deepseek_v32_offload_on_equals_off"

AN_NPU_RUNNER = """\
import os, sys
sys.path.insert(0, {tests!r})
import npu_requirements
npu_requirements.npu_present = lambda: True
"""


def test_served_npu_test_fails_on_a_runner_without_a_model(tmp_path):
    (tmp_path / "as_npu_runner.py").write_text(AN_NPU_RUNNER.format(tests=os.path.join(REPO, "tests")))
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_ASCEND_OFFLOAD_NPU_MODEL", "SAO_NPU_STANDIN")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]), SGLANG_USE_CPU_ENGINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "as_npu_runner", "-p", "no:cacheprovider", NPU_PATH],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed" in out, out[-3000:]
    assert "missing on an NPU runner: served DeepSeek-V3.2 offload on == off: no model named: set " in out
    assert "SGLANG_ASCEND_OFFLOAD_NPU_MODEL to a DeepSeek-V3.2-style checkpoint" in out
