"""Plant each fault of ``sglang_ascend_offload/testing/faults.py`` and run the tests that should catch it.

Run from the repository root with the CPU environment::

    .venv/bin/python scripts/plant_faults.py            # a table
    .venv/bin/python scripts/plant_faults.py --json     # one JSON document on stdout

For each fault, one at a time: one pytest run of the fault's tests (``Fault.tests``: the
served and component tests of README command (2) that should catch it) and of its
shadow-verification probes (``Fault.shadow_tests``: served tests with
``verify_sample_rate: 1.0`` that fail only when shadow verification reported a mismatch),
with ``SGLANG_ASCEND_OFFLOAD_PLANTED_FAULT`` set: the pytest process installs the fault
(``testing/fault_plugin.py``) and every server the test launcher starts gets it through
the harness's ``fault`` seam. A fault is *caught* when at least one of its tests fails
(an error, e.g. a server that refuses to start, counts: the fault was not silent).

Before the faults, a baseline run of every test involved without any fault: a test that
fails there proves nothing when it fails with a fault, so the report lists it
(``--no-baseline`` skips it).

JSON (public contract): ``{"faults": [{"name", "fault_class", "caught", "caught_by":
[test ids], "shadow_caught", ...}], "all_caught": bool, ...}``; extra keys: per fault
``missed_by`` (its tests that passed), ``errors``, ``seconds``, ``shadow_note``; at the
top ``baseline_failed`` and ``seconds``. Progress goes to stderr. Exit status 0 when every
fault was caught and the baseline passed, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_ascend_offload.testing import faults as planted  # noqa: E402
from sglang_ascend_offload.testing.fault_plugin import REPORT_ENV  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_tests(test_ids: Sequence[str], fault: str, timeout_s: float) -> Dict[str, str]:
    """One pytest run of ``test_ids`` with ``fault`` planted (``""``: none); returns
    ``{nodeid: "passed" | "failed" | "error" | "skipped"}``."""
    with tempfile.TemporaryDirectory(prefix="plant_faults_") as tmp:
        report = Path(tmp) / "report.jsonl"
        env = dict(os.environ)
        env.pop(planted.PLANTED_FAULT_ENV, None)
        if fault:
            env[planted.PLANTED_FAULT_ENV] = fault
        env[REPORT_ENV] = str(report)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "sglang_ascend_offload.testing.fault_plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            "--no-header",
            *test_ids,
        ]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
            tail = proc.stdout[-1500:]
        except subprocess.TimeoutExpired as exc:
            tail = f"pytest timed out after {timeout_s:.0f} s; " + (exc.stdout or b"")[-1000:].decode(errors="replace")
        outcomes: Dict[str, str] = {}
        if report.exists():
            for line in report.read_text().splitlines():
                row = json.loads(line)
                outcomes[row["nodeid"]] = _merge(outcomes.get(row["nodeid"]), row)
        if not outcomes:
            outcomes["<pytest>"] = "error"
            log(tail)
        return outcomes


def _merge(before, row) -> str:
    """One outcome per test from its setup / call / teardown reports (the worst wins)."""
    now = row["outcome"]
    if row["when"] != "call" and now == "failed":
        now = "error"
    rank = {None: -1, "passed": 0, "skipped": 1, "failed": 2, "error": 3}
    return now if rank[now] > rank[before] else before


def belongs(nodeid: str, test_id: str) -> bool:
    """Whether the collected ``nodeid`` is (a parametrisation of) the listed ``test_id``."""
    return nodeid == test_id or nodeid.startswith(test_id + "::") or nodeid.startswith(test_id + "[")


def plant(fault: planted.Fault, timeout_s: float) -> planted.Outcome:
    t0 = time.monotonic()
    outcomes = run_tests([*fault.tests, *fault.shadow_tests], fault.name, timeout_s)
    out = planted.Outcome(fault.name, fault.fault_class, caught=False)
    for test_id in fault.tests:
        mine = {n: o for n, o in outcomes.items() if belongs(n, test_id)}
        if any(o in ("failed", "error") for o in mine.values()):
            out.caught_by.append(test_id)
        elif mine:
            out.missed_by.append(test_id)
        else:
            out.errors.append(f"{test_id}: not collected")
    out.caught = bool(out.caught_by)
    shadow = {n: o for n, o in outcomes.items() if any(belongs(n, s) for s in fault.shadow_tests)}
    out.shadow_caught = any(o in ("failed", "error") for o in shadow.values())
    out.errors += [f"{n}: error" for n, o in outcomes.items() if o == "error"]
    out.seconds = round(time.monotonic() - t0, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--faults", default="", help="comma-separated fault names (default: every fault)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without any fault")
    ap.add_argument("--timeout", type=float, default=2400.0, help="seconds per pytest run")
    args = ap.parse_args(argv)
    names = [n for n in args.faults.split(",") if n] or list(planted.FAULTS)
    chosen = [planted.get(n) for n in names]
    t0 = time.monotonic()
    baseline_failed: List[str] = []
    if not args.no_baseline:
        tests = sorted({t for f in chosen for t in (*f.tests, *f.shadow_tests)})
        log(f"baseline: {len(tests)} test ids without a fault")
        base = run_tests(tests, "", args.timeout)
        baseline_failed = sorted(n for n, o in base.items() if o in ("failed", "error"))
        log(f"baseline: {len(base)} tests, failed: {baseline_failed or 'none'} ({time.monotonic() - t0:.0f} s)")
    rows = []
    for fault in chosen:
        log(f"planting {fault.name}: {fault.description}")
        row = plant(fault, args.timeout)
        log(
            f"  {'caught' if row.caught else 'MISSED'} by {row.caught_by or '-'}; shadow "
            f"{'caught' if row.shadow_caught else 'no'}; {row.seconds:.0f} s"
        )
        rows.append({**row.as_json(), "shadow_note": fault.shadow_note})
    doc = {
        "faults": rows,
        "all_caught": all(r["caught"] for r in rows),
        "baseline_failed": baseline_failed,
        "seconds": round(time.monotonic() - t0, 1),
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{'fault':28} {'class':56} {'caught':7} {'shadow':7} caught by")
        for r in rows:
            print(
                f"{r['name']:28} {r['fault_class'][:56]:56} {'yes' if r['caught'] else 'NO':7} "
                f"{'yes' if r['shadow_caught'] else 'no':7} {', '.join(r['caught_by']) or '-'}"
            )
        print(
            f"all caught: {doc['all_caught']}; baseline failures: {baseline_failed or 'none'}; {doc['seconds']:.0f} s"
        )
    return 0 if doc["all_caught"] and not baseline_failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
