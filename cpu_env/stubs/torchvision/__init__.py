"""Import-only stand-in for torchvision in the CPU test environment (see ../README.md).

PyPI's torchvision wheel is a CUDA build that cannot load next to the CPU torch
wheel. SGLang imports torchvision at module level in several model configs; this
stand-in satisfies those imports. Any image operation raises
:class:`TorchvisionUnavailable` when called.
"""

__version__ = "0.0.0+cpu-stand-in"
IS_CPU_STAND_IN = True


class TorchvisionUnavailable(RuntimeError):
    """Raised by every operation of the stand-in."""


class _Unavailable:
    """A placeholder for a torchvision callable or class that raises when used."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise TorchvisionUnavailable(
            f"torchvision.{self._qualname} is not available: this is the CPU test "
            "environment's import stand-in (cpu_env/stubs). Install a torchvision "
            "build that matches your torch to use image models."
        )

    def __getattr__(self, name: str) -> "_Unavailable":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._qualname}.{name}")


def _module_getattr(prefix: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{prefix}{name}")

    return __getattr__


__getattr__ = _module_getattr("")

from . import io, transforms  # noqa: E402,F401
