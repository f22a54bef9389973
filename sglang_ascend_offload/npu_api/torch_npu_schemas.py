"""torch_npu operator schemas, extracted from the wheel, and the check of our calls.

Authoritative source: the schema strings registered with the PyTorch dispatcher, as
they are compiled into ``torch_npu/lib/libtorch_npu.so`` (the ``m.def("npu_x(Tensor
query, ..., *, ...) -> ...")`` registrations of torch_npu's op-plugin). ``torch_npu.npu_x``
and ``torch.ops.npu.npu_x`` are bound from exactly these schemas, so their parameter
names, which are positional and which keyword-only, and which have defaults are what a
call is checked against at run time on a node. The wheel also ships
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (the codegen input the
registrations were generated from); :func:`extract_from_wheel` reads both and records a
disagreement between them. ``torch_npu/_op_plugin_docs.py`` holds prose docstrings, not
schemas, and is not used. ``torch.npu.*`` names are checked against the names
``torch_npu/npu/__init__.py`` binds (its ``__all__`` and definitions).

The extracted schemas of the ops the project calls live in ``torch_npu_ops.json`` next
to this module, written by ``scripts/extract_torch_npu_schemas.py`` (which downloads
the wheel with ``pip download --no-deps``; nothing is installed). :func:`check` reads
that file only.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import zipfile
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .callsites import Use
from .result import Finding, PackageResult, bind_problem

__all__ = ["DATA_FILE", "OpSchema", "parse_schema", "extract_from_wheel", "load", "check"]

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_npu_ops.json")
_LIB = "torch_npu/lib/libtorch_npu.so"
_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
_INIT = "torch_npu/__init__.py"
_NPU_INIT = "torch_npu/npu/__init__.py"  # torch.npu


@dataclass(frozen=True)
class OpSchema:
    """One parsed schema: ``name``, its overload (``""`` for the default one), the
    parameters as an :class:`inspect.Signature` and the raw text."""

    name: str
    overload: str
    signature: inspect.Signature
    text: str


from .packages import _split_top  # noqa: E402 - the one bracket- and quote-aware splitter

_SCHEMA_RE = re.compile(r"^([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?\((.*)\)\s*->\s*.+$")


def parse_schema(text: str) -> Optional[OpSchema]:
    """Parse ``name[.overload](Type a, Type? b=None, *, int c=1) -> ret``; ``None`` if not one."""
    m = _SCHEMA_RE.match(text.strip())
    if not m:
        return None
    P = inspect.Parameter
    params, kind = [], P.POSITIONAL_OR_KEYWORD
    for raw in _split_top(m.group(3)):
        if raw == "*":
            kind = P.KEYWORD_ONLY
            continue
        decl, eq, _default = raw.partition("=")
        words = decl.split()
        if len(words) < 2:
            return None
        try:
            params.append(P(words[-1], kind, default=None if eq else P.empty))
        except ValueError:
            return None
    try:
        sig = inspect.Signature(params)
    except ValueError:
        return None
    return OpSchema(m.group(1), m.group(2) or "", sig, text.strip())


def _binary_strings(data: bytes, min_len: int = 12) -> Iterable[str]:
    for m in re.finditer(rb"[\x20-\x7e]{%d,}" % min_len, data):
        yield m.group(0).decode("ascii")


def _init_names(source: str) -> List[str]:
    """Top-level names a module's source binds statically (its ``__all__`` included)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return sorted(names)


def extract_from_wheel(wheel: str, ops: Sequence[str]) -> Dict[str, object]:
    """The JSON document for ``ops`` read from the torch_npu ``wheel`` (a zip)."""
    with zipfile.ZipFile(wheel) as z:
        lib = z.read(_LIB)
        yaml_text = z.read(_YAML).decode("utf-8", "replace") if _YAML in z.namelist() else ""
        init_src = z.read(_INIT).decode("utf-8", "replace")
        npu_src = z.read(_NPU_INIT).decode("utf-8", "replace")
        version_src = z.read("torch_npu/version.py").decode() if "torch_npu/version.py" in z.namelist() else ""
    wanted = set(ops)
    found: Dict[str, List[str]] = {}
    for text in _binary_strings(lib):
        schema = parse_schema(text)
        if schema and schema.name in wanted and text not in found.get(schema.name, []):
            found.setdefault(schema.name, []).append(text)
    yaml_schemas: Dict[str, List[str]] = {}
    for m in re.finditer(r"func:\s*(.+)", yaml_text):
        schema = parse_schema(m.group(1))
        if schema and schema.name in wanted:
            yaml_schemas.setdefault(schema.name, []).append(schema.text)
    disagree = {
        n: {"lib": found.get(n, []), "yaml": v}
        for n, v in yaml_schemas.items()
        if sorted(v) != sorted(found.get(n, []))
    }
    version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", version_src)
    return {
        "torch_npu_version": version.group(1) if version else None,
        "wheel": os.path.basename(wheel),
        "source": f"dispatcher schema strings in {_LIB}",
        "ops": {n: sorted(found[n]) for n in sorted(found)},
        "missing": sorted(wanted - set(found)),
        "lib_yaml_disagreements": disagree,
        "module_names": _init_names(init_src),
        "npu_module_names": _init_names(npu_src),
    }


def load(path: str = DATA_FILE) -> Dict[str, object]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def schemas(data: Dict[str, object]) -> Dict[str, List[OpSchema]]:
    out: Dict[str, List[OpSchema]] = {}
    for name, texts in dict(data.get("ops", {})).items():
        out[name] = [s for s in (parse_schema(t) for t in texts) if s]
    return out


def _call_problem(overloads: List[OpSchema], use: Use) -> Optional[str]:
    problems = [bind_problem(s.signature, use.positional, use.keywords, use.starred) for s in overloads]
    if all(problems):
        return "; ".join(p for p in problems if p)
    return None


def check(uses: Sequence[Use], data: Optional[Dict[str, object]] = None) -> PackageResult:
    """Check every ``torch_npu`` use: an op call must name an extracted schema and bind
    to it (keyword names, positional arity, required parameters); a ``torch.npu.*`` name
    must be one ``torch_npu/npu/__init__.py`` binds, and a call of it is unverified (its
    signature is not extracted)."""
    data = data or load()
    ops = schemas(data)
    names = set(data.get("module_names", []))
    result = PackageResult("torch_npu", data.get("torch_npu_version"), str(data.get("source")))
    for use in uses:
        if use.package == "torch_npu":
            _check_use(use, ops, names, set(data.get("npu_module_names", [])), result)
    return result


def _check_use(use: Use, ops: Dict[str, List[OpSchema]], names, npu_names, result: PackageResult) -> None:
    """One use's outcome (``result.py``)."""
    if len(use.path) < 2:
        result.checked += 1
        return
    name = use.path[1]
    if len(use.path) == 2 and use.kind == "call":
        if name not in ops:
            why = (
                f"no registered schema named {name!r} in torch_npu {result.version} "
                f"(run scripts/extract_torch_npu_schemas.py if it is a new call)"
            )
            result.findings.append(Finding(use.file, use.line, "torch_npu", f"torch_npu.{name}(...)", why))
            return
        why = _call_problem(ops[name], use)
        if why:
            result.findings.append(Finding(use.file, use.line, "torch_npu", f"torch_npu.{name}(...)", why))
            return
        result.checked += 1
    elif len(use.path) == 2 and (name in ops or name in names):
        result.checked += 1
    elif len(use.path) >= 3 and name == "npu" and use.path[2] != "()":
        if use.path[2] not in npu_names:
            why = f"torch_npu {result.version}'s torch.npu module has no {use.path[2]!r} ({_NPU_INIT})"
            result.findings.append(Finding(use.file, use.line, "torch_npu", f"torch.npu.{use.path[2]}", why))
        elif len(use.path) > 3:
            result.skip(use, f"torch.npu.{use.path[2]} exists; what follows it is not extracted")
        elif use.kind == "call":
            result.unverify(use, f"torch.npu.{use.path[2]} exists; torch.npu's signatures are not extracted")
        else:
            result.checked += 1
    elif len(use.path) == 2 and name.startswith("npu_"):
        result.findings.append(
            Finding(use.file, use.line, "torch_npu", f"torch_npu.{name}", "no registered schema of that name")
        )
    else:
        result.skip(use, "a torch_npu Python attribute (only op schemas and top-level names are extracted)")


def project_ops(uses: Iterable[Use]) -> Tuple[str, ...]:
    """The op names the project's ``torch_npu`` uses reach (what the extractor keeps)."""
    return tuple(
        sorted(
            {u.path[1] for u in uses if u.package == "torch_npu" and len(u.path) == 2 and u.path[1].startswith("npu_")}
        )
    )
