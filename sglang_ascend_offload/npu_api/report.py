"""One report over every checker: :func:`collect` and its human / JSON forms.

Contract: :func:`collect` scans the project (or ``roots``), checks each package's uses
and returns an :class:`NpuApiReport`. Every use has one outcome (``result.py``):
``checked_calls`` counts the uses that conform (the name resolves in the real package
and a call binds to a signature read from it); ``unverified`` lists the calls of names
that resolve but whose signature could not be read; ``skipped`` lists the uses the
checkers cannot type, each with its reason; ``unknown`` holds every use that does not
conform plus every dynamic reference the finder could not resolve, and is empty when
the source is clean. The human form's first line reads
``checked / unverified / skipped / unknown``; ``--json`` has the same four keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from . import callsites, packages, sglang_source, torch_npu_schemas
from .result import Finding, PackageResult

__all__ = ["NpuApiReport", "collect", "format_human"]


@dataclass
class NpuApiReport:
    """``packages``: checked package -> version; ``details``: per-package results;
    ``uses``: distinct uses found; ``files``: source files scanned; ``checked_calls``,
    ``unverified``, ``skipped``, ``unknown``: the outcomes (module docstring)."""

    packages: Dict[str, Optional[str]]
    checked_calls: int
    unknown: List[Finding]
    unverified: List[Finding] = field(default_factory=list)
    skipped: List[Finding] = field(default_factory=list)
    details: Dict[str, PackageResult] = field(default_factory=dict)
    uses: int = 0
    files: int = 0

    def as_dict(self) -> Dict[str, object]:
        return {
            "packages": self.packages,
            "checked_calls": self.checked_calls,
            "unverified": [f.as_dict() for f in self.unverified],
            "skipped": [f.as_dict() for f in self.skipped],
            "unknown": [f.as_dict() for f in self.unknown],
            "uses": self.uses,
            "files": self.files,
            "details": {name: r.as_dict() for name, r in self.details.items()},
        }

    def summary(self) -> str:
        """``N checked / N unverified / N skipped / N unknown``."""
        return (
            f"{self.checked_calls} checked / {len(self.unverified)} unverified / {len(self.skipped)} skipped / "
            f"{len(self.unknown)} unknown"
        )


def _test_tree_torch_npu(scan: callsites.Scan) -> None:
    """Add the ``torch_npu`` uses of the repository's ``tests/`` (the npu-marked tests call
    the operators directly) to ``scan``; the tests' other packages are stand-ins. The npu
    stand-in's own folder (``tests/npu_standin/``) is left out: its self-tests call the
    stand-in with deliberately wrong arguments to show it refuses them as torch_npu does,
    and its surface is held against the real wheel by its conformance test."""
    tests = os.path.join(os.path.dirname(callsites.project_roots()[0]), "tests")
    if not os.path.isdir(tests):
        return
    extra = callsites.scan([tests])

    def ours(file: str) -> bool:
        return "npu_standin/" not in file.replace(os.sep, "/")

    scan.uses += [u for u in extra.uses if u.package == "torch_npu" and ours(u.file)]
    scan.unresolved += [u for u in extra.unresolved if "torch_npu" in u.what and ours(u.file)]
    scan.files += extra.files


def collect(
    roots: Optional[Sequence[str]] = None,
    *,
    torch_npu_data: Optional[dict] = None,
    sglang_tree: Optional[sglang_source.SourceTree] = None,
) -> NpuApiReport:
    """Scan ``roots`` (default: the project, plus the ``torch_npu`` calls of ``tests/``)
    and check every use (module docstring)."""
    scan = callsites.scan(roots)
    if roots is None:
        _test_tree_torch_npu(scan)
    details: Dict[str, PackageResult] = {}
    for pkg in packages.DISTRIBUTIONS:
        details[pkg] = packages.check(scan.uses, pkg)
    details["torch_npu"] = torch_npu_schemas.check(scan.uses, torch_npu_data)
    details["sglang"] = sglang_source.check(scan.uses, sglang_tree)
    unknown = [f for r in details.values() for f in r.findings]
    unknown += [
        Finding(u.file, u.line, u.what.split("(", 1)[-1].split(",")[0].split(".")[0], u.what, u.why)
        for u in scan.unresolved
    ]
    unknown.sort(key=lambda f: (f.file, f.line, f.what))
    return NpuApiReport(
        packages={name: r.version for name, r in details.items()},
        checked_calls=sum(r.checked for r in details.values()),
        unknown=unknown,
        unverified=_in_order(f for r in details.values() for f in r.unverified),
        skipped=_in_order(f for r in details.values() for f in r.skipped),
        details=details,
        uses=len(scan.uses),
        files=scan.files,
    )


def _in_order(findings) -> List[Finding]:
    return sorted(findings, key=lambda f: (f.file, f.line, f.what))


def format_human(report: NpuApiReport) -> str:
    lines = [f"NPU API conformance: {report.uses} uses in {report.files} files: {report.summary()}"]
    for name, r in report.details.items():
        lines.append(
            f"  {name:18s} {r.version or '-':10s} {r.checked:4d} checked / {len(r.unverified):3d} unverified / "
            f"{len(r.skipped):3d} skipped / {len(r.findings)} findings  ({r.source})"
        )
    for label, entries in (("UNVERIFIED", report.unverified), ("SKIPPED", report.skipped), ("UNKNOWN", report.unknown)):
        for f in entries:
            lines.append(f"  {label} {f.file}:{f.line}: {f.what}: {f.why}")
    return "\n".join(lines)
