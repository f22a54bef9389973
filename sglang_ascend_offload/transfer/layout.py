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
from typing import Any, List, Optional, Sequence, Tuple

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
    #: the logical layers ``per_layer`` holds (ascending); ``None``: every layer, in order
    layers: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class RawTensor:
    """One KV tensor by address: ``layer_addrs[i]`` is block 0 of logical layer
    ``layers[i]`` (of layer ``i`` when ``layers`` is ``None``)."""

    role: str
    name: str
    block_bytes: int
    num_blocks: int
    layer_addrs: Sequence[int]
    layers: Optional[Sequence[int]] = None


def layout_from_regions(block_tokens: int, tensors: Sequence[RawTensor]) -> KVLayout:
    """:class:`KVLayout` of tensors given by address (validated).

    Tensors holding every layer must agree on the layer count; a main tensor with
    ``layers`` holds those layers only (the layout's layers are then those the
    whole-layer tensors hold, or ``max(layers) + 1`` when every tensor names its layers).
    """
    counts = {len(t.layer_addrs) for t in tensors if t.layers is None}
    if len(counts) > 1:
        raise ValueError(f"tensors disagree on the layer count: {sorted(counts)}")
    num_layers = counts.pop() if counts else max(max(t.layers) for t in tensors) + 1
    specs = [
        TensorSpec(
            role=t.role,
            name=t.name,
            block_bytes=int(t.block_bytes),
            num_blocks=int(t.num_blocks),
            layer_base_addrs=[int(a) for a in t.layer_addrs],
            layers=None if t.layers is None else [int(x) for x in t.layers],
        )
        for t in tensors
    ]
    layout = KVLayout(num_layers=num_layers, block_tokens=block_tokens, tensors=specs)
    layout.validate()
    return layout


def build_layout(block_tokens: int, tensors: Sequence[TensorLayers]) -> KVLayout:
    """:class:`KVLayout` of ``tensors`` (validated). Tensors without ``layers`` must have
    the same layer count; a tensor with ``layers`` has one buffer per named layer."""
    raw: List[RawTensor] = []
    num_layers = None
    for t in tensors:
        expected = len(t.layers) if t.layers is not None else num_layers
        if t.layers is None and num_layers is None:
            num_layers = expected = len(t.per_layer)
        if len(t.per_layer) != expected:
            raise ValueError(f"tensor {t.name!r} has {len(t.per_layer)} layers, expected {expected}")
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
        raw.append(
            RawTensor(t.role, t.name, block_bytes, first.shape[0], [x.data_ptr() for x in t.per_layer], t.layers)
        )
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
        out.append(
            f"layers: prefill {source.num_layers}, decode {dest.num_layers} (both servers need the "
            "same model and the same speculative draft layers)"
        )
    if source.block_tokens != dest.block_tokens:
        out.append(f"tokens per block: prefill {source.block_tokens}, decode {dest.block_tokens}")
    common = min(source.num_layers, dest.num_layers)  # main tensors compared on the layers both have
    for layers, dm in dest.main_groups():
        layers = [x for x in layers if x < common]
        if layers:
            sm = source.main_at(layers[0])
            where = "" if len(layers) == common else f"layers {_span(layers)}: "
            if any(source.main_at(x) != sm for x in layers):
                out.append(
                    f"{where}prefill's main tensors differ within decode's group "
                    f"(prefill {[t.name for t in sm]} at layer {layers[0]})"
                )
            if len(sm) != len(dm):
                out.append(f"{where}main tensor count: prefill {len(sm)}, decode {len(dm)}")
            for s, d in zip(sm, dm):
                if s.name != d.name:
                    out.append(f"{where}main tensor order: prefill {s.name!r}, decode {d.name!r}")
                if s.block_bytes != d.block_bytes:
                    out.append(
                        f"{where}main tensor {s.name!r} block bytes: prefill {s.block_bytes}, decode {d.block_bytes}"
                    )
    for role, label in (("indexer", "indexer"), ("indexer_scale", "LIC8 scale")):
        s = getattr(source, role)
        d = getattr(dest, role)
        if (s is None) != (d is None):
            out.append(f"{label} presence: prefill {'yes' if s else 'no'}, decode {'yes' if d else 'no'}")
        elif s is not None and s.block_bytes != d.block_bytes:
            out.append(f"{label} block bytes: prefill {s.block_bytes}, decode {d.block_bytes}")
    return out


def _span(layers: Sequence[int]) -> str:
    """``"0-60"`` for a contiguous run, else the ids (at most 8)."""
    if list(layers) == list(range(layers[0], layers[-1] + 1)) and len(layers) > 1:
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(str(x) for x in layers[:8]) + ("..." if len(layers) > 8 else "")


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
