"""``torch_npu`` of a stand-in process (``tests/npu_standin``): importing it installs the
CPU-backed ``npu`` device, as importing the real torch_npu registers the NPU. This
directory is on ``sys.path`` only where ``SAO_NPU_STANDIN=1`` put it there.

Its ops: the ones the project calls (``torch_npu_ops.KERNELS``, on the recorded
schemas); the names third-party import paths bind at import time
(``torch_npu_ops.UNMODELLED``: e.g. transformers imports ``npu_fusion_attention`` when
torch_npu is present), which refuse when called."""

import os
import sys

import torch

_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import npu_standin  # noqa: E402
from npu_standin import torch_npu_ops  # noqa: E402

npu_standin.install()

__version__ = "2.13.0+standin"
npu = torch.npu

for _name in (*torch_npu_ops.KERNELS, *torch_npu_ops.SGLANG_KERNELS):
    globals()[_name] = torch_npu_ops.python_binding(_name)
for _name in torch_npu_ops.UNMODELLED:
    globals()[_name] = torch_npu_ops.unmodelled(_name)
del _name
