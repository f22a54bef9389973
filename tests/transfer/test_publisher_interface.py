"""The two prefill publishers share one interface (``transfer/publisher.py``)."""

from __future__ import annotations

import inspect

from sglang_ascend_offload.transfer.layerwise_publisher import LayerwisePublisher
from sglang_ascend_offload.transfer.prefill_links import PrefillLinks
from sglang_ascend_offload.transfer.publisher import PrefillPublisher


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_both_publishers_implement_the_whole_interface_with_one_constructor():
    for kind in (PrefillLinks, LayerwisePublisher):
        assert issubclass(kind, PrefillPublisher)
        assert not kind.__abstractmethods__, kind  # every abstract method implemented
    assert _params(PrefillLinks.__init__) == _params(LayerwisePublisher.__init__)
    assert PrefillLinks.publishes_during_forward is False
    assert LayerwisePublisher.publishes_during_forward is True
    # the interface's methods keep their signatures in both implementations
    for name, member in inspect.getmembers(PrefillPublisher, inspect.isfunction):
        if name.startswith("_"):
            continue
        for kind in (PrefillLinks, LayerwisePublisher):
            assert _params(getattr(kind, name)) == _params(member), (kind.__name__, name)


def test_the_after_forward_publisher_refuses_announcements():
    links = PrefillLinks.__new__(PrefillLinks)  # no pool needed: expect() is the interface's default
    try:
        links.expect(0, 1, "session")
    except RuntimeError as exc:
        assert "publishes after the forward" in str(exc)
    else:
        raise AssertionError("PrefillLinks.expect accepted an announcement")
