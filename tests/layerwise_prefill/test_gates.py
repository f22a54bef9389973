"""SlotGates: reuse only after every consumer of the previous content finished."""

import threading
import time

import pytest

from sglang_ascend_offload.layerwise_prefill.gates import GateError, GateTimeout, SlotBusyError, SlotGates


def test_fresh_slot_is_free_and_empty_consumers_free_at_once():
    g = SlotGates(2)
    g.wait_free(0, 0.0)
    g.begin(0, 3, [])
    g.wait_free(0, 0.0)
    assert g.pending(0) == frozenset()
    assert g.layer(0) == 3


def test_begin_on_busy_slot_raises_and_done_releases():
    g = SlotGates(2)
    g.begin(1, 1, ["save", "decode0"])
    assert g.pending(1) == {"save", "decode0"}
    with pytest.raises(SlotBusyError, match="layer 1"):
        g.begin(1, 7, ["save"])
    g.done(1, 1, "save")
    with pytest.raises(SlotBusyError):
        g.begin(1, 7, ["save"])
    g.done(1, 1, "decode0")
    g.wait_free(1, 0.0)
    g.begin(1, 7, ["save"])
    assert g.layer(1) == 7 and g.state(1).generation == 2
    # other slot untouched
    assert g.pending(0) == frozenset()


def test_unknown_completion_raises_value_error():
    g = SlotGates(1)
    g.begin(0, 1, ["save"])
    with pytest.raises(ValueError):
        g.done(0, 2, "save")  # wrong layer
    with pytest.raises(ValueError):
        g.done(0, 1, "decode")  # unknown consumer
    g.done(0, 1, "save")
    with pytest.raises(ValueError):
        g.done(0, 1, "save")  # reported twice
    with pytest.raises(ValueError):
        g.done(5, 1, "save")  # bad slot


def test_timeout_names_slot_layer_and_pending():
    g = SlotGates(3)
    g.begin(2, 13, ["save", "decode1"])
    g.done(2, 13, "save")
    t0 = time.monotonic()
    with pytest.raises(GateTimeout) as ei:
        g.wait_free(2, 0.05)
    assert time.monotonic() - t0 >= 0.05
    msg = str(ei.value)
    assert "slot 2" in msg and "layer 13" in msg and "decode1" in msg and "'save'" not in msg


def test_error_raised_only_after_all_consumers_finished():
    g = SlotGates(1)
    g.begin(0, 4, ["save", "decode0"])
    g.done(0, 4, "decode0", error="READ_FAILED: link down")
    # still one pending consumer: the wait times out rather than reporting early
    with pytest.raises(GateTimeout, match="READ_FAILED"):
        g.wait_free(0, 0.01)
    g.done(0, 4, "save")
    with pytest.raises(GateError) as ei:
        g.wait_free(0, 1.0)
    assert ei.value.slot == 0 and ei.value.layer == 4
    assert ei.value.errors == {"decode0": "READ_FAILED: link down"}
    with pytest.raises(GateError):  # sticky until the next begin
        g.wait_free(0, 1.0)
    g.begin(0, 5, [])  # the slot itself is free
    g.wait_free(0, 0.0)


def test_waiter_wakes_when_last_consumer_finishes_on_other_thread():
    g = SlotGates(1)
    g.begin(0, 1, ["a", "b"])
    woke = []

    def waiter():
        g.wait_free(0, 5.0)
        woke.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.02)
    g.done(0, 1, "a")
    time.sleep(0.02)
    assert not woke
    released = time.monotonic()
    g.done(0, 1, "b")
    t.join(5)
    assert woke and woke[0] >= released


def test_invalid_construction_and_duplicate_consumers():
    with pytest.raises(ValueError):
        SlotGates(0)
    g = SlotGates(1)
    with pytest.raises(ValueError):
        g.begin(0, 1, ["save", "save"])
