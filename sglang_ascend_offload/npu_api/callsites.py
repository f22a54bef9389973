"""Find the project's uses of NPU-only APIs by reading its source with :mod:`ast`.

Contract: :func:`scan` parses every ``.py`` file under the given roots (nothing is
imported) and returns a :class:`Scan`: one :class:`Use` per reference into a tracked
package (``memfabric_hybrid``, ``memcache_hybrid``, ``torch_npu``, ``sglang``) and one
:class:`Unresolved` per dynamic reference whose name it could not work out.

A use is a *path* from the package root: ``("memfabric_hybrid", "offload",
"OffloadConfig", "()", "flags")`` reads "the ``flags`` attribute of what calling
``memfabric_hybrid.offload.OffloadConfig`` returns". ``"()"`` (:data:`CALL`) marks a
call result; the checkers decide what that result is from the real package.

Values are typed by a small flow-insensitive evaluator, in statement order:

* imports and aliases (``import memfabric_hybrid as mf``, ``from memfabric_hybrid import
  bm``), ``importlib.import_module("memcache_hybrid")``, ``torch.ops.npu`` (an alias of
  ``torch_npu``'s op namespace) and ``torch.npu`` (``torch_npu.npu``, which torch_npu
  installs there);
* assignments (``cfg = offload.OffloadConfig()``, tuple targets) and ``self.x = ...`` in
  any method of a class or of its project base classes (``self._started(engine, ...)``
  in a base that stores ``self._engine = engine`` types ``self._engine``);
* project functions and methods called with typed or literal arguments are evaluated
  with those bound (``_memcache()`` returning the imported module, ``self._ok()``
  returning ``self._raw``, ``_torch_npu_op("npu_x")`` returning
  ``getattr(torch_npu, name)``);
* names in ``getattr`` / ``setattr``: literals, loop variables over literal tuples,
  ``.upper()`` / ``.lower()`` of those, parameters guarded by ``name in CONSTANT`` (a
  module-level tuple of strings), and ``obj.field`` of a parameter annotated with a
  project dataclass (its default plus every literal passed for that field). Accesses
  guarded by ``hasattr(obj, name)`` in the same function are safe by construction and
  skipped; ``hasattr`` probes themselves are not uses.

String constants that spell an SGLang path (``"sglang.srt.managers.scheduler.Scheduler"``,
the plugin's patch targets) are uses of kind ``target``.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

__all__ = ["CALL", "TRACKED", "Use", "Unresolved", "Scan", "scan", "scan_source", "project_roots"]

CALL = "()"
TRACKED = ("memfabric_hybrid", "memcache_hybrid", "torch_npu", "sglang")
_TARGET_RE = re.compile(r"^sglang\.srt(\.[A-Za-z_]\w*)+$")
_MAX_DEPTH = 4

Path = Tuple[str, ...]


@dataclass(frozen=True)
class Use:
    """One reference into a tracked package.

    kind: ``import`` (an imported name), ``load`` (attribute read), ``store``
    (attribute assignment), ``call`` (``positional`` arguments, ``keywords`` names;
    ``starred`` when ``*args`` / ``**kw`` make the arity unknown), ``target`` (a dotted
    SGLang path in a string constant). ``note`` says how a dynamic name was resolved.
    """

    file: str
    line: int
    path: Path
    kind: str
    positional: int = 0
    keywords: Tuple[str, ...] = ()
    starred: bool = False
    note: str = ""

    @property
    def package(self) -> str:
        return self.path[0]

    @property
    def dotted(self) -> str:
        return ".".join(self.path).replace(".()", "()")

    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Unresolved:
    """A reference into a tracked package whose name the finder could not work out."""

    file: str
    line: int
    what: str
    why: str


@dataclass
class Scan:
    """Everything :func:`scan` found; ``files`` is the number of files parsed."""

    uses: List[Use] = field(default_factory=list)
    unresolved: List[Unresolved] = field(default_factory=list)
    files: int = 0

    def by_package(self, package: str) -> List[Use]:
        return [u for u in self.uses if u.package == package]


def project_roots(repo: Optional[str] = None) -> List[str]:
    """The runtime package and ``triton_ops/`` of the repository holding this file."""
    repo = repo or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [os.path.join(repo, "sglang_ascend_offload"), os.path.join(repo, "triton_ops")]


# ------------------------------------------------------------------ indexes
@dataclass
class _Module:
    rel: str
    tree: ast.Module
    functions: Dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: Dict[str, ast.ClassDef] = field(default_factory=dict)
    str_consts: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    env: Dict[str, Path] = field(default_factory=dict)


def _str_tuple(node: ast.AST) -> Optional[Tuple[str, ...]]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if (
        isinstance(node, (ast.Tuple, ast.List, ast.Set))
        and node.elts
        and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    ):
        return tuple(e.value for e in node.elts)
    return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


class _Project:
    def __init__(self, modules: List[_Module]):
        self.modules = modules
        self.memo: Dict[tuple, Optional[Path]] = {}
        self.classes: Dict[str, List[Tuple[_Module, ast.ClassDef]]] = {}
        self.field_values: Dict[Tuple[str, str], Set[str]] = {}
        for m in modules:
            for name, cls in m.classes.items():
                self.classes.setdefault(name, []).append((m, cls))
                if _is_dataclass(cls):
                    for stmt in cls.body:
                        if (
                            isinstance(stmt, ast.AnnAssign)
                            and isinstance(stmt.target, ast.Name)
                            and stmt.value is not None
                        ):
                            lits = _str_tuple(stmt.value)
                            if lits and len(lits) == 1:
                                self.field_values.setdefault((name, stmt.target.id), set()).add(lits[0])
        for m in modules:  # literal keyword arguments of dataclass constructions
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    for kw in node.keywords:
                        key = (node.func.id, kw.arg or "")
                        lits = _str_tuple(kw.value)
                        if key in self.field_values and lits and len(lits) == 1:
                            self.field_values[key].add(lits[0])

    def family(self, module: _Module, cls: ast.ClassDef) -> List[Tuple[_Module, ast.ClassDef]]:
        """``cls`` then its base classes defined in the project (by name), depth first."""
        out, seen, todo = [], set(), [(module, cls)]
        while todo:
            m, c = todo.pop(0)
            if id(c) in seen:
                continue
            seen.add(id(c))
            out.append((m, c))
            for b in c.bases:
                name = b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", None)
                for cand in self.classes.get(name or "", []):
                    todo.append(cand)
        return out


def _index(rel: str, tree: ast.Module) -> _Module:
    m = _Module(rel, tree)
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            m.functions[stmt.name] = stmt
        elif isinstance(stmt, ast.ClassDef):
            m.classes[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            lits = _str_tuple(stmt.value)
            if lits:
                m.str_consts[stmt.targets[0].id] = lits
    return m


def _stores_or_returns(fn: ast.FunctionDef) -> bool:
    """Whether evaluating ``fn`` can type anything: it returns a value or sets ``self.x``."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Return) and n.value is not None:
            return True
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(
                isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" for t in targets
            ):
                return True
    return False


def _methods(cls: ast.ClassDef) -> List[ast.FunctionDef]:
    return [s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]


# ------------------------------------------------------------------ evaluator
class _Eval:
    """Types names in one function (or module) body; records uses when ``sink`` is set."""

    def __init__(
        self,
        project: _Project,
        module: _Module,
        sink: Optional["_Sink"],
        cls: Optional[Tuple[_Module, ast.ClassDef]] = None,
        self_types: Optional[Dict[str, Path]] = None,
        depth: int = 0,
    ):
        self.p, self.m, self.sink, self.cls = project, module, sink, cls
        self.self_types = self_types if self_types is not None else {}
        self.depth = depth
        self.env: Dict[str, Path] = dict(module.env)
        self.lits: Dict[str, Tuple[str, ...]] = {}
        self.annots: Dict[str, str] = {}
        self.returns: List[Path] = []
        self.fn: Optional[ast.AST] = None

    # ---------------------------------------------------------------- recording
    def _rec(self, node: ast.AST, path: Path, kind: str, **kw) -> None:
        if kind == "load" and path[-1] == CALL:
            return  # reading a stored call result is no reference into the package
        if self.sink is not None and path and path[0] in TRACKED:
            self.sink.uses.add(Use(self.m.rel, getattr(node, "lineno", 0), path, kind, **kw))

    def _unresolved(self, node: ast.AST, what: str, why: str) -> None:
        if self.sink is not None:
            self.sink.unresolved.add(Unresolved(self.m.rel, getattr(node, "lineno", 0), what, why))

    # ---------------------------------------------------------------- functions
    def run_function(self, fn: ast.FunctionDef, bound: Dict[str, Tuple[Optional[Path], Optional[Tuple[str, ...]]]]):
        self.fn = fn
        for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            if isinstance(a.annotation, ast.Name):
                self.annots[a.arg] = a.annotation.id
            elif isinstance(a.annotation, ast.Constant) and isinstance(a.annotation.value, str):
                self.annots[a.arg] = a.annotation.value
            self.env.pop(a.arg, None)
        for name, (typ, lits) in bound.items():
            if typ:
                self.env[name] = typ
            if lits:
                self.lits[name] = lits
        for node in ast.walk(fn):  # membership guards: `if name not in CONSTANT`
            if (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Name)
                and len(node.ops) == 1
                and isinstance(node.ops[0], (ast.In, ast.NotIn))
                and isinstance(node.comparators[0], ast.Name)
                and node.comparators[0].id in self.m.str_consts
                and node.left.id not in self.lits
            ):
                self.lits[node.left.id] = self.m.str_consts[node.comparators[0].id]
        self.run(fn.body)

    def _bind_call(self, fn: ast.FunctionDef, call: ast.Call, skip_self: bool):
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if skip_self and params:
            params = params[1:]
        bound = {}
        for name, arg in zip(params, call.args):
            if isinstance(arg, ast.Starred):
                break
            bound[name] = (self.typeof(arg), self.strings_of(arg))
        for kw in call.keywords:
            if kw.arg:
                bound[kw.arg] = (self.typeof(kw.value), self.strings_of(kw.value))
        return bound

    def _summary(
        self, fn: ast.FunctionDef, call: ast.Call, module: _Module, cls: Optional[Tuple[_Module, ast.ClassDef]]
    ) -> Optional[Path]:
        if self.depth >= _MAX_DEPTH:
            return None
        bound = self._bind_call(fn, call, skip_self=cls is not None)
        key = (
            id(fn),
            id(cls[1]) if cls else 0,
            tuple(sorted(bound.items())),
            tuple(sorted(self.self_types.items())) if cls else (),
        )
        if key in self.p.memo:
            return self.p.memo[key]
        self.p.memo[key] = None  # recursion guard
        sub = _Eval(self.p, module, None, cls, self.self_types if cls else None, self.depth + 1)
        sub.run_function(fn, bound)
        result = next((r for r in sub.returns if r), None)
        self.p.memo[key] = result
        return result

    def _method(self, name: str):
        if not self.cls:
            return None
        for m, c in self.p.family(*self.cls):
            for fn in _methods(c):
                if fn.name == name:
                    return m, c, fn
        return None

    # ---------------------------------------------------------------- statements
    def run(self, stmts: Sequence[ast.stmt]) -> None:
        for s in stmts:
            self.stmt(s)

    def _bind_import(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    self.env[a.asname] = tuple(a.name.split("."))
                else:
                    root = a.name.split(".")[0]
                    self.env[root] = (root,)
                self._rec(node, tuple(a.name.split(".")), "import")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            base = tuple(node.module.split("."))
            for a in node.names:
                if a.name == "*":
                    continue
                path = base + (a.name,)
                self.env[a.asname or a.name] = path
                self._rec(node, path, "import")

    def _assign(
        self, target: ast.AST, value: Optional[ast.AST], typ: Optional[Path], lits: Optional[Tuple[str, ...]]
    ) -> None:
        if isinstance(target, ast.Name):
            if typ:
                self.env[target.id] = typ
            else:
                self.env.pop(target.id, None)
            if lits:
                self.lits[target.id] = lits
            else:
                self.lits.pop(target.id, None)
        elif isinstance(target, (ast.Tuple, ast.List)):
            vals = value.elts if isinstance(value, (ast.Tuple, ast.List)) else None
            for i, t in enumerate(target.elts):
                v = vals[i] if vals and i < len(vals) else None
                self._assign(
                    t, v, self.typeof(v) if v is not None else None, self.strings_of(v) if v is not None else None
                )
        elif isinstance(target, ast.Attribute):
            if isinstance(target.value, ast.Name) and target.value.id == "self" and self.cls:
                if typ:
                    self.self_types[target.attr] = typ
                return
            base = self.typeof(target.value)
            if base:
                self._rec(target, base + (target.attr,), "store")
            else:
                self.visit(target.value)
        else:
            self.visit(target)

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            self._bind_import(s)
        elif isinstance(s, ast.Assign):
            self.visit(s.value)
            typ, lits = self.typeof(s.value), self.strings_of(s.value)
            for t in s.targets:
                self._assign(t, s.value, typ, lits)
        elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
            if s.value is not None:
                self.visit(s.value)
                if isinstance(s, ast.AnnAssign):
                    self._assign(s.target, s.value, self.typeof(s.value), self.strings_of(s.value))
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self.visit(s.iter)
            lits = _str_tuple(s.iter) or (self.lits.get(s.iter.id) if isinstance(s.iter, ast.Name) else None)
            if isinstance(s.target, ast.Name) and lits:
                self.lits[s.target.id] = lits
            self.run(s.body)
            self.run(s.orelse)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in s.decorator_list:
                self.visit(d)
            sub = _Eval(self.p, self.m, self.sink, self.cls, self.self_types, self.depth)
            sub.env, sub.lits = dict(self.env), dict(self.lits)
            sub.run_function(s, {})
        elif isinstance(s, ast.ClassDef):
            pass  # classes are analysed by _scan_module
        elif isinstance(s, ast.Return):
            if s.value is not None:
                self.visit(s.value)
                self.returns.append(self.typeof(s.value))
        else:
            for name in ("test", "exc", "cause", "msg"):
                if getattr(s, name, None) is not None:
                    self.visit(getattr(s, name))
            if isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    self.visit(item.context_expr)
            if isinstance(s, ast.Expr):
                self.visit(s.value)
            for name in ("body", "orelse", "finalbody"):
                self.run(getattr(s, name, []) or [])
            for h in getattr(s, "handlers", []) or []:
                self.run(h.body)

    # ---------------------------------------------------------------- expressions
    def visit(self, node: Optional[ast.AST]) -> None:
        if node is None:
            return
        if isinstance(node, ast.Call):
            self._call(node)
        elif isinstance(node, ast.Attribute):
            typ = self.typeof(node)
            if typ and typ[0] in TRACKED and isinstance(node.ctx, ast.Load):
                self._rec(node, typ, "load")
                self._visit_chain(node.value)
            else:
                self.visit(node.value)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for g in node.generators:
                self.visit(g.iter)
                lits = _str_tuple(g.iter)
                if isinstance(g.target, ast.Name) and lits:
                    self.lits[g.target.id] = lits
                for cond in g.ifs:
                    self.visit(cond)
            for part in ("elt", "key", "value"):
                self.visit(getattr(node, part, None))
        elif isinstance(node, ast.Lambda):
            self.visit(node.body)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, str) and _TARGET_RE.match(node.value):
                self._rec(node, tuple(node.value.split(".")), "target")
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.visit(child)
                elif isinstance(child, ast.keyword):
                    self.visit(child.value)
                elif isinstance(child, ast.comprehension):
                    self.visit(child.iter)

    def _visit_chain(self, node: ast.AST) -> None:
        """Record the calls nested in an attribute chain (``bm.create2(...).join``)."""
        while isinstance(node, ast.Attribute):
            node = node.value
        if isinstance(node, ast.Call):
            self._call(node)
        elif isinstance(node, ast.Subscript):
            self.visit(node)

    def _is_param(self, name: str) -> bool:
        fn = self.fn
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
        return name in {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}

    def _guarded(self, obj: ast.AST, name: ast.AST) -> bool:
        key = (ast.dump(obj), ast.dump(name))
        for n in ast.walk(self.fn) if self.fn is not None else ():
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "hasattr"
                and len(n.args) == 2
                and (ast.dump(n.args[0]), ast.dump(n.args[1])) == key
            ):
                return True
        return False

    def _dynamic(self, node: ast.Call, kind: str) -> None:
        obj, name = node.args[0], node.args[1]
        base = self.typeof(obj)
        if not base or base[0] not in TRACKED:
            return
        lits = self.strings_of(name)
        if lits:
            note = "" if isinstance(name, ast.Constant) else f"name {ast.unparse(name)!r} resolved to {list(lits)}"
            for lit in lits:
                self._rec(node, base + (lit,), kind, note=note)
        elif isinstance(name, ast.Name) and self._is_param(name.id):
            pass  # resolved where the function is called with a literal (see _summary)
        elif not self._guarded(obj, name):
            self._unresolved(
                node,
                f"{node.func.id}({'.'.join(base)}, {ast.unparse(name)})",
                "the attribute name is computed at run time and not guarded by hasattr",
            )

    def _call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "setattr") and len(node.args) >= 2:
            self._dynamic(node, "load" if func.id == "getattr" else "store")
        elif not (isinstance(func, ast.Name) and func.id == "hasattr"):
            typ = self.typeof(func)
            if typ and typ[0] in TRACKED:
                starred = any(isinstance(a, ast.Starred) for a in node.args) or any(
                    k.arg is None for k in node.keywords
                )
                self._rec(
                    node,
                    typ,
                    "call",
                    positional=sum(not isinstance(a, ast.Starred) for a in node.args),
                    keywords=tuple(k.arg for k in node.keywords if k.arg),
                    starred=starred,
                )
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
            and any(self.typeof(a) for a in node.args)
        ):
            self._call_type(node)  # a self method may store its typed arguments in self.<attr>
        if isinstance(func, ast.Attribute):
            self._visit_chain(func)
        elif isinstance(func, (ast.Call, ast.Subscript)):
            self.visit(func)
        for a in node.args:
            self.visit(a.value if isinstance(a, ast.Starred) else a)
        for k in node.keywords:
            self.visit(k.value)

    def typeof(self, node: Optional[ast.AST]) -> Optional[Path]:
        if node is None:
            return None
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and self.cls:
                return self.self_types.get(node.attr)
            base = self.typeof(node.value)
            if not base:
                return None
            path = base + (node.attr,)
            if path == ("torch", "ops", "npu"):
                return ("torch_npu",)  # the op namespace torch_npu registers
            if path == ("torch", "npu"):
                return ("torch_npu", "npu")  # the device module torch_npu installs as torch.npu
            return path
        if isinstance(node, ast.Call):
            return self._call_type(node)
        return None

    def _call_type(self, node: ast.Call) -> Optional[Path]:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id == "getattr" and len(node.args) >= 2:
                base, lits = self.typeof(node.args[0]), self.strings_of(node.args[1])
                return base + (lits[0],) if base and lits and len(lits) == 1 else None
            if func.id == "super" and self.cls:
                base = self.cls[1].bases[0] if self.cls[1].bases else None
                typ = self.typeof(base) if base is not None else None
                return typ + (CALL,) if typ else None
            if func.id in self.m.functions and func.id not in self.env:
                return self._summary(self.m.functions[func.id], node, self.m, None)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            found = self._method(func.attr)
            if found and _stores_or_returns(found[2]):
                return self._summary(found[2], node, found[0], self.cls)
        typ = self.typeof(func)
        if typ in (("importlib", "import_module"), ("builtins", "__import__")) or (
            isinstance(func, ast.Name) and func.id == "__import__"
        ):
            lits = self.strings_of(node.args[0]) if node.args else None
            return tuple(lits[0].split(".")) if lits and len(lits) == 1 else None
        return typ + (CALL,) if typ else None

    def strings_of(self, node: Optional[ast.AST]) -> Optional[Tuple[str, ...]]:
        if node is None:
            return None
        lits = _str_tuple(node)
        if lits:
            return lits
        if isinstance(node, ast.Name):
            return self.lits.get(node.id) or self.m.str_consts.get(node.id)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("upper", "lower")
            and not node.args
        ):
            inner = self.strings_of(node.func.value)
            if inner:
                return tuple(s.upper() if node.func.attr == "upper" else s.lower() for s in inner)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            cls = self.annots.get(node.value.id)
            values = self.p.field_values.get((cls or "", node.attr))
            if values:
                return tuple(sorted(values))
        return None


class _Sink:
    def __init__(self):
        self.uses: Set[Use] = set()
        self.unresolved: Set[Unresolved] = set()


# ------------------------------------------------------------------ driver
def _scan_module(project: _Project, m: _Module, sink: _Sink) -> None:
    top = _Eval(project, m, sink)
    top.run([s for s in m.tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))])
    m.env = dict(top.env)
    for fn in m.functions.values():
        for d in fn.decorator_list:
            top.visit(d)
        _Eval(project, m, sink).run_function(fn, {})
    for cls in m.classes.values():
        for b in cls.bases:
            top.visit(b)
        fam = project.family(m, cls)
        self_types: Dict[str, Path] = {}
        for _ in range(2):  # learn self.<attr> types from every method of the family
            for fm, fc in fam:
                for fn in _methods(fc):
                    _Eval(project, fm, None, (m, cls), self_types).run_function(fn, {})
        tracked = any(t[0] in TRACKED for t in self_types.values())
        for idx, (fm, fc) in enumerate(fam):
            if idx and not tracked:
                break
            for fn in _methods(fc):
                _Eval(project, fm, sink, (m, cls), self_types).run_function(fn, {})
        for stmt in cls.body:
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                top.stmt(stmt)


def _iter_files(roots: Iterable[str]) -> Iterable[Tuple[str, str]]:
    for root in roots:
        base = os.path.dirname(os.path.abspath(root))
        if os.path.isfile(root):
            yield root, os.path.relpath(root, base)
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    yield path, os.path.relpath(path, base)


def scan_source(sources: Dict[str, str]) -> Scan:
    """Scan in-memory sources ``{relative path: text}`` as one project."""
    modules = [_index(rel, ast.parse(text, filename=rel)) for rel, text in sorted(sources.items())]
    project = _Project(modules)
    sink = _Sink()
    for _ in range(2):  # module envs feed function scans; the second pass sees them all
        sink = _Sink()
        for m in modules:
            _scan_module(project, m, sink)
    uses = sorted(sink.uses, key=lambda u: (u.file, u.line, u.path, u.kind))
    unresolved = sorted(sink.unresolved, key=lambda u: (u.file, u.line, u.what))
    return Scan(uses, unresolved, len(modules))


def scan(roots: Optional[Sequence[str]] = None) -> Scan:
    """Scan every ``.py`` file under ``roots`` (default :func:`project_roots`)."""
    sources = {}
    for path, rel in _iter_files(roots or project_roots()):
        with open(path, encoding="utf-8") as f:
            sources[rel] = f.read()
    return scan_source(sources)
