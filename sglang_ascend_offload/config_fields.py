"""Declarative config fields: each field of a config dataclass carries its own constraint
(:func:`knob`) and, in the class body right below it, its own docstring.

A field is declared as ::

    verify_sample_rate: float = knob(0.0, ge=0.0, le=1.0, note="0 = off; e.g. 1e-3")
    \"\"\"Shadow verification: ...\"\"\"

:func:`limit_problems` checks every field's :class:`Limits` at parsing (rule
``parse.range``; rules across fields stay in the class's ``_check``), and
:func:`field_docs` reads the docstrings back from the source, for
``docs/configuration.md`` (``scripts/gen_config_doc.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

__all__ = ["Limits", "knob", "limit_problems", "field_docs"]

_MISSING = dataclasses.MISSING


@dataclass(frozen=True)
class Limits:
    """A field's own constraint; ``None`` values of an optional field are always allowed.

    ge / gt / le: bounds (inclusive, exclusive, inclusive). power_of_two: the value is a
    power of two. note: what the values mean, appended to the message
    (e.g. ``"0 = off"``).
    """

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    power_of_two: bool = False
    note: str = ""

    def describe(self) -> str:
        """The constraint in words, e.g. ``">= 1"``, ``"in [0, 1]"``, ``"a power of two"``."""
        if self.ge is not None and self.le is not None:
            text = f"in [{_num(self.ge)}, {_num(self.le)}]"
        else:
            parts = [
                f">= {_num(self.ge)}" if self.ge is not None else "",
                f"> {_num(self.gt)}" if self.gt is not None else "",
                f"<= {_num(self.le)}" if self.le is not None else "",
            ]
            text = " and ".join(p for p in parts if p)
        if self.power_of_two:
            text = f"{text} and a power of two" if text else "a power of two"
        return text

    def violated(self, value: Any) -> bool:
        if value is None or isinstance(value, (list, str, bool)):
            return False
        return (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.power_of_two and (value <= 0 or int(value) & (int(value) - 1) != 0))
        )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def knob(default: Any = _MISSING, *, default_factory: Any = _MISSING, **limits: Any) -> Any:
    """A dataclass field with its :class:`Limits` (``ge``, ``gt``, ``le``, ``power_of_two``,
    ``note``) in its metadata."""
    metadata = {"limits": Limits(**limits)} if limits else {}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def limit_problems(obj: Any) -> List[str]:
    """One message per field of ``obj`` whose value breaks its :class:`Limits`."""
    out = []
    for f in dataclasses.fields(obj):
        limits: Optional[Limits] = f.metadata.get("limits")
        value = getattr(obj, f.name)
        if limits is not None and limits.violated(value):
            note = f" ({limits.note})" if limits.note else ""
            out.append(f"{f.name}={value} is out of range: it must be {limits.describe()}{note}")
    return out


def field_docs(cls: type) -> Dict[str, str]:
    """``{field: docstring}`` of ``cls``: the string literal right below each field in the
    class body (the convention of this module), dedented and joined into one paragraph."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: Dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs
