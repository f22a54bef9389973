"""Decode's read pipeline: overlapping engine reads of one prefill peer, answered in order.

Two levels: :class:`ReadPipeline` alone (plain callables, no engine), and a
:class:`DecodeReceiver` on real Mooncake engines fed by a hand-driven prefill peer
that sends several layers at once (so they queue), with an engine wrapper that slows
or fails chosen reads to make overlap and failures deterministic.
"""

import importlib.util
import threading
import time

import pytest
import torch

from sglang_ascend_offload.transfer.destinations import RequestDestination
from sglang_ascend_offload.transfer.decode_side import DecodeReceiver
from sglang_ascend_offload.transfer.errors import EngineReadError, RequestFailed
from sglang_ascend_offload.transfer.protocol import ReadDone, ReadFailed, TransferVerdict
from sglang_ascend_offload.transfer.read_pipeline import ReadPipeline
from sglang_ascend_offload.transfer.status import TransferState
from test_pd_sides import wait_until  # the in-process P/D rig's helpers (same folder)

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ ReadPipeline alone
class Recorder:
    """read/complete/cancel callables for ReadPipeline that record what happened."""

    def __init__(self, delays=None, raise_on=()):
        self.delays = delays or {}
        self.raise_on = set(raise_on)
        self.lock = threading.Lock()
        self.read_order, self.completed, self.cancelled = [], [], []
        self.reading = 0
        self.max_reading = 0

    def read(self, job):
        with self.lock:
            self.reading += 1
            self.max_reading = max(self.max_reading, self.reading)
            self.read_order.append(job)
        try:
            time.sleep(self.delays.get(job, 0.0))
            if job in self.raise_on:
                raise RuntimeError(f"bug while reading {job}")
        finally:
            with self.lock:
                self.reading -= 1

    def complete(self, job):
        with self.lock:
            self.completed.append(job)

    def cancel(self, job):
        with self.lock:
            self.cancelled.append(job)


def test_reads_overlap_and_completions_keep_submission_order():
    rec = Recorder(delays={0: 0.4, 1: 0.05, 2: 0.05, 3: 0.05})  # the first read is the slowest
    pipe = ReadPipeline(2, rec.read, rec.complete, rec.cancel)
    for job in range(4):
        pipe.submit(job)
    assert wait_until(lambda: len(rec.completed) == 4)
    assert rec.completed == [0, 1, 2, 3]  # 1..3 finished reading first, still answered after 0
    assert rec.max_reading == 2 == pipe.max_in_flight  # never more than depth in flight
    assert not pipe.busy() and pipe.completed == pipe.submitted == 4
    assert pipe.close() == 0 and rec.cancelled == []


def test_depth_one_reads_one_at_a_time():
    rec = Recorder(delays={j: 0.02 for j in range(5)})
    pipe = ReadPipeline(1, rec.read, rec.complete, rec.cancel)
    for job in range(5):
        pipe.submit(job)
    assert wait_until(lambda: len(rec.completed) == 5)
    assert rec.completed == rec.read_order == [0, 1, 2, 3, 4] and rec.max_reading == 1
    pipe.close()


def test_job_without_read_waits_for_the_reads_before_it():
    rec = Recorder(delays={0: 0.3})
    pipe = ReadPipeline(2, rec.read, rec.complete, rec.cancel)
    pipe.submit(0)
    pipe.submit("refused", needs_read=False)  # e.g. a batch that failed validation
    time.sleep(0.1)
    assert rec.completed == []  # its answer must not overtake batch 0's
    assert wait_until(lambda: rec.completed == [0, "refused"])
    assert "refused" not in rec.read_order
    pipe.close()


def test_a_read_that_raises_does_not_stall_the_order():
    rec = Recorder(delays={1: 0.05}, raise_on={0})
    pipe = ReadPipeline(2, rec.read, rec.complete, rec.cancel)
    for job in range(3):
        pipe.submit(job)
    assert wait_until(lambda: rec.completed == [0, 1, 2])
    pipe.close()


def test_close_cancels_queued_jobs_and_waits_for_reads_in_flight():
    rec = Recorder(delays={0: 0.3, 1: 0.3})
    pipe = ReadPipeline(2, rec.read, rec.complete, rec.cancel)
    for job in range(5):
        pipe.submit(job)
    assert wait_until(lambda: rec.reading == 2)
    assert pipe.close(timeout_s=5.0) == 0
    assert rec.read_order == [0, 1]  # 2..4 never started
    assert rec.cancelled == [2, 3, 4]
    assert rec.completed == [0, 1, 2, 3, 4]  # every job completed exactly once, in order
    with pytest.raises(RuntimeError, match="after close"):
        pipe.submit(9)


def test_close_leaves_a_stuck_read_outstanding_until_it_returns():
    rec = Recorder(delays={0: 1.5})
    pipe = ReadPipeline(2, rec.read, rec.complete, rec.cancel)
    pipe.submit(0)
    pipe.submit(1, needs_read=False)
    assert wait_until(lambda: rec.reading == 1)
    assert pipe.close(timeout_s=0.1) == 2  # the read is still running: nothing may be released
    assert rec.completed == []
    assert wait_until(lambda: rec.completed == [0, 1])  # completed once the engine returned


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match=">= 1"):
        ReadPipeline(0, print, print, print)


# ------------------------------------------------------------------ DecodeReceiver, real engines
needs_mooncake = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                    reason="needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)")


class SlowEngine:
    """Wraps an engine: every read sleeps ``delay_s`` first (``fail_layers``: raise instead), and
    the most reads in flight at once is recorded."""

    def __init__(self, inner, delay_s=0.15, fail_layers=()):
        self.inner, self.delay_s, self.fail_layers = inner, delay_s, set(fail_layers)
        self.name = inner.name
        self._layer = threading.local()
        self.lock = threading.Lock()
        self.reading = self.max_reading = 0
        self.layers_read = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def set_context(self, layer):
        self._layer.value = layer

    def read(self, peer, dst, src, lengths):
        layer = self._layer.value
        with self.lock:
            self.reading += 1
            self.max_reading = max(self.max_reading, self.reading)
        try:
            time.sleep(self.delay_s)
            if layer in self.fail_layers:
                raise EngineReadError(f"injected failure of layer {layer}")
            self.inner.read(peer, dst, src, lengths)
            with self.lock:
                self.layers_read.append(layer)
        finally:
            with self.lock:
                self.reading -= 1


@pytest.fixture()
def pd_rig(engines_pair):
    """A factory: decode receiver over a SlowEngine, request ``a`` expected, a raw prefill peer."""
    from test_pd_sides import RawPeer, cfg, decode_side, free_port, handshake_msg, prefill_side

    pe, de = engines_pair
    made = []

    def make(depth=2, delay_s=0.15, fail_layers=()):
        port = free_port()
        dec, pre = decode_side(de), prefill_side(pe)
        slow = SlowEngine(de, delay_s, fail_layers)
        released = []
        recv = DecodeReceiver(cfg(port, read_pipeline_depth=depth, read_retries=0, layer_timeout_s=5.0),
                              d_tp=1, d_rank=0, layout=dec.layout, engine=slow, on_release=released.append)
        dest = RequestDestination("a", (5, 9, 2), (7, 1, 3))
        recv.expect(dest)
        recv.start()
        peer = RawPeer(port)
        peer.send(handshake_msg(pre, pe))
        assert peer.recv().accepted
        made.append((recv, dec, pre, peer))

        class Rig:
            pass

        r = Rig()
        r.recv, r.dec, r.pre, r.peer, r.slow, r.dest, r.released = recv, dec, pre, peer, slow, dest, released
        return r

    yield make
    for recv, dec, pre, peer in made:
        peer.close()
        recv.close()
        dec.close()
        pre.close()


@pytest.fixture(scope="module")
def engines_pair():
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)")
    from sglang_ascend_offload.transfer.engine_mooncake import MooncakeEngine

    p, d = MooncakeEngine("127.0.0.1"), MooncakeEngine("127.0.0.1")
    yield p, d
    p.close()
    d.close()


def send_all_layers(r, layers, batch_ids=None):
    """Every layer's batch in one write, so they are all waiting when decode reads the first."""
    from sglang_ascend_offload.transfer.channel import frame
    from sglang_ascend_offload.transfer.protocol import encode_message
    from test_pd_sides import L, batch, fill, rr

    for layer in range(L):
        fill(r.pre, layer % 2, seed=100 + layer)  # 2 slots: layers 0/2 and 1/3 share one
    ids = batch_ids or list(range(len(layers)))
    data = b"".join(frame(encode_message(batch(layer, [rr()], batch_id=b, finished=["a"] if layer == L - 1 else [])))
                    for layer, b in zip(layers, ids))
    r.peer.send_raw(data)


@needs_mooncake
def test_queued_layers_are_read_two_at_a_time_and_answered_in_order(pd_rig):
    from test_pd_sides import L, V

    r = pd_rig(depth=2, delay_s=0.15)
    t0 = time.monotonic()
    send_all_layers(r, list(range(L)))
    answers = [r.peer.recv(timeout_s=10) for _ in range(L)]
    took = time.monotonic() - t0
    assert [type(a) for a in answers] == [ReadDone] * L
    assert [a.batch_id for a in answers] == list(range(L))  # in the order prefill sent them
    assert r.slow.max_reading == 2 and r.recv.stats.max_reads_in_flight == 2
    assert r.recv.stats.pipelined_batches >= L - 1  # the first may go inline, the rest queue behind it
    assert took < L * 0.15 * 0.9, took  # overlapped: serial reads would take at least 0.6 s
    r.peer.send(TransferVerdict(version=V, request_ids=["a"], ok=True, reason=""))
    assert wait_until(lambda: r.recv.status("a").state is TransferState.DONE)
    got = r.recv.claim("a")
    for layer in range(L):  # bit-exact: each layer holds its slot's bytes (filled before any read)
        slot = layer % 2
        for n in ("latent", "rope"):
            assert torch.equal(r.dec.store[n][layer][list(got.main_blocks)], r.pre.slots[n][slot][[0, 1, 2]])
        for n in ("indexer", "indexer_scale"):
            assert torch.equal(r.dec.store[n][layer][list(got.indexer_blocks)], r.pre.slots[n][slot][[4, 5, 6]])


@needs_mooncake
def test_depth_one_reads_serially(pd_rig):
    from test_pd_sides import L

    r = pd_rig(depth=1, delay_s=0.05)
    send_all_layers(r, list(range(L)))
    answers = [r.peer.recv(timeout_s=10) for _ in range(L)]
    assert [a.batch_id for a in answers] == list(range(L)) and all(isinstance(a, ReadDone) for a in answers)
    assert r.slow.max_reading == 1 and r.recv.stats.pipelined_batches == 0


@needs_mooncake
def test_a_failed_read_in_the_pipeline_fails_the_request_and_nothing_after_it_is_done(pd_rig):
    from test_pd_sides import L

    r = pd_rig(depth=2, delay_s=0.1, fail_layers={1})
    send_all_layers(r, list(range(L)))
    answers = [r.peer.recv(timeout_s=10) for _ in range(L)]
    assert [a.batch_id for a in answers] == list(range(L))
    assert isinstance(answers[0], ReadDone)
    assert all(isinstance(a, ReadFailed) for a in answers[1:]), answers  # never READ_DONE after the failure
    assert "injected failure of layer 1" in answers[1].reason
    st = r.recv.status("a")
    assert st.state is TransferState.FAILED and "layer 1" in st.reason
    with pytest.raises(RequestFailed):
        r.recv.claim("a")
    # released exactly once, and only when no read into it was in flight any more
    assert wait_until(lambda: r.released == [r.dest])
    assert r.slow.reading == 0


@needs_mooncake
def test_a_layer_sent_twice_is_refused_while_the_first_is_still_in_flight(pd_rig):
    r = pd_rig(depth=2, delay_s=0.3)
    send_all_layers(r, [0, 0], batch_ids=[10, 11])  # the duplicate arrives before layer 0 is delivered
    first, second = r.peer.recv(timeout_s=10), r.peer.recv(timeout_s=10)
    assert (first.batch_id, second.batch_id) == (10, 11)
    assert isinstance(second, ReadFailed) and "sent twice" in second.reason
    assert r.slow.layers_read.count(0) <= 1  # the duplicate was never read


@needs_mooncake
def test_close_with_layers_queued_releases_the_destination_once(pd_rig):
    from test_pd_sides import L

    r = pd_rig(depth=2, delay_s=0.4)
    send_all_layers(r, list(range(L)))
    assert wait_until(lambda: r.slow.reading == 2)
    r.recv.close()
    assert r.recv.status("a").state is TransferState.FAILED
    assert r.released == [r.dest] and r.slow.reading == 0  # after the reads in flight returned
    assert len(r.slow.layers_read) == 2  # the two queued behind them were never read
