"""Stand-in for ``torchvision.transforms`` (see ``torchvision/__init__.py``)."""

import enum

from torchvision import _module_getattr


class InterpolationMode(enum.Enum):
    """Same member names and values as torchvision's enum (imports bind it at module level)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = _module_getattr("transforms.")

from . import functional, v2  # noqa: E402,F401
