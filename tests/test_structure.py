"""Package structure (issue 16): one direction for every import.

* no runtime module imports the test/benchmark scaffolding in ``testing/`` (only
  ``testing/`` itself and the ``bench`` commands may);
* module-level imports form no cycle (imports inside functions, the lazy factory
  lookups, are allowed to point back);
* ``ops`` and ``triton_ops`` never import ``sparse_decode``; ``ops/contract.py``
  imports nothing of the package;
* ``transfer/`` is engine-agnostic: it never imports SGLang.

The import graph comes from the source (AST), so the checks need no optional
dependency and see lazy imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
PKG = "sglang_ascend_offload"
SCAFFOLDING = f"{PKG}.testing"
MAY_IMPORT_SCAFFOLDING = (f"{PKG}.testing", f"{PKG}.bench")


def _modules() -> Dict[str, Path]:
    mods: Dict[str, Path] = {}
    for path in (REPO / PKG).rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    for path in (REPO / "triton_ops").rglob("*.py"):  # installed as sglang_ascend_offload.triton_ops
        parts = list(path.relative_to(REPO / "triton_ops").with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join([PKG, "triton_ops", *parts])] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(source: str, module: str, is_package: bool) -> Iterator[Tuple[str, List[str], bool]]:
    """``(imported module, imported names, lazy)`` for every import statement of ``source``
    (``lazy``: inside a function); ``if TYPE_CHECKING`` blocks are skipped."""

    def walk(nodes, lazy):
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, [], lazy
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    if not is_package:
                        base = base[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                yield target, [a.name for a in node.names], lazy
            for field in ("body", "orelse", "finalbody", "handlers"):
                child = getattr(node, field, None)
                if isinstance(child, list) and child and not isinstance(node, (ast.Import, ast.ImportFrom)):
                    inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    yield from walk(child, inner)

    yield from walk(ast.parse(source).body, False)


def _graph(include_lazy: bool) -> Dict[str, Set[str]]:
    mods = _modules()
    graph: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        out: Set[str] = set()
        for target, names, lazy in imports(path.read_text(), name, path.name == "__init__.py"):
            if lazy and not include_lazy:
                continue
            for sub in names or [""]:
                full = f"{target}.{sub}" if sub else target
                if full in mods:
                    out.add(full)
                elif target in mods:
                    out.add(target)
        out.discard(name)
        graph[name] = out
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _scaffolding_importers(graph: Dict[str, Set[str]]) -> List[Tuple[str, str]]:
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if (t == SCAFFOLDING or t.startswith(SCAFFOLDING + "."))
                  and not m.startswith(MAY_IMPORT_SCAFFOLDING))


# ---------------------------------------------------------------------------- the checks
def test_no_runtime_module_imports_the_testing_scaffolding():
    graph = _graph(include_lazy=True)
    assert _scaffolding_importers(graph) == []
    # the check can fail: a runtime module with a lazy import of testing/ is caught
    fake = dict(graph)
    fake[f"{PKG}.transfer.fake"] = {f"{PKG}.testing.ports"}
    assert _scaffolding_importers(fake) == [(f"{PKG}.transfer.fake", f"{PKG}.testing.ports")]


def test_module_level_imports_form_no_cycle():
    graph = _graph(include_lazy=False)
    assert len(graph) > 100
    assert cycles(graph) == []
    # the detector finds a cycle when there is one
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_ops_sit_below_sparse_decode_and_the_contract_imports_nothing_of_the_package():
    graph = _graph(include_lazy=True)
    lower = (f"{PKG}.ops", f"{PKG}.triton_ops")
    up = sorted((m, t) for m, targets in graph.items() if m.startswith(lower)
                for t in targets if t.startswith(f"{PKG}.sparse_decode"))
    assert up == []
    assert graph[f"{PKG}.ops.contract"] == set()


def test_transfer_never_imports_sglang():
    mods = _modules()
    found = []
    for name, path in mods.items():
        if not name.startswith(f"{PKG}.transfer"):
            continue
        for target, _, _ in imports(path.read_text(), name, path.name == "__init__.py"):
            if target == "sglang" or target.startswith("sglang.") or target.startswith(f"{PKG}.sglang_plugin"):
                found.append((name, target))
    assert found == []
    src = "def f():\n    from sglang.srt import server_args\n"
    assert [t for t, _, lazy in imports(src, f"{PKG}.transfer.x", False) if lazy] == ["sglang.srt"]
