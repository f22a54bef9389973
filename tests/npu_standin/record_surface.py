#!/usr/bin/env python3
"""Write ``tests/npu_standin/torch_npu_surface.json``: what the stand-in is held against.

From the torch_npu wheel that pyproject.toml's ``[npu]`` extra pins (downloaded with
``pip download --no-deps``, never installed; or ``--wheel W.whl``), read:

* ``ops``: the dispatcher schemas (``libtorch_npu.so``) of the torch_npu ops the
  stand-in defines beyond the project's own (``npu_api/torch_npu_ops.json``): those that
  SGLang's NPU pool calls and the names third-party import paths bind;
* ``python``: the parameters (name, default source) of every top-level function and
  class method of the Python files that make ``torch.npu`` and
  ``torch_npu.multiprocessing.reductions`` (:data:`FILES`), keyed ``module:qualname``;
* ``all``: each of those files' ``__all__``.

``tests/npu_standin/test_conformance.py`` compares the stand-in with this file (and
with ``npu_api/torch_npu_ops.json``)::

    python tests/npu_standin/record_surface.py [--wheel W.whl] [--check]
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import sys
import tempfile
import zipfile
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "torch_npu_surface.json")

#: ops the stand-in defines beyond npu_api/torch_npu_ops.json
OPS = ("npu_scatter_nd_update_", "npu_fusion_attention")
#: module key -> file in the wheel
FILES = {
    "npu": "torch_npu/npu/__init__.py",
    "npu.utils": "torch_npu/npu/utils.py",
    "npu.streams": "torch_npu/npu/streams.py",
    "npu.graphs": "torch_npu/npu/graphs.py",
    "npu.memory": "torch_npu/npu/memory.py",
    "multiprocessing.reductions": "torch_npu/multiprocessing/reductions.py",
}


def _params(fn: ast.FunctionDef) -> List[List[Optional[str]]]:
    """``[[name, default source or None], ...]`` including ``*args`` / ``**kwargs`` as
    ``*name`` / ``**name``, in order; keyword-only ones after a ``*`` entry."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [[p.arg, d] for p, d in zip(positional, defaults)]
    if a.vararg:
        out.append([f"*{a.vararg.arg}", None])
    elif a.kwonlyargs:
        out.append(["*", None])
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append([p.arg, None if d is None else ast.unparse(d)])
    if a.kwarg:
        out.append([f"**{a.kwarg.arg}", None])
    return out


def python_surface(source: str, module: str) -> Dict[str, list]:
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[f"{module}:{node.name}"] = _params(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{module}:{node.name}.{item.name}"] = _params(item)
    return out


def declared_all(source: str) -> Optional[List[str]]:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return sorted(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return None


def record(wheel: str) -> dict:
    sys.path.insert(0, REPO)
    from sglang_ascend_offload.npu_api import torch_npu_schemas

    doc = torch_npu_schemas.extract_from_wheel(wheel, OPS)
    python, alls = {}, {}
    with zipfile.ZipFile(wheel) as z:
        for module, path in FILES.items():
            source = z.read(path).decode("utf-8", "replace")
            python.update(python_surface(source, module))
            alls[module] = declared_all(source)
    return {
        "torch_npu_version": doc["torch_npu_version"],
        "wheel": doc["wheel"],
        "ops": doc["ops"],
        "missing_ops": doc["missing"],
        "python": dict(sorted(python.items())),
        "all": alls,
    }


def _download(dest: str) -> str:
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import extract_torch_npu_schemas as extract  # the one place that knows the pin and the pip call

    extract.download(extract.pinned_version(), dest)
    return glob.glob(os.path.join(dest, "torch_npu-*.whl"))[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", help="a torch_npu wheel already here (default: download the pinned one)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the recorded file differs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        doc = record(args.wheel or _download(tmp))
    text = json.dumps(doc, indent=1, sort_keys=False) + "\n"
    if args.check:
        same = os.path.isfile(OUT) and open(OUT, encoding="utf-8").read() == text
        print("up to date" if same else f"{OUT} is stale: rerun without --check")
        return 0 if same else 1
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUT}: {len(doc['ops'])} ops, {len(doc['python'])} Python callables")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
