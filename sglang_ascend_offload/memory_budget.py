"""Memory the offload features are about to allocate, checked against what exists.

A launch that asks for more than the machine has must stop before anything is
allocated, with the numbers and the fix, not after the model loaded (or after the
kernel's OOM killer took the machine). Every feature describes its large buffers as
:class:`Allocation` items (where they live, how many bytes, the formula in words);
:func:`check` sums them per memory (device / host; on a CPU "device" the two are
the same memory) and compares each sum with what is available now.

Available memory:

* host: ``MemAvailable`` of ``/proc/meminfo``, capped by the cgroup limit of this
  process (``memory.max`` minus ``memory.current``) where one is set;
* device: ``mem_get_info`` of the NPU / CUDA runtime when it is already usable in
  this process; ``None`` (not checked here; the pool checks again when it
  allocates) where asking would initialise the device in a launcher process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

from .errors import Violation

__all__ = ["Allocation", "check", "host_available_bytes", "device_free_bytes", "format_bytes", "parse_size", "HEADROOM"]

#: Fraction of the available memory the offload buffers may take: the rest is left to
#: SGLang's own pools, activations and the rest of the process.
HEADROOM = 0.9


@dataclass(frozen=True)
class Allocation:
    """One large buffer a feature will allocate.

    name: what it is (``"hot buffers"``). where: ``"device"`` or ``"host"``.
    nbytes: its size. formula: how ``nbytes`` follows from the settings, in words with
    the numbers (shown in the error). knob: the setting that shrinks it.
    """

    name: str
    where: str
    nbytes: int
    formula: str
    knob: str


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes of ``"1073741824"``, ``"512MiB"``, ``"1.5GiB"``, ``"64M"`` (binary units:
    K/M/G/T = 2**10/20/30/40, with or without ``iB``). ``ValueError`` says the accepted forms."""
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(
            f"{text!r} is not a size: give bytes (1073741824) or a number with a binary unit (512MiB, 1.5GiB, 64M)"
        )
    return int(float(m.group(1)) * _SCALE[m.group(2).upper()])


def _cgroup_room() -> Optional[int]:
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
        return max(int(limit) - used, 0)
    except (OSError, ValueError):
        return None


def host_available_bytes() -> Optional[int]:
    """Host memory available to this process now (``None`` when it cannot be read)."""
    avail: Optional[int] = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    room = _cgroup_room()
    if avail is None:
        return room
    return avail if room is None else min(avail, room)


def device_free_bytes(device: str) -> Optional[int]:
    """Free memory of ``device`` (``cpu`` = host memory) without initialising a device
    runtime that is not initialised yet (``None`` then)."""
    if device == "cpu":
        return host_available_bytes()
    try:
        import torch

        if device == "cuda" and torch.cuda.is_initialized():
            return int(torch.cuda.mem_get_info()[0])
        if device == "npu" and "torch_npu" in __import__("sys").modules:
            npu = getattr(torch, "npu", None)
            if npu is not None and npu.is_initialized():
                return int(npu.mem_get_info()[0])
    except Exception:  # noqa: BLE001 - a runtime that cannot answer is "unknown", never a pass
        return None
    return None


def check(
    items: Iterable[Allocation],
    device: str,
    *,
    rule: str = "memory.insufficient",
    available: Optional[Dict[str, Optional[int]]] = None,
) -> List[Violation]:
    """One :class:`Violation` per memory whose planned allocations exceed
    ``HEADROOM`` x what is available. ``device``: ``npu`` / ``cuda`` / ``cpu``.
    ``available``: override (``{"device": bytes, "host": bytes}``), for tests.
    """
    items = [i for i in items if i.nbytes > 0]
    if device == "cpu":  # the device *is* host memory: one budget for both
        items = [Allocation(i.name, "host", i.nbytes, i.formula, i.knob) for i in items]
    if available is None:
        available = available_bytes(device)
    out: List[Violation] = []
    for where in ("device", "host"):
        mine = [i for i in items if i.where == where]
        have = available.get(where)
        if not mine or have is None:
            continue
        need = sum(i.nbytes for i in mine)
        budget = int(have * HEADROOM)
        if need <= budget:
            continue
        memory = "host memory" if where == "host" else f"{device} device memory"
        parts = "; ".join(f"{i.name} {format_bytes(i.nbytes)} = {i.formula}" for i in mine)
        knobs = ", ".join(dict.fromkeys(i.knob for i in mine))
        out.append(
            Violation(
                rule,
                f"the offload buffers need {format_bytes(need)} of {memory} but {format_bytes(have)} is available "
                f"({format_bytes(budget)} usable at {HEADROOM:.0%}): {parts}",
                f"lower {knobs} so the total fits in {format_bytes(budget)}",
            )
        )
    return out


def available_bytes(device: str) -> Dict[str, Optional[int]]:
    """``{"host": bytes, "device": bytes}`` free now (``None``: unknown; on a CPU the device
    is host memory, so ``device`` is ``None`` and the host figure is the one budget)."""
    return {"host": host_available_bytes(), "device": None if device == "cpu" else device_free_bytes(device)}
