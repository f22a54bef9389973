"""Package structure: one direction for every import, one home for every concept.

* no runtime module imports the test/benchmark scaffolding in ``testing/`` (only
  ``testing/`` itself and the ``bench`` commands may);
* module-level imports form no cycle;
* imports inside functions form no cycle either, between modules or between the
  package's parts (each subpackage one node), except the lazy factory lookups listed
  in :data:`FACTORY_LOOKUPS` (a function that picks and imports one implementation of
  an interface whose implementations import the interface's module);
* ``ops`` and ``triton_ops`` never import ``sparse_decode``; ``ops/contract.py``
  imports nothing of the package;
* ``transfer/`` is engine-agnostic: it never imports SGLang.

The import graph comes from the source (AST), so the checks need no optional
dependency and see lazy imports too.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
PKG = "sglang_ascend_offload"
SCAFFOLDING = f"{PKG}.testing"
# ``demo`` serves the checkout's trained checkpoint through the same server launcher.
MAY_IMPORT_SCAFFOLDING = (f"{PKG}.testing", f"{PKG}.bench", f"{PKG}.demo")


@dataclass(frozen=True)
class Factory:
    """A lazy factory lookup: ``importer``'s function ``scope`` imports ``imported``
    when it is called, and ``imported`` imports ``importer`` back (it implements or
    subclasses what ``importer`` defines). Only this function's import is excused."""

    importer: str
    scope: str
    imported: str
    why: str


def _f(importer: str, scope: str, imported: str, why: str) -> Factory:
    return Factory(f"{PKG}.{importer}", scope, f"{PKG}.{imported}", why)


# Every import inside a function that may point back up the import graph, and why it
# is a factory. Anything else that closes a cycle fails the cycle checks below.
FACTORY_LOOKUPS: Tuple[Factory, ...] = (
    # The attention backend factory SGLang calls for --attention-backend ascend_offload
    # returns the sparse decode subclass when the served config enables it; that
    # subclass (attention/sparse_decode.py) imports attention/dsa_backend.py to subclass it.
    _f(
        "sglang_plugin.attention.dsa_backend",
        "create_backend",
        "sglang_plugin.attention.sparse_decode",
        "attention backend factory: picks SparseDecodeOffloadBackend, a subclass of backend's class",
    ),
    # SGLang's draft-backend factory (hooked) and the multi-step draft backend build
    # AscendOffloadAttnBackend instances for the draft model; attention/dsa_backend.py uses the
    # speculative helpers (verify lengths, draft runner test) at module level.
    _f(
        "sglang_plugin.speculative.eagle",
        "MultiStepDraftBackend.__init__",
        "sglang_plugin.attention.dsa_backend",
        "draft backend factory: one AscendOffloadAttnBackend per draft step",
    ),
    _f(
        "sglang_plugin.speculative.eagle",
        "create_backend_around",
        "sglang_plugin.attention.dsa_backend",
        "DraftBackendFactory hook: adds the ascend_offload draft backend constructors",
    ),
    # make_store builds the host KV store the config names; each store module
    # implements store.py's HostKVStore interface.
    _f(
        "layerwise_prefill.store",
        "make_store",
        "layerwise_prefill.store_local",
        "host KV store factory: the local store implements store.HostKVStore",
    ),
    _f(
        "layerwise_prefill.store",
        "make_store",
        "layerwise_prefill.store_memcache",
        "host KV store factory: the MemCache store implements store.HostKVStore (optional dependency)",
    ),
    # create_engine starts the P/D transfer engine the config names; each engine
    # module implements engine.py's TransferEngine interface.
    _f(
        "transfer.engine",
        "create_engine",
        "transfer.engine_mooncake",
        "transfer engine factory: Mooncake implements engine.TransferEngine (optional dependency)",
    ),
    _f(
        "transfer.engine",
        "create_engine",
        "transfer.engine_memfabric",
        "transfer engine factory: MemFabric implements engine.TransferEngine (optional dependency)",
    ),
    # The Triton rung's ops load their kernels when called (Triton is optional; the
    # registry only marks them); the kernel modules implement ops/contract.py's types.
    _f(
        "ops.triton_impls",
        "residency_manage",
        "triton_ops.residency",
        "Triton rung of residency_manage: loads its kernels on first call; they return ops.contract types",
    ),
    _f(
        "ops.triton_impls",
        "copy_miss_rows",
        "triton_ops.copy_rows",
        "Triton rung of copy_miss_rows: loads its kernel on first call; it follows ops.contract",
    ),
    # allocate_rank_pool's NPU attention-TP > 1 branch builds the MemFabric group pool;
    # its control block reuses shared_host_pool's AppendOrder and header.
    _f(
        "sglang_plugin.mem_cache.pool_host.shared",
        "open_memfabric_group",
        "sglang_plugin.mem_cache.pool_host.group_rendezvous",
        "host pool factory: the MemFabric group's control block builds on shared_host_pool.AppendOrder",
    ),
    _f(
        "sglang_plugin.mem_cache.pool_host.shared",
        "open_memfabric_group",
        "sglang_plugin.mem_cache.pool_host.npu_memfabric",
        "host pool factory: the MemFabric group pool (NPU only) uses the control block above",
    ),
)


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
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class Import(NamedTuple):
    """One import statement's target, as :func:`imports` yields it."""

    target: str  # the imported module (``from X import names``: X)
    names: List[str]  # ``from X import names``; [] for ``import X``
    lazy: bool  # inside a function (runs when the function is called, not at import)
    scope: str  # qualified name of the enclosing function / class ("" at module level)


def imports(source: str, module: str, is_package: bool) -> Iterator[Import]:
    """Every import statement of ``source`` (module ``module``); ``if TYPE_CHECKING``
    blocks are skipped."""

    def walk(nodes, lazy, scope):
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(alias.name, [], lazy, scope)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    if not is_package:
                        base = base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                yield Import(target, [a.name for a in node.names], lazy, scope)
            is_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            inner_scope = f"{scope}.{node.name}".lstrip(".") if is_def else scope
            inner_lazy = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for field in ("body", "orelse", "finalbody", "handlers"):
                child = getattr(node, field, None)
                if isinstance(child, list) and child and not isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield from walk(child, inner_lazy, inner_scope)

    yield from walk(ast.parse(source).body, False, "")


Site = Tuple[str, bool]  # (scope, lazy) of one import of a module by another


@functools.lru_cache(maxsize=1)
def _edges() -> Dict[str, Dict[str, Set[Site]]]:
    """importer -> imported module of the package -> the sites (scope, lazy) importing it.
    Cached: callers must not change it (copy with :func:`_with_site`)."""
    mods = _modules()
    edges: Dict[str, Dict[str, Set[Site]]] = {}
    for name, path in mods.items():
        out: Dict[str, Set[Site]] = {}
        for imp in imports(path.read_text(), name, path.name == "__init__.py"):
            for sub in imp.names or [""]:
                full = f"{imp.target}.{sub}" if sub else imp.target
                hit = full if full in mods else imp.target if imp.target in mods else None
                if hit is not None and hit != name:
                    out.setdefault(hit, set()).add((imp.scope, imp.lazy))
        edges[name] = out
    return edges


def _with_site(
    edges: Dict[str, Dict[str, Set[Site]]], importer: str, scope: str, imported: str, lazy: bool
) -> Dict[str, Dict[str, Set[Site]]]:
    """A copy of ``edges`` with one more import (negative controls)."""
    out = {m: {t: set(s) for t, s in targets.items()} for m, targets in edges.items()}
    out.setdefault(f"{PKG}.{importer}", {}).setdefault(f"{PKG}.{imported}", set()).add((scope, lazy))
    return out


def _graph(
    include_lazy: bool, excused: Sequence[Factory] = (), edges: Optional[Dict[str, Dict[str, Set[Site]]]] = None
) -> Dict[str, Set[str]]:
    """importer -> imported modules. Module-level imports always count; imports inside
    functions count with ``include_lazy``, except those ``excused`` lists (an edge whose
    every site is excused is dropped)."""
    ok = {(f.importer, f.scope, f.imported) for f in excused}
    graph: Dict[str, Set[str]] = {}
    for name, out in (_edges() if edges is None else edges).items():
        graph[name] = {
            target
            for target, sites in out.items()
            if any(not lazy or (include_lazy and (name, scope, target) not in ok) for scope, lazy in sites)
        }
    return graph


def _collapse(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The graph between the package's parts: every subpackage (``ops``, ``sparse_decode``,
    ``sglang_plugin`` ...) is one node, every top-level module (``config``, ``capacity``
    ...) its own."""

    def part(mod: str) -> str:
        rest = mod[len(PKG) + 1 :].split(".") if mod.startswith(PKG + ".") else [""]
        return rest[0]

    out: Dict[str, Set[str]] = {}
    for mod, targets in graph.items():
        node = out.setdefault(part(mod), set())
        node.update(part(t) for t in targets if part(t) != part(mod))
    return out


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
    return sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if (t == SCAFFOLDING or t.startswith(SCAFFOLDING + ".")) and not m.startswith(MAY_IMPORT_SCAFFOLDING)
    )


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


def _cycles_everywhere(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Cycles between modules, then cycles between the package's parts."""
    return cycles(graph) + cycles(_collapse(graph))


def test_no_cycle_through_imports_inside_functions_except_factory_lookups():
    graph = _graph(include_lazy=True, excused=FACTORY_LOOKUPS)
    assert cycles(graph) == [], "a function-level import closes a module cycle (not a listed factory lookup)"
    assert cycles(_collapse(graph)) == [], "a function-level import closes a cycle between the package's parts"


def test_every_factory_lookup_is_a_lazy_import_that_is_needed():
    """Each allow-list entry names an existing import inside that function, and is
    needed: without it the cycle checks fail (the list cannot grow stale or loose)."""
    edges = _edges()
    for f in FACTORY_LOOKUPS:
        sites = edges.get(f.importer, {}).get(f.imported, set())
        assert (f.scope, True) in sites, f"stale FACTORY_LOOKUPS entry {f}: no such import inside {f.scope}"
        assert _cycles_everywhere(_graph(include_lazy=True, excused=[g for g in FACTORY_LOOKUPS if g != f])), (
            f"FACTORY_LOOKUPS entry {f} closes no cycle: remove it"
        )


def test_function_level_cycle_check_can_fail():
    """Negative controls on the real graph plus one injected import."""
    base = _edges()
    # the cycle this check was written for: compat importing the hooks' modules to list their targets
    bad = _with_site(base, "sglang_plugin.compat", "_hooked", "sglang_plugin.install", lazy=True)
    found = cycles(_graph(include_lazy=True, excused=FACTORY_LOOKUPS, edges=bad))
    assert any({f"{PKG}.sglang_plugin.compat", f"{PKG}.sglang_plugin.install"} <= set(c) for c in found), found
    assert cycles(_graph(include_lazy=False, edges=bad)) == []  # invisible to the module-level check
    # an allow-listed pair imported from another function is not excused
    bad = _with_site(
        base,
        "sglang_plugin.attention.dsa_backend",
        "AscendOffloadAttnBackend.init_forward_metadata",
        "sglang_plugin.attention.sparse_decode",
        lazy=True,
    )
    found = cycles(_graph(include_lazy=True, excused=FACTORY_LOOKUPS, edges=bad))
    assert any(f"{PKG}.sglang_plugin.attention.sparse_decode" in c for c in found), found
    # nor is the listed function's import when it moves to module level
    bad = _with_site(base, "transfer.engine", "", "transfer.engine_mooncake", lazy=False)
    found = cycles(_graph(include_lazy=True, excused=FACTORY_LOOKUPS, edges=bad))
    assert [f"{PKG}.transfer.engine", f"{PKG}.transfer.engine_mooncake"] in found, found
    # a cycle between parts only (capacity -> sparse_decode.sizing; sparse_decode.size_hot -> capacity)
    bad = _with_site(base, "sparse_decode.size_hot", "recommend", "capacity", lazy=True)
    graph = _graph(include_lazy=True, excused=FACTORY_LOOKUPS, edges=bad)
    assert cycles(graph) == []
    assert cycles(_collapse(graph)) == [["capacity", "sparse_decode"]]


def test_import_sites_know_their_function():
    src = (
        "import a\nclass C:\n    import b\n    def m(self):\n        def inner():\n"
        "            from . import c\n        return inner\nasync def g():\n    from .d import x\n"
    )
    got = [(i.target, i.lazy, i.scope) for i in imports(src, f"{PKG}.pkg.mod", False)]
    assert got == [("a", False, ""), ("b", False, "C"), (f"{PKG}.pkg", True, "C.m.inner"), (f"{PKG}.pkg.d", True, "g")]


def test_ops_sit_below_sparse_decode_and_the_contract_imports_nothing_of_the_package():
    graph = _graph(include_lazy=True)
    lower = (f"{PKG}.ops", f"{PKG}.triton_ops")
    up = sorted(
        (m, t)
        for m, targets in graph.items()
        if m.startswith(lower)
        for t in targets
        if t.startswith(f"{PKG}.sparse_decode")
    )
    assert up == []
    assert graph[f"{PKG}.ops.contract"] == set()


def test_transfer_never_imports_sglang():
    mods = _modules()
    found = []
    for name, path in mods.items():
        if not name.startswith(f"{PKG}.transfer"):
            continue
        for target, _, _, _ in imports(path.read_text(), name, path.name == "__init__.py"):
            if target == "sglang" or target.startswith("sglang.") or target.startswith(f"{PKG}.sglang_plugin"):
                found.append((name, target))
    assert found == []
    src = "def f():\n    from sglang.srt import server_args\n"
    assert [(t, scope) for t, _, lazy, scope in imports(src, f"{PKG}.transfer.x", False) if lazy] == [
        ("sglang.srt", "f")
    ]


# ---------------------------------------------------------------------------- the SGLang adapter
CORE = ("ops", "sparse_decode", "layerwise_prefill", "transfer", "kvpp")
PLUGIN = f"{PKG}.sglang_plugin"
# A module of the adapter past this many lines is a family that wants to be a package
# (sglang_plugin/README.md): split it by what its parts do. Lines as ruff formats them
# (one argument per line where a call does not fit in 120 columns).
PLUGIN_MODULE_MAX_LINES = 700


def _core_importers_of_the_plugin(graph: Dict[str, Set[str]]) -> List[Tuple[str, str]]:
    return sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if m.startswith(tuple(f"{PKG}.{c}" for c in CORE)) and (t == PLUGIN or t.startswith(PLUGIN + "."))
    )


def test_the_core_packages_never_import_the_sglang_adapter():
    graph = _graph(include_lazy=True)
    assert _core_importers_of_the_plugin(graph) == []
    fake = dict(graph)
    fake[f"{PKG}.sparse_decode.fake"] = {f"{PLUGIN}.mem_cache.pool.sparse_decode"}
    assert _core_importers_of_the_plugin(fake) == [
        (f"{PKG}.sparse_decode.fake", f"{PLUGIN}.mem_cache.pool.sparse_decode")
    ]


def test_adapter_modules_stay_small_and_the_old_flat_layout_is_gone():
    plugin_dir = REPO / PKG / "sglang_plugin"
    long = {
        str(p.relative_to(plugin_dir)): n
        for p in plugin_dir.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > PLUGIN_MODULE_MAX_LINES
    }
    assert long == {}, f"split these modules (over {PLUGIN_MODULE_MAX_LINES} lines): {long}"
    top = sorted(p.name for p in plugin_dir.glob("*.py"))
    assert top == [
        "__init__.py",
        "compat.py",
        "cpu_capability.py",
        "entry.py",
        "features.py",
        "install.py",
        "names.py",
    ], f"a new adapter module goes in its extension point's folder (sglang_plugin/README.md), not at the top: {top}"
    folders = sorted(p.name for p in plugin_dir.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["args", "attention", "disaggregation", "mem_cache", "observability", "speculative"], folders
    for folder in plugin_dir.rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), f"{folder} lacks __init__.py"


def test_every_package_is_listed_for_the_wheel():
    """pyproject.toml lists packages explicitly: a folder missing there is missing from
    an installed wheel (an editable install would not notice)."""
    text = (REPO / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(sglang_ascend_offload(?:\.\w+)*)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / PKG).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"


# ------------------------------------------------------------------ one rule registry
RULE_ID = re.compile(
    r"^(parse|deployment|flags|capacity|memory|sparse_decode|layerwise_prefill|pd_transfer|kvpp|sglang)"
    r"\.[a-z0-9_]+$"
)
_REPORTERS = {"Violation", "violation", "_violation", "add"}


def _rule_ids_reported() -> List[Tuple[str, int, str]]:
    """``(file, line, id)`` of every literal rule id given to a violation constructor."""
    found = []
    for path in sorted((REPO / PKG).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _REPORTERS and isinstance(node.args[0].value, str) and RULE_ID.match(node.args[0].value):
                found.append((str(path.relative_to(REPO)), node.lineno, node.args[0].value))
    return found


def test_rule_ids_are_defined_once_in_the_registry():
    """Every reported rule id is in ``rules.py``; no other module keeps a rule table
    (``config.RULES`` is the registry's deployment scope, derived from it)."""
    from sglang_ascend_offload.rules import RULES

    reported = _rule_ids_reported()
    unknown = [f"{f}:{line} {rule}" for f, line, rule in reported if rule not in RULES]
    assert unknown == [], f"register these rule ids in {PKG}/rules.py: {unknown}"
    assert len({rule for _, _, rule in reported}) > 60  # the scan sees the reporting sites
    tables = []
    for path in sorted((REPO / PKG).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "RULES" for t in targets):
                tables.append(str(path.relative_to(REPO)))
    assert tables == [f"{PKG}/config.py", f"{PKG}/rules.py"], tables


def test_installed_versions_have_one_reader():
    """``importlib.metadata.version`` is called in ``versions.py`` only."""
    callers = []
    for path in sorted((REPO / PKG).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                base = getattr(node.func, "value", None)
                if name == "version" and (base is None or getattr(base, "id", "") in ("md", "metadata")):
                    callers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert callers and all(c.startswith(f"{PKG}/versions.py:") for c in callers), callers


def test_hookregistry_is_called_from_install_only_and_every_target_lives_in_compat():
    """``sglang_plugin/install.py`` is the one HookRegistry caller of the runtime (the test
    harness's seams and planted faults in ``testing/`` hook the plugin's own code, only in
    processes the test launcher starts); each row of install's hook tables names a
    ``compat.TARGET_*`` path, and every such handler exists."""
    from sglang_ascend_offload.sglang_plugin import compat, install

    callers = []
    for path in sorted((REPO / PKG).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register"
                and getattr(node.func.value, "id", "") == "HookRegistry"
            ):
                callers.append(str(path.relative_to(REPO)))
    runtime_callers = {c for c in callers if not c.startswith(f"{PKG}/testing/")}
    assert runtime_callers == {f"{PKG}/sglang_plugin/install.py"}, callers
    targets = {value for name, value in vars(compat).items() if name.startswith("TARGET_")}
    for hook in install.FLAG_HOOKS + install.HOOKS:
        assert hook.target in targets, hook
        assert hook.kind in ("AROUND", "AFTER", "BEFORE", "REPLACE"), hook
        assert callable(install._resolve(hook.handler)), hook
        assert hook.when is None or callable(install._resolve(hook.when)), hook
    hooked = {h.path for h in compat.HOOKED}
    assert {h.target for h in install.HOOKS if h.target.startswith("sglang.")} <= hooked


#: Benchmarks, the test harness and the kernel checker: tools around the runtime.
TOOLING = (f"{PKG}.testing", f"{PKG}.bench", f"{PKG}.kernel_check", f"{PKG}.demo")
#: The command line and its subcommand modules (``*_cli``) dispatch to the tools.
CLI = (f"{PKG}.cli", f"{PKG}.__main__")


def _runtime_importers_of_tooling(graph: Dict[str, Set[str]]) -> List[Tuple[str, str]]:
    return sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if t.startswith(TOOLING) and not m.startswith(TOOLING + CLI) and not m.endswith("_cli")
    )


def test_runtime_packages_import_nothing_from_benchmarks_or_test_scaffolding():
    """Runtime code (the core packages, the SGLang adapter, config, ops) never imports
    ``bench``, ``testing``, ``kernel_check`` or ``demo``, not even lazily: what a server
    runs does not depend on tools that read the source checkout."""
    graph = _graph(include_lazy=True)
    assert _runtime_importers_of_tooling(graph) == []
    fake = dict(graph)
    fake[f"{PKG}.sparse_decode.fake"] = {f"{PKG}.bench.serve"}
    assert _runtime_importers_of_tooling(fake) == [(f"{PKG}.sparse_decode.fake", f"{PKG}.bench.serve")]


# Lines as ruff formats them (one argument per line where a call does not fit in 120 columns).
RUNTIME_FUNCTION_MAX_LINES = 100


# Functions the formatter pushed over the limit, to be split (issue 48); this list only shrinks.


def _long_functions(roots) -> List[str]:
    out = []
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > RUNTIME_FUNCTION_MAX_LINES:
                    out.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_runtime_function_is_longer_than_the_limit():
    """Runtime code (everything but the tools: bench, testing, kernel_check, demo) keeps
    functions a reader takes in at once; a longer one is split into named steps."""
    tooling = {"bench", "testing", "kernel_check"}
    roots = [p for p in (REPO / PKG).iterdir() if p.is_dir() and p.name not in tooling and p.name != "__pycache__"]
    modules = [p for p in (REPO / PKG).glob("*.py") if p.name != "demo.py"]
    long = _long_functions(roots)
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > RUNTIME_FUNCTION_MAX_LINES
            ):
                long.append(f"{module.relative_to(REPO)}:{node.lineno} {node.name}")
    assert long == [], f"split these functions (over {RUNTIME_FUNCTION_MAX_LINES} lines): {long}"


DOCUMENT_REFERENCE = re.compile(r"§|\bseed\s+0\d\d\b|\b[Ii]ssue\s*#?\d+|\bstop \d+\b")


def test_code_cites_no_document_a_reader_lacks():
    """Comments and docstrings say what a limit is and why, not "seed 000 section x" or a
    tracker number: a reader of the repository has neither."""
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sorted((REPO / PKG).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if DOCUMENT_REFERENCE.search(line)
    ]
    assert hits == [], hits
    assert DOCUMENT_REFERENCE.search("see seed 000 §3") and not DOCUMENT_REFERENCE.search("manual_seed(0)")


# Any "seed <number>" (not only the three-digit document names), tracker words, and SGLang
# source line numbers, which change with every release (docs/design/sglang_hooks.md keeps them).
CODE_CITATION = re.compile(r"§|\bseed\s+#?\d+\b|\bissue\s*#?\d+|\bstop\s+\d+\b|\.py:\d+", re.IGNORECASE)


def _citations(root: Path) -> List[str]:
    return [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in sorted(root.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if CODE_CITATION.search(line)
    ]


def test_code_names_no_design_section_tracker_item_or_sglang_line_number():
    """No .py file of the package cites a section sign, a "seed <number>" design document,
    a tracker item ("issue 17", "issue #4", "stop 35") or an SGLang ``file.py:<line>``: the
    code states the rule and why; history and source locations live in docs/design/."""
    hits = _citations(REPO / PKG)
    assert hits == [], "cite the rule, not the document (file:line):\n" + "\n".join(hits)
    for cited in (
        "seed 001 says so",
        "Seed 000 §3.2",
        "issue #17",
        "Issue 17",
        "stop 35",
        "(``dsa_indexer.py:1888-1891``)",
    ):
        assert CODE_CITATION.search(cited), cited
    for fine in (
        "torch.manual_seed(0)",
        "seed=0",
        "--seed",
        "seeded prompts",
        "the seed of the request mix",
        "self.stop()",
        "issued on the stream",
        "127.0.0.1:5000",
    ):
        assert not CODE_CITATION.search(fine), fine


def test_no_function_in_the_package_is_longer_than_the_limit(monkeypatch):
    """Every function and method of the package, the tools included (bench, testing,
    kernel_check, demo), is at most ``RUNTIME_FUNCTION_MAX_LINES`` lines: a newcomer reads each top-down in one go, and
    a longer one is split into named steps. A failure lists every offender (path:line,
    name, length)."""
    long = _long_functions([REPO / PKG])
    assert long == [], f"split these functions (over {RUNTIME_FUNCTION_MAX_LINES} lines):\n" + "\n".join(long)
    # the scan measures: with a lower limit it finds functions and names each one
    monkeypatch.setitem(globals(), "RUNTIME_FUNCTION_MAX_LINES", 20)
    found = _long_functions([REPO / PKG])
    assert found and all(
        re.fullmatch(rf"{PKG}/\S+\.py:\d+ \w+ \((2[1-9]|[3-9]\d|\d{{3,}}) lines\)", f) for f in found
    ), found[:3]


CONFIG_READERS = {"active_config", "sparse_decode_enabled", "section_for_served_pool"}


def _config_read_sites(root: Path) -> Set[Tuple[str, str]]:
    """``(module relative to root, enclosing function qualname)`` of every call of a
    reader of the published configuration outside ``args/carrier.py``."""
    sites: Set[Tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        if path.name == "carrier.py":
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)

        def walk(node: ast.AST, scope: Tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, scope + (child.name,))
                    continue
                if isinstance(child, ast.Call):
                    func = child.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                    if name in CONFIG_READERS:
                        sites.add((module, ".".join(scope) or "<module>"))
                walk(child, scope)

        walk(ast.parse(path.read_text()), ())
    return sites


def test_the_published_config_is_read_at_sglang_entry_points_only(tmp_path):
    """Runtime code gets its config passed in: the launcher's published configuration is
    read only where SGLang hands control to the plugin (``carrier.ENTRY_POINTS``, each
    with what SGLang calls there), never below them and never in the core packages."""
    from sglang_ascend_offload.sglang_plugin.args import carrier

    declared = {(module, function) for module, function, _why in carrier.ENTRY_POINTS}
    found = _config_read_sites(REPO / PKG / "sglang_plugin")
    assert found - declared == set(), (
        "reads of the published config outside carrier.ENTRY_POINTS: pass the "
        f"config in from the entry point instead: {sorted(found - declared)}"
    )
    assert declared - found == set(), (
        f"carrier.ENTRY_POINTS lists sites that no longer read it: {sorted(declared - found)}"
    )
    assert all(why for _m, _f, why in carrier.ENTRY_POINTS)
    # the scan sees a read in a nested method and names its scope
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "x.py").write_text(
        "class P:\n    def build(self):\n        return carrier.active_config().kvpp\n"
    )
    assert _config_read_sites(tmp_path) == {("pool.x", "P.build")}


# Environment variables only a test sets: fault injection and resource pins belong to the
# test harness (``testing/harness.py``), which installs them as hooks from outside.
TEST_SEAM_ENV = re.compile(r"""["'](?:[A-Z0-9_]*_TEST_[A-Z0-9_]*|SAO_AVAILABLE_[A-Z0-9_]*)["']""")


def _test_seam_env_reads(root: Path) -> List[str]:
    """``path:line`` of every string literal naming a test-only environment variable in the
    runtime package (the tools ``testing``, ``bench`` and ``kernel_check`` excepted)."""
    tools = {"testing", "bench", "kernel_check"}
    found = []
    for path in sorted(root.rglob("*.py")):
        if tools & set(path.relative_to(root).parts[:-1]):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if TEST_SEAM_ENV.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}")
    return found


def test_runtime_modules_read_no_test_seams(tmp_path, monkeypatch):
    """No runtime module names a ``*_TEST_*`` or ``SAO_AVAILABLE_*`` environment variable:
    a test that needs a server to misbehave asks the test harness for a seam
    (``testing/harness.py``), which hooks the runtime from outside."""
    assert _test_seam_env_reads(REPO / PKG) == []
    # negative control: the scan finds such reads in a runtime-shaped tree, not in its tools
    for folder, name in (("sparse_decode", "pool.py"), ("testing", "harness.py")):
        (tmp_path / PKG / folder).mkdir(parents=True)
        (tmp_path / PKG / folder / name).write_text(
            'import os\nflag = os.environ.get("SGLANG_ASCEND_OFFLOAD_TEST_FORCE_DEMOTE")\n'
            'n = os.environ.get("SAO_AVAILABLE_HOST_BYTES")\n'
        )
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert _test_seam_env_reads(tmp_path / PKG) == [f"{PKG}/sparse_decode/pool.py:2", f"{PKG}/sparse_decode/pool.py:3"]


# ---------------------------------------------------------------------------- the feature index
#: What marks an adapter module as using a feature: an import of the feature's core package,
#: pool, server rules or sizing module; its config class or pool class by name; its config
#: section as an attribute (``config.sparse_decode``); for sparse decode, the engine's API.
FEATURE_SIGNS = {
    "sparse_decode": (
        (f"{PKG}.sparse_decode", "mem_cache.pool.sparse_decode", "mem_cache.pool_host", "sparse_decode_startup"),
        {"SparseDecodeOffloadConfig", "HostMainKVPool", "begin_step", "begin_graph_verify", "hot_plan", "host_pool"},
    ),
    "layerwise_prefill": (
        (f"{PKG}.layerwise_prefill", "mem_cache.pool.layerwise_"),
        {"LayerwisePrefillOffloadConfig", "LayerwisePrefillPool"},
    ),
    "kvpp": ((f"{PKG}.kvpp", "mem_cache.pool.kvpp"), {"KVPPConfig", "KVPPPool"}),
    "pd_transfer": ((f"{PKG}.transfer", "disaggregation.ascend_offload"), {"PDTransferConfig"}),
}


def _features_used(path: Path, plugin_root: Path) -> Set[str]:
    """The features whose package, pool, classes, config section or engine API ``path`` uses."""
    dotted = f"{PKG}.sglang_plugin." + path.relative_to(plugin_root).with_suffix("").as_posix().replace("/", ".")
    used: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        imported: List[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(dotted.split(".")[: -node.level] + ([base] if base else []))
            imported = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        for feature, (packages, names) in FEATURE_SIGNS.items():
            if any(p in m for m in imported for p in packages):
                used.add(feature)
            if isinstance(node, ast.Name) and node.id in names:
                used.add(feature)
            if isinstance(node, ast.Attribute) and (node.attr in names or node.attr == feature):
                used.add(feature)
    return used


def _feature_index_problems(plugin_root: Path, features, plugin_wide) -> List[str]:
    listed = {f.section: set(f.modules) for f in features}
    problems = []
    for path in sorted(plugin_root.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        module = path.relative_to(plugin_root).with_suffix("").as_posix().replace("/", ".")
        homes = {section for section, modules in listed.items() if module in modules}
        if module in plugin_wide:
            if homes:
                problems.append(f"{module}: plugin-wide and listed by {sorted(homes)}")
            continue
        if not homes:
            problems.append(f"{module}: in no feature's entry and not plugin-wide")
        for feature in sorted(_features_used(path, plugin_root) - homes):
            problems.append(f"{module}: uses {feature} but {feature}'s entry does not list it")
    return problems


def test_the_feature_index_lists_every_module_of_each_feature():
    """Every adapter module is in the entries of the features it uses (``features.FEATURES``)
    or serves every feature alike (``PLUGIN_WIDE``); a newcomer finds a feature's whole
    surface in one entry. Negative controls: a module dropped from an entry, and a new
    module using a feature's pool, are each reported."""
    from sglang_ascend_offload.sglang_plugin import features

    root = REPO / PKG / "sglang_plugin"
    assert _feature_index_problems(root, features.FEATURES, features.PLUGIN_WIDE) == []
    sparse = features.by_section("sparse_decode")
    dropped = dataclasses.replace(sparse, modules=tuple(m for m in sparse.modules if m != "speculative.cpu_graph"))
    others = tuple(f for f in features.FEATURES if f is not sparse)
    assert _feature_index_problems(root, (dropped,) + others, features.PLUGIN_WIDE) == [
        "speculative.cpu_graph: in no feature's entry and not plugin-wide",
        "speculative.cpu_graph: uses sparse_decode but sparse_decode's entry does not list it",
    ]


def test_a_new_module_using_a_feature_must_join_its_entry(tmp_path):
    from sglang_ascend_offload.sglang_plugin import features

    root = tmp_path / "sglang_plugin"
    (root / "mem_cache").mkdir(parents=True)
    (root / "mem_cache" / "peek.py").write_text("from .pool.kvpp import build_kvpp_pool\n")
    (root / "names.py").write_text("BACKEND_NAME = 'x'\n")
    assert _feature_index_problems(root, features.FEATURES, ("names",)) == [
        "mem_cache.peek: in no feature's entry and not plugin-wide",
        "mem_cache.peek: uses kvpp but kvpp's entry does not list it",
    ]


def test_each_feature_names_its_config_rules_pool_rules_sizing_and_hooks():
    """Every ``_check_*`` of ``config.py`` belongs to exactly one feature; a feature's pool,
    server rules and sizing modules are in its module list; its hooks' handlers live in its
    modules or plugin-wide ones; ``install.HOOKS`` is assembled from the entries."""
    from sglang_ascend_offload import config
    from sglang_ascend_offload.sglang_plugin import features, install

    checks = {n for n, v in vars(config).items() if n.startswith("_check_") and callable(v)}
    claimed = [name for f in features.FEATURES for name in f.config_rules]
    assert sorted(claimed) == sorted(checks), (sorted(set(claimed) ^ checks), claimed)
    for f in features.FEATURES:
        own = set(f.modules) | set(features.PLUGIN_WIDE)
        for spec in (f.pool, f.server_rules):
            assert spec is None or spec.split(":")[0] in own, (f.section, spec)
        assert f.sizing is None or f.sizing in own, (f.section, f.sizing)
        for hook in f.hooks:
            assert hook.handler.split(":")[0] in own, (f.section, hook.handler)
            assert hook in install.HOOKS, hook
