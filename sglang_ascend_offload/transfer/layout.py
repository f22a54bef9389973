"""Describe KV tensors as a :class:`~.protocol.KVLayout` and compare two layouts.

A layout names, per tensor, the address of block 0 of every logical layer and the
bytes per block. It is built from the tensors a side already has (SGLang pool
buffers, layerwise slots, the decode host pool) without copying anything.

Nothing here imports torch: :func:`build_layout` only uses the tensor methods
``data_ptr / numel / element_size / shape / is_contiguous``, and
:func:`layout_from_regions` takes raw addresses (numpy buffers, registered host
memory, device pointers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from .engine import Region
from .protocol import KVLayout, TensorSpec


@dataclass(frozen=True)
class TensorLayers:
    """One KV tensor: per logical layer, a ``[num_blocks, ...]`` contiguous tensor.

    Layers aliasing one physical slot pass the same tensor. ``role`` is ``main``,
    ``indexer`` or ``indexer_scale``.
    """

    role: str
    name: str
    per_layer: Sequence[Any]  # torch.Tensor (or anything with the same methods)


@dataclass(frozen=True)
class RawTensor:
    """One KV tensor by address: ``layer_addrs[L]`` is block 0 of layer ``L``."""

    role: str
    name: str
    block_bytes: int
    num_blocks: int
    layer_addrs: Sequence[int]


def layout_from_regions(block_tokens: int, tensors: Sequence[RawTensor]) -> KVLayout:
    """:class:`KVLayout` of tensors given by address (validated)."""
    counts = {len(t.layer_addrs) for t in tensors}
    if len(counts) != 1:
        raise ValueError(f"tensors disagree on the layer count: {sorted(counts)}")
    specs = [TensorSpec(role=t.role, name=t.name, block_bytes=int(t.block_bytes),
                        num_blocks=int(t.num_blocks), layer_base_addrs=[int(a) for a in t.layer_addrs])
             for t in tensors]
    layout = KVLayout(num_layers=counts.pop(), block_tokens=block_tokens, tensors=specs)
    layout.validate()
    return layout


def build_layout(block_tokens: int, tensors: Sequence[TensorLayers]) -> KVLayout:
    """:class:`KVLayout` of ``tensors`` (validated). All must have the same layer count."""
    raw: List[RawTensor] = []
    num_layers = None
    for t in tensors:
        if num_layers is None:
            num_layers = len(t.per_layer)
        if len(t.per_layer) != num_layers:
            raise ValueError(f"tensor {t.name!r} has {len(t.per_layer)} layers, expected {num_layers}")
        shapes = {tuple(x.shape) for x in t.per_layer}
        if len(shapes) != 1:
            raise ValueError(f"tensor {t.name!r}: layers differ in shape {sorted(shapes)}")
        first = t.per_layer[0]
        if first.dim() < 1 or first.shape[0] < 1:
            raise ValueError(f"tensor {t.name!r}: expected [num_blocks, ...], got {tuple(first.shape)}")
        for x in t.per_layer:
            if not x.is_contiguous():
                raise ValueError(f"tensor {t.name!r}: layer buffers must be contiguous")
        block_bytes = first[0].numel() * first.element_size()
        raw.append(RawTensor(t.role, t.name, block_bytes, first.shape[0],
                             [x.data_ptr() for x in t.per_layer]))
    return layout_from_regions(block_tokens, raw)


def registration_regions(tensors: Sequence[TensorLayers]) -> List[Region]:
    """Distinct ``(address, bytes)`` regions to register with an engine (aliases once)."""
    seen = {}
    for t in tensors:
        for x in t.per_layer:
            seen.setdefault(x.data_ptr(), x.numel() * x.element_size())
    return sorted(seen.items())


def layout_mismatches(source: KVLayout, dest: KVLayout) -> List[str]:
    """Every reason why ``source`` blocks cannot be copied into ``dest`` blocks (empty = compatible).

    Checks layer count, tokens per block, main tensor count, names and block bytes,
    indexer presence and block bytes, scale presence and layout (block bytes).
    """
    out = []
    if source.num_layers != dest.num_layers:
        out.append(f"layers: prefill {source.num_layers}, decode {dest.num_layers}")
    if source.block_tokens != dest.block_tokens:
        out.append(f"tokens per block: prefill {source.block_tokens}, decode {dest.block_tokens}")
    sm, dm = source.main, dest.main
    if len(sm) != len(dm):
        out.append(f"main tensor count: prefill {len(sm)}, decode {len(dm)}")
    for s, d in zip(sm, dm):
        if s.name != d.name:
            out.append(f"main tensor order: prefill {s.name!r}, decode {d.name!r}")
        if s.block_bytes != d.block_bytes:
            out.append(f"main tensor {s.name!r} block bytes: prefill {s.block_bytes}, decode {d.block_bytes}")
    for role, label in (("indexer", "indexer"), ("indexer_scale", "LIC8 scale")):
        s = getattr(source, role)
        d = getattr(dest, role)
        if (s is None) != (d is None):
            out.append(f"{label} presence: prefill {'yes' if s else 'no'}, decode {'yes' if d else 'no'}")
        elif s is not None and s.block_bytes != d.block_bytes:
            out.append(f"{label} block bytes: prefill {s.block_bytes}, decode {d.block_bytes}")
    return out


def coalesce(dst: Sequence[int], src: Sequence[int], length: int) -> Tuple[List[int], List[int], List[int]]:
    """Merge equal-length copies whose source and destination are both contiguous.

    Returns ``(dst_addrs, src_addrs, lengths)`` with the same bytes moved.
    """
    out_d: List[int] = []
    out_s: List[int] = []
    out_n: List[int] = []
    for d, s in zip(dst, src):
        if out_n and out_d[-1] + out_n[-1] == d and out_s[-1] + out_n[-1] == s:
            out_n[-1] += length
        else:
            out_d.append(d)
            out_s.append(s)
            out_n.append(length)
    return out_d, out_s, out_n
