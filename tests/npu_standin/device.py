"""The stand-in ``npu`` device: torch's PrivateUse1 backend renamed ``npu``, in Python.

Route (torch 2.13): :func:`install` renames PrivateUse1 to ``npu``, generates the
``Tensor.npu()`` / ``is_npu`` methods, registers ``torch.npu`` (``npu_module.py``), a
device guard, and the accelerator hooks (``pinned_hooks.cpp``: the pinned-host
allocator Python hooks cannot provide). A tensor on ``npu:<i>`` is an :class:`NpuTensor`:
a wrapper subclass holding CPU memory (``_cpu``) whose ``__torch_dispatch__`` checks
the operands as torch_npu does (``rules.py``), runs the op on the CPU data (or, for a
torch_npu / AscendC op, its stand-in kernel from :data:`KERNELS`) and wraps the results
on the same device. Views wrap CPU views, so writes through a view land in its base.
Factories (``torch.empty(..., device="npu")``, ``.to("npu")``, ``torch.tensor(...,
device="npu")``) reach the PrivateUse1 kernels registered here with ``torch.library``.

Every device->host read and host->device copy is counted (``transfers.py``); inside a
graph capture the ones a real capture refuses raise (``graphs.py``).

Why Python and not a C++ PrivateUse1 extension: the wrapper sees every op with its
operands (device checks, transfer counting and graph recording are a few lines each
here, and need no allocator, no storage impl and no per-op kernels); the C++ part is
the 70-line hooks file, built once with ``torch.utils.cpp_extension`` (~15 s, cached).
"""

from __future__ import annotations

import functools
import threading
from typing import Dict, Optional

import torch

from . import graphs, rules, transfers

NAME = "npu"
aten = torch.ops.aten

#: stand-in kernels of non-aten ops (torch_npu, AscendC): OpOverload -> function of CPU tensors
#: (filled when the stand-in is installed, before any of these ops runs)
KERNELS: Dict[object, object] = {}
#: arguments of such an op that live on the host on a node too (Copy-SFA's registered ``host``)
HOST_OPERANDS: Dict[object, frozenset] = {}

_local = threading.local()


def current_index() -> int:
    return getattr(_local, "index", 0)


def set_current_index(index: int) -> None:
    _local.index = int(index)


def device_count() -> int:
    from . import npu_module

    return npu_module.DEVICE_COUNT


def _index_of(device) -> int:
    index = torch.device(device).index
    index = current_index() if index is None else index
    if not 0 <= index < device_count():
        raise RuntimeError(f"npu:{index}: invalid device ordinal (the stand-in has {device_count()} devices)")
    return index


class NpuTensor(torch.Tensor):
    """A tensor on ``npu:<index>`` backed by the CPU tensor ``_cpu`` (same shape, strides,
    storage offset and dtype)."""

    _cpu: torch.Tensor

    @staticmethod
    def __new__(cls, cpu: torch.Tensor, index: int):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            cpu.size(),
            strides=cpu.stride(),
            storage_offset=cpu.storage_offset(),
            dtype=cpu.dtype,
            layout=cpu.layout,
            device=torch.device(NAME, index),
            requires_grad=False,
        )
        t._cpu = cpu
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None):
        _read("print", self)
        text = repr(self._cpu)
        return text[:-1] + f", device='{self.device}')" if text.endswith(")") else text

    __str__ = __repr__

    def tolist(self):
        _read("Tensor.tolist", self)
        return self._cpu.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )

    def data_ptr(self) -> int:
        """The device address: the stand-in's device memory is host memory."""
        return self._cpu.data_ptr()

    def untyped_storage(self):
        return self._cpu.untyped_storage()


def cpu_of(t: torch.Tensor) -> torch.Tensor:
    """The CPU memory behind an ``npu`` tensor (for the stand-in's kernels and tests)."""
    if not isinstance(t, NpuTensor):
        raise TypeError(f"expected an npu tensor, got one on {t.device}")
    return t._cpu


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _read(what: str, t: torch.Tensor) -> None:
    graphs.refuse_in_capture(f"a device->host read ({what})")
    transfers.record("d2h", what, _nbytes(t))


def _is_pinned(cpu: torch.Tensor) -> bool:
    return cpu.numel() == 0 or cpu.is_pinned()


def _h2d(what: str, src: torch.Tensor) -> transfers.Transfer:
    pinned = _is_pinned(src)
    if not pinned:
        graphs.refuse_in_capture(f"a host->device copy from pageable memory ({what})")
    return transfers.record("h2d", what, _nbytes(src), pinned)


def _tree_map(fn, x):
    """``fn`` over the leaves of an op's arguments / results (tuples, lists, dicts)."""
    if type(x) in (tuple, list):
        return type(x)(_tree_map(fn, v) for v in x)
    if type(x) is dict:
        return {k: _tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def _leaves(x, out: list) -> list:
    if type(x) in (tuple, list):
        for v in x:
            _leaves(v, out)
    elif type(x) is dict:
        for v in x.values():
            _leaves(v, out)
    else:
        out.append(x)
    return out


class _Operands:
    """One pass over an op's arguments: their CPU form, the ``npu`` devices seen and the
    host tensors among them."""

    __slots__ = ("devices", "host")

    def __init__(self):
        self.devices = set()
        self.host = []

    def unwrap(self, x):
        kind = type(x)
        if kind is NpuTensor:
            self.devices.add(x.device.index)
            return x._cpu
        if kind is tuple or kind is list:
            return kind(self.unwrap(v) for v in x)
        if kind is dict:
            return {k: self.unwrap(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor):
            self.host.append(x)
        elif kind is torch.device and x.type == NAME:
            return torch.device("cpu")
        return x


def _unwrap(x):
    if isinstance(x, NpuTensor):
        return x._cpu
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    return x


class _OpInfo:
    """What dispatch needs of an op's schema, computed once per op."""

    def __init__(self, func):
        schema = func._schema
        self.name = rules.base_name(func.name())
        self.write_args = tuple(
            (i, a.name, tuple(a.alias_info.before_set))
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        self.returns = tuple(r.alias_info for r in schema.returns)
        names = HOST_OPERANDS.get(func, frozenset())
        self.host_args = tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.name in names)
        self.kernel = KERNELS.get(func, func)
        self.index_op = self.name in rules.INDEX_OPS
        self.scalar_ok = self.name in rules.CPU_SCALAR_OPS
        self.reads_back = self.name in rules.DATA_DEPENDENT_SHAPE


@functools.lru_cache(maxsize=None)
def _info(func) -> _OpInfo:
    return _OpInfo(func)


# ---------------------------------------------------------------- operand checks
def _check_operands(func, info: _OpInfo, args, kwargs, seen: _Operands) -> Optional[int]:
    """The device index of the op's ``npu`` operands, after torch_npu's checks; CPU index
    tensors of indexing ops are counted as the host->device copies torch_npu makes."""
    if len(seen.devices) > 1:
        a, b = sorted(seen.devices)[:2]
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, npu:{a} and npu:{b}! "
            f"({func})"
        )
    if seen.host:
        index_operands = args[1] if info.index_op and len(args) > 1 else ()
        host_operands = {id(args[i] if i < len(args) else kwargs.get(n)) for i, n in info.host_args}
        for t in seen.host:
            if id(t) in host_operands:
                continue
            if any(t is i for i in index_operands if i is not None):
                _h2d(f"{func} (a cpu index tensor moved to the device)", t)
                continue
            if t.dim() == 0 and info.scalar_ok:
                continue
            shape = tuple(t.shape)
            raise RuntimeError(f"{rules.SAME_DEVICE_ERROR} ({func}: an operand of shape {shape} is on {t.device})")
    return min(seen.devices) if seen.devices else None


def _bool_index(info: _OpInfo, args) -> bool:
    if not info.index_op or len(args) < 2:
        return False
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])


# ------------------------------------------------------------------- dispatch
def dispatch(func, args, kwargs):
    """One op with at least one ``npu`` operand (``NpuTensor.__torch_dispatch__``)."""
    if func is aten.copy_.default:
        return _copy(args[0], args[1])
    if func is aten._to_copy.default:
        return _to_copy_from_npu(args[0], **kwargs)
    if func is aten.is_pinned.default:
        return False
    info = _info(func)
    seen = _Operands()
    cpu_args, cpu_kwargs = seen.unwrap(args), seen.unwrap(kwargs)
    index = _check_operands(func, info, args, kwargs, seen)
    out_device = kwargs.get("device")
    if out_device is not None:
        out_device = torch.device(out_device)
        index = _index_of(out_device) if out_device.type == NAME else None
    if info.name in rules.HOST_RESULT_OPS:
        _read(str(func), next(t for t in _leaves(args, []) if isinstance(t, NpuTensor)))
        return func(*cpu_args, **cpu_kwargs)
    if info.reads_back or _bool_index(info, args):
        _read(f"{func} (output shape read from the device)", args[0])
    kernel = info.kernel

    def run():
        return kernel(*cpu_args, **cpu_kwargs)

    targets = _write_targets(info, args, kwargs) if info.write_args else {}
    capture = graphs.active()
    if capture is not None:
        for target in targets.values():
            for memory in _leaves(target, []):
                if isinstance(memory, NpuTensor):
                    capture.keep_before_write(memory._cpu)
    out = run()
    if index is None:  # an npu operand asked for a CPU result (device="cpu")
        return out
    if targets:
        _check_not_resized(func, targets)
    result = _wrap_outputs(info, targets, out, index)
    if capture is not None:
        capture.entries.append(graphs.Entry(run, _fresh_outputs(info, out)))
    return result


def _write_targets(info: _OpInfo, args, kwargs) -> Dict[object, object]:
    """alias set -> the argument object an op writes in place (``Tensor(a!)``)."""
    targets = {}
    for i, name, aliases in info.write_args:
        value = args[i] if i < len(args) else kwargs.get(name)
        for alias in aliases:
            targets[alias] = value
    return targets


def _check_not_resized(func, targets: Dict[object, object]) -> None:
    """A wrapper's shape is fixed at creation: an op that resized the CPU memory of an
    ``npu`` tensor it writes (``out=`` of another size, ``resize_``) is refused loudly."""
    for target in targets.values():
        if isinstance(target, NpuTensor) and (
            target._cpu.shape != target.shape or target._cpu.stride() != target.stride()
        ):
            raise RuntimeError(
                f"npu stand-in: {func} resized an npu tensor in place ({tuple(target.shape)} -> "
                f"{tuple(target._cpu.shape)}); allocate the output at its size"
            )


def _wrap_outputs(info: _OpInfo, targets: Dict[object, object], out, index: int):
    """Wrap an op's CPU results on ``npu:<index>``; an in-place / ``out=`` result is the
    argument object itself."""

    def one(alias_info, value):
        if alias_info is not None and alias_info.is_write:
            for alias in alias_info.before_set:
                if alias in targets:
                    return targets[alias]
        if type(value) is torch.Tensor:
            return NpuTensor(value, index)
        return _tree_map(lambda x: NpuTensor(x, index) if isinstance(x, torch.Tensor) else x, value)

    if not info.returns:  # an op returning nothing (it writes an argument in place)
        return None
    if len(info.returns) == 1:
        return one(info.returns[0], out)
    return tuple(one(r, v) for r, v in zip(info.returns, out))


def _fresh_outputs(info: _OpInfo, out):
    """The output buffers a replay refreshes: results that alias no input."""
    values = list(out) if isinstance(out, (tuple, list)) and len(info.returns) > 1 else [out]
    return [v if isinstance(v, torch.Tensor) and r is None else None for r, v in zip(info.returns, values)]


# --------------------------------------------------------------------- copies
def _copy(dst: torch.Tensor, src: torch.Tensor):
    """``dst.copy_(src)`` with at least one ``npu`` side."""
    if isinstance(dst, NpuTensor) and isinstance(src, NpuTensor):
        cpu_src, event = src._cpu, None  # device -> device (any two npu devices)
    elif isinstance(dst, NpuTensor):
        cpu_src, event = src, _h2d("Tensor.copy_ (host -> device)", src)
    else:
        _read("Tensor.copy_ (device -> host)", src)
        dst.copy_(src._cpu)
        return dst
    target = dst._cpu

    def run():
        target.copy_(cpu_src)

    capture = graphs.active()
    if capture is not None:
        capture.keep_before_write(target)
        capture.entries.append(graphs.Entry(run, [], event))
    run()
    return dst


def _to_copy_from_npu(src: NpuTensor, *, device=None, **kwargs):
    """``src.to(...)`` (``aten._to_copy``): to the host (a read), to another / the same
    ``npu`` device, or a dtype change on the device."""
    kwargs.pop("pin_memory", None)
    target = torch.device(device) if device is not None else src.device
    if target.type == "cpu":
        _read("Tensor.to(cpu)", src)
        return aten._to_copy.default(src._cpu, **kwargs)
    if target.type != NAME:
        raise RuntimeError(f"the stand-in npu device copies to cpu or npu only, not {target}")
    cpu = src._cpu
    out = aten._to_copy.default(cpu, **kwargs)
    capture = graphs.active()
    if capture is not None:
        capture.entries.append(graphs.Entry(lambda: aten._to_copy.default(cpu, **kwargs), [out]))
    return NpuTensor(out, _index_of(target))


def _to_copy_from_host(src: torch.Tensor, *, device=None, **kwargs):
    """PrivateUse1 ``_to_copy``: a host tensor copied to an ``npu`` device."""
    kwargs.pop("pin_memory", None)
    event = _h2d("Tensor.to(npu) (host -> device)", src)
    out = aten._to_copy.default(src, **kwargs)
    capture = graphs.active()
    if capture is not None:
        capture.entries.append(graphs.Entry(lambda: aten._to_copy.default(src, **kwargs), [out], event))
    return NpuTensor(out, _index_of(device))


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    fmt = memory_format or torch.contiguous_format
    return NpuTensor(torch.empty(size, dtype=dtype, layout=layout, memory_format=fmt), _index_of(device))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return NpuTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout), _index_of(device))


#: factories whose composite kernel allocates an empty tensor and resizes it through an
#: ``out=`` op (a wrapper cannot be resized): computed on the host and wrapped instead
SIZED_BY_DATA = (
    "arange",
    "arange.start",
    "arange.start_step",
    "randperm",
    "randperm.generator",
    "linspace",
    "logspace",
    "tril_indices",
    "triu_indices",
)


def _on_host_then_wrapped(name: str):
    base, _, overload = name.partition(".")
    op = getattr(getattr(aten, base), overload or "default")

    def factory(*args, device=None, pin_memory=None, **kwargs):
        return NpuTensor(op(*args, device=torch.device("cpu"), **kwargs), _index_of(device))

    return factory


_library: Optional[torch.library.Library] = None


def register_factories() -> None:
    """The PrivateUse1 kernels of the ops that create ``npu`` tensors from nothing or from
    host tensors (no ``npu`` operand, so no ``__torch_dispatch__``)."""
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("_to_copy", _to_copy_from_host, "PrivateUse1")
    for name in SIZED_BY_DATA:
        lib.impl(name, _on_host_then_wrapped(name), "PrivateUse1")
    _library = lib
