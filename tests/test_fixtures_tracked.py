"""Test data under ``tests/fixtures`` must reach a fresh clone.

A fixture that a git-ignore rule hides exists on the machine that made it and nowhere
else: the suite passes there and fails in CI (a recorded ``.npz`` trace once did, under
the repository-wide ``*.npz`` rule). Both checks read git's own verdict.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout of the project"
)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)


def test_no_fixture_file_is_hidden_by_an_ignore_rule():
    """Every file present under tests/fixtures is one git would commit."""
    ignored = _git("ls-files", "--others", "--ignored", "--exclude-standard", "--", "tests/fixtures")
    assert ignored.returncode == 0, ignored.stderr
    hidden = [line for line in ignored.stdout.splitlines() if line.strip()]
    assert hidden == [], f"fixture files that git ignores (they would be missing in a fresh clone): {hidden}"


@pytest.mark.parametrize(
    "name",
    [
        "traces/some_trace.npz",
        "some_model/model.safetensors",
        "some_model/tokenizer.json",
        "cann/x/ascend_toolkit_install.info",
    ],
)
def test_fixture_kinds_are_not_ignored(name):
    """The kinds of file the fixtures hold are committable wherever they are added, also
    before the file exists (``check-ignore --no-index`` evaluates the rules alone)."""
    path = f"tests/fixtures/{name}"
    verdict = _git("check-ignore", "--no-index", path)  # exit 0: ignored, 1: not ignored
    assert verdict.returncode in (0, 1), verdict.stderr
    rule = _git("check-ignore", "--no-index", "-v", path).stdout.strip()
    assert verdict.returncode == 1, f"{path} is ignored by {rule}"


def test_the_shipped_trace_is_tracked():
    tracked = _git("ls-files", "--error-unmatch", "tests/fixtures/traces/tiny_dsa_trained_decode.npz")
    assert tracked.returncode == 0, tracked.stderr
