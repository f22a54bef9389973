"""Stand-in for ``torchvision.transforms.v2.functional`` (see ``torchvision/__init__.py``)."""

from torchvision import _module_getattr

__getattr__ = _module_getattr("transforms.v2.functional.")
