"""The tree is ruff-clean: lint and format, with the settings in pyproject.toml ([tool.ruff])."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed (bash scripts/setup_cpu_env.sh installs it)", pytrace=False)
    return [found]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args):
    run = subprocess.run(_ruff() + args, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, (
        f"ruff {' '.join(args)} found problems (fix: ruff check --fix . && ruff format .):\n"
        + (run.stdout + run.stderr)[-4000:]
    )


def test_ruff_sees_a_planted_problem(tmp_path):
    """Negative control: the same command fails on an unformatted file with an unused import."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx=( 1,2 )\n")
    lint = subprocess.run(_ruff() + ["check", "--config", str(ROOT / "pyproject.toml"), str(bad)], capture_output=True)
    fmt = subprocess.run(
        _ruff() + ["format", "--check", "--config", str(ROOT / "pyproject.toml"), str(bad)], capture_output=True
    )
    assert lint.returncode != 0 and fmt.returncode != 0
