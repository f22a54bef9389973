"""KVPP runtime: storage, full-layer broadcast, and one-layer-ahead prefetch (seed 002 §5).

* :class:`KVPPStorage` allocates this rank's persistent bundles (owned target
  layers + draft layers) and the two scratch buffers, as flat ``uint8`` tensors;
  ``bundle(layer)`` is where that layer's KV lives during the current forward.
* :class:`BroadcastTransport` broadcasts a whole bundle from its owner to the group
  on a transfer stream, after the compute stream's ``cache_ready`` event, and
  returns only when the device copy is complete (so attention never overwrites a
  persistent cache the broadcast is still reading).
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
        own = plan.ownership.owned_by(plan.rank) + plan.ownership.draft_layers
        self.persistent: Dict[int, torch.Tensor] = {
            layer: torch.zeros(bundle_bytes_per_block(plan.bundles[layer]) * num_blocks,
                               dtype=torch.uint8, device=device)
            for layer in own
        }
        scratch_bytes = plan.scratch_buffer_bytes(num_blocks)
        self.scratch: List[torch.Tensor] = [torch.zeros(scratch_bytes, dtype=torch.uint8, device=device)
                                            for _ in range(SCRATCH_BUFFER_COUNT)]

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
        raw = self.bundle(layer)[rng.offset:rng.offset + rng.size]
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

    def broadcast(self, layer: int, cache_ready=None) -> None:
        import torch.distributed as dist

        owner = self.storage.plan.ownership.owner_of[layer]
        buf = self.storage.bundle(layer)
        with platform.stream_context(self.stream):
            if cache_ready is not None:
                self.stream.wait_event(cache_ready)
            dist.broadcast(buf, src=self.group_ranks[owner], group=self.group)
            done = platform.new_event()
            done.record(self.stream)
        done.synchronize()  # device completion, owner's source reads included
        self.broadcasts += 1
        if owner != self.storage.plan.rank:
            self.bytes_received += buf.numel()


class KVPPScheduler:
    """Per-forward prefetch driver; ``layers`` are target layers in execution order."""

    def __init__(self, transport: BroadcastTransport, layers: Optional[Sequence[int]] = None,
                 prefetch: bool = True):
        self.transport = transport
        self.layers = list(layers) if layers is not None else list(
            transport.storage.plan.ownership.target_layers)
        self.prefetch_enabled = prefetch
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpp-prefetch")
        self._futures: Dict[int, cf.Future] = {}
        self._has_history = False
        self._next = 0
        self._lock = threading.Lock()

    def schedule_forward(self, has_history: bool) -> None:
        if self._futures:
            raise RuntimeError("previous forward not completed (call complete_forward)")
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
