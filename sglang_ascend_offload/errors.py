"""Typed problem reports: a broken rule (:class:`Violation`) and the error that lists
every one found (:class:`ConfigError`).

Their home sits below every other module of the package (this module imports nothing
of it), so the configuration schema and rules (``config.py``), the model specs
(``model_specs.py``), the capacity planner (``capacity.py``) and the memory budget
(``memory_budget.py``) share them without importing one another: dependencies run
config -> plan -> runtime, never back. ``config`` re-exports both names
(``config.ConfigError`` / ``config.Violation`` are these classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

__all__ = ["Violation", "ConfigError"]


@dataclass(frozen=True)
class Violation:
    """One broken rule: its id, what is wrong, and what to change."""

    rule: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.problem} -> {self.fix}"


class ConfigError(ValueError):
    """Every problem found, in one error. ``violations`` keeps them typed."""

    def __init__(self, violations: List[Violation], what: str = "configuration"):
        self.violations = list(violations)
        lines = "\n".join(f"  {i + 1}. {v}" for i, v in enumerate(self.violations))
        super().__init__(f"invalid {what} ({len(self.violations)} problem(s)):\n{lines}")
