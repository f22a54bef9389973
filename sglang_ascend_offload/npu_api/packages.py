"""Check ``memfabric_hybrid`` / ``memcache_hybrid`` uses against the installed packages.

Both import on a CPU-only machine (their native libraries load; nothing is initialised),
so every use is resolved on the real module objects:

* attributes by ``getattr`` along the path; a call result ``()`` of a class is an
  instance of it, of a pybind11 function the class its signature names after ``->``
  (``create2(...) -> (anonymous namespace)::BigMemory`` types the result as
  ``bm.BigMemory``);
* stores (``cfg.flags = ...``) need a settable property of the pybind11 class;
* calls are bound against the signature: pybind11 functions carry theirs in the first
  line(s) of ``__doc__`` (every overload is tried), Python functions through
  :func:`inspect.signature`.

Versions: the installed version is the API reference. It must lie in the range the
project's ``[npu]`` extra declares (read from the installed distribution's metadata);
the CPU environment installs the lowest supported version. A version outside the
range is itself a finding, since nothing else was checked against it.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import os
import re
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..versions import installed_version
from .callsites import CALL, Use
from .result import Finding, PackageResult, bind_problem, use_what

__all__ = ["DISTRIBUTIONS", "PybindSignature", "parse_pybind_signatures", "supported_range", "check"]

#: import name -> distribution name
DISTRIBUTIONS = {"memfabric_hybrid": "memfabric-hybrid", "memcache_hybrid": "memcache-hybrid"}
PROJECT = "sglang-ascend-offload"


@dataclass(frozen=True)
class PybindSignature:
    """One overload parsed from a pybind11 docstring."""

    name: str
    signature: inspect.Signature
    returns: str


def _split_top(text: str) -> List[str]:
    parts, depth, cur, quote = [], 0, [], ""
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _closing(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def parse_pybind_signatures(doc: Optional[str], name: str) -> List[PybindSignature]:
    """Every ``name(params) -> ret`` line of a pybind11 ``__doc__`` (overloads included)."""
    out: List[PybindSignature] = []
    P = inspect.Parameter
    for m in re.finditer(rf"(?m)^(?:\d+\.\s*)?{re.escape(name)}\(", doc or ""):
        open_at = m.end() - 1
        close = _closing(doc, open_at)
        if close < 0:
            continue
        params: List[inspect.Parameter] = []
        kind = P.POSITIONAL_OR_KEYWORD
        for raw in _split_top(doc[open_at + 1 : close]):
            if raw == "*":
                kind = P.KEYWORD_ONLY
                continue
            if raw.startswith("**"):
                params.append(P(raw[2:].split(":")[0].strip(), P.VAR_KEYWORD))
                continue
            if raw.startswith("*"):
                params.append(P(raw[1:].split(":")[0].strip(), P.VAR_POSITIONAL))
                kind = P.KEYWORD_ONLY
                continue
            pname = re.split(r"[:=]", raw, maxsplit=1)[0].strip()
            has_default = bool(re.search(r"\s=\s", raw)) or ("=" in raw and ":" not in raw)
            params.append(P(pname, kind, default=None if has_default else P.empty))
        rest = doc[close + 1 :].split("\n", 1)[0]
        returns = rest.split("->", 1)[1].strip() if "->" in rest else ""
        try:
            out.append(PybindSignature(name, inspect.Signature(params), returns))
        except ValueError:
            continue
    return out


def _npu_requirements() -> List[str]:
    """The ``[npu]`` extra: from the checkout's pyproject.toml when there is one (it is
    newer than an editable install's metadata), else from the installed metadata."""
    pyproject = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pyproject.toml"
    )
    if os.path.isfile(pyproject):
        try:
            import tomllib  # noqa: PLC0415 - Python 3.11+

            with open(pyproject, "rb") as f:
                npu = tomllib.load(f)["project"]["optional-dependencies"]["npu"]
            return [f'{r}; extra == "npu"' for r in npu]
        except (ImportError, KeyError, ValueError):
            pass
    try:
        return md.requires(PROJECT) or []
    except md.PackageNotFoundError:
        return []


def supported_range(distribution: str) -> Optional[str]:
    """The version specifier the project's ``[npu]`` extra gives ``distribution``."""
    for req in _npu_requirements():
        head, _, marker = req.partition(";")
        if "extra" not in marker or "npu" not in marker:
            continue
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", head)
        if m and m.group(1).replace("_", "-").lower() == distribution:
            return m.group(2).strip().strip("()") or None
    return None


def _in_range(version: str, spec: Optional[str]) -> bool:
    if not spec:
        return True
    from packaging.specifiers import SpecifierSet  # noqa: PLC0415 - only when checking

    return SpecifierSet(spec).contains(version, prereleases=True)


class _Untyped(Exception):
    pass


@dataclass
class _Obj:
    value: Any
    instance: bool = False  # an instance of ``value`` (a class)


def _is_pybind(obj: Any) -> bool:
    return isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)) or (
        type(obj).__name__ == "instancemethod"
    )


def _find_class(root: types.ModuleType, spelled: str) -> Optional[type]:
    """The class named by the last component of ``spelled`` reachable from ``root``."""
    want = re.split(r"::|\.", spelled.strip())[-1]
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for name in dir(obj):
            try:
                val = getattr(obj, name)
            except Exception:  # noqa: BLE001 - a property that needs a driver
                continue
            if (
                isinstance(val, type)
                and val.__name__ == want
                and val.__module__.split(".")[0].lstrip("_") != "builtins"
            ):
                return val
            if isinstance(val, types.ModuleType) and getattr(val, "__name__", "").lstrip("_").startswith(
                ("pymf", "pymmc", root.__name__)
            ):
                todo.append(val)
            elif isinstance(val, type) and not name.startswith("_"):
                todo.append(val)
    return None


def _signatures(obj: _Obj, attr_name: str) -> Tuple[List[inspect.Signature], str]:
    """Call signatures of ``obj`` (``self`` dropped where it is bound) and where they came from."""
    value = obj.value
    if isinstance(value, type) and not obj.instance:  # constructing
        init = getattr(value, "__init__", None)
        if _is_pybind(init):
            sigs = parse_pybind_signatures(init.__doc__, "__init__")
            return [_drop_first(s.signature) for s in sigs], "pybind11 __init__ doc"
        try:
            return [inspect.signature(value)], "inspect.signature"
        except (TypeError, ValueError):
            raise _Untyped("constructor without a signature") from None
    if _is_pybind(value):
        sigs = parse_pybind_signatures(value.__doc__, getattr(value, "__name__", attr_name))
        if not sigs:
            raise _Untyped("pybind11 function without a signature in __doc__")
        bound = obj.instance or any(p == "self" for s in sigs for p in list(s.signature.parameters)[:1])
        return [_drop_first(s.signature) if bound and obj.instance else s.signature for s in sigs], "pybind11 doc"
    if callable(value):
        try:
            sig = inspect.signature(value)
        except (TypeError, ValueError):
            raise _Untyped("callable without a signature") from None
        return [_drop_first(sig) if obj.instance else sig], "inspect.signature"
    raise _Untyped("not callable")


def _drop_first(sig: inspect.Signature) -> inspect.Signature:
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:]) if params and params[0].name == "self" else sig


class _Resolver:
    def __init__(self, root: types.ModuleType):
        self.root = root

    def walk(self, path: Sequence[str]) -> Tuple[_Obj, Optional[_Obj], str]:
        """(the object ``path`` names, its parent, its last name); raises LookupError / _Untyped."""
        cur = _Obj(self.root)
        parent: Optional[_Obj] = None
        last = path[0]
        for part in path[1:]:
            if part == CALL:
                cur = self._call_result(cur, last)
                continue
            if not hasattr(cur.value, part):
                owner = getattr(cur.value, "__name__", type(cur.value).__name__)
                raise LookupError(
                    f"{owner} has no attribute {part!r}; it has "
                    f"{sorted(n for n in dir(cur.value) if not n.startswith('_'))}"
                )
            parent, last = cur, part
            try:
                val = getattr(cur.value, part)
            except Exception as exc:  # noqa: BLE001 - e.g. a property that needs an instance
                raise _Untyped(f"reading {part} raised {type(exc).__name__}") from None
            cur = _Obj(val, instance=cur.instance and not isinstance(val, type))
        return cur, parent, last

    def _call_result(self, obj: _Obj, name: str) -> _Obj:
        if isinstance(obj.value, type) and not obj.instance:
            return _Obj(obj.value, instance=True)
        if _is_pybind(obj.value):
            for sig in parse_pybind_signatures(obj.value.__doc__, getattr(obj.value, "__name__", name)):
                cls = _find_class(self.root, sig.returns) if sig.returns else None
                if cls is not None:
                    return _Obj(cls, instance=True)
                raise _Untyped(f"{name} returns {sig.returns or 'an undeclared type'}")
        raise _Untyped(f"the result of calling {name}")


def _check_use(resolver: _Resolver, use: Use, result: PackageResult) -> None:
    """One use's outcome (``result.py``): a name that does not resolve is a finding, one
    that cannot be typed is skipped, a call whose signature cannot be read unverified."""
    try:
        obj, parent, last = resolver.walk(use.path)
        if use.kind == "store" and parent is not None:
            attr = inspect.getattr_static(parent.value, last, None) if isinstance(parent.value, type) else None
            if isinstance(attr, property) and attr.fset is None:
                raise LookupError(f"{last} is a read-only property")
        if use.kind == "call":
            try:
                sigs, origin = _signatures(obj, last)
            except _Untyped as exc:
                return result.unverify(use, str(exc))
            if not sigs:
                return result.unverify(use, f"no signature could be read from its {origin}")
            problems = [bind_problem(s, use.positional, use.keywords, use.starred) for s in sigs]
            if all(problems):
                raise LookupError(problems[0] if len(problems) == 1 else "; ".join(problems))
        result.checked += 1
    except LookupError as exc:
        why = str(exc).strip("'\"")
        if use.note:
            why += f" ({use.note})"
        result.findings.append(Finding(use.file, use.line, use.package, use_what(use), why))
    except _Untyped as exc:
        result.skip(use, str(exc))


def check(uses: Sequence[Use], package: str) -> PackageResult:
    """Check the uses of ``package`` (``memfabric_hybrid`` or ``memcache_hybrid``)."""
    dist = DISTRIBUTIONS[package]
    version = installed_version(dist)
    spec = supported_range(dist)
    result = PackageResult(package, version, f"installed {dist} {version or '-'} (supported {spec or 'any'})")
    mine = [u for u in uses if u.package == package]
    if version is None:
        for u in mine[:1]:
            result.findings.append(Finding(u.file, u.line, package, dist, "not installed: nothing checked"))
        return result
    if not _in_range(version, spec):
        first = mine[0] if mine else None
        result.findings.append(
            Finding(
                first.file if first else "pyproject.toml",
                first.line if first else 0,
                package,
                f"{dist} {version}",
                f"outside the supported range {spec}: the check says nothing about it",
            )
        )
    module = importlib.import_module(package)
    resolver = _Resolver(module)
    for use in mine:
        _check_use(resolver, use, result)
    return result


def versions() -> Dict[str, Optional[str]]:
    return {pkg: installed_version(dist) for pkg, dist in DISTRIBUTIONS.items()}
