"""A P/D server that sleeps when idle without stalling its transfers.

SGLang's ``--sleep-on-idle`` parks a scheduler that has no batch to run on its input
sockets for up to a second (``IdleSleeper.maybe_sleep``). A P/D scheduler has no batch
to run while its requests wait on KV transfers too, and only its own loop polls those:
parked there, a finished transfer would be noticed up to a second late. Without the
flag the loop spins, taking a whole core per idle server.

On the ``ascend_offload`` P/D backend this hook keeps both benefits: while any request
sits in a P/D queue (decode: pre-allocation, transfer, retracted; prefill: bootstrap,
in flight, a chunk sent), the idle step sleeps one short slice
(:data:`PD_IDLE_SLICE_S`) and the loop polls its transfers again; with nothing in
flight SGLang's own sleeper parks as before, woken by the next request. Without
``--sleep-on-idle`` (no sleeper) nothing changes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

#: idle step while transfers are in flight: the latency it can add to noticing one
PD_IDLE_SLICE_S = 0.002


def pd_work_in_flight(scheduler: Any) -> bool:
    """Whether a request of ``scheduler`` waits in one of SGLang's P/D queues."""
    for name in ("disagg_decode_prealloc_queue", "disagg_decode_transfer_queue", "disagg_prefill_bootstrap_queue"):
        queue = getattr(scheduler, name, None)
        if queue is not None and (queue.queue or getattr(queue, "retracted_queue", None)):
            return True
    return bool(
        getattr(scheduler, "disagg_prefill_inflight_queue", None)
        or getattr(scheduler, "disagg_prefill_pending_chunk_rids", None)
    )


def maybe_sleep_on_idle_around(original: Callable, self: Any) -> None:
    """HookRegistry AROUND hook for ``Scheduler.maybe_sleep_on_idle`` (module docstring)."""
    if getattr(self, "idle_sleeper", None) is not None and _on_this_backend(self) and pd_work_in_flight(self):
        time.sleep(PD_IDLE_SLICE_S)
        return None
    return original(self)


def _on_this_backend(scheduler: Any) -> bool:
    from sglang.srt.disaggregation.utils import TransferBackend

    from .install import pd_active

    return getattr(scheduler, "transfer_backend", None) == TransferBackend.ASCEND and pd_active()
