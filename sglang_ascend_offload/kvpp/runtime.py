"""KVPP runtime: storage, full-layer broadcast, and one-layer-ahead prefetch (docs/kvpp.md).

* :class:`KVPPStorage` allocates this rank's persistent bundles (owned target
  layers + draft layers) and the two scratch buffers, as flat ``uint8`` tensors;
  ``bundle(layer)`` is where that layer's KV lives during the current forward.
* :class:`BroadcastTransport` broadcasts a whole bundle from its owner to the group
  on a transfer stream, after the compute stream's ``cache_ready`` event, and
  returns only when the device copy is complete (so attention never overwrites a
  persistent cache the broadcast is still reading).
  With *active blocks* set for the forward (:meth:`BroadcastTransport.set_active_blocks`,
  int64 block ids), only those blocks of every component are gathered into one
  contiguous staging buffer on the owner, broadcast, and scattered into the same
  blocks on the receivers; ``None`` broadcasts the whole bundle (every allocated
  block: the ``full`` broadcast mode). Every rank knows the active set (same batch), so no
  metadata travels.
* :class:`KVPPScheduler` drives it per forward: with history, prefetch the first
  target layer at once; ``wait_for_layer(i)`` blocks until layer ``i`` arrived and
  immediately starts layer ``i + 1``'s prefetch, so broadcast overlaps compute.
  Forwards without history (first prefill, warm-up) broadcast nothing.

Every rank of the group must run the same forwards in the same order: broadcasts
are collectives, issued from one worker thread per rank on a dedicated group.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Dict, List, Optional, Sequence

import torch

from .. import platform
from .plan import SCRATCH_BUFFER_COUNT, KVPPPlan, bundle_bytes_per_block


class KVPPStorage:
    """Persistent bundles + 2 scratch buffers of one rank, for ``num_blocks`` blocks."""

    def __init__(self, plan: KVPPPlan, num_blocks: int, device: Optional[torch.device] = None):
        self.plan = plan
        self.num_blocks = num_blocks
        device = device or torch.device("cpu")
        self.device = device
        own = plan.ownership.owned_by(plan.rank) + plan.ownership.draft_layers
        self.persistent: Dict[int, torch.Tensor] = {
            layer: torch.zeros(
                bundle_bytes_per_block(plan.bundles[layer]) * num_blocks, dtype=torch.uint8, device=device
            )
            for layer in own
        }
        scratch_bytes = plan.scratch_buffer_bytes(num_blocks)
        self.scratch: List[torch.Tensor] = [
            torch.zeros(scratch_bytes, dtype=torch.uint8, device=device) for _ in range(SCRATCH_BUFFER_COUNT)
        ]

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() for t in self.persistent.values()) + sum(t.numel() for t in self.scratch)

    def bundle(self, layer: int) -> torch.Tensor:
        """Flat uint8 view of ``layer``'s bundle: persistent storage or its scratch buffer."""
        place = self.plan.placement(layer, self.num_blocks)
        size = sum(c.size for c in place.components)
        if place.kind == "persistent":
            return self.persistent[layer]
        return self.scratch[place.buffer][:size]

    def component(self, layer: int, name: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """Typed view of one component (e.g. ``kv_latent`` as bf16 ``[blocks, block, 512]``)."""
        place = self.plan.placement(layer, self.num_blocks)
        rng = next((c for c in place.components if c.name == name), None)
        if rng is None:
            raise KeyError(f"layer {layer} has no component {name!r}")
        raw = self.bundle(layer)[rng.offset : rng.offset + rng.size]
        return raw.view(dtype).view(*shape)


class BroadcastTransport:
    """Whole-bundle broadcast from owner to the group (``torch.distributed``).

    group: the KVPP process group (``None`` = the default group);
    group_ranks: global rank of each group rank (index = KVPP rank).
    """

    def __init__(self, storage: KVPPStorage, group=None, group_ranks: Optional[Sequence[int]] = None):
        self.storage = storage
        self.group = group
        size = storage.plan.ownership.group_size
        self.group_ranks = list(group_ranks) if group_ranks is not None else list(range(size))
        self.stream = platform.new_stream()
        self.broadcasts = 0
        self.bytes_received = 0
        self.bytes_broadcast = 0  # payload of every broadcast this rank took part in
        self.active_blocks: Optional[torch.Tensor] = None
        self._staging: Optional[torch.Tensor] = None
        self._single_run: Optional[tuple] = None  # (lo, hi) when the active blocks are one sorted run

    def set_active_blocks(self, blocks: Optional[torch.Tensor]) -> None:
        """Blocks (int64 ids in ``0..num_blocks-1``, unique) the next broadcasts carry;
        ``None`` = whole bundles. Only change it between forwards (nothing in flight).

        Blocks forming one sorted contiguous run travel without staging (each
        component's run is already contiguous: one broadcast per component, or one for
        the whole bundle when the run is every block)."""
        if blocks is not None:
            blocks = blocks.to(device=self.storage.device, dtype=torch.long)
            if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= self.storage.num_blocks):
                raise ValueError(f"active blocks outside 0..{self.storage.num_blocks - 1}")
        self.active_blocks = blocks
        self._single_run = None
        if blocks is not None and blocks.numel():
            lo, hi = int(blocks[0]), int(blocks[-1]) + 1
            if hi - lo == blocks.numel() and bool((blocks[1:] > blocks[:-1]).all()):
                self._single_run = (lo, hi)

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 staging buffer of ``nbytes`` (reused: broadcasts run one at
        a time on the transfer thread, and each scatters before returning)."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.storage.device)
        return self._staging[:nbytes]

    def payload_bytes(self, layer: int) -> int:
        """Bytes one broadcast of ``layer`` moves with the current active set."""
        if self.active_blocks is None:
            return self.storage.bundle(layer).numel()
        per_block = bundle_bytes_per_block(self.storage.plan.bundles[layer])
        return per_block * int(self.active_blocks.numel())

    def _block_views(self, layer: int) -> List[torch.Tensor]:
        """Each component of ``layer``'s bundle as uint8 ``[num_blocks, bytes_per_block]``."""
        buf = self.storage.bundle(layer)
        place = self.storage.plan.placement(layer, self.storage.num_blocks)
        return [buf[r.offset : r.offset + r.size].view(self.storage.num_blocks, -1) for r in place.components]

    def broadcast(self, layer: int, cache_ready=None) -> None:
        import torch.distributed as dist

        owner = self.storage.plan.ownership.owner_of[layer]
        is_owner = owner == self.storage.plan.rank
        blocks = self.active_blocks
        src = self.group_ranks[owner]
        moved = 0
        with platform.stream_context(self.stream):
            if cache_ready is not None:
                self.stream.wait_event(cache_ready)
            if blocks is None or self._single_run == (0, self.storage.num_blocks):  # whole bundle
                buf = self.storage.bundle(layer)
                dist.broadcast(buf, src=src, group=self.group)
                moved = buf.numel()
            elif self._single_run is not None:  # one contiguous run: each component's run in place
                lo, hi = self._single_run
                for v in self._block_views(layer):
                    dist.broadcast(v[lo:hi], src=src, group=self.group)
                    moved += v[lo:hi].numel()
            elif blocks.numel():
                views = self._block_views(layer)
                nb = blocks.numel()
                buf = self._staging_buffer(sum(v.shape[1] for v in views) * nb)
                pieces, cursor = [], 0
                for v in views:
                    pieces.append(buf[cursor : cursor + v.shape[1] * nb].view(nb, v.shape[1]))
                    cursor += v.shape[1] * nb
                if is_owner:  # gather the active blocks of every component into the staging buffer
                    for v, piece in zip(views, pieces):
                        torch.index_select(v, 0, blocks, out=piece)
                dist.broadcast(buf, src=src, group=self.group)
                if not is_owner:  # scatter into the same blocks of the scratch copy
                    for v, piece in zip(views, pieces):
                        v.index_copy_(0, blocks, piece)
                moved = buf.numel()
            done = platform.new_event()
            done.record(self.stream)
        done.synchronize()  # device completion, owner's source reads included
        self.broadcasts += 1
        self.bytes_broadcast += moved
        if not is_owner:
            self.bytes_received += moved


def _bind_device(device: torch.device) -> None:
    """Prefetch thread start: make ``device`` current (a new thread starts on device 0)."""
    if device.type in ("npu", "cuda") and device.index is not None:
        getattr(torch, device.type).set_device(device.index)


class KVPPScheduler:
    """Per-forward prefetch driver; ``layers`` are target layers in execution order."""

    def __init__(self, transport: BroadcastTransport, layers: Optional[Sequence[int]] = None, prefetch: bool = True):
        self.transport = transport
        self.layers = list(layers) if layers is not None else list(transport.storage.plan.ownership.target_layers)
        self.prefetch_enabled = prefetch
        device = transport.storage.device
        self._executor = cf.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvpp-prefetch", initializer=_bind_device, initargs=(device,)
        )
        self._futures: Dict[int, cf.Future] = {}
        self._has_history = False
        self._next = 0
        self._lock = threading.Lock()

    def schedule_forward(self, has_history: bool, active_blocks: Optional[torch.Tensor] = None) -> None:
        """Open a forward. ``active_blocks``: the blocks this forward reads (every rank
        passes the same set), or ``None`` to broadcast whole bundles."""
        if self._futures:
            raise RuntimeError("previous forward not completed (call complete_forward)")
        self.transport.set_active_blocks(active_blocks)
        self._has_history = has_history
        self._next = 0
        if has_history and self.layers and self.prefetch_enabled:
            self._start(0)

    def _start(self, index: int) -> None:
        layer = self.layers[index]
        cache_ready = platform.new_event()
        cache_ready.record(platform.current_stream())
        self._futures[layer] = self._executor.submit(self.transport.broadcast, layer, cache_ready)

    def wait_for_layer(self, layer: int) -> None:
        """Block until ``layer``'s bundle is in place; start the next layer's prefetch."""
        if not self._has_history:
            return
        index = self.layers.index(layer)
        if index != self._next:
            raise RuntimeError(f"layer {layer} waited out of order (expected {self.layers[self._next]})")
        if layer not in self._futures:  # prefetch disabled: fetch synchronously
            self._start(index)
        self._futures.pop(layer).result()
        self._next = index + 1
        if self._next < len(self.layers):
            if self.prefetch_enabled:
                self._start(self._next)

    def complete_forward(self) -> None:
        for fut in self._futures.values():
            fut.result()
        self._futures.clear()
        self._has_history = False
        self._next = 0

    def close(self) -> None:
        self.complete_forward()
        self._executor.shutdown(wait=True)
