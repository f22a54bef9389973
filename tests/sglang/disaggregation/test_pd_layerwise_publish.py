"""P/D from the layerwise prefill offload pool: per-layer publish, decode read gates slot reuse.

Real SGLang objects: the layerwise pool harness of ``test_layerwise_pool`` (a dense
``DeviceDSAPool`` reference and a ``LayerwisePrefillPool`` with one shared buffer, fed
identical forwards through the ``ascend_offload`` attention backend), a decode
``DeviceDSAPool`` behind a :class:`DecodeSink`, one Mooncake engine per side over TCP.
The decode engine's reads are slowed down so that a slot released before decode's
READ_DONE would be rewritten under the read.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import torch
from dsa_harness import published_context
from layerwise_harness import LAYERS, PAGE, LayerwiseHarness, lw_config
from pd_components_harness import device_pool, host_pool, pd_config

from sglang_ascend_offload.transfer.status import TransferState

pytestmark = [
    pytest.mark.usefixtures("plugins_loaded"),
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)",
    ),
    pytest.mark.timeout(120),
]

SESSION = "decode-session"


@pytest.fixture
def ctx():
    with published_context():
        yield


def _wait(pub, sink, room, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p, d = pub.status(room), sink.status(room)
        if p is not None and p.terminal and d is not None and d.terminal:
            return p, d
        time.sleep(0.01)
    raise AssertionError(f"room {room}: prefill {pub.status(room)}, decode {sink.status(room)}")


def run_transfer(gate_reads: bool, decode_expects: bool = True, then=None, decode: str = "split", **config):
    """Prefill request ``a`` in two chunks (the last one published), decode reads it.

    Returns ``(prefill status, decode status, mismatching (layer, buffer) pairs, events,
    busy slots)``; ``gate_reads=False`` drops decode's consumer from the pool's gates
    (negative control); ``then(pub, harness, src_pages)`` runs once the transfer is over;
    ``decode="host_rows"``: decode runs sparse decode offload (main KV into its host pool,
    packed through the publisher's staging); read answers are then recorded where they
    release the shared buffer (``pool.gates.done``)."""
    from sglang_ascend_offload.transfer.decode_sink import DecodeSink
    from sglang_ascend_offload.transfer.engine import create_engine
    from sglang_ascend_offload.transfer.layerwise_publisher import LayerwisePublisher

    h = LayerwiseHarness(lw_config(1))  # one shared buffer for all reusable layers
    pool = h.pool
    assert len(pool.pipelined) >= 2, "the test needs a reused buffer"
    config = pd_config(**config)
    p_engine, d_engine = create_engine(config, "prefill"), create_engine(config, "decode")
    d_pool = device_pool(layers=LAYERS) if decode == "split" else host_pool(layers=LAYERS)
    sink = DecodeSink(config, d_tp=1, d_rank=0, dp_rank=0, pool=d_pool, engine=d_engine)
    pub = LayerwisePublisher(config, p_tp=1, p_rank=0, pool=pool, engine=p_engine)
    pub.note_peer(SESSION, sink.advert())
    if not gate_reads:
        pool.set_extra_consumers(lambda info: (pub.consumers_of(info), {})[1])

    events, lock = [], threading.Lock()
    real_read = d_engine.read

    # Decode is slow: reuse before READ_DONE would corrupt the read. Without the read gate
    # (negative control) every read waits until the prefill forward is over, so the shared
    # buffer holds the last layer by then and the corruption shows whatever the load (a
    # fixed 0.4 s delay let a loaded machine's slow forward hide it).
    forward_over = threading.Event()

    def slow_read(*args, **kwargs):
        if gate_reads:
            time.sleep(0.05)
        else:
            assert forward_over.wait(60), "the prefill forward never finished"
        return real_read(*args, **kwargs)

    d_engine.read = slow_read
    real_done, real_ready = pub.router.done, pool.pipe.wait_until_ready

    def done(slot, layer, consumer, error=None):
        with lock:
            events.append(("read_done", layer, error))
        real_done(slot, layer, consumer, error)

    def wait_until_ready(layer, timeout_s=None):
        real_ready(layer, timeout_s)
        with lock:
            events.append(("ready", layer, None))

    if decode == "split":
        pub.router.done = done
    else:
        real_done = pool.gates.done

        def pool_done(slot, layer, consumer, error=None):
            if consumer.startswith("pd_read:"):
                with lock:
                    events.append(("read_done", layer, error))
            real_done(slot, layer, consumer, error)

        pool.gates.done = pool_done
    pool.pipe.wait_until_ready = wait_until_ready
    try:
        a, b = h.new_request("a"), h.new_request("b")
        h.extend([a, b], [24, 9])  # first chunk of a (its rows go to the host store), b not sent
        events.clear()
        n_pages = -(-(a.length + 21) // PAGE)
        dst = list(range(1, n_pages + 1))
        if decode_expects:
            sink.expect(7, dst)
        pub.expect(a.row, room=7, session=SESSION)  # a's last chunk: cached rows loaded, new rows written
        h.extend([a], [21])
        pool.flush()
        forward_over.set()
        src = h.req_to_token_pool.req_to_token[a.row, : n_pages * PAGE : PAGE].long() // PAGE
        if not decode_expects:
            deadline = time.monotonic() + 30
            while not (pub.status(7).terminal and pool.gates.busy_slots() == []) and time.monotonic() < deadline:
                time.sleep(0.01)
            return pub.status(7), None, [], list(events), pool.gates.busy_slots(), pool.pipelined
        p, d = _wait(pub, sink, 7)
        dense = h.dense_pool  # what a prefill without layerwise offload holds
        if decode == "split":
            bad = [
                (layer, buf)
                for layer in range(LAYERS)
                for buf in ("k_buffer", "v_buffer", "index_k_buffer")
                if not torch.equal(getattr(d_pool, buf)[layer][dst], getattr(dense, buf)[layer][src])
            ]
        else:
            bad = []
            for layer in range(LAYERS):
                want = torch.cat(
                    (
                        dense.k_buffer[layer][src].reshape(len(src), PAGE, -1),
                        dense.v_buffer[layer][src].reshape(len(src), PAGE, -1),
                    ),
                    dim=-1,
                )
                if not torch.equal(d_pool.host_page_blocks(layer)[dst], want):
                    bad.append((layer, "host_rows"))
                if not torch.equal(d_pool.index_k_buffer[layer][dst], dense.index_k_buffer[layer][src]):
                    bad.append((layer, "index_k_buffer"))
        with lock:
            order = list(events)
        if then is not None:
            then(pub, h, src.tolist())
        return p, d, bad, order, pool.gates.busy_slots(), pool.pipelined
    finally:
        pub.close()
        sink.close()
        pool.close()
        p_engine.close()
        d_engine.close()


def test_decode_gets_every_layer_bit_exact_and_slots_wait_for_read_done(ctx):
    p, d, bad, order, busy, pipelined = run_transfer(gate_reads=True)
    assert p.state is TransferState.DONE and d.state is TransferState.DONE, (p, d)
    assert bad == []
    assert all(e[2] is None for e in order if e[0] == "read_done"), order
    assert sorted(e[1] for e in order if e[0] == "read_done") == list(range(LAYERS))
    for earlier, later in zip(pipelined, pipelined[1:]):  # same buffer: read before reuse
        assert order.index(("read_done", earlier, None)) < order.index(("ready", later, None)), order
    assert busy == []


def test_negative_control_without_the_read_gate_decode_reads_reused_buffers(ctx):
    p, d, bad, order, busy, pipelined = run_transfer(gate_reads=False)
    assert p.state is TransferState.DONE and d.state is TransferState.DONE, (p, d)
    assert any(layer in pipelined[:-1] for layer, _ in bad), bad  # the check above can fail


def test_decode_that_never_reads_fails_the_request_not_the_prefill_forward(ctx):
    p, _, _, order, busy, _ = run_transfer(gate_reads=True, decode_expects=False, layer_timeout_s=0.5)
    assert p.state is TransferState.FAILED and p.reason, p
    assert busy == []  # every gate answered; the forward above completed


def test_sends_after_the_forward_are_checked_and_stale_announcements_fail(ctx):
    """What the KV manager and the run_batch hook do around the forward (conn.py, install.py)."""
    seen = {}

    def then(pub, h, src):
        pub.check_sent(7, src)  # SGLang's last-chunk send names the pages published: nothing changes
        seen["same_pages"] = pub.status(7)
        pub.check_sent(8, src)  # never announced before its forward (optimistic prefill, requeue)
        seen["unannounced"] = pub.status(8)
        c = h.new_request("c")
        pub.expect(c.row, room=9, session=SESSION)
        pub.begin_batch()  # the next batch starts: room 9's forward never opened the pool
        seen["stale"] = pub.status(9)
        pub.forget(7)
        seen["forgotten"] = pub.status(7)

    p, d, bad, *_ = run_transfer(gate_reads=True, then=then)
    assert p.state is TransferState.DONE and bad == []
    assert seen["same_pages"].state is TransferState.DONE
    assert seen["unannounced"].state is TransferState.FAILED
    assert "optimistic prefill" in seen["unannounced"].reason
    assert seen["stale"].state is TransferState.FAILED and "never ran" in seen["stale"].reason
    assert seen["forgotten"] is None


def test_last_chunk_rows_picks_the_requests_this_forward_finishes():
    from types import SimpleNamespace as NS

    from sglang_ascend_offload.sglang_plugin.disaggregation.ascend_offload.install import last_chunk_rows

    extend = NS(is_extend=lambda: True)

    def req(row, room, end, n=100, pending=False, sender=True):
        return NS(
            kv=NS(req_pool_idx=row),
            bootstrap_room=room,
            extend_end=end,
            origin_input_ids=[0] * n,
            pending_bootstrap=pending,
            disagg_kv_sender=object() if sender else None,
        )

    batch = NS(
        forward_mode=extend,
        req_pool_indices_cpu=None,
        reqs=[
            req(0, 10, 100),  # last chunk
            req(1, 11, 64),  # middle chunk: its KV is published with the last one
            req(2, 12, 100, pending=True),  # optimistic, decode not bootstrapped: no peer yet
            req(3, None, 100),  # not a P/D request
            req(4, 14, 100, sender=False),
            req(5, 15, 120, n=120),
        ],
    )
    assert last_chunk_rows(batch) == [(0, 10), (5, 15)]
    # SGLang's batch carries the rows in request order; they win over the requests' own
    batch.req_pool_indices_cpu = torch.tensor([20, 21, 22, 23, 24, 25])
    assert last_chunk_rows(batch) == [(20, 10), (25, 15)]
    assert last_chunk_rows(NS(forward_mode=NS(is_extend=lambda: False), reqs=batch.reqs)) == []


def test_sparse_decode_offload_peer_gets_packed_rows_bit_exact_and_slots_wait_for_its_reads(ctx):
    """``host_rows`` decode: each layer is packed into the staging, main KV lands in decode's
    host pool, the indexer in its device cache; the shared buffer still waits for the read."""
    p, d, bad, order, busy, pipelined = run_transfer(gate_reads=True, decode="host_rows")
    assert p.state is TransferState.DONE and d.state is TransferState.DONE, (p, d)
    assert bad == []
    assert sorted(e[1] for e in order if e[0] == "read_done") == sorted(pipelined)
    for earlier, later in zip(pipelined, pipelined[1:]):
        assert order.index(("read_done", earlier, None)) < order.index(("ready", later, None)), order
    assert busy == []


def test_sent_pages_may_name_the_radix_trees_copies_but_not_another_count():
    """SGLang sends the pages in its row, which a radix checkpoint may have rewritten with the
    tree's pages of the same tokens (seen under load in the served P/D test, on prefix pages
    and on the last chunk's own page: 'SGLang sends 3 pages but 3 other pages were
    published'); the forward's published KV is the request's. Another count is another
    request's or forward's pages."""
    from sglang_ascend_offload.transfer.layerwise_publisher import sent_pages_problem

    published = (40, 41, 25)
    assert sent_pages_problem((40, 41, 25), published) == ""
    assert sent_pages_problem((3, 5, 9), published) == ""  # the radix tree's copies of the same tokens
    # negative controls: a page too many or too few
    assert "sends 2 pages but 3" in sent_pages_problem((40, 41), published)
    assert "sends 4 pages but 3" in sent_pages_problem((40, 41, 25, 26), published)
