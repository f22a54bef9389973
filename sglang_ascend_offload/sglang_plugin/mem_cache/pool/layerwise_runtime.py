"""The layerwise pipeline as the SGLang pool drives it, and the hooks it offers P/D.

:class:`SlotPipeline` is :class:`~sglang_ascend_offload.layerwise_prefill.pipeline.LayerwisePrefillPipeline`
with one more way to open a forward: :meth:`SlotPipeline.begin_forward_rows` takes
the row layout from the caller (the pool's page plan, rows = SGLang slots) instead of
matching token-content prefixes itself. Everything else (loader / saver threads,
slot gates, prefetch, leases, errors) is the engine-agnostic pipeline's.

Hooks for the P/D sender (``sglang_plugin/disaggregation/ascend_offload/``), all on
:class:`~.layerwise_prefill.LayerwisePrefillPool`:

``pool.add_layer_listener(fn)``
    ``fn(LayerWritten)`` runs once per layer and forward after the layer's KV rows are
    complete in its buffer (device write event synchronized): for pipelined layers in
    the pipeline's saver thread, just before the host save; for layers with a
    dedicated buffer in the pool's notifier thread. The P/D sender publishes "layer
    ready" here. A listener that raises is logged and skipped (the save goes on); it
    must answer its gate consumers itself (with an error) or the slot times out. Buffer rows are SGLang slots, so
    the source pages of a request are
    its ``req_to_token`` pages, at the layer's (aliased) buffer addresses
    (``pool.get_contiguous_buf_infos()``).
``pool.set_extra_consumers(fn)``
    ``fn(ForwardInfo) -> {layer: [consumer, ...]}`` (local layer ids; a plain sequence
    applies to every pipelined layer) is asked once per forward; the named consumers
    are added to each layer's slot gate next to ``compute`` and ``save``. The slot is
    not reused (the next layer sharing it does not load or write) until each of them
    answered ``pool.gates.done(slot, layer, consumer, error=None | "READ_FAILED: ...")``.
    Layers with a dedicated buffer have no gate: their rows are only rewritten after
    SGLang frees and reallocates the pages.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ....layerwise_prefill.pipeline import ForwardLayout, LayerwisePrefillPipeline, RequestRows
from .layerwise_pages import BatchRequest

logger = logging.getLogger(__name__)

__all__ = ["SlotPipeline", "ForwardInfo", "LayerWritten", "ExtraConsumers", "LayerListener", "WrittenNotifier"]


@dataclass(frozen=True)
class ForwardInfo:
    """One forward as the hooks see it.

    forward_id: increasing per pool; requests: per request its ``req_to_token`` row,
    cached prefix and length after the forward, and SGLang page ids (= buffer pages);
    pipelined_layers: local layer ids whose buffer is shared (gated, saved, loaded).
    """

    forward_id: int
    requests: Tuple[BatchRequest, ...]
    pipelined_layers: Tuple[int, ...]


@dataclass(frozen=True)
class LayerWritten:
    """A layer's KV is complete in its physical buffer for this forward.

    layer: local layer id (``layer_id - start_layer``); slot: physical buffer index;
    tensors: the buffer's tensors ``[latent [S, Dl], rope [S, Dr], (index K [S, Di])]``
    with ``S`` = SGLang's slot space (row = slot); pipelined: the slot is shared (gated).
    """

    forward: ForwardInfo
    layer: int
    slot: int
    tensors: Tuple[torch.Tensor, ...]
    pipelined: bool


ExtraConsumers = Callable[[ForwardInfo], object]
LayerListener = Callable[[LayerWritten], None]


class SlotPipeline(LayerwisePrefillPipeline):
    """The pipeline with caller-made layouts (see module doc)."""

    def begin_forward_rows(
        self,
        rows: Sequence[RequestRows],
        layers: Sequence[int],
        extra_consumers: Optional[Dict[int, Sequence[str]]] = None,
    ) -> ForwardLayout:
        """Open a forward over ``layers`` with the given rows (blocks ``[:cached_blocks]``
        are loaded into ``row0 + start``, the rest saved from there). Same contract as
        :meth:`begin_forward` otherwise (leases, prefetch, one open forward)."""
        return self.open_forward(ForwardLayout(tuple(rows), tuple(layers)), extra_consumers)


class WrittenNotifier:
    """Calls layer listeners for dedicated-buffer layers off the scheduler thread,
    after the layer's write event completed (one daemon thread, FIFO)."""

    def __init__(self):
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="lwp-notify", daemon=True)
        self._thread.start()

    def submit(self, event, item: LayerWritten, listeners: Sequence[LayerListener]) -> None:
        self._q.put((event, item, tuple(listeners)))

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            event, item, listeners = job
            if isinstance(item, threading.Event):  # flush marker
                item.set()
                continue
            try:
                event.synchronize()
                for fn in listeners:
                    fn(item)
            except Exception:  # noqa: BLE001 - a listener must not kill the notifier
                logger.exception("layerwise prefill: layer listener failed for layer %d", item.layer)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every notification submitted so far ran; False at the deadline."""
        done = threading.Event()
        self._q.put((None, done, ()))
        return done.wait(timeout_s)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
