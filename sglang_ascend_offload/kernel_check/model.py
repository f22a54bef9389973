"""The functional model of the AscendC kernels, as ``check-kernels`` uses it.

The model (build, host tiling, launch on simulated cores) is runtime code since the
fused rung runs on it on CPU: it lives in :mod:`sglang_ascend_offload.ops.ascendc_model`
and is re-exported here under the names this package has always used (``km.build``,
``km.KernelModel``, ``km.ModelFault``, ``km.LIM`` ...).
"""

from __future__ import annotations

from ..ops.ascendc_model import (  # noqa: F401 - re-exported for kernel_check and its tests
    COPY_ROWS,
    COPY_SFA,
    KERNELS,
    LIM,
    LIM_C8,
    MODEL_DIR,
    OUT_DIR,
    TASK_RATION,
    KernelModel,
    Launch,
    ModelBuildError,
    ModelFault,
    ShapeUnsupported,
    build,
)

__all__ = [
    "COPY_ROWS",
    "COPY_SFA",
    "KERNELS",
    "LIM",
    "LIM_C8",
    "MODEL_DIR",
    "OUT_DIR",
    "TASK_RATION",
    "KernelModel",
    "Launch",
    "ModelBuildError",
    "ModelFault",
    "ShapeUnsupported",
    "build",
]
