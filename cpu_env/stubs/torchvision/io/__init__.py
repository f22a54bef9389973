"""Stand-in for ``torchvision.io`` (see ``torchvision/__init__.py``)."""

from torchvision import _module_getattr

__getattr__ = _module_getattr("io.")
