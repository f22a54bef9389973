"""KVPP's transfer stream, checked on CPU through recording stand-ins of the device
stream and event API (``platform.new_stream`` / ``current_stream`` / ``new_event`` /
``stream_context``) and of ``torch.distributed.broadcast``.

What ``kvpp/runtime.py`` promises: :class:`BroadcastTransport` broadcasts on its own
transfer stream (created with the transport, not the compute stream), that stream
first waits for the compute stream's ``cache_ready`` event, and ``broadcast`` returns
only after a completion event recorded on the transfer stream has been synchronised;
the :class:`KVPPScheduler` issues each layer's broadcast from its prefetch thread and
``wait_for_layer(i)`` returns after layer ``i``'s completion, with layer ``i + 1``'s
broadcast already started. On CPU the real stand-ins do nothing, so only this
recording can see the order; ``tests/kvpp/test_kvpp.py`` moves real bytes over gloo
(and on HCCL counts broadcasts on the compute stream).
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest
import torch

from sglang_ascend_offload import platform
from sglang_ascend_offload.kvpp.ownership import assign_owners
from sglang_ascend_offload.kvpp.plan import ComponentSpec, bundles_for, plan_rank
from sglang_ascend_offload.kvpp.runtime import BroadcastTransport, KVPPScheduler, KVPPStorage

NUM_LAYERS, GROUP, BLOCKS = 5, 2, 4
COMPS = (ComponentSpec("kv", 64), ComponentSpec("index", 16))


class Recorder:
    """Stand-in streams and events that append what happens, with the calling thread, to
    one log (list appends are atomic, so the log is in real-time order across threads)."""

    def __init__(self):
        self.log = []
        self.compute = self.Stream(self, "compute")
        self._current = threading.local()
        self._ids = itertools.count()

    class Stream:
        def __init__(self, rec, name):
            self.rec, self.name = rec, name

        def wait_event(self, event):
            self.rec.add("wait", stream=self, event=event)

        def synchronize(self):
            self.rec.add("stream_sync", stream=self)

    class Event:
        def __init__(self, rec, name):
            self.rec, self.name = rec, name

        def record(self, stream=None):
            self.rec.add("record", event=self, stream=stream)

        def synchronize(self):
            self.rec.add("event_sync", event=self)

        def query(self):
            return True

    def add(self, what, **kw):
        self.log.append(dict(what=what, thread=threading.current_thread().name, **kw))

    def current(self):
        return getattr(self._current, "stream", self.compute)

    # the platform API
    def new_stream(self):
        stream = self.Stream(self, f"side{next(self._ids)}")
        self.add("new_stream", stream=stream)
        return stream

    def new_event(self):
        return self.Event(self, f"event{next(self._ids)}")

    @contextlib.contextmanager
    def stream_context(self, stream):
        before = self.current()
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def broadcast(self, tensor, src=None, group=None, **kw):
        self.add("broadcast", stream=self.current(), ptr=tensor.data_ptr(), src=src)


@pytest.fixture()
def rec(monkeypatch):
    import torch.distributed as dist

    r = Recorder()
    monkeypatch.setattr(platform, "new_stream", r.new_stream)
    monkeypatch.setattr(platform, "current_stream", r.current)
    monkeypatch.setattr(platform, "new_event", r.new_event)
    monkeypatch.setattr(platform, "stream_context", r.stream_context)
    monkeypatch.setattr(dist, "broadcast", r.broadcast)  # the transport looks it up per call
    return r


def _rig(rank: int):
    own = assign_owners(range(NUM_LAYERS), GROUP)
    plan = plan_rank(rank, own, bundles_for(range(NUM_LAYERS), COMPS))
    storage = KVPPStorage(plan, BLOCKS)
    return storage, BroadcastTransport(storage)


def _layer_runs(rec):
    """The prefetch thread's log cut into one run per broadcast: from the transfer
    stream's wait to the completion event's synchronisation."""
    worker = [e for e in rec.log if e["thread"].startswith("kvpp-prefetch")]
    runs, run = [], None
    for e in worker:
        if e["what"] == "wait":
            run = [e]
            runs.append(run)
        else:
            assert run is not None, f"{e['what']} on the prefetch thread before the transfer stream's wait"
            run.append(e)
    return runs


@pytest.mark.parametrize("rank", [0, 1], ids=["owner_first", "receiver_first"])
@pytest.mark.parametrize("active", [None, [1, 2], [0, 2, 3]], ids=["whole", "one_run", "staged"])
def test_broadcasts_run_on_the_transfer_stream_after_cache_ready_and_complete_before_use(rec, rank, active):
    storage, transport = _rig(rank)
    created = [e["stream"] for e in rec.log if e["what"] == "new_stream"]
    assert created == [transport.stream] and transport.stream is not rec.compute  # its own stream
    sched = KVPPScheduler(transport)
    layers = sched.layers
    sched.schedule_forward(
        has_history=True, active_blocks=None if active is None else torch.tensor(active, dtype=torch.long)
    )
    for layer in layers:
        sched.wait_for_layer(layer)
        rec.add("layer_ready", layer=layer)
    sched.complete_forward()
    sched.close()

    runs = _layer_runs(rec)
    assert len(runs) == len(layers) == transport.broadcasts
    log = rec.log
    for layer, run in zip(layers, runs):
        wait, *body, done_record, done_sync = run
        # the transfer stream waits for cache_ready, which the compute stream recorded first,
        # on the thread that runs the forward
        assert wait["stream"] is transport.stream
        ready = [e for e in log[: log.index(wait)] if e["what"] == "record" and e["event"] is wait["event"]]
        assert len(ready) == 1 and ready[0]["stream"] is rec.compute
        assert ready[0]["thread"] == threading.current_thread().name
        # every broadcast of the layer is issued on the transfer stream
        casts = [e for e in body if e["what"] == "broadcast"]
        assert casts and all(e["stream"] is transport.stream for e in casts), (layer, body)
        assert [e["what"] for e in body] == ["broadcast"] * len(casts)
        if active is None:  # the whole bundle of this layer
            assert [e["ptr"] for e in casts] == [storage.bundle(layer).data_ptr()]
        # completion: an event recorded on the transfer stream, synchronised before the layer is used
        assert done_record["what"] == "record" and done_record["stream"] is transport.stream
        assert done_sync["what"] == "event_sync" and done_sync["event"] is done_record["event"]
        used = next(i for i, e in enumerate(log) if e["what"] == "layer_ready" and e["layer"] == layer)
        assert log.index(done_sync) < used
        # prefetch: the next layer's broadcast was started before this layer was handed over
        following = layers.index(layer) + 1
        if following < len(layers):
            next_wait = runs[following][0]
            started = next(i for i, e in enumerate(log) if e["what"] == "record" and e["event"] is next_wait["event"])
            assert started < used
    # nothing was issued on the compute stream by anyone
    assert not [e for e in log if e["what"] == "broadcast" and e["stream"] is not transport.stream]
