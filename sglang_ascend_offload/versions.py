"""The one reader of installed package versions (``importlib.metadata``)."""

from __future__ import annotations

import importlib.metadata as md
from typing import Optional

__all__ = ["installed_version"]


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (a pip name, e.g. ``sglang``,
    ``memfabric-hybrid``), or ``None`` when it is not installed."""
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None
