"""``sglang_ascend_offload._C_ascend`` of a stand-in process: the AscendC extension on
the functional model.

On a node, ``bash ascendc_ops/build.sh --install`` builds the extension; importing
``sglang_ascend_offload._C_ascend`` registers ``TORCH_LIBRARY(sglang_ascend_offload)``:
the five schemas, LIM / LIM-C8 / Copy-SFA / the miss copy for PrivateUse1 and the
host-memory registration for CPU (``ascendc_ops/host/torch_ops.cpp``). Here a meta-path finder
answers that import with a module whose loading registers the same: the schemas of
``ops/ascendc_cpu_ops.SCHEMAS`` (a CPU test holds them equal to ``torch_ops.cpp``), the
four device ops as stand-in kernels of ``npu`` tensors, the registration for CPU
tensors. The kernels are the functional model's (``ops/ascendc_cpu_ops.py``: the kernel
sources compiled against a model of the AscendC API), run on the CPU memory of the
``npu`` tensors; ``host`` is the one operand on the host (registered memory, as on a
node). The model's own registration in the namespace (``ascendc_cpu_ops.register``) is
for CPU machines and stays off: the fused rung on the stand-in is the extension's path.

Copy-SFA's and the miss copy's rows are read by the kernels from registered host memory:
counted as host->device transfers of the misses' bytes (``transfers.py``), at the call
site.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Optional

import torch

from sglang_ascend_offload.ops import ascendc_cpu_ops, ascendc_model
from sglang_ascend_offload.ops.npu_impls import FUSED_EXTENSION_MODULE, FUSED_OP_NAMESPACE

from . import device, transfers

LIM, LIM_C8 = "npu_fused_lightning_indexer_manage", "npu_fused_quant_lightning_indexer_manage"
COPY_SFA, REGISTER = "npu_fused_scatter_copy_sparse_flash_attention", "npu_fused_register_host_memory"
COPY_ROWS = "npu_fused_copy_miss_rows"

_library: Optional[torch.library.Library] = None


def _load_model() -> None:
    """The functional model's kernels, loaded for ``ascendc_cpu_ops``'s op bodies (built
    on first use, cached; without registering its CPU ops)."""
    if ascendc_cpu_ops._STATE.model is None:
        path = ascendc_model.library_path()
        ascendc_cpu_ops._STATE.model = ascendc_model.KernelModel(path if path.is_file() else ascendc_model.build())


def _copy_sfa(query, query_rope, host, hot, sparse_indices, token_rows, miss_tokens, miss_slots, miss_count, *rest):
    """Copy-SFA on the model; the misses the kernel reads from host memory are counted."""
    row_bytes = host.shape[1] * host.element_size()
    owned = token_rows[token_rows >= 0].unique().to(torch.int64)
    misses = int(miss_count.to(torch.int64)[owned].sum()) if owned.numel() else 0
    if misses:
        transfers.record("h2d", f"{COPY_SFA}: miss rows read from registered host memory", misses * row_bytes, True)
    return ascendc_cpu_ops._copy_sfa(
        query, query_rope, host, hot, sparse_indices, token_rows, miss_tokens, miss_slots, miss_count, *rest
    )


def _copy_rows(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table):
    """The miss copy on the model; the rows the kernel reads from host memory are counted."""
    misses = int(miss_count.to(torch.int64).sum())
    if misses:
        row_bytes = host.shape[1] * host.element_size()
        transfers.record("h2d", f"{COPY_ROWS}: miss rows read from registered host memory", misses * row_bytes, True)
    return ascendc_cpu_ops._copy_rows(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)


def _register_on_device(host, device_address=0):
    raise NotImplementedError(
        f"Could not run '{FUSED_OP_NAMESPACE}::{REGISTER}' with arguments from the 'PrivateUse1' backend "
        "(the host pool is registered as a CPU tensor)"
    )


def _register_ops() -> None:
    global _library
    _load_model()
    lib = torch.library.Library(FUSED_OP_NAMESPACE, "DEF")
    for schema in ascendc_cpu_ops.SCHEMAS.values():
        lib.define(schema)
    lib.impl(REGISTER, ascendc_cpu_ops._register_host_memory, "CPU")
    namespace = getattr(torch.ops, FUSED_OP_NAMESPACE)
    kernels = ((LIM, ascendc_cpu_ops._lim), (LIM_C8, ascendc_cpu_ops._lim_c8), (COPY_SFA, _copy_sfa))
    for name, kernel in kernels + ((COPY_ROWS, _copy_rows),):
        device.KERNELS[getattr(namespace, name).default] = kernel
    device.KERNELS[getattr(namespace, REGISTER).default] = _register_on_device
    for name in (COPY_SFA, COPY_ROWS):
        device.HOST_OPERANDS[getattr(namespace, name).default] = frozenset({"host"})
    _library = lib


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if _library is None:
            _register_ops()
        module.__doc__ = "AscendC fused operators on the npu stand-in (tests/npu_standin/ascendc.py)"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != FUSED_EXTENSION_MODULE:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), origin="npu-standin")


def register() -> None:
    """Make ``import sglang_ascend_offload._C_ascend`` load the stand-in extension."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
