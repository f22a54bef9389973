"""Which rank of a KVPP group persistently owns which layer.

Layers are sorted and cut into contiguous, balanced ranges: with ``n`` layers over
``g`` ranks, ``base, extra = divmod(n, g)`` and the first ``extra`` ranks take one
layer more. Example: 8 layers over 3 ranks -> owners ``[0, 0, 0, 1, 1, 1, 2, 2]``.

A layer's whole bundle (main KV, indexer, scales) has exactly one owner. Draft
(MTP) layers are not partitioned: every rank that needs them keeps its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Sequence, Tuple


@dataclass(frozen=True)
class LayerOwnership:
    """Owner rank of every target layer of one KVPP group.

    group_size: ranks in the group (tp * pcp).
    owner_of: target layer id -> owning rank in ``0..group_size-1``.
    draft_layers: layers replicated on every rank (never broadcast).
    """

    group_size: int
    owner_of: Dict[int, int]
    draft_layers: Tuple[int, ...] = ()

    @property
    def target_layers(self) -> Tuple[int, ...]:
        return tuple(sorted(self.owner_of))

    def owned_by(self, rank: int) -> Tuple[int, ...]:
        return tuple(layer for layer in self.target_layers if self.owner_of[layer] == rank)

    def execution_ordinal(self, layer: int) -> int:
        """Position of ``layer`` among target layers (selects its scratch buffer)."""
        return self.target_layers.index(layer)


def assign_owners(layers: Iterable[int], group_size: int, draft_layers: Sequence[int] = ()) -> LayerOwnership:
    """Contiguous balanced partition of ``layers`` (minus drafts) over ``group_size`` ranks."""
    if group_size < 1:
        raise ValueError(f"KVPP group size must be >= 1, got {group_size}")
    drafts = tuple(sorted(set(draft_layers)))
    targets = sorted(set(layers) - set(drafts))
    if len(targets) != len(list(targets)):
        raise ValueError("duplicate layer ids")
    base, extra = divmod(len(targets), group_size)
    owner_of: Dict[int, int] = {}
    cursor = 0
    for rank in range(group_size):
        size = base + (1 if rank < extra else 0)
        for layer in targets[cursor : cursor + size]:
            owner_of[layer] = rank
        cursor += size
    return LayerOwnership(group_size=group_size, owner_of=owner_of, draft_layers=drafts)
