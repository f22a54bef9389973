"""Stand-in for ``torchvision.transforms.functional`` (see ``torchvision/__init__.py``)."""

from torchvision import _module_getattr
from torchvision.transforms import InterpolationMode  # noqa: F401

__getattr__ = _module_getattr("transforms.functional.")
