"""Buffer planner: map cache-bearing logical layers onto fewer physical buffers.

With ``N`` cache-bearing layers, ``I`` independent layers (each
keeps a dedicated buffer), ``R = N - I`` reusable layers and ``B`` shared buffers,
a uniform layout needs ``I + min(B, R)`` physical buffers. Reusable layers are
assigned round-robin: shared buffer ``s`` of a group holds ``reused[s::b]`` with
``b = min(B, R_group)``. Layers whose main-KV specs (or indexer specs) differ are
put in different groups and never share a buffer; ``B`` applies per group, so a
mixed layout needs ``I + sum_g min(B, R_g)`` buffers. MTP layers are numbered after
the base layers and take part like any other layer. The indexer cache (if a
layer has one) lives in the same physical buffer as its main KV.

Every layer gets a *predecessor*: the previous layer in its buffer's list, whose
consumers (host save, remote reads) must have finished before the buffer can be
overwritten with this layer's KV (``None`` for the first layer of a buffer; at
run time :class:`~.gates.SlotGates` also orders the first layer of a forward
after the last layer of the previous forward).

Physical buffers are numbered: independent buffers first (in layer order), then
the shared buffers group by group (groups in order of their first layer).
Example: 27 layers, ``B = 6``, ``I = [0]`` -> buffer 0 holds ``[0]``, buffer 1
holds ``[1, 7, 13, 19, 25]``, and layer 7's predecessor is layer 1.

Invalid layouts raise :class:`LayoutError` listing every reason at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "TensorSpec",
    "LayerKVSpec",
    "PhysicalBuffer",
    "BufferPlan",
    "LayoutError",
    "plan_buffers",
    "plan_from_config",
    "uniform_specs",
    "torch_dtype",
]


class LayoutError(ValueError):
    """An invalid cache layout; ``reasons`` lists every problem found."""

    def __init__(self, reasons: Sequence[str]):
        self.reasons = list(reasons)
        lines = "\n".join(f"  {i + 1}. {r}" for i, r in enumerate(self.reasons))
        super().__init__(f"invalid layerwise prefill buffer layout ({len(self.reasons)} problem(s)):\n{lines}")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``"torch.int8"`` -> ``torch.dtype``; ``ValueError`` if unknown."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int8": "int8"}
    key = name.replace("torch.", "")
    key = aliases.get(key, key)
    dt = getattr(torch, key, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layer buffer: ``shape[0]`` is token rows; ``dtype`` a torch dtype name."""

    shape: Tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch_dtype(self.dtype).itemsize

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token row."""
        return self.nbytes // self.shape[0]

    def problems(self, where: str) -> List[str]:
        errs = []
        if not self.shape or any((not isinstance(d, int)) or d < 1 for d in self.shape):
            errs.append(f"{where}: shape {self.shape} must be non-empty with positive int dims")
        try:
            torch_dtype(self.dtype)
        except ValueError:
            errs.append(f"{where}: unknown dtype {self.dtype!r}")
        return errs


@dataclass(frozen=True)
class LayerKVSpec:
    """Per-layer cache spec.

    layer: logical layer id (base layers first, MTP layers numbered after them).
    main: main-KV tensors of the layer buffer (e.g. latent ``[T, 512]`` + rope ``[T, 64]`` bf16).
    indexer: optional indexer-cache tensors (``()`` = no indexer), same token rows ``T``.
    mtp: the layer belongs to an MTP / draft module.
    """

    layer: int
    main: Tuple[TensorSpec, ...]
    indexer: Tuple[TensorSpec, ...] = ()
    mtp: bool = False

    @property
    def signature(self) -> Tuple[Tuple[TensorSpec, ...], Tuple[TensorSpec, ...]]:
        """Layers share a buffer only if their signatures are equal."""
        return (self.main, self.indexer)

    @property
    def tensors(self) -> Tuple[TensorSpec, ...]:
        """All tensors of the buffer: main parts then indexer parts."""
        return self.main + self.indexer

    @property
    def main_nbytes(self) -> int:
        return sum(t.nbytes for t in self.main)

    @property
    def token_rows(self) -> int:
        return self.main[0].shape[0]


@dataclass(frozen=True)
class PhysicalBuffer:
    """One physical device buffer and the logical layers that alias it (in order)."""

    index: int
    layers: Tuple[int, ...]
    spec: LayerKVSpec  # spec of its layers (all equal signatures); ``spec.layer`` = first layer
    independent: bool
    group: int  # spec group id (-1 for independent buffers)


@dataclass(frozen=True)
class BufferPlan:
    """Result of :func:`plan_buffers`.

    buffers: physical buffers, ``buffers[i].index == i``.
    layer_buffer: logical layer -> physical buffer index.
    predecessor: logical layer -> earlier layer of the same buffer whose consumers
        must finish before this layer overwrites it (``None`` = first user).
    order: logical layers in execution order (base ascending, then MTP).
    shared_buffers: B as configured (``None`` = one per reusable layer).
    """

    buffers: Tuple[PhysicalBuffer, ...]
    layer_buffer: Dict[int, int]
    predecessor: Dict[int, Optional[int]]
    order: Tuple[int, ...]
    specs: Dict[int, LayerKVSpec]
    shared_buffers: Optional[int]
    independent_layers: Tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.order)

    @property
    def num_physical(self) -> int:
        return len(self.buffers)

    def buffer_of(self, layer: int) -> int:
        return self.layer_buffer[layer]

    def layers_of(self, buffer: int) -> Tuple[int, ...]:
        return self.buffers[buffer].layers

    def wait_for(self, layer: int) -> Optional[int]:
        """Layer whose consumers must finish before ``layer`` may overwrite its buffer."""
        return self.predecessor[layer]

    @property
    def main_bytes_logical(self) -> int:
        """Main-KV bytes if every layer had its own buffer."""
        return sum(s.main_nbytes for s in self.specs.values())

    @property
    def main_bytes_physical(self) -> int:
        return sum(b.spec.main_nbytes for b in self.buffers)

    @property
    def footprint_ratio(self) -> float:
        """Physical / logical main-KV bytes (= physical buffers / N for uniform layouts)."""
        return self.main_bytes_physical / self.main_bytes_logical

    def summary(self) -> str:
        return (
            f"{self.num_layers} layers -> {self.num_physical} physical buffers "
            f"(B={self.shared_buffers}, independent={list(self.independent_layers)}), "
            f"main-KV footprint ratio {self.footprint_ratio:.3f}"
        )


def _validate(
    specs: Sequence[LayerKVSpec], shared_buffers: Optional[int], independent: Union[Sequence[int], str]
) -> List[str]:
    errs: List[str] = []
    if not specs:
        errs.append("no cache-bearing layers given")
    ids = [s.layer for s in specs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        errs.append(f"duplicate layer ids {dup}")
    if any((not isinstance(i, int)) or i < 0 for i in ids):
        errs.append("layer ids must be non-negative ints")
    base = [s.layer for s in specs if not s.mtp]
    mtp = [s.layer for s in specs if s.mtp]
    if base and mtp and min(mtp) <= max(base):
        errs.append(f"MTP layers {sorted(mtp)} must be numbered after the base layers (last base layer is {max(base)})")
    for s in specs:
        where = f"layer {s.layer}"
        if not s.main:
            errs.append(f"{where}: no main-KV tensors")
        for k, t in enumerate(s.main):
            errs += t.problems(f"{where} main[{k}]")
        for k, t in enumerate(s.indexer):
            errs += t.problems(f"{where} indexer[{k}]")
        rows = {t.shape[0] for t in s.tensors if t.shape}
        if len(rows) > 1:
            errs.append(f"{where}: main and indexer tensors disagree on token rows {sorted(rows)}")
    if shared_buffers is not None and (not isinstance(shared_buffers, int) or shared_buffers < 1):
        errs.append(f"shared_buffers={shared_buffers!r} must be a positive int (or None)")
    if independent != "all":
        known = set(ids)
        unknown = sorted(i for i in independent if i not in known)
        if unknown:
            errs.append(
                f"independent layers {unknown} are not cache-bearing layers "
                f"(known: {sorted(known)[:8]}{'...' if len(known) > 8 else ''})"
            )
        if len(set(independent)) != len(list(independent)):
            errs.append("independent_layers has duplicates")
    elif not isinstance(independent, str):
        errs.append("independent_layers must be a list of layer ids or 'all'")
    return errs


def plan_buffers(
    specs: Sequence[LayerKVSpec],
    shared_buffers: Optional[int] = None,
    independent_layers: Union[Sequence[int], str] = (0,),
) -> BufferPlan:
    """Plan physical buffers; raises :class:`LayoutError` with every reason if invalid."""
    if independent_layers != "all":
        independent_layers = list(independent_layers)
    errs = _validate(specs, shared_buffers, independent_layers)
    if errs:
        raise LayoutError(errs)
    by_id = {s.layer: s for s in specs}
    order = tuple(sorted(s.layer for s in specs if not s.mtp)) + tuple(sorted(s.layer for s in specs if s.mtp))
    indep = set(order) if independent_layers == "all" else set(independent_layers)

    buffers: List[PhysicalBuffer] = []
    for layer in order:
        if layer in indep:
            buffers.append(PhysicalBuffer(len(buffers), (layer,), by_id[layer], True, -1))

    groups: Dict[tuple, List[int]] = {}
    for layer in order:
        if layer not in indep:
            groups.setdefault(by_id[layer].signature, []).append(layer)
    for gid, reused in enumerate(groups.values()):
        nb = len(reused) if shared_buffers is None else min(shared_buffers, len(reused))
        for s in range(nb):
            members = tuple(reused[s::nb])
            buffers.append(PhysicalBuffer(len(buffers), members, by_id[members[0]], False, gid))

    layer_buffer: Dict[int, int] = {}
    predecessor: Dict[int, Optional[int]] = {}
    for buf in buffers:
        prev = None
        for layer in buf.layers:
            layer_buffer[layer] = buf.index
            predecessor[layer] = prev
            prev = layer
    return BufferPlan(tuple(buffers), layer_buffer, predecessor, order, by_id, shared_buffers, tuple(sorted(indep)))


def plan_from_config(cfg, specs: Sequence[LayerKVSpec]) -> BufferPlan:
    """Plan from a :class:`~sglang_ascend_offload.config.LayerwisePrefillOffloadConfig`."""
    return plan_buffers(specs, cfg.shared_buffers, cfg.independent_layers)


def uniform_specs(
    num_layers: int, main: Sequence[TensorSpec], indexer: Sequence[TensorSpec] = (), num_mtp_layers: int = 0
) -> List[LayerKVSpec]:
    """``num_layers`` base layers then ``num_mtp_layers`` MTP layers, all with one spec."""
    main_t, idx_t = tuple(main), tuple(indexer)
    return [LayerKVSpec(i, main_t, idx_t, mtp=i >= num_layers) for i in range(num_layers + num_mtp_layers)]
