"""Result types shared by the checkers: one :class:`Finding` per use that does not
conform, is unverified or was skipped, one :class:`PackageResult` per checked package.

Every use of a package lands in exactly one of four outcomes:

* **checked**: the name resolves in the real package and, for a call, the call binds to
  a signature read from it (keyword names, positional arity, required parameters);
* **unverified**: the name resolves, but it is called and no signature could be read
  (a pybind11 function or constructor without one in its ``__doc__``, ``torch.npu``
  functions, whose names but not signatures are extracted): the arguments are unchecked;
* **skipped**: the checker cannot say what the use names (the result of a function
  call, a value computed at run time), each with its reason;
* **finding**: the use does not conform (reported as ``unknown``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["Finding", "PackageResult", "bind_problem", "use_what"]


@dataclass(frozen=True)
class Finding:
    """``file:line`` in our source, the package, what was used and why it is wrong (or,
    for an unverified or skipped use, why it was not checked)."""

    file: str
    line: int
    package: str
    what: str
    why: str

    def as_dict(self) -> Dict[str, object]:
        return {"where": f"{self.file}:{self.line}", "package": self.package, "what": self.what, "why": self.why}


def use_what(use) -> str:
    """How a use (``callsites.Use``) is spelled in a report: ``a.b(...)`` for a call,
    ``a.b = ...`` for a store, ``a.b`` otherwise."""
    return use.dotted + ("(...)" if use.kind == "call" else " = ..." if use.kind == "store" else "")


@dataclass
class PackageResult:
    """Outcome for one package: the version checked against and each use's outcome
    (module docstring): ``checked`` a count, the others one :class:`Finding` per use."""

    package: str
    version: Optional[str]
    source: str
    checked: int = 0
    unverified: List[Finding] = field(default_factory=list)
    skipped: List[Finding] = field(default_factory=list)
    findings: List[Finding] = field(default_factory=list)

    def unverify(self, use, why: str) -> None:
        """``use`` resolves but its call's signature could not be read (``why``)."""
        self.unverified.append(Finding(use.file, use.line, self.package, use_what(use), why))

    def skip(self, use, why: str) -> None:
        """``use`` could not be resolved to an object of the package (``why``)."""
        self.skipped.append(Finding(use.file, use.line, self.package, use_what(use), why))

    def as_dict(self) -> Dict[str, object]:
        return {
            "version": self.version,
            "source": self.source,
            "checked": self.checked,
            "unverified": len(self.unverified),
            "skipped": len(self.skipped),
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
