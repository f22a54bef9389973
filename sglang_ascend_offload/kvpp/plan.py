"""Per-rank physical memory plan of KVPP.

A layer's *bundle* is every cache component of that layer (main KV, indexer,
scales) laid out contiguously, each component holding all logical blocks::

    bundle(layer) = [component_0: bytes_per_block_0 * num_blocks][component_1: ...]...

Per rank::

    physical bytes per block = sum(owned target bundles per block)
                             + local draft (MTP) bundles per block
                             + 2 * largest target bundle per block
    available blocks         = floor(available bytes / physical bytes per block)

The two scratch buffers (current layer, next layer's prefetch) are each sized to
the largest target bundle and aligned to ``alignment`` bytes (2 MiB by default);
target layer ``i`` (execution ordinal) uses scratch ``i % 2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

from .ownership import LayerOwnership

SCRATCH_BUFFER_COUNT = 2


@dataclass(frozen=True)
class ComponentSpec:
    """One cache component of a layer: ``name`` and its bytes per logical block."""

    name: str
    bytes_per_block: int


@dataclass(frozen=True)
class ComponentRange:
    """Where a component lives inside its buffer: byte ``offset`` and ``size``."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's bundle lives on this rank during a forward.

    kind: ``persistent`` (owned or draft layer) or ``scratch``.
    buffer: index of the persistent buffer (a layer id) or of the scratch buffer (0/1).
    components: byte ranges inside that buffer.
    """

    layer: int
    kind: str
    buffer: int
    owner: int
    components: Tuple[ComponentRange, ...]


def bundle_bytes_per_block(components: Tuple[ComponentSpec, ...]) -> int:
    return sum(c.bytes_per_block for c in components)


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class KVPPPlan:
    """The physical plan of one rank; build with :func:`plan_rank`."""

    rank: int
    ownership: LayerOwnership
    bundles: Mapping[int, Tuple[ComponentSpec, ...]]
    alignment: int

    @property
    def persistent_bytes_per_block(self) -> int:
        own = self.ownership.owned_by(self.rank)
        return sum(bundle_bytes_per_block(self.bundles[layer]) for layer in own + self.ownership.draft_layers)

    @property
    def scratch_bytes_per_block(self) -> int:
        """Largest target bundle per block (one scratch buffer)."""
        targets = self.ownership.target_layers
        return max((bundle_bytes_per_block(self.bundles[layer]) for layer in targets), default=0)

    @property
    def physical_bytes_per_block(self) -> int:
        return self.persistent_bytes_per_block + SCRATCH_BUFFER_COUNT * self.scratch_bytes_per_block

    def num_blocks(self, available_bytes: int) -> int:
        """Blocks this rank can hold: ``available_bytes // physical_bytes_per_block``, before
        alignment padding."""
        per_block = self.physical_bytes_per_block
        return available_bytes // per_block if per_block else 0

    def scratch_buffer_bytes(self, num_blocks: int) -> int:
        return _align(self.scratch_bytes_per_block * num_blocks, self.alignment)

    def placement(self, layer: int, num_blocks: int) -> LayerPlacement:
        owner = self.ownership.owner_of.get(layer)
        ranges, cursor = [], 0
        for comp in self.bundles[layer]:
            size = comp.bytes_per_block * num_blocks
            ranges.append(ComponentRange(comp.name, cursor, size))
            cursor += size
        if owner is None or owner == self.rank:
            return LayerPlacement(layer, "persistent", layer, self.rank if owner is None else owner, tuple(ranges))
        scratch = self.ownership.execution_ordinal(layer) % SCRATCH_BUFFER_COUNT
        return LayerPlacement(layer, "scratch", scratch, owner, tuple(ranges))


def plan_rank(
    rank: int,
    ownership: LayerOwnership,
    bundles: Mapping[int, Tuple[ComponentSpec, ...]],
    alignment: int = 2 * 1024 * 1024,
) -> KVPPPlan:
    """Check that every layer has a bundle and build ``rank``'s plan."""
    problems = []
    if not 0 <= rank < ownership.group_size:
        problems.append(f"rank {rank} outside the group of {ownership.group_size}")
    missing = [layer for layer in ownership.target_layers + ownership.draft_layers if layer not in bundles]
    if missing:
        problems.append(f"no cache components given for layers {missing}")
    for layer, comps in bundles.items():
        if not comps or any(c.bytes_per_block <= 0 for c in comps):
            problems.append(f"layer {layer}: every component needs bytes_per_block > 0")
    if alignment <= 0 or alignment & (alignment - 1):
        problems.append(f"alignment {alignment} is not a power of two")
    if problems:
        raise ValueError("invalid KVPP plan: " + "; ".join(problems))
    return KVPPPlan(rank=rank, ownership=ownership, bundles=dict(bundles), alignment=alignment)


def mla_bundle(
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    index_head_dim: int = 128,
    block_size: int = 128,
    kv_bytes: int = 2,
    index_bytes: int = 2,
    index_scale_bytes: int = 0,
) -> Tuple[ComponentSpec, ...]:
    """Components of one DSA/MLA layer per block: latent, rope, indexer K (+ scales)."""
    comps = [
        ComponentSpec("kv_latent", kv_lora_rank * kv_bytes * block_size),
        ComponentSpec("kv_rope", rope_dim * kv_bytes * block_size),
    ]
    if index_head_dim:
        comps.append(ComponentSpec("index_k", index_head_dim * index_bytes * block_size))
    if index_scale_bytes:
        comps.append(ComponentSpec("index_k_scale", index_scale_bytes * block_size))
    return tuple(comps)


def bundles_for(layers, components: Tuple[ComponentSpec, ...]) -> Dict[int, Tuple[ComponentSpec, ...]]:
    return {layer: components for layer in layers}
