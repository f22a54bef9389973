"""``python -m sglang_ascend_offload check-kernels [--json]``: the AscendC kernels on CPU.

Runs both checks of :mod:`sglang_ascend_offload.kernel_check`:

1. compile: every kernel, vector and cube variant, syntax-only against the AscendC
   headers (``$SAO_ASCENDC_HEADERS``, else ``$ASCEND_HOME_PATH``, else
   ``../shared/third_party/asc-devkit-8.5.0``), plus the negative control (a kernel copy
   with a wrong AscendC call, which must fail);
2. functional: the kernels' C++ on the functional model against the reference
   compositions of ``ops/fused.py``.

Prints a table (or, with ``--json``, exactly one JSON document on stdout:
``{"kernels": [{"name", "variant", "compiled", "functional_checked", "cases",
"bit_exact", "max_abs_err"}], "headers": "<version>"}``; progress goes to stderr).
Exit status 1 when anything fails (a compile, the negative control compiling, a
functional mismatch, or missing headers / compiler).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from . import compile_check, copy_rows, functional
from . import headers as hdr
from . import model as km


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--jobs", type=int, default=compile_check.MAX_JOBS, help=f"parallel compiles (at most {compile_check.MAX_JOBS})"
    )
    parser.add_argument("--no-cache", action="store_true", help="recompile even when the cache has the result")
    parser.add_argument("--seed", type=int, default=0, help="seed of the functional scenarios")
    parser.add_argument("--quick", action="store_true", help="skip the largest-shape functional cases")


@dataclass
class CheckReport:
    """Everything one ``check-kernels`` run found (``rows`` is the JSON ``kernels`` list)."""

    headers: str
    headers_path: str = ""
    rows: List[Dict[str, object]] = field(default_factory=list)
    negative_control_failed: Optional[bool] = None
    failures: List[str] = field(default_factory=list)
    compile_seconds: float = 0.0
    functional_seconds: float = 0.0
    coverage: Dict[str, Dict[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {"kernels": self.rows, "headers": self.headers}


def _log(msg: str) -> None:
    print(f"[check-kernels] {msg}", file=sys.stderr, flush=True)


def run_checks(
    jobs: int = compile_check.MAX_JOBS,
    use_cache: bool = True,
    seed: int = 0,
    largest: bool = True,
    do_compile: bool = True,
    do_functional: bool = True,
) -> CheckReport:
    report = CheckReport(headers="not found")
    compiled: Dict[tuple, Optional[bool]] = {}
    if do_compile:
        t0 = time.monotonic()
        try:
            headers = hdr.locate()
            report.headers = headers.version
            report.headers_path = f"{headers.root} ({headers.layout}, from {headers.source})"
            _log(
                f"compiling {len(compile_check.KERNEL_UNITS)} kernel units x {len(compile_check.VARIANTS)} "
                f"variants + negative control against {report.headers_path}"
            )
            cr = compile_check.run(jobs=jobs, use_cache=use_cache, headers=headers)
            for r in cr.results:
                compiled[(r.unit, r.variant)] = r.ok
                if not r.ok:
                    report.failures.append(f"compile {r.unit} [{r.variant}]: {r.errors} errors\n{r.log[:3000]}")
            report.failures += [f"header name clash: {x}" for x in cr.shadowing]
            report.negative_control_failed = cr.negative is not None and not cr.negative.ok
            if not report.negative_control_failed:
                report.failures.append(
                    "negative control: a kernel copy with a wrong AscendC call COMPILED; the "
                    "compile check cannot be trusted"
                )
        except (hdr.HeadersNotFound, compile_check.CompilerNotFound) as exc:
            report.failures.append(str(exc))
        report.compile_seconds = time.monotonic() - t0
    results: Dict[str, functional.KernelResult] = {}
    if do_functional:
        t0 = time.monotonic()
        _log(
            "functional model: building and running LIM, LIM-C8, Copy-SFA and the miss copy against the reference "
            "compositions"
        )
        try:
            m = km.KernelModel(km.build(use_cache))
            for r in functional.run(seed=seed, largest=largest, model=m) + [copy_rows.check_copy_rows(m, seed=seed)]:
                results[r.name] = r
                report.coverage[r.name] = dict(r.coverage)
                report.failures += [f"functional {r.name}: {f}" for f in r.failures[:10]]
                if not r.ok and not r.failures:
                    report.failures.append(f"functional {r.name}: no case ran")
        except (RuntimeError, compile_check.CompilerNotFound) as exc:
            report.failures.append(f"functional model: {exc}")
        report.functional_seconds = time.monotonic() - t0
    for unit, _src, entries in compile_check.KERNEL_UNITS:
        for entry in entries:
            for variant in compile_check.VARIANTS:
                fr = results.get(entry)
                report.rows.append(
                    {
                        "name": entry,
                        "variant": variant,
                        "compiled": bool(compiled.get((unit, variant), False)),
                        "functional_checked": bool(fr is not None and fr.ok),
                        "cases": fr.cases if fr else 0,
                        "bit_exact": bool(fr is not None and fr.cases > 0 and fr.bit_exact),
                        "max_abs_err": float(fr.max_abs_err) if fr else None,
                    }
                )
    return report


def _table(report: CheckReport) -> str:
    cols = ["name", "variant", "compiled", "functional_checked", "cases", "bit_exact", "max_abs_err"]
    cells = [[str(r[c]) if c != "max_abs_err" or r[c] is None else f"{r[c]:.3g}" for c in cols] for r in report.rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    lines.append("")
    lines.append(f"headers: {report.headers} {report.headers_path}")
    if report.negative_control_failed is not None:
        lines.append(
            "negative control (wrong AscendC call): "
            + ("failed to compile, as it must" if report.negative_control_failed else "COMPILED (bad)")
        )
    lines.append(f"time: compile {report.compile_seconds:.1f} s, functional {report.functional_seconds:.1f} s")
    for name, cov in report.coverage.items():
        lines.append(f"coverage {name}: " + ", ".join(f"{k}={v}" for k, v in sorted(cov.items())))
    if report.failures:
        lines.append("")
        lines.append("FAILED:")
        lines += [f"  - {f}" for f in report.failures]
    else:
        lines.append("all kernels compiled and functionally checked")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.jobs < 1 or args.jobs > compile_check.MAX_JOBS:
        print(f"--jobs must be 1..{compile_check.MAX_JOBS}", file=sys.stderr)
        return 2
    report = run_checks(jobs=args.jobs, use_cache=not args.no_cache, seed=args.seed, largest=not args.quick)
    if args.json:
        for f in report.failures:
            _log(f"FAILED: {f}")
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(_table(report))
    return 0 if report.ok else 1
