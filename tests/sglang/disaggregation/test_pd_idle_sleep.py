"""``--sleep-on-idle`` on the ascend_offload P/D backend (``disaggregation/ascend_offload/idle.py``):
while a request waits in a P/D queue the idle step sleeps one short slice instead of
parking on the input sockets for up to a second; otherwise SGLang's sleeper runs."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from sglang.srt.disaggregation.utils import TransferBackend

from sglang_ascend_offload.sglang_plugin.disaggregation.ascend_offload import idle
from sglang_ascend_offload.sglang_plugin.disaggregation.ascend_offload import install as pd_install


def _scheduler(**queues):
    """A decode or prefill scheduler's P/D state; every queue empty unless given."""
    q = lambda items=(), retracted=(): SimpleNamespace(queue=list(items), retracted_queue=list(retracted))  # noqa: E731
    s = SimpleNamespace(
        idle_sleeper=object(),
        transfer_backend=TransferBackend.ASCEND,
        disagg_decode_prealloc_queue=q(),
        disagg_decode_transfer_queue=q(),
        disagg_prefill_bootstrap_queue=q(),
        disagg_prefill_inflight_queue=[],
        disagg_prefill_pending_chunk_rids=set(),
    )
    for name, value in queues.items():
        setattr(s, name, value)
    return s


@pytest.mark.parametrize(
    "name,value",
    [
        ("disagg_decode_prealloc_queue", SimpleNamespace(queue=["r"], retracted_queue=[])),
        ("disagg_decode_prealloc_queue", SimpleNamespace(queue=[], retracted_queue=["r"])),
        ("disagg_decode_transfer_queue", SimpleNamespace(queue=["r"])),
        ("disagg_prefill_bootstrap_queue", SimpleNamespace(queue=["r"])),
        ("disagg_prefill_inflight_queue", ["r"]),
        ("disagg_prefill_pending_chunk_rids", {"rid"}),
    ],
)
def test_each_p_d_queue_counts_as_work_in_flight(name, value):
    assert not idle.pd_work_in_flight(_scheduler())
    assert idle.pd_work_in_flight(_scheduler(**{name: value}))


def test_a_colocated_scheduler_has_no_p_d_work():
    s = SimpleNamespace(
        disagg_decode_prealloc_queue=None,
        disagg_decode_transfer_queue=None,
        disagg_prefill_bootstrap_queue=None,
        disagg_prefill_inflight_queue=None,
    )
    assert not idle.pd_work_in_flight(s)


def test_the_idle_step_sleeps_a_slice_only_with_transfers_in_flight(monkeypatch):
    monkeypatch.setattr(pd_install, "pd_active", lambda: True)
    parked = []

    def original(self):
        parked.append(self)

    busy = _scheduler(disagg_decode_transfer_queue=SimpleNamespace(queue=["r"]))
    t0 = time.perf_counter()
    idle.maybe_sleep_on_idle_around(original, busy)
    assert parked == [] and time.perf_counter() - t0 < 0.5  # a slice, not SGLang's 1 s park
    quiet = _scheduler()
    idle.maybe_sleep_on_idle_around(original, quiet)
    assert parked == [quiet]  # nothing in flight: SGLang's sleeper parks as before
    # without --sleep-on-idle, on another transfer backend, or with P/D off: SGLang decides
    for s in (
        _scheduler(idle_sleeper=None, disagg_prefill_inflight_queue=["r"]),
        _scheduler(transfer_backend=TransferBackend.MOONCAKE, disagg_prefill_inflight_queue=["r"]),
    ):
        idle.maybe_sleep_on_idle_around(original, s)
        assert parked[-1] is s
    monkeypatch.setattr(pd_install, "pd_active", lambda: False)
    off = _scheduler(disagg_prefill_inflight_queue=["r"])
    idle.maybe_sleep_on_idle_around(original, off)
    assert parked[-1] is off
