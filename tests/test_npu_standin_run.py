"""README command (2) runs the npu-marked tests on the CPU-backed ``npu`` stand-in.

The stand-in is process-global (a renamed PrivateUse1 backend cannot be renamed back,
and the CPU tests must keep seeing ``device_kind() == "cpu"``), so this test starts the
public command ``SAO_NPU_STANDIN=1 python -m pytest -m npu`` in a process of its own and
holds: no failure and no error, at least :data:`MIN_EXECUTED` tests executed (not
skipped), every skip with its reason. It prints run / xfailed (the stand-in's findings,
``tests/npu_standin/limits.py``) / skipped with reason / total. On a machine with an NPU
the npu tests run on the device in the suite itself, and this test skips.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from npu_requirements import npu_present

REPO = Path(__file__).resolve().parents[1]
MIN_EXECUTED = 20
TIMEOUT_S = 900


def standin_env() -> dict:
    """This environment for a stand-in run: SGLang's CPU engine and Triton's interpreter,
    which this (CPU) session selected, are not what a node has."""
    env = dict(os.environ, SAO_NPU_STANDIN="1")
    for name in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET"):
        env.pop(name, None)
    return env


def outcomes(junit: Path):
    """``[(nodeid, outcome, message)]`` from a junit XML report; outcome one of passed,
    failed, error, skipped, xfailed."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        nodeid = f"{path}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = ("failed" if child.tag == "failure" else "error"), child.get("message", "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, message = ("xfailed" if xfail else "skipped"), child.get("message", "")
        out.append((nodeid, outcome, message))
    return out


@pytest.mark.skipif(npu_present(), reason="an NPU runner runs the npu tests on the device")
def test_npu_marked_tests_pass_on_the_stand_in(tmp_path):
    junit = tmp_path / "standin.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "npu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    proc = subprocess.run(cmd, cwd=REPO, env=standin_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert junit.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    results = outcomes(junit)
    by = collections.defaultdict(list)
    for nodeid, outcome, message in results:
        by[outcome].append((nodeid, message))
    executed = len(by["passed"]) + len(by["failed"]) + len(by["error"]) + len(by["xfailed"])
    print(
        f"\nnpu stand-in: {len(by['passed'])} passed, {len(by['xfailed'])} xfailed (findings), "
        f"{len(by['skipped'])} skipped, {len(results)} total"
    )
    for outcome in ("xfailed", "skipped"):
        reasons = collections.Counter(message for _, message in by[outcome])
        for message, count in reasons.most_common():
            print(f"  {outcome} x{count}: {message}")
    problems = by["failed"] + by["error"]
    assert not problems, "\n".join(f"{n}: {m}" for n, m in problems) + "\n" + proc.stdout[-6000:]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert executed >= MIN_EXECUTED and len(by["passed"]) >= MIN_EXECUTED, (executed, len(by["passed"]))
    assert all(message for _, message in by["skipped"]), "a skip without its reason"


def test_outcomes_read_every_kind(tmp_path):
    """The report reader sees failures, errors, skips and xfails (negative control of the
    run's assertions: a failing stand-in test is not read as a pass)."""
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="boom"/></testcase>'
        '<testcase classname="tests.a" name="test_err"><error message="setup"/></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped type="pytest.skip" message="why"/></testcase>'
        '<testcase classname="tests.b" name="test_x"><skipped type="pytest.xfail" message="finding"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert outcomes(junit) == [
        ("tests/a::test_ok", "passed", ""),
        ("tests/a::test_bad", "failed", "boom"),
        ("tests/a::test_err", "error", "setup"),
        ("tests/b::test_skip", "skipped", "why"),
        ("tests/b::test_x", "xfailed", "finding"),
    ]
