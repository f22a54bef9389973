"""Installation of the stand-in device, in the order torch needs it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

import torch
from torch.utils.cpp_extension import load

from . import device, npu_module

_HOOKS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pinned_hooks.cpp")

_hooks = None


class _DeviceGuard(torch._C._acc.DeviceGuard):
    """The device guard of the renamed PrivateUse1 key (its current device is
    ``torch.npu.current_device()``)."""

    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def hooks():
    """The compiled accelerator hooks (``pinned_hooks.cpp``; built on first use, cached by
    torch's extension cache)."""
    global _hooks
    if _hooks is None:
        _hooks = load("sao_npu_standin_hooks", sources=[_HOOKS_SOURCE], extra_cflags=["-O1"], verbose=False)
    return _hooks


_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FAKE_MEMFABRIC = os.path.join(_TESTS, "sglang", "fake_memfabric.py")


def install_fake_memfabric() -> None:
    """``memfabric_hybrid`` of a stand-in process is the signature-checked stand-in
    (``tests/sglang/fake_memfabric.py``: the ``bm`` API over shared-memory segments); the
    installed CPU wheel's data path needs the Ascend driver."""
    if "fake_memfabric" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fake_memfabric", _FAKE_MEMFABRIC)
        module = importlib.util.module_from_spec(spec)
        sys.modules["fake_memfabric"] = module
        spec.loader.exec_module(module)
    sys.modules["fake_memfabric"].install()
    for name in ("memfabric_hybrid", "memfabric_hybrid.bm"):  # importlib.util.find_spec needs a spec
        if getattr(sys.modules[name], "__spec__", None) is None:
            sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None, origin=_FAKE_MEMFABRIC)


def install() -> None:
    hooks().install()
    torch.utils.rename_privateuse1_backend(device.NAME)
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module(device.NAME, npu_module)
    torch._C._acc.register_python_privateuseone_device_guard(_DeviceGuard())
    device.register_factories()
    install_fake_memfabric()
    for name in ("torch_npu_ops", "ascendc", "hccl"):
        try:
            mod = __import__(f"{__package__}.{name}", fromlist=["register"])
        except ImportError:
            continue
        mod.register()
