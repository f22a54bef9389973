"""An Ascend node as ``check-config --launch`` reads one, in a process of its own on this
CPU machine: what the launch validation asks of the node, and nothing it does not.

``python tests/sglang/npu_node.py RUNS_JSON`` runs ``python -m sglang_ascend_offload``
commands in this process, one after the other, and prints one JSON list of ``{"code",
"stdout"}``. RUNS_JSON is a list of ``{"argv": [...], "extension": bool}``: with
``extension`` the node has the built AscendC extension from that run on.

What the node has (each piece is what the launcher reads there; nothing else of an NPU is
modelled, and no operator runs):

* ``torch_npu``: importable, with every ``npu_*`` operator name (the separate operators'
  availability probe asks for names only);
* the platform probe says ``npu``: ``SGLANG_ASCEND_OFFLOAD_DEVICE=npu``, the project's own
  override of :func:`sglang_ascend_offload.platform.device_kind` (set by the caller);
* ``torch.cuda.get_device_capability`` answers as ``torch_npu.contrib.transfer_to_npu``
  routes it on a node (SGLang's DSA resolution asks it on every device);
* the installed CANN build: ``ASCEND_HOME_PATH`` names one of ``tests/fixtures/cann/``
  (set by the caller);
* with ``extension``: ``import sglang_ascend_offload._C_ascend`` defines the four ops of
  ``TORCH_LIBRARY(sglang_ascend_offload)`` (their schemas,
  ``ops/ascendc_cpu_ops.SCHEMAS``, held equal to ``ascendc_ops/host/torch_ops.cpp`` by
  a CPU test), as the built extension's import does; no kernel is registered: the launch
  validation only asks whether the ops exist.

``tests/npu_standin`` is the fuller stand-in (a CPU-backed ``npu`` device that runs the
operators); SGLang's NPU resolution does not import on it yet (torchair,
``sgl_kernel_npu``).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import sys
import types

import torch

EXTENSION = "sglang_ascend_offload._C_ascend"


def _torch_npu() -> types.ModuleType:
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = "2.13.0+npu-node"

    def operator(name: str):
        if name.startswith("npu_"):
            return lambda *args, **kwargs: None
        raise AttributeError(f"module 'torch_npu' has no attribute {name!r}")

    module.__getattr__ = operator
    return module


class _Extension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import sglang_ascend_offload._C_ascend``: the four ops' schemas, defined on import."""

    library = None

    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == EXTENSION else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from sglang_ascend_offload.ops import ascendc_cpu_ops

        if _Extension.library is None:
            _Extension.library = torch.library.Library("sglang_ascend_offload", "DEF")
            for schema in ascendc_cpu_ops.SCHEMAS.values():
                _Extension.library.define(schema)


def _install_extension() -> None:
    from sglang_ascend_offload.ops import npu_impls

    sys.meta_path.insert(0, _Extension())
    npu_impls._npu_extension_unavailable.cache_clear()  # the node probed before the build was installed


def main(runs) -> list:
    sys.modules["torch_npu"] = _torch_npu()
    torch.cuda.get_device_capability = lambda *args, **kwargs: (0, 0)
    from sglang_ascend_offload import cli

    out = []
    for run in runs:
        if run.get("extension") and not any(isinstance(f, _Extension) for f in sys.meta_path):
            _install_extension()
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = cli.main(list(run["argv"]))
        out.append({"code": code, "stdout": stdout.getvalue()})
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
