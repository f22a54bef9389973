"""P/D layouts of the plugin's KV pools, and the prefill-side packing staging.

A layout names, per tensor and per logical layer, the address of block 0 and the
bytes of one block (:class:`~sglang_ascend_offload.transfer.protocol.KVLayout`). One
block is one SGLang page (``page_size`` tokens) everywhere, so SGLang's page ids are
the block ids on both sides.

==============  =====================================================================
layout kind     main KV tensors (role ``main``)                 indexer (role ``indexer``)
==============  =====================================================================
``split``       ``latent`` ``k_buffer[L]`` [pages+1, P, 1, 512]  ``index_k_buffer[slot(L)]``
                ``rope``   ``v_buffer[L]`` [pages+1, P, 1, 64]   [pages+1, P, 1, 128]
``host_rows``   ``latent_rope``: decode: the host pool's page    same (device, decode);
                blocks [blocks, P, 576] (the plugin's           prefill: its own pool
                ``HostMainKVPool.host_page_blocks``); prefill: a
                :class:`PackedStaging` slot [max_blocks, P, 576]
==============  =====================================================================

With speculative decoding (NextN / MTP) a server has a second pool, the draft model's
(a device ``DeviceDSAPool`` on both sides, also under sparse decode offload). Its
layers are numbered after the base layers (logical layers ``L .. L + D - 1``) and are
moved by the same request, layer by layer: ``latent`` / ``rope`` device pages on both
sides and its indexer with the base layers'. In a ``split`` layout the draft layers
simply extend the base tensors; in a ``host_rows`` layout ``latent_rope`` holds the
base layers only and ``latent`` / ``rope`` the draft layers
(:attr:`~.protocol.TensorSpec.layers`), so the layout itself says where the draft
layer lands.

``split`` is SGLang's NPU MLA pool (the plugin's ``DeviceDSAPool``) on both sides:
decode pulls straight from prefill's pool pages into its pool pages. ``host_rows``
serves a decode with sparse decode offload: its main KV lives in host memory as one
576-wide row per token (latent | rope), which prefill's split pages cannot be copied
into as contiguous blocks. Prefill therefore packs each layer's pages of the request
into a staging slot (``[latent | rope]`` per token, a device gather) and decode pulls
the packed pages straight into its host pool; the staging slot is a physical slot in
the protocol's sense: layer ``L`` uses slot ``L % slots`` and is rewritten only after
decode answered for its previous content (the slot gates).

A ``host_rows`` decode whose index-K cache is int8 (LIM-C8: ``indexer_dtype`` ``int8`` in
its advert, Hadamard-rotated int8 keys + one fp16 scale per token) gets the indexer
packed too: :class:`PackedStaging` with ``indexer_dtype="int8"`` holds per slot int8
keys ``[max_blocks, P, 1, D]`` and fp16 scales ``[max_blocks, P, 1]``
(``ops.hadamard.rotate_and_quantize`` of prefill's bf16 pages, bit-identical to what the
decode's own indexer would store), sent as the ``indexer`` and ``indexer_scale`` tensors
from the staging blocks ``0 .. n-1`` (:meth:`PackedStaging.indexer_blocks`).

Pools are duck-typed (no SGLang import here): :func:`check_pool` requires the
attributes of the plugin's DSA pools (:data:`POOL_ATTRIBUTES`); the plugin's KV
manager checks the pool's class before it builds a publisher or sink.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from .. import platform
from .engine import Region
from .layout import TensorLayers, build_layout
from .protocol import KVLayout

MAIN_SPLIT = ("latent", "rope")
MAIN_ROWS = "latent_rope"
INDEXER = "index_k"
INDEXER_SCALE = "index_k_scale"


#: What every pool the backend moves has (the plugin's ``DeviceDSAPool`` and its subclasses).
POOL_ATTRIBUTES = ("k_buffer", "v_buffer", "page_size", "layer_num", "start_layer")


class LayoutError(ValueError):
    """A pool the P/D backend cannot describe (the message says what to change)."""


def _layer_ids(pool: Any) -> List[int]:
    return list(range(pool.start_layer, pool.start_layer + pool.layer_num))


def _is_host_rows_pool(pool: Any) -> bool:
    return callable(getattr(pool, "host_page_blocks", None)) and getattr(pool, "host_pool", None) is not None


def layout_kind(pool: Any) -> str:
    """``host_rows`` for the sparse-decode-offload pool, ``split`` for the device pool."""
    return "host_rows" if _is_host_rows_pool(pool) else "split"


def main_kv_placement(pool: Any) -> str:
    """Where a decode pool holds the main KV (:data:`~.topology.MainKVPlacement`).

    ``tp_shared``: the sparse-decode host pool mapped from one memory by every TP rank of
    the attention-DP group (the plugin's ``HostMainKVPool`` has an ``append_order``
    exactly when its pool is the group's: ``mem_cache.pool_host.shared.RankPool``) as a tensor this
    rank's engine can write into; ``per_rank`` otherwise (the device pool; a private host
    pool). A group pool without a tensor view (NPU's MemFabric group pool) has no
    destination at all: :func:`host_rows_tensors` fails on it.
    """
    from ..sparse_decode.host_rows import is_tensor_backed

    if (
        _is_host_rows_pool(pool)
        and getattr(pool, "append_order", None) is not None
        and is_tensor_backed(pool.host_pool)
    ):
        return "tp_shared"
    return "per_rank"


def is_layerwise_pool(pool: Any) -> bool:
    """``pool`` is the layerwise prefill offload pool (layers alias shared buffers)."""
    return type(pool).__name__ == "LayerwisePrefillPool"


def check_pool(pool: Any, *, allow_layerwise: bool = False) -> None:
    """Raise :class:`LayoutError` unless ``pool`` is one the backend can move.

    ``allow_layerwise``: the caller publishes from the layerwise pool's layer listener
    (:mod:`.layerwise_publisher`), so its aliased layer buffers are valid sources."""
    missing = [name for name in POOL_ATTRIBUTES if not hasattr(pool, name)]
    if missing:
        raise LayoutError(
            f"P/D transfer backend ascend_offload moves the ascend_offload attention backend's "
            f"DSA pools; got {type(pool).__name__} without {', '.join(missing)} (serve a "
            "DeepSeek-V3.2-style model with --attention-backend ascend_offload)"
        )
    if is_layerwise_pool(pool) and not allow_layerwise:
        raise LayoutError(
            "the layerwise prefill offload pool is served only by transfer/layerwise_publisher.py "
            "on a prefill server (its pipelined layers are not in device memory after the "
            "forward; they are published during it)"
        )
    if getattr(pool, "index_head_dim", None) is None:
        raise LayoutError("P/D transfer backend ascend_offload needs a DSA model (an indexer cache)")
    if getattr(pool, "dsa_kv_cache_store_fp8", False):
        raise LayoutError(
            "packed fp8 DSA KV storage is not supported by the P/D backend: use --kv-cache-dtype bfloat16"
        )
    if getattr(pool, "use_fia_nz", False):
        raise LayoutError("the FIA NZ KV layout is not supported by the P/D backend: unset SGLANG_USE_FIA_NZ")
    missing = [lid for lid in _layer_ids(pool) if lid not in pool.indexer_layer_id_to_slot]
    if missing:
        raise LayoutError(
            f"layers {missing} have no indexer cache (shared top-k layers): not supported by the P/D backend yet"
        )


def check_draft_pool(pool: Any, draft_pool: Any) -> None:
    """Raise :class:`LayoutError` unless ``draft_pool`` (the draft model's pool) can be
    moved next to ``pool``: a device DSA pool with an indexer on every layer, in the
    same page space (same page size and page count: SGLang gives the draft model the
    target's page ids)."""
    check_pool(draft_pool)
    if _is_host_rows_pool(draft_pool) or is_layerwise_pool(draft_pool):
        raise LayoutError(f"the draft (NextN) KV pool is a {type(draft_pool).__name__}, not a device pool")
    problems = []
    if draft_pool.page_size != pool.page_size:
        problems.append(f"page size: draft {draft_pool.page_size}, target {pool.page_size}")
    if getattr(draft_pool, "index_head_dim", None) != getattr(pool, "index_head_dim", None):
        problems.append("the draft and target indexers differ in head dim")
    target_pages = pool.index_k_buffer[0].shape[0]
    draft_pages = draft_pool.index_k_buffer[0].shape[0]
    if draft_pages != target_pages:
        problems.append(f"pages: draft {draft_pages}, target {target_pages}")
    if not _is_host_rows_pool(pool) and tuple(draft_pool.k_buffer[0].shape) != tuple(pool.k_buffer[0].shape):
        problems.append(
            f"main KV pages: draft {tuple(draft_pool.k_buffer[0].shape)}, target {tuple(pool.k_buffer[0].shape)}"
        )
    if problems:
        raise LayoutError("the draft (NextN) KV pool cannot be moved with the target's: " + "; ".join(problems))


def _indexer_tensors(pool: Any, draft_pool: Any = None) -> List[TensorLayers]:
    pools = [pool] if draft_pool is None else [pool, draft_pool]
    keys = [p.index_k_buffer[p._get_indexer_slot(i)] for p in pools for i in _layer_ids(p)]
    out = [TensorLayers("indexer", INDEXER, keys)]
    if getattr(pool, "index_k_scale_buffer", None) is not None:
        if draft_pool is not None and getattr(draft_pool, "index_k_scale_buffer", None) is None:
            raise LayoutError("the target's indexer has LIC8 scales but the draft's has none")
        out.append(
            TensorLayers(
                "indexer_scale",
                INDEXER_SCALE,
                [p.index_k_scale_buffer[p._get_indexer_slot(i)] for p in pools for i in _layer_ids(p)],
            )
        )
    return out


def _draft_split(pool: Any, draft_pool: Any) -> List[TensorLayers]:
    """The draft layers' device main KV, as logical layers after ``pool``'s."""
    layers = list(range(pool.layer_num, pool.layer_num + draft_pool.layer_num))
    return [
        TensorLayers("main", MAIN_SPLIT[0], [draft_pool.k_buffer[i] for i in range(draft_pool.layer_num)], layers),
        TensorLayers("main", MAIN_SPLIT[1], [draft_pool.v_buffer[i] for i in range(draft_pool.layer_num)], layers),
    ]


def split_tensors(pool: Any, draft_pool: Any = None, *, allow_layerwise: bool = False) -> List[TensorLayers]:
    """Main KV (latent, rope page blocks) and indexer of a device pool (of the layerwise
    pool: each layer's aliased physical buffer, with ``allow_layerwise``), followed by the
    draft pool's layers when there is one."""
    check_pool(pool, allow_layerwise=allow_layerwise)
    if _is_host_rows_pool(pool):
        raise LayoutError("the sparse-decode-offload pool has no device main KV: use host_rows_tensors")
    if draft_pool is not None:
        check_draft_pool(pool, draft_pool)
    pools = [pool] if draft_pool is None else [pool, draft_pool]
    return [
        TensorLayers("main", MAIN_SPLIT[0], [p.k_buffer[i] for p in pools for i in range(p.layer_num)]),
        TensorLayers("main", MAIN_SPLIT[1], [p.v_buffer[i] for p in pools for i in range(p.layer_num)]),
        *_indexer_tensors(pool, draft_pool),
    ]


def host_rows_tensors(pool: Any, draft_pool: Any = None) -> List[TensorLayers]:
    """Main KV as host-pool page blocks (``latent_rope``) and the device indexer; the draft
    pool's layers (when there is one) as device ``latent`` / ``rope`` pages."""
    check_pool(pool)
    if not _is_host_rows_pool(pool):
        raise LayoutError("host_rows destinations need the sparse-decode-offload pool (--enable-sparse-decode-offload)")
    rows = [pool.host_page_blocks(i) for i in _layer_ids(pool)]
    if draft_pool is None:
        return [TensorLayers("main", MAIN_ROWS, rows), *_indexer_tensors(pool)]
    check_draft_pool(pool, draft_pool)
    return [
        TensorLayers("main", MAIN_ROWS, rows, list(range(pool.layer_num))),
        *_draft_split(pool, draft_pool),
        *_indexer_tensors(pool, draft_pool),
    ]


def destination_tensors(pool: Any, draft_pool: Any = None) -> List[TensorLayers]:
    """Decode: where a pulled page lands (kind from :func:`layout_kind`)."""
    if _is_host_rows_pool(pool):
        return host_rows_tensors(pool, draft_pool)
    return split_tensors(pool, draft_pool)


def layout_of(pool: Any, tensors: Sequence[TensorLayers]) -> KVLayout:
    return build_layout(pool.page_size, tensors)


def whole_regions(tensors: Sequence[Any]) -> List[Region]:
    """Distinct ``(address, bytes)`` storage regions holding ``tensors`` (registered once each).

    Per-layer views of one big tensor share its storage: the whole storage is one
    region (engines refuse overlapping registrations).
    """
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
    return sorted(seen.items())


def tensors_regions(tensor_layers: Sequence[TensorLayers]) -> List[Region]:
    return whole_regions([x for t in tensor_layers for x in t.per_layer])


class PackedStaging:
    """Prefill staging for ``host_rows`` peers: ``slots`` buffers ``[max_blocks, P, latent + rope]``.

    Layer ``L`` is packed into slot ``L % slots``; :meth:`tensors` is the source side
    of the ``host_rows`` layout (main from the staging, indexer from the pool).
    """

    def __init__(
        self,
        pool: Any,
        *,
        slots: int = 2,
        max_blocks: Optional[int] = None,
        allow_layerwise: bool = False,
        draft_pool: Any = None,
        indexer_dtype: str = "bf16",
    ):
        check_pool(pool, allow_layerwise=allow_layerwise)
        if _is_host_rows_pool(pool):
            raise LayoutError("a prefill server cannot run sparse decode offload")
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if indexer_dtype not in ("bf16", "int8"):
            raise LayoutError(f"decode indexer dtype {indexer_dtype!r}: expected bf16 or int8")
        if draft_pool is not None:
            check_draft_pool(pool, draft_pool)
            if indexer_dtype == "int8":
                raise LayoutError(
                    "a decode with an int8 (LIM-C8) index-K cache and a speculative draft layer: the "
                    "draft's bf16 indexer cannot share the target's int8 indexer tensor; serve "
                    'indexer_dtype "bf16" on that decode'
                )
        self.pool = pool
        self.draft_pool = draft_pool
        self.slots = slots
        pages = pool.k_buffer[0].shape[0]
        self.max_blocks = min(pages, max_blocks) if max_blocks else pages
        self.latent_dim = pool.k_buffer[0].shape[-1]
        self.rope_dim = pool.v_buffer[0].shape[-1]
        self.buffer = torch.zeros(
            (slots, self.max_blocks, pool.page_size, self.latent_dim + self.rope_dim),
            dtype=pool.k_buffer[0].dtype,
            device=pool.k_buffer[0].device,
        )
        self.index_values: Optional[torch.Tensor] = None  # int8 [slots, max_blocks, P, 1, D] (int8 peers)
        self.index_scales: Optional[torch.Tensor] = None  # fp16 [slots, max_blocks, P, 1]
        if indexer_dtype == "int8":
            if getattr(pool, "index_k_scale_buffer", None) is not None:
                raise LayoutError("the prefill pool already holds indexer scales; int8 packing quantises bf16 keys")
            dim = pool.index_k_buffer[0].shape[-1]
            device = pool.index_k_buffer[0].device
            self.index_values = torch.zeros(
                (slots, self.max_blocks, pool.page_size, 1, dim), dtype=torch.int8, device=device
            )
            self.index_scales = torch.zeros(
                (slots, self.max_blocks, pool.page_size, 1), dtype=torch.float16, device=device
            )

    @property
    def packs_indexer(self) -> bool:
        """The indexer is packed (int8 + scales) into the staging, not read from the pool."""
        return self.index_values is not None

    def buffers(self) -> List[torch.Tensor]:
        """Every staging tensor (to register with the transfer engine)."""
        extra = [self.index_values, self.index_scales] if self.packs_indexer else []
        return [self.buffer, *extra]

    def indexer_blocks(self, pages: Sequence[int]) -> List[int]:
        """Source block ids of a request's indexer: staging blocks ``0 .. n-1`` when the
        indexer is packed, else the pool's own pages."""
        return list(range(len(pages))) if self.packs_indexer else [int(p) for p in pages]

    def slot_of(self, layer_index: int) -> int:
        return layer_index % self.slots

    def tensors(self) -> List[TensorLayers]:
        """Source side of a ``host_rows`` layout: base layers from the staging slots; the
        draft pool's layers (not packed: their destination is device pages) straight
        from the draft pool."""
        staged = [self.buffer[self.slot_of(i)] for i in range(self.pool.layer_num)]
        if self.packs_indexer:  # int8 peer (no draft pool: refused at construction)
            layers = range(self.pool.layer_num)
            return [
                TensorLayers("main", MAIN_ROWS, staged),
                TensorLayers("indexer", INDEXER, [self.index_values[self.slot_of(i)] for i in layers]),
                TensorLayers("indexer_scale", INDEXER_SCALE, [self.index_scales[self.slot_of(i)] for i in layers]),
            ]
        if self.draft_pool is None:
            return [TensorLayers("main", MAIN_ROWS, staged), *_indexer_tensors(self.pool)]
        return [
            TensorLayers("main", MAIN_ROWS, staged, list(range(self.pool.layer_num))),
            *_draft_split(self.pool, self.draft_pool),
            *_indexer_tensors(self.pool, self.draft_pool),
        ]

    def pack(self, layer_index: int, pages: Sequence[int], main: bool = True) -> int:
        """Copy ``pages`` of layer ``layer_index`` as ``[latent | rope]`` rows into its slot
        (``main``), and, for an int8 peer, its index K rotated and quantised into the
        slot's int8 keys and fp16 scales.

        Block ``j`` of the slot is ``pages[j]``; returns the slot. Completes before it
        returns (an event on the current stream on an accelerator), so a peer may read.
        """
        n = len(pages)
        if n > self.max_blocks:
            raise LayoutError(f"request of {n} pages exceeds the P/D staging of {self.max_blocks} pages")
        slot = self.slot_of(layer_index)
        index = torch.as_tensor(list(pages), dtype=torch.long, device=self.buffer.device)
        if main:
            dst = self.buffer[slot, :n]
            latent = self.pool.k_buffer[layer_index].index_select(0, index)
            rope = self.pool.v_buffer[layer_index].index_select(0, index)
            dst[..., : self.latent_dim].copy_(latent.reshape(n, self.pool.page_size, self.latent_dim))
            dst[..., self.latent_dim :].copy_(rope.reshape(n, self.pool.page_size, self.rope_dim))
        if self.packs_indexer:
            self._pack_indexer(layer_index, slot, index)
        event = platform.new_event()
        event.record()
        event.synchronize()
        return slot

    def _pack_indexer(self, layer_index: int, slot: int, index: torch.Tensor) -> None:
        """Pages ``index`` of the layer's bf16 index K ``[n, P, 1, D]`` -> int8 keys and
        fp16 scales of the slot's blocks ``0 .. n-1`` (``rotate_and_quantize`` per token)."""
        from ..ops.hadamard import rotate_and_quantize

        keys = self.pool.index_k_buffer[self.pool._get_indexer_slot(self.pool.start_layer + layer_index)]
        values, scales = rotate_and_quantize(keys.index_select(0, index.to(keys.device)))
        n = index.numel()
        self.index_values[slot, :n].copy_(values)
        self.index_scales[slot, :n].copy_(scales)
