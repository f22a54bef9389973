"""Ascend SoC names -> families: the one mapping (used by the config rules and the
platform probe; torch-free so the config CLI stays light)."""

from __future__ import annotations

from typing import Optional

# CANN SoC name prefix -> family, most specific first.
SOC_FAMILIES = (
    ("Ascend950", "950"),  # 950PR / 950DT
    ("Ascend910_95", "950"),  # CANN 8.5 names the 950PR / 950DT series Ascend910_95xx
    ("Ascend910_93", "A3"),
    ("Ascend910B", "A2"),
    ("Ascend910", "910"),
    ("Ascend310P", "310P"),
)
FAMILIES = ("950", "A3", "A2", "910", "310P")


def soc_family(soc: Optional[str]) -> Optional[str]:
    """The family of a CANN SoC name (``"Ascend910_9391"`` -> ``"A3"``), or of a family
    or short name given directly (``"A3"``, ``"910B"``, ``"950PR"``); an unknown name
    is returned as given (upper case, without ``Ascend``); ``None`` for no SoC."""
    if not soc:
        return None
    for prefix, family in SOC_FAMILIES:
        if soc.startswith(prefix):
            return family
    short = soc.upper().replace("ASCEND", "")
    for prefix, family in SOC_FAMILIES:
        if ("ASCEND" + short).startswith(prefix.upper()):
            return family
    return short
