"""Result types shared by the checkers: one :class:`Finding` per use that does not
conform (or cannot be checked), one :class:`PackageResult` per checked package."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["Finding", "PackageResult", "bind_problem"]


@dataclass(frozen=True)
class Finding:
    """``file:line`` in our source, the package, what was used and why it is wrong."""

    file: str
    line: int
    package: str
    what: str
    why: str

    def as_dict(self) -> Dict[str, object]:
        return {"where": f"{self.file}:{self.line}", "package": self.package, "what": self.what, "why": self.why}


@dataclass
class PackageResult:
    """Outcome for one package: the version checked against, how many uses were checked,
    how many could not be typed further (``skipped``, with reasons) and the findings."""

    package: str
    version: Optional[str]
    source: str
    checked: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)
    findings: List[Finding] = field(default_factory=list)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def as_dict(self) -> Dict[str, object]:
        return {
            "version": self.version,
            "source": self.source,
            "checked": self.checked,
            "skipped": dict(sorted(self.skipped.items())),
            "findings": [f.as_dict() for f in self.findings],
        }


def bind_problem(
    sig: inspect.Signature, positional: int, keywords: Sequence[str], starred: bool = False
) -> Optional[str]:
    """Why a call with ``positional`` arguments and ``keywords`` does not fit ``sig``
    (``None`` if it does). With ``starred`` (``*args`` / ``**kw`` at the call) only the
    keyword names are checked."""
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    bad = [k for k in keywords if k not in named]
    if bad and not has_var_kw:
        return f"unexpected keyword(s) {bad}; signature {sig}"
    if starred:
        return None
    try:
        sig.bind(*([None] * positional), **{k: None for k in keywords})
    except TypeError as exc:
        names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        return f"{exc} (signature {sig}; parameters {names})"
    return None
