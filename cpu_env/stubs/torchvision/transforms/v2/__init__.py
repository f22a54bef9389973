"""Stand-in for ``torchvision.transforms.v2`` (see ``torchvision/__init__.py``)."""

from torchvision import _module_getattr

__getattr__ = _module_getattr("transforms.v2.")

from . import functional  # noqa: E402,F401
