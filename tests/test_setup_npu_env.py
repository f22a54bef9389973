"""``scripts/setup_npu_env.sh`` on a machine without CANN: its first step (CANN sourced)
stops it with what to do and a non-zero exit, before anything is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "setup_npu_env.sh"


def _run(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")}
    base.update(HOME=str(tmp_path), PYTHON="/nonexistent/python-must-not-run", **env)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=base, timeout=60)


def test_without_cann_it_says_what_to_do_and_installs_nothing(tmp_path):
    if Path("/usr/local/Ascend").exists():
        import pytest

        pytest.skip("this machine has an Ascend install")
    run = _run(tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "CANN not found: ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME are not set" in run.stderr
    assert "source <install>/set_env.sh" in run.stderr and "bash scripts/setup_cpu_env.sh" in run.stderr
    assert "installing" not in run.stdout  # stopped before pip (PYTHON points nowhere: never reached)


def test_installed_but_not_sourced_names_the_set_env_file(tmp_path):
    set_env = tmp_path / "Ascend" / "ascend-toolkit" / "set_env.sh"
    set_env.parent.mkdir(parents=True)
    set_env.write_text("# fixture\n")
    run = _run(tmp_path)
    assert run.returncode == 2
    assert "CANN is installed but not sourced" in run.stderr
    if not Path("/usr/local/Ascend").exists():
        assert f"Run: source {set_env}" in run.stderr


def test_a_stale_ascend_home_path_is_refused(tmp_path):
    run = _run(tmp_path, ASCEND_HOME_PATH=str(tmp_path / "gone"))
    assert run.returncode == 2
    assert f"ASCEND_HOME_PATH={tmp_path / 'gone'} does not exist" in run.stderr
