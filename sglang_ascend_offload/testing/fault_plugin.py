"""A pytest plugin that plants :data:`.faults.PLANTED_FAULT_ENV`'s fault in the pytest process.

``scripts/plant_faults.py`` runs ``pytest -p sglang_ascend_offload.testing.fault_plugin``
with the variable set: component tests (pools, engines, backends built in-process) run
with the fault's hooks applied before any test, and every server the test launcher
starts gets the same fault through the harness's ``fault`` seam
(:func:`.faults.seams_from_environment`). Without the variable the plugin does nothing.
"""

from __future__ import annotations

import json
import os

from . import faults


def pytest_configure(config) -> None:
    name = os.environ.get(faults.PLANTED_FAULT_ENV)
    if name:
        faults.install_in_process(name)


def pytest_report_header(config):
    name = os.environ.get(faults.PLANTED_FAULT_ENV)
    return f"planted fault: {name}" if name else None


#: ``scripts/plant_faults.py``: a file to which each test phase's outcome is appended (JSON lines)
REPORT_ENV = "SGLANG_ASCEND_OFFLOAD_PLANTED_REPORT"


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    row = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
