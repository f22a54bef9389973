"""Check the plugin's ``sglang.srt`` uses against SGLang's installed source, parsed, not imported.

Many of SGLang's NPU-side modules (``hardware_backend/npu``, ``pool_host/npu_memfabric``,
the Ascend attention backends) import ``torch_npu`` at the top, so they are read with
:mod:`ast` from the installed files instead of imported.

Contract of :func:`check`: for every ``sglang`` :class:`~.callsites.Use`, the dotted
path is walked through the source: the longest prefix that is a module file, then
names in module scope (``def``, ``class``, assignments, imports, which are followed),
then class members (body, ``self.x = ...`` in any method for instances, project base
classes resolved through the defining module's names). A name that does not exist is
a :class:`~.result.Finding`; a call is bound against the ``def``'s parameters
(``self`` dropped for instances and ``super()``). What the source cannot type (the
result of a function call, a member inherited from a base outside SGLang, a module
``__getattr__``) is skipped, listed with the reason; a call of a name that resolves to
something without a ``def`` in the source (a module-level value) is unverified.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..versions import installed_version
from .callsites import CALL, Use
from .result import Finding, PackageResult, bind_problem, use_what

__all__ = ["SourceTree", "check"]

_NEUTRAL_BASES = {
    "object",
    "ABC",
    "Generic",
    "Protocol",
    "NamedTuple",
    "Exception",
    "RuntimeError",
    "ValueError",
    "TypeError",
    "KeyError",
    "IntEnum",
    "Enum",
    "str",
    "int",
    "dict",
}
_ALWAYS = {
    "__init__",
    "__class__",
    "__dict__",
    "__name__",
    "__mro__",
    "__doc__",
    "__module__",
    "__call__",
    "__qualname__",
}


class _Untyped(Exception):
    """The source cannot say what this step is; the reason is the message."""


class _Missing(Exception):
    """The name does not exist; the message says where it was looked up."""


@dataclass
class _Mod:
    name: str
    tree: ast.Module


@dataclass
class _Cls:
    mod: _Mod
    node: ast.ClassDef
    instance: bool = False


@dataclass
class _Fn:
    mod: _Mod
    node: Union[ast.FunctionDef, ast.AsyncFunctionDef]
    bound: bool = False  # reached through an instance: drop self
    owner: Optional[_Cls] = None


@dataclass
class _Val:
    """A name that exists and holds a value the source does not type."""

    what: str


_Node = Union[_Mod, _Cls, _Fn, _Val]


def _top_statements(body: Sequence[ast.stmt]):
    for s in body:
        yield s
        if isinstance(s, ast.If):
            yield from _top_statements(s.body)
            yield from _top_statements(s.orelse)
        elif isinstance(s, ast.Try):
            yield from _top_statements(s.body)
            for h in s.handlers:
                yield from _top_statements(h.body)
            yield from _top_statements(s.orelse)


def _target_names(t: ast.AST):
    if isinstance(t, ast.Name):
        yield t.id
    elif isinstance(t, (ast.Tuple, ast.List)):
        for e in t.elts:
            yield from _target_names(e)


def signature_of(fn: ast.FunctionDef, drop_first: bool) -> inspect.Signature:
    """An :class:`inspect.Signature` with ``fn``'s parameter names, kinds and whether each has a default."""
    a = fn.args
    P = inspect.Parameter
    params: List[inspect.Parameter] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if d is None else None))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    if drop_first and params and params[0].kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
        params = params[1:]
    return inspect.Signature(params)


def _decorators(fn) -> List[str]:
    out = []
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.append(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


class SourceTree:
    """Parsed modules of one installed package (default: SGLang), found by file path."""

    def __init__(self, package: str = "sglang", location: Optional[str] = None):
        if location is None:
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise FileNotFoundError(f"{package} is not installed")
            location = list(spec.submodule_search_locations)[0]
        self.package, self.location = package, location
        self._cache: Dict[str, Optional[_Mod]] = {}

    def module(self, dotted: str) -> Optional[_Mod]:
        if dotted in self._cache:
            return self._cache[dotted]
        parts = dotted.split(".")
        mod = None
        if parts[0] == self.package:
            base = os.path.join(self.location, *parts[1:])
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as f:
                        mod = _Mod(dotted, ast.parse(f.read(), filename=path))
                    break
        self._cache[dotted] = mod
        return mod

    def is_package(self, dotted: str) -> bool:
        return os.path.isdir(os.path.join(self.location, *dotted.split(".")[1:]))

    # ------------------------------------------------------------------ lookups
    def _module_member(self, mod: _Mod, name: str, depth: int = 0) -> _Node:
        if depth > 8:
            raise _Untyped("import chain too deep")
        for s in _top_statements(mod.tree.body):
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name:
                return _Fn(mod, s)
            if isinstance(s, ast.ClassDef) and s.name == name:
                return _Cls(mod, s)
        for s in _top_statements(mod.tree.body):
            if isinstance(s, ast.Assign) and any(name in _target_names(t) for t in s.targets):
                return _Val("a module-level value")
            if isinstance(s, ast.AnnAssign) and name in _target_names(s.target):
                return _Val("a module-level value")
            if isinstance(s, ast.ImportFrom):
                for a in s.names:
                    if (a.asname or a.name) == name:
                        src = self._absolute(mod, s)
                        if src is None:
                            raise _Untyped(f"imported from {s.module} outside {self.package}")
                        sub = self.module(src + "." + a.name)
                        if sub is not None:
                            return sub
                        target = self.module(src)
                        if target is None:
                            raise _Untyped(f"imported from {src}, not a source module")
                        return self._module_member(target, a.name, depth + 1)
            if isinstance(s, ast.Import):
                for a in s.names:
                    if (a.asname or a.name.split(".")[0]) == name:
                        sub = self.module(a.name if a.asname else a.name.split(".")[0])
                        if sub is None:
                            raise _Untyped(f"module {a.name} outside {self.package}")
                        return sub
        sub = self.module(f"{mod.name}.{name}")
        if sub is not None:
            return sub
        for s in _top_statements(mod.tree.body):
            if isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names):
                src = self._absolute(mod, s)
                star = self.module(src) if src else None
                if star is None:
                    raise _Untyped(f"may come from 'from {s.module} import *' outside {self.package}")
                try:
                    return self._module_member(star, name, depth + 1)
                except _Missing:
                    continue
        if any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in mod.tree.body):
            raise _Untyped("module defines __getattr__")
        raise _Missing(f"{mod.name} has no {name!r}")

    def _absolute(self, mod: _Mod, node: ast.ImportFrom) -> Optional[str]:
        if node.level:
            pkg = mod.name if self.is_package(mod.name) else mod.name.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                pkg = pkg.rsplit(".", 1)[0]
            name = f"{pkg}.{node.module}" if node.module else pkg
        else:
            name = node.module or ""
        return name if name.split(".")[0] == self.package else None

    def _resolve_expr(self, mod: _Mod, expr: ast.AST) -> Optional[_Node]:
        try:
            if isinstance(expr, ast.Name):
                return self._module_member(mod, expr.id)
            if isinstance(expr, ast.Attribute):
                base = self._resolve_expr(mod, expr.value)
                if isinstance(base, _Mod):
                    return self._module_member(base, expr.attr)
        except (_Untyped, _Missing):
            return None
        return None

    def _class_member(self, cls: _Cls, name: str, seen=None) -> _Node:
        seen = seen if seen is not None else set()
        if id(cls.node) in seen:
            raise _Missing(f"{cls.node.name} has no {name!r}")
        seen.add(id(cls.node))
        for s in cls.node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name:
                return _Fn(cls.mod, s, bound=cls.instance and "staticmethod" not in _decorators(s), owner=cls)
            if isinstance(s, ast.ClassDef) and s.name == name:
                return _Cls(cls.mod, s)
            if isinstance(s, ast.Assign) and any(name in _target_names(t) for t in s.targets):
                return _Val("a class attribute value")
            if isinstance(s, ast.AnnAssign) and name in _target_names(s.target):
                return _Val("a class attribute value")
        if cls.instance:
            for fn in ast.walk(cls.node):
                if isinstance(fn, (ast.Assign, ast.AnnAssign)):
                    targets = fn.targets if isinstance(fn, ast.Assign) else [fn.target]
                    for t in targets:
                        for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if (
                                isinstance(e, ast.Attribute)
                                and isinstance(e.value, ast.Name)
                                and e.value.id == "self"
                                and e.attr == name
                            ):
                                return _Val("an instance attribute value")
        outside = []
        for b in cls.node.bases:
            base = self._resolve_expr(cls.mod, b)
            if isinstance(base, _Cls):
                try:
                    return self._class_member(_Cls(base.mod, base.node, cls.instance), name, seen)
                except _Missing:
                    continue
            label = ast.unparse(b)
            if label.split(".")[-1].split("[")[0] not in _NEUTRAL_BASES:
                outside.append(label)
        if outside:
            raise _Untyped(f"may be inherited from a base outside {self.package} ({', '.join(outside)})")
        if name in _ALWAYS or (name.startswith("__") and name.endswith("__")):
            raise _Untyped("a Python-, decorator- or metaclass-provided dunder attribute")
        raise _Missing(f"{cls.mod.name}.{cls.node.name} has no {name!r}")

    # ------------------------------------------------------------------ walking
    def walk(self, path: Tuple[str, ...]) -> _Node:
        """The node ``path`` names; raises _Missing / _Untyped."""
        i = len(path)
        while i > 0 and (CALL in path[:i] or self.module(".".join(path[:i])) is None):
            i -= 1
        if i == 0:
            raise _Missing(f"no module {'.'.join(path[:2])} in {self.package}")
        node: _Node = self.module(".".join(path[:i]))
        for part in path[i:]:
            if part == CALL:
                if isinstance(node, _Cls) and not node.instance:
                    node = _Cls(node.mod, node.node, instance=True)
                    continue
                raise _Untyped("the result of a function call")
            if isinstance(node, _Mod):
                node = self._module_member(node, part)
            elif isinstance(node, _Cls):
                node = self._class_member(node, part)
            elif isinstance(node, _Val):
                raise _Untyped(f"an attribute of {node.what}")
            else:
                raise _Untyped("an attribute of a function")
        return node

    def call_signature(self, node: _Node) -> inspect.Signature:
        if isinstance(node, _Fn):
            decos = _decorators(node.node)
            drop = node.bound or ("classmethod" in decos and node.owner is not None)
            return signature_of(node.node, drop_first=drop)
        if isinstance(node, _Cls) and not node.instance:
            try:
                init = self._class_member(_Cls(node.mod, node.node, instance=True), "__init__")
            except _Missing:
                raise _Untyped("no __init__ in the source (generated or inherited outside)") from None
            if isinstance(init, _Fn):
                return signature_of(init.node, drop_first=True)
        raise _Untyped(f"a call of {node.what}" if isinstance(node, _Val) else "not a function or class")


def check(uses: Sequence[Use], tree: Optional[SourceTree] = None) -> PackageResult:
    """Check every ``sglang`` use (see the module docstring): a path that cannot be typed
    is skipped, a call whose signature cannot be read from the source unverified."""
    tree = tree or SourceTree()
    version = installed_version("sglang")
    result = PackageResult("sglang", version, f"source parsed from {tree.location}")
    for use in uses:
        if use.package != "sglang":
            continue
        try:
            node = tree.walk(use.path)
        except _Missing as exc:
            result.findings.append(Finding(use.file, use.line, "sglang", use_what(use), str(exc).strip("'\"")))
            continue
        except _Untyped as exc:
            result.skip(use, str(exc))
            continue
        if use.kind == "call":
            try:
                sig = tree.call_signature(node)
            except _Untyped as exc:
                result.unverify(use, str(exc))
                continue
            why = bind_problem(sig, use.positional, use.keywords, use.starred)
            if why:
                result.findings.append(Finding(use.file, use.line, "sglang", use.dotted + "(...)", why))
                continue
        result.checked += 1
    return result
