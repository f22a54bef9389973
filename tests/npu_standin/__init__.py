"""A CPU-backed ``npu`` device for tests: the NPU code paths executed without an NPU.

What it is (each piece in its own module):

* ``device.py``: torch's PrivateUse1 backend renamed ``npu``; tensors on ``npu:<i>``
  hold CPU memory and check their operands as torch_npu does (``rules.py``);
  device->host reads and host->device copies are counted per call site (``transfers.py``);
* ``npu_module.py``: ``torch.npu`` (streams, events, devices, memory queries, graphs:
  ``graphs.py``);
* ``torch_npu_ops.py``: the torch_npu operators the project calls, on the recorded
  schemas (``npu_api/torch_npu_ops.json``), computed by the project's reference ops;
* ``ascendc.py``: ``sglang_ascend_offload._C_ascend``, the AscendC extension, whose ops run
  the kernels on their functional model (``ops/ascendc_model.py``);
* ``hccl.py``: the ``hccl`` process-group backend, gloo underneath;
* ``site/torch_npu``: the importable ``torch_npu`` of a stand-in process (on ``sys.path``
  only there); importing it installs the stand-in, as importing torch_npu registers the
  NPU.

The stand-in is process-global and one-way (a renamed PrivateUse1 backend cannot be
renamed back), so it lives in processes of its own: ``SAO_NPU_STANDIN=1 python -m
pytest -m npu`` (``tests/conftest.py`` puts ``site/`` on the path) runs the npu-marked
tests on it. The runtime package never imports this package. ``docs/testing.md`` says
what it checks and what it cannot show.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import threading

ENV = "SAO_NPU_STANDIN"
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")

_lock = threading.Lock()
_installed = False


def requested() -> bool:
    """Whether this process was asked to run on the stand-in (``SAO_NPU_STANDIN=1``)."""
    return os.environ.get(ENV) == "1"


def installed() -> bool:
    return _installed


def put_site_on_path() -> None:
    """Make ``import torch_npu`` find the stand-in, in this process and its children."""
    if SITE not in sys.path:
        sys.path.insert(0, SITE)
    tests_dir = os.path.dirname(os.path.dirname(SITE))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for path in (tests_dir, SITE):
        if path not in parts:
            parts.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def _real_torch_npu() -> str:
    """Where a real torch_npu is installed (``""``: nowhere)."""
    spec = importlib.machinery.PathFinder.find_spec("torch_npu", [p for p in sys.path if p != SITE])
    return "" if spec is None else str(spec.origin)


def install() -> None:
    """Install the stand-in in this process (idempotent). Refused where a real torch_npu
    is installed: that machine runs the npu tests on its device."""
    global _installed
    with _lock:
        if _installed:
            return
        real = _real_torch_npu()
        if real:
            raise RuntimeError(
                f"{ENV}=1 with a real torch_npu installed ({real}): "
                "run the npu tests on the device (python -m pytest -m npu) without the stand-in"
            )
        from . import backend

        backend.install()
        _installed = True
