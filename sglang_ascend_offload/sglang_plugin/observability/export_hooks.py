"""The two moments SGLang's scheduler must have the offload counters exported.

During decode the Prometheus counters are exported at most every
:data:`~.metrics.EXPORT_INTERVAL_S` (:class:`~.metrics.OffloadMetrics`). A reader looks
at them when a request has finished or the server has gone quiet, so both moments flush
what the interval held back:

* before the output streamer sends a step's outputs in which a request finished (the
  client cannot see the finish before the counters of its last step);
* when the scheduler is idle (nothing runs: the device counts are read as of now).

Both are no-ops unless an offload backend of the process holds steps back.
"""

from __future__ import annotations

from typing import Any

from .metrics import flush_exports, held_back


def flush_before_stream_output(streamer: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``SchedulerOutputStreamer.stream_output(reqs, return_logprob, ...)``."""
    if not held_back():  # nothing to flush: skip the scan of the batch
        return None
    reqs = args[0] if args else kwargs.get("reqs")
    if reqs and any(req.finished() for req in reqs):
        flush_exports(wait=False)  # the overlap scheduler may already run the next step
    return None


def flush_after_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.on_idle()``."""
    flush_exports(wait=True)  # a no-op unless steps are held back
    return None
