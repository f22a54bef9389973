"""Planted faulty kernels: a copy of ``ascendc_ops/kernels`` with one line changed, built on
the AscendC functional model (as ``check-kernels``' mutation tests do), and a context that
serves the fused ops from such a library for one test.

* :data:`LIM_VICTIM_ORDER`: the residency step evicts, among slots of equal stamp, the
  highest slot first (the contract: the lowest), a fault of the fused LIM / LIM-C8;
* :data:`COPY_SFA_ROPE_OFFSET`: Copy-SFA gathers a key's rope part from its latent's offset.

:func:`registration_left_as_found` wraps a test module that selects the fused rung on CPU.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator, Tuple

from sglang_ascend_offload.kernel_check import compile_check
from sglang_ascend_offload.ops import ascendc_cpu_ops, ascendc_model

Mutation = Tuple[str, str, str]  # (file in ascendc_ops/kernels, line as written, line as planted)

LIM_VICTIM_ORDER: Mutation = (
    "residency_manage.h",
    "return sa < sb || (sa == sb && a < b);",
    "return sa < sb || (sa == sb && a > b);",
)
COPY_SFA_ROPE_OFFSET: Mutation = (
    "scatter_copy_sparse_flash_attention.cpp",
    "AscendC::DataCopyPad(kRope_[j * t_.ropeDim], buf[b * t_.rowDim + t_.latentDim], rope);",
    "AscendC::DataCopyPad(kRope_[j * t_.ropeDim], buf[b * t_.rowDim], rope);",
)


def mutated_library(tmp: Path, mutation: Mutation) -> Path:
    """The functional-model library of the kernels with ``mutation`` applied (built in ``tmp``)."""
    file, old, new = mutation
    dst = tmp / "kernels"
    shutil.copytree(compile_check.KERNELS_DIR, dst)
    src = dst / file
    text = src.read_text()
    assert text.count(old) == 1, f"{file} no longer holds {old!r}: update the mutation"
    src.write_text(text.replace(old, new))
    return ascendc_model.build(kernels=dst)


@contextlib.contextmanager
def fused_ops_from(library: Path) -> Iterator[None]:
    """Serve the fused ops on CPU from ``library`` inside; the default registration state after."""
    was = ascendc_cpu_ops.registered()
    ascendc_cpu_ops.unregister()
    ascendc_cpu_ops.register(path=library)
    try:
        yield
    finally:
        ascendc_cpu_ops.unregister()
        if was:
            ascendc_cpu_ops.register()


@contextlib.contextmanager
def registration_left_as_found() -> Iterator[None]:
    """Whatever registers the fused ops on their functional model inside (selecting ``ops=fused``
    does), they are unregistered after it unless they were registered before: later tests
    see the state they would have seen (e.g. the pre-flight's "nothing fused here")."""
    was = ascendc_cpu_ops.registered()
    try:
        yield
    finally:
        if not was:
            ascendc_cpu_ops.unregister()
