"""Test modules import from ``conftest`` only at module level.

Several test directories have a ``conftest.py`` and none is a package, so each is
imported as the module ``conftest``: while a directory's test modules are collected,
``conftest`` is that directory's, but a test *function* runs after all collection, when
``conftest`` is whichever directory's loaded last. A ``from conftest import X`` inside a
function then fails in the full suite and passes when the file runs alone (a served
test once did, with ``tests/transfer/conftest.py`` answering for ``tests/sglang``).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def function_level_conftest_imports(source: str, name: str):
    """``(file, line)`` of every ``import conftest`` / ``from conftest import`` inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.module == "conftest":
                    found.append((name, inner.lineno))
                elif isinstance(inner, ast.Import) and any(a.name == "conftest" for a in inner.names):
                    found.append((name, inner.lineno))
    return found


def test_no_test_imports_conftest_inside_a_function():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += function_level_conftest_imports(path.read_text(), str(path.relative_to(TESTS)))
    assert found == [], f"import these at module level or from sglang_ascend_offload.testing: {found}"


def test_the_check_finds_a_function_level_import():
    source = "import os\nfrom conftest import REPO\n\ndef test_x():\n    from conftest import ServerProcess\n"
    assert function_level_conftest_imports(source, "x.py") == [("x.py", 5)]
