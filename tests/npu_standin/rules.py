"""Which CPU operands an op on ``npu`` tensors accepts, as torch_npu decides it.

Read from torch_npu 2.13's operator plugin (github.com/Ascend/op-plugin, the ``opapi``
kernels torch_npu registers for PrivateUse1):

* Every operand an ``aclnn`` kernel receives is converted by ``ConvertType``
  (``op_plugin/utils/op_api_common.cpp``), whose first step, ``CheckNpuTensorValid``
  (``op_api_common.h``), refuses a tensor that is not on the NPU with "Expected all
  tensors to be on the same device. Expected NPU tensor, please check whether the input
  tensor device is correct." A CPU 0-d tensor is refused there too.
* A few kernels look at their operands first and turn a CPU 0-d tensor into a scalar
  (``other.dim() == 0 && !torch_npu::utils::is_npu(other)`` -> ``other.item()``, e.g.
  ``AddKernelNpuOpApi.cpp``): :data:`CPU_SCALAR_OPS`, the ops whose ``opapi`` kernel
  file makes that test (``git grep -l "dim() == 0 && !torch_npu::utils::is_npu"``).
* Advanced indexing (``index.Tensor``, ``index_put_``, ``_index_put_impl_``) passes its
  indices through ``AdvanceIndex::npu_expand_tensors`` (``op_plugin/utils/AdvancedIndex.cpp``),
  which moves an index on another device to ``self``'s: a CPU index tensor is accepted
  at the price of a host->device copy (:data:`INDEX_OPS`). The indexed tensor itself
  must be on the NPU, and so must the values written.
* A boolean / byte index becomes ``nonzero`` on the device, whose output size is read
  back: a device->host read, as are the ops of :data:`DATA_DEPENDENT_SHAPE`.

CUDA is more permissive (any op takes a CPU 0-d tensor through TensorIterator); the
stand-in follows torch_npu, not CUDA.
"""

from __future__ import annotations

#: ``aten`` op base names (no overload, no trailing ``_``) whose torch_npu kernel takes a
#: CPU 0-d tensor operand as a scalar.
CPU_SCALAR_OPS = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "atan2",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "eq",
        "ne",
        "ge",
        "gt",
        "le",
        "lt",
        "fill",
        "floor_divide",
        "fmod",
        "logical_or",
        "masked_fill",
        "max",
        "min",
        "maximum",
        "minimum",
        "pow",
        "remainder",
        "where",
    }
)

#: advanced indexing: CPU index tensors are moved to the device (a host->device copy each)
INDEX_OPS = frozenset({"index", "index_put", "_index_put_impl"})

#: ops whose output shape is read back from the device (a device->host read each)
DATA_DEPENDENT_SHAPE = frozenset(
    {
        "nonzero",
        "nonzero_static_unchecked",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
    }
)

#: ops that return host values computed from device data (a device->host read each)
HOST_RESULT_OPS = frozenset({"_local_scalar_dense", "equal"})

SAME_DEVICE_ERROR = (
    "Expected all tensors to be on the same device. Expected NPU tensor, please check whether the "
    "input tensor device is correct."
)


def base_name(op_name: str) -> str:
    """``aten::add_`` / ``aten::add.Tensor`` -> ``add``."""
    name = op_name.split("::")[-1].split(".")[0]
    return name[:-1] if name.endswith("_") else name
