"""The stand-in's own surface against the real torch_npu, so it cannot drift.

Recorded from the torch_npu 2.13.0 wheel (never installed): the dispatcher schemas
(``npu_api/torch_npu_ops.json``, ``torch_npu_surface.json``) and the Python signatures
of the files that make ``torch.npu`` and ``torch_npu.multiprocessing.reductions``
(``torch_npu_surface.json``, written by ``record_surface.py``). Held here, in the CPU
suite (importing the stand-in's modules installs nothing):

* every public callable of the stand-in's ``torch.npu`` is a name the real one binds,
  with the same parameters in the same order and the same defaults where the real one
  is Python (a name defined in C is checked by name only, and listed);
* every stand-in torch_npu op's kernel takes its recorded schema's parameters, in order,
  with the schema's defaults; the refusing names and ``reductions`` exist in the wheel;
* every ``torch.npu.*`` name and torch_npu op the project and the npu tests use is
  provided by the stand-in (else a stand-in run fails on the stand-in, not the code).

Negative controls: a renamed parameter, a changed default and an invented name are each
reported.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from npu_standin import npu_module, torch_npu_ops
from sglang_ascend_offload.npu_api import callsites, torch_npu_schemas

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site" / "torch_npu"
NPU_MODULES = ("npu", "npu.utils", "npu.streams", "npu.graphs", "npu.memory")


def _value(text: Optional[str]):
    if text is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def real_params(recorded: List[list]) -> List[tuple]:
    """``[(name, default)]`` of a recorded signature without ``self`` / ``cls``."""
    return [(n, _value(d)) for n, d in recorded if n not in ("self", "cls")]


def stand_in_params(fn) -> List[tuple]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "cls"):
            continue
        name = {p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
        if p.kind == p.KEYWORD_ONLY and not any(n.startswith("*") for n, _ in out):
            out.append(("*", inspect.Parameter.empty))
        out.append((name, p.default))
    return out


def _real_entry(python: Dict[str, list], qualname: str) -> Optional[list]:
    for module in NPU_MODULES:
        if f"{module}:{qualname}" in python:
            return python[f"{module}:{qualname}"]
    return None


def callables_of(module) -> Dict[str, object]:
    """Public functions / classes a module defines itself (its settings, in capitals, aside)."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and not name.isupper()
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module.__name__
    }


def npu_surface_problems(module, surface: dict, names: List[str]) -> List[str]:
    """Differences between a stand-in ``torch.npu`` module and the recorded one."""
    python, problems, known = surface["python"], [], set(names)
    for name, obj in callables_of(module).items():
        if name not in known:
            problems.append(f"torch.npu has no {name!r}")
            continue
        members = [(name, obj)]
        if inspect.isclass(obj):
            members = [
                (f"{name}.{m}", f) for m, f in vars(obj).items() if inspect.isfunction(f) and not m.startswith("_")
            ]
            ctor = _real_entry(python, f"{name}.__new__") or _real_entry(python, f"{name}.__init__")
            if ctor is not None:
                members.append((f"{name}.__init__", obj.__init__))
        for qualname, fn in members:
            lookup = qualname.replace(".__init__", ".__new__")
            real = _real_entry(python, lookup) or _real_entry(python, qualname)
            if real is None and inspect.isfunction(obj) and _real_entry(python, f"{name}.__init__"):
                real = _real_entry(python, f"{name}.__init__")  # a class in torch_npu, a function here
            if real is None:
                continue  # defined in C: checked by name
            mine, theirs = stand_in_params(fn), real_params(real)
            if mine != theirs:
                problems.append(f"torch.npu.{qualname}: stand-in {mine} != torch_npu {theirs}")
    return problems


def _schema_params(text: str) -> List[tuple]:
    """``[(name, default value)]`` of a dispatcher schema (``*`` kept)."""
    from sglang_ascend_offload.npu_api.packages import _split_top

    body = re.match(r"^[\w.]+\((.*)\)\s*->", text).group(1)
    out = []
    for part in _split_top(body):
        if part == "*":
            out.append(("*", inspect.Parameter.empty))
            continue
        decl, eq, default = part.partition("=")
        value = inspect.Parameter.empty
        if eq:
            default = default.strip()
            value = {"None": None, "True": True, "False": False}.get(default, default)
            if isinstance(value, str):
                value = _value(default) if not default.startswith('"') else default.strip('"')
        out.append((decl.split()[-1], value))
    return out


def kernel_problems(kernels: Dict[str, object], schemas: Dict[str, str]) -> List[str]:
    problems = []
    for name, kernel in kernels.items():
        theirs = [p for p in _schema_params(schemas[name]) if p[0] != "*"]
        mine = [p for p in stand_in_params(kernel) if p[0] != "*"]
        if mine != theirs:
            problems.append(f"{name}: stand-in {mine} != schema {theirs}")
    return problems


@pytest.fixture(scope="module")
def surface():
    return torch_npu_ops.surface()


def test_the_stand_in_torch_npu_module_matches_torch_npu(surface):
    names = torch_npu_schemas.load()["npu_module_names"]
    assert npu_surface_problems(npu_module, surface, names) == []


def test_the_stand_in_ops_take_their_recorded_schemas(surface):
    schemas = torch_npu_ops.recorded_schemas()
    assert kernel_problems({**torch_npu_ops.KERNELS, **torch_npu_ops.SGLANG_KERNELS}, schemas) == []
    assert set(torch_npu_ops.UNMODELLED) <= set(surface["ops"])
    assert surface["torch_npu_version"] == torch_npu_schemas.load()["torch_npu_version"]
    tree = ast.parse((SITE / "multiprocessing" / "reductions.py").read_text())
    mine = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    assert sorted(mine) == surface["all"]["multiprocessing.reductions"]


def _used_torch_npu_names() -> Dict[str, set]:
    """``torch.npu.*`` names and torch_npu ops used by the package (``npu_api``'s call-site
    scan of the modules that mention torch_npu) and by the npu-marked tests (their text)."""
    package = REPO / "sglang_ascend_offload"
    sources = {}
    for path in package.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "torch_npu" in text or "torch.npu" in text:
            sources[str(path.relative_to(REPO))] = text
    uses = [u.path for u in callsites.scan_source(sources).uses if u.path and u.path[0] == "torch_npu"]
    npu = {p[2] for p in uses if p[:2] == ("torch_npu", "npu") and len(p) > 2}
    ops = {p[1] for p in uses if len(p) > 1 and p[1].startswith("npu_")}
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text(errors="replace")
        if "npu_standin" in path.parts or "mark.npu" not in text:
            continue
        npu |= set(re.findall(r"torch\.npu\.([A-Za-z_]\w*)", text))
        ops |= set(re.findall(r"torch_npu\.(npu_\w+)", text))
    return {"npu": npu, "ops": ops}


def test_everything_the_project_uses_is_provided():
    used = _used_torch_npu_names()
    provided_ops = set(torch_npu_ops.KERNELS) | set(torch_npu_ops.SGLANG_KERNELS) | set(torch_npu_ops.UNMODELLED)
    assert sorted(n for n in used["npu"] if not hasattr(npu_module, n)) == []
    assert sorted(used["ops"] - provided_ops) == []


def test_a_drift_is_reported(surface):
    """Negative controls: the comparison sees a renamed parameter, a changed default and
    an invented name."""
    names = torch_npu_schemas.load()["npu_module_names"]

    class Drifted:
        __name__ = "npu_module_drifted"

        @staticmethod
        def _functions():
            def synchronize(dev=None):  # renamed parameter
                return None

            def current_stream(device=0):  # changed default
                return None

            def teleport():  # no such name in torch.npu
                return None

            return synchronize, current_stream, teleport

    import types

    module = types.ModuleType("npu_module_drifted")
    for fn in Drifted._functions():
        fn.__module__ = module.__name__
        setattr(module, fn.__name__, fn)
    problems = npu_surface_problems(module, surface, names)
    assert any("synchronize" in p for p in problems)
    assert any("current_stream" in p for p in problems)
    assert any("'teleport'" in p for p in problems)
    schemas = torch_npu_ops.recorded_schemas()

    def npu_lightning_indexer(query, key, weight):  # a parameter renamed, the rest missing
        return None

    assert kernel_problems({"npu_lightning_indexer": npu_lightning_indexer}, schemas)
