"""Fault injection for the failure tests and the transfer benchmark.

Two wrappers, both driven by one :class:`FaultPlan`:

* :class:`FaultyEngine` wraps any :class:`~sglang_ascend_offload.transfer.engine.TransferEngine`: fail reads
  (a given number of times, optionally only for given layers), or delay them;
* :class:`FaultyOutbox` is a ``send_filter`` for a control-plane endpoint: drop
  or truncate outgoing messages of a given kind (optionally only for a layer).

The layer of a read is told to the engine wrapper by the decode side through
:meth:`FaultyEngine.set_context` (engines themselves know nothing about layers).
The plan is a frozen, picklable spec (it crosses process boundaries in the
tests); a :class:`FaultInjector` holds the counters and is shared by both
wrappers of a process. Every injected fault is counted in
:attr:`FaultInjector.injected` so a test can assert it really happened.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..transfer.engine import Region, TransferEngine
from ..transfer.errors import EngineReadError
from ..transfer.protocol import Message, message_kind


@dataclass(frozen=True)
class FaultPlan:
    """What to break.

    fail_reads: number of reads to fail (counted over matching reads).
    fail_layers: only reads of these layers fail (``None`` = any layer).
    read_delay_s: sleep before a matching read (``delay_layers`` restricts), at most
        ``max_delays`` times.
    drop_kinds / truncate_kinds: outgoing message kinds (``"read_done"``,
        ``"ready"``, ...) to drop / cut in half; ``fault_layer`` restricts both to
        messages carrying that layer; ``max_message_faults`` bounds how many.
    exit_on_layer: the process exits (``os._exit``) when asked to read this layer
        (simulates a decode that dies mid-transfer).
    """

    fail_reads: int = 0
    fail_layers: Optional[Tuple[int, ...]] = None
    read_delay_s: float = 0.0
    delay_layers: Optional[Tuple[int, ...]] = None
    max_delays: int = 1
    drop_kinds: Tuple[str, ...] = ()
    truncate_kinds: Tuple[str, ...] = ()
    fault_layer: Optional[int] = None
    max_message_faults: int = 1
    exit_on_layer: Optional[int] = None

    @property
    def active(self) -> bool:
        return bool(
            self.fail_reads
            or self.read_delay_s
            or self.drop_kinds
            or self.truncate_kinds
            or self.exit_on_layer is not None
        )


class FaultInjector:
    """The counters of one process's injected faults (thread-safe)."""

    def __init__(self, plan: FaultPlan):
        self.plan = plan
        self.injected: Counter = Counter()
        self._lock = threading.Lock()

    def take(self, what: str, limit: int) -> bool:
        """Atomically claim one more fault of kind ``what`` if fewer than ``limit`` happened."""
        with self._lock:
            if self.injected[what] >= limit:
                return False
            self.injected[what] += 1
            return True


class FaultyEngine(TransferEngine):
    """A :class:`TransferEngine` that fails or delays reads according to a plan."""

    def __init__(self, inner: TransferEngine, injector: FaultInjector):
        self.inner = inner
        self.injector = injector
        self.name = inner.name
        self._layer = threading.local()

    def set_context(self, layer: Optional[int]) -> None:
        """Layer of the reads the calling thread issues next."""
        self._layer.value = layer

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    @property
    def data_protocol(self) -> str:
        return self.inner.data_protocol

    def register(self, regions: Sequence[Region]) -> None:
        self.inner.register(regions)

    def unregister(self, addresses: Sequence[int]) -> None:
        self.inner.unregister(addresses)

    def read(self, peer_session, dst_addrs, src_addrs, lengths) -> None:
        layer = getattr(self._layer, "value", None)
        p, inj = self.injector.plan, self.injector
        if p.exit_on_layer is not None and layer == p.exit_on_layer:
            import os

            os._exit(17)
        if p.read_delay_s > 0 and (p.delay_layers is None or layer in p.delay_layers):
            if inj.take("delay", p.max_delays):
                time.sleep(p.read_delay_s)
        if p.fail_reads and (p.fail_layers is None or layer in p.fail_layers):
            if inj.take("fail_read", p.fail_reads):
                raise EngineReadError(f"injected read failure (layer {layer})")
        self.inner.read(peer_session, dst_addrs, src_addrs, lengths)

    def close(self) -> None:
        self.inner.close()


class FaultyOutbox:
    """``send_filter`` that drops or truncates outgoing messages per the plan.

    Called with the message and its encoded bytes; returns the bytes to send, or
    ``None`` to drop the message.
    """

    def __init__(self, injector: FaultInjector):
        self.injector = injector

    def __call__(self, msg: Message, data: bytes) -> Optional[bytes]:
        p, inj = self.injector.plan, self.injector
        kind = message_kind(msg)
        layer = getattr(msg, "layer", None)
        if p.fault_layer is not None and layer != p.fault_layer:
            return data
        if kind in p.drop_kinds and inj.take("drop", p.max_message_faults):
            return None
        if kind in p.truncate_kinds and inj.take("truncate", p.max_message_faults):
            return data[: len(data) // 2]
        return data
