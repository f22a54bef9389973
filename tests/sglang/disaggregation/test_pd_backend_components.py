"""The ascend_offload P/D backend's adapter classes with real SGLang pools and real engines.

In one process: a prefill rank's :class:`PrefillLinks` over the plugin's
``DeviceDSAPool`` (random KV) and a decode rank's :class:`DecodeSink` over either a
``DeviceDSAPool`` (``split``) or the sparse-decode ``HostMainKVPool`` (``host_rows``),
each with its own Mooncake engine over TCP on 127.0.0.1. Pulled pages must equal the
prefill pages bit for bit (main KV into the host pool rows, index K into the device
cache); failures must reach both sides with their reason and leave nothing busy.

npu-marked, on the stand-in only: the same links and sink with both ranks' pools on the
``npu`` device (the packing staging and index K on the device, the host rows in host
memory), equal to the CPU run bit for bit. MemFabric's engine, which moves device memory
on a node, has no stand-in; the Mooncake TCP engine moves the stand-in's device memory
(CPU memory underneath), and on a node ``test_pd_npu.py`` runs the MemFabric path.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import npu_standin
import pytest
import torch
from dsa_harness import LATENT, ROPE, published_context
from npu_requirements import npu_present
from pd_components_harness import (
    LAYERS,
    PAGE,
    Pair,
    assert_host_rows_equal,
    assert_idle,
    assert_split_equal,
    device_pool,
    draft_pool,
    host_pool,
)

from sglang_ascend_offload.transfer.layout import layout_mismatches
from sglang_ascend_offload.transfer.status import TransferState

pytestmark = [
    pytest.mark.usefixtures("plugins_loaded"),
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)",
    ),
    pytest.mark.timeout(120),
]


@pytest.fixture
def ctx():
    with published_context():
        yield


# ------------------------------------------------------------------ layouts
def test_layouts_of_the_pools_pair_up(ctx):
    from sglang_ascend_offload.transfer import pool_layouts as layouts

    p, d, h = device_pool(), device_pool(), host_pool()
    split_p = layouts.layout_of(p, layouts.split_tensors(p))
    assert layout_mismatches(split_p, layouts.layout_of(d, layouts.destination_tensors(d))) == []
    staging = layouts.PackedStaging(p, slots=2, max_blocks=8)
    packed_p = layouts.layout_of(p, staging.tensors())
    rows_d = layouts.layout_of(h, layouts.destination_tensors(h))
    assert layouts.layout_kind(h) == "host_rows" and layouts.layout_kind(d) == "split"
    assert layout_mismatches(packed_p, rows_d) == []
    assert [t.block_bytes for t in rows_d.main] == [PAGE * (LATENT + ROPE) * 2]
    assert rows_d.main[0].num_blocks == h.host_pool.shape.tokens // PAGE
    # the staging slots alias: layer L uses slot L % 2
    bases = packed_p.main[0].layer_base_addrs
    assert bases[0] == bases[2] != bases[1]
    why = layout_mismatches(split_p, rows_d)
    assert any("main tensor count" in w for w in why)
    # SGLang's registration numbers of the host pool (ptrs, lengths, item lengths)
    ptrs, lens, items = h.get_contiguous_buf_infos()
    assert len(ptrs) == 2 * LAYERS and items[0] == PAGE * (LATENT + ROPE) * 2
    assert ptrs[0] == h.host_rows(0).data_ptr()


def test_packing_is_a_bit_exact_gather(ctx):
    from sglang_ascend_offload.transfer.pool_layouts import LayoutError, PackedStaging

    p = device_pool(fill_seed=3)
    staging = PackedStaging(p, slots=2, max_blocks=4)
    pages = [5, 2, 9]
    for layer in range(LAYERS):
        slot = staging.pack(layer, pages)
        assert slot == layer % 2
        want = torch.cat(
            (p.k_buffer[layer][pages].reshape(3, PAGE, LATENT), p.v_buffer[layer][pages].reshape(3, PAGE, ROPE)), dim=-1
        )
        assert torch.equal(staging.buffer[slot, :3], want)
    with pytest.raises(LayoutError, match="exceeds the P/D staging"):
        staging.pack(0, [1, 2, 3, 4, 5])


def test_pools_the_backend_cannot_move_are_refused(ctx):
    from sglang_ascend_offload.transfer.pool_layouts import LayoutError, check_draft_pool, check_pool

    with pytest.raises(LayoutError, match="ascend_offload attention backend"):
        check_pool(object())
    check_draft_pool(device_pool(), draft_pool())  # the draft model's pool in the target's page space
    with pytest.raises(LayoutError, match=r"draft \(NextN\) KV pool.*pages: draft 9, target 17") as err:
        check_draft_pool(device_pool(), draft_pool(slots=8 * PAGE))
    assert "main KV pages" in str(err.value)  # every problem, not the first
    with pytest.raises(LayoutError, match="not a device pool"):
        check_draft_pool(device_pool(), host_pool())


def test_draft_layer_layouts_say_where_the_draft_kv_lands(ctx):
    """Decode with sparse decode offload: base layers as host rows, the draft layer (logical
    layer L) as device latent / rope pages; the prefill's packed source says the same."""
    from sglang_ascend_offload.transfer import pool_layouts as layouts

    p, h = device_pool(), host_pool()
    rows_d = layouts.layout_of(h, layouts.destination_tensors(h, draft_pool()))
    assert rows_d.num_layers == LAYERS + 1
    groups = [(layers, [t.name for t in specs]) for layers, specs in rows_d.main_groups()]
    assert groups == [(list(range(LAYERS)), ["latent_rope"]), ([LAYERS], ["latent", "rope"])]
    assert rows_d.indexer.layers is None and len(rows_d.indexer.layer_base_addrs) == LAYERS + 1
    staging = layouts.PackedStaging(p, slots=2, max_blocks=8, draft_pool=draft_pool())
    packed_p = layouts.layout_of(p, staging.tensors())
    assert layout_mismatches(packed_p, rows_d) == []
    split_p = layouts.layout_of(p, layouts.split_tensors(p, draft_pool()))
    assert [t.layers for t in split_p.main] == [None, None]  # the draft layer extends the base tensors
    assert layout_mismatches(split_p, layouts.layout_of(p, layouts.split_tensors(p, draft_pool()))) == []
    why = layout_mismatches(split_p, rows_d)
    assert any(w.startswith(f"layers 0-{LAYERS - 1}: main tensor count") for w in why), why
    assert not any(w.startswith(f"layers {LAYERS}:") for w in why), why  # the draft layers agree
    # a prefill without the draft layer: the layer count says it
    assert any(
        "layers: prefill 3, decode 4" in w
        for w in layout_mismatches(
            layouts.layout_of(p, layouts.PackedStaging(p, slots=2, max_blocks=8).tensors()), rows_d
        )
    )


# ------------------------------------------------------------------ data path
@pytest.mark.parametrize("kind", ["split", "host_rows"])
def test_requests_arrive_bit_exact(ctx, kind):
    pair = Pair(device_pool() if kind == "split" else host_pool())
    try:
        jobs = {
            11: ([3, 7, 1], [9, 4, 12]),
            12: ([2, 5, 8, 10, 11, 13, 14, 15], [1, 2, 3, 5, 6, 7, 8, 10]),
            13: ([6], [15]),
        }
        pair.transfer_all(jobs, assert_split_equal if kind == "split" else assert_host_rows_equal)
        link = pair.links.links()[0]
        assert link.sender.open_batches() == 0
        assert link.gates.busy_slots() == []
        stats = pair.links.stats
        assert stats.layers_published == LAYERS * len(jobs)
        assert stats.packed_layers == (LAYERS * len(jobs) if kind == "host_rows" else 0)
        assert pair.sink.receiver.stats.requests_done == len(jobs)
        if kind == "host_rows":
            assert pair.d_pool.k_buffer is None  # no device main KV on the way
    finally:
        pair.close()


PD_JOBS = {
    11: ([3, 7, 1], [9, 4, 12]),
    12: ([2, 5, 8, 10, 11, 13, 14, 15], [1, 2, 3, 5, 6, 7, 8, 10]),
    13: ([6], [15]),
}


def _decode_state(pool):
    """Every destination tensor of a decode pool, on the host (device pool: latent, rope,
    index K; host pool: each layer's host rows and the index K)."""
    if pool.k_buffer is None:
        return [pool.host_rows(layer).cpu() for layer in range(LAYERS)] + [pool.index_k_buffer.cpu()]
    return [pool.k_buffer.cpu(), pool.v_buffer.cpu(), pool.index_k_buffer.cpu()]


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN and torch_npu")
@pytest.mark.skipif(
    npu_present() and not npu_standin.installed(),
    reason="Mooncake TCP cannot move device memory: on a node test_pd_npu.py runs the links and sink over MemFabric",
)
@pytest.mark.parametrize("kind", ["split", "host_rows"])
def test_links_and_sink_on_npu_pools_equal_the_cpu_run(kind):
    """Prefill and decode pools on the npu device, the same requests as the CPU run: every
    request done on both sides, the decode pool's every tensor equal to the CPU run's,
    each request's pages equal to the prefill's; ``host_rows`` packs on the device
    (its staging is an npu tensor) into host rows in host memory, and no device main KV
    exists on the decode."""
    pools = {}
    for device in ("cpu", "npu"):
        with published_context(device):
            decode = device_pool(device=device) if kind == "split" else host_pool(device=device)
            pair = Pair(decode, prefill_pool=device_pool(fill_seed=1, device=device))
            try:
                pair.transfer_all(PD_JOBS, assert_split_equal if kind == "split" else assert_host_rows_equal)
                link = pair.links.links()[0]
                assert link.sender.open_batches() == 0 and link.gates.busy_slots() == []
                assert pair.sink.receiver.stats.requests_done == len(PD_JOBS)
                if kind == "host_rows":
                    assert link.staging.buffer.device.type == device and decode.k_buffer is None
                    assert decode.host_rows(0).device.type == "cpu"
                assert decode.index_k_buffer.device.type == device
                pools[device] = _decode_state(decode)
            finally:
                pair.close()
    for got, want in zip(pools["npu"], pools["cpu"]):
        # an NPU host pool's layers are rounded up to 4 KiB-aligned slices (the fused Copy-SFA
        # registers them): compare the rows both have
        rows = min(got.shape[0], want.shape[0])
        assert torch.equal(got[:rows], want[:rows])


def assert_draft_equal(p_draft, d_draft, src, dst):
    for buf in ("k_buffer", "v_buffer", "index_k_buffer"):
        assert torch.equal(getattr(d_draft, buf)[0][dst], getattr(p_draft, buf)[0][src]), buf


@pytest.mark.parametrize("kind", ["split", "host_rows"])
def test_the_draft_layer_arrives_bit_exact_on_the_device(ctx, kind):
    """Speculative P/D: every request moves its base layers and then the draft (NextN)
    layer into the decode's device draft pool, packed for nothing (host_rows packs the
    base layers only)."""
    d_draft = draft_pool()
    pair = Pair(device_pool() if kind == "split" else host_pool(), p_draft=draft_pool(fill_seed=7), d_draft=d_draft)
    try:
        jobs = {41: ([3, 7, 1], [9, 4, 12]), 42: ([2, 5, 8, 10, 11], [1, 2, 3, 5, 6]), 43: ([6], [15])}
        pair.transfer_all(
            jobs,
            assert_split_equal if kind == "split" else assert_host_rows_equal,
            also=lambda src, dst: assert_draft_equal(pair.p_draft, d_draft, src, dst),
        )
        untouched = sorted(set(range(1, 16)) - {b for _, dst in jobs.values() for b in dst})
        assert not d_draft.k_buffer[0][untouched].any()  # nothing else was written
        stats = pair.links.stats
        assert stats.layers_published == (LAYERS + 1) * len(jobs)
        assert stats.packed_layers == (LAYERS * len(jobs) if kind == "host_rows" else 0)
        assert_idle(pair.links.links()[0])
        assert pair.sink.advert().draft_layers == 1
    finally:
        pair.close()


@pytest.mark.parametrize("prefill_draft", [True, False])
def test_a_draft_layer_on_one_side_only_fails_with_the_reason(ctx, prefill_draft):
    pair = Pair(
        host_pool(),
        p_draft=draft_pool(fill_seed=7) if prefill_draft else None,
        d_draft=None if prefill_draft else draft_pool(),
    )
    try:
        pair.sink.expect(51, [1, 2])
        pair.links.submit(51, ["decode-session"], [3, 4])
        p, _ = pair.wait(51, decode=False)
        assert p.state is TransferState.FAILED
        assert (
            f"serves {0 if prefill_draft else 1} speculative draft layer(s), this prefill {1 if prefill_draft else 0}"
            in p.reason
            and "--speculative-algorithm" in p.reason
        )
        assert pair.links.stats.handshakes == 0  # refused before any handshake
        assert pair.sink.forget(51, "test done")
    finally:
        pair.close()


def test_page_count_mismatch_fails_both_sides_and_frees_everything(ctx):
    pair = Pair(host_pool())
    try:
        p, d = pair.transfer(21, [1, 2, 3], [4, 5])
        assert p.state is TransferState.FAILED and d.state is TransferState.FAILED
        assert "3 blocks, decode destination 2" in d.reason
        assert "3 blocks, decode destination 2" in p.reason  # decode's READ_FAILED reason reaches prefill
        assert pair.sink.released(21)  # no read in flight: SGLang may free the pages
        assert_idle(pair.links.links()[0])
        # the link still works for the next request
        p, d = pair.transfer(22, [1, 2], [4, 5])
        assert p.state is TransferState.DONE and d.state is TransferState.DONE
    finally:
        pair.close()


def test_handshake_refusal_fails_the_request_with_every_reason(ctx):
    pair = Pair(device_pool(page=32), prefill_pool=device_pool(fill_seed=1))
    try:
        pair.sink.expect(31, [1])
        pair.links.submit(31, ["decode-session"], [1])
        p, _ = pair.wait(31, decode=False)
        assert p.state is TransferState.FAILED
        assert "refused the handshake" in p.reason and "tokens per block: prefill 16, decode 32" in p.reason
        pair.links.submit(32, ["decode-session"], [2])  # the link stays failed: no second handshake wait
        p2, _ = pair.wait(32, timeout=2.0, decode=False)
        assert p2.state is TransferState.FAILED and "tokens per block" in p2.reason
        assert pair.links.stats.handshakes == 1
        assert pair.sink.forget(31, "test done")  # pending decode request: failed and released at once
    finally:
        pair.close()


def test_requests_without_an_advert_or_with_two_decode_peers_fail(ctx):
    pair = Pair(device_pool())
    try:
        pair.links.submit(41, ["someone-else"], [1])
        assert "never registered" in pair.links.status(41).reason
        pair.links.note_peer("broken", None, "invalid decode advert from broken: bad")
        pair.links.submit(42, ["broken"], [1])
        assert "invalid decode advert" in pair.links.status(42).reason
        pair.links.submit(43, ["decode-session", "other"], [1])
        assert "2 decode ranks target" in pair.links.status(43).reason
        pair.links.submit(44, ["decode-session"], [1, 1])
        assert "repeated pages" in pair.links.status(44).reason
    finally:
        pair.close()


class _Gate:
    """A stand-in for SGLang's wait_event: the link blocks on it until released."""

    def __init__(self):
        self.event = threading.Event()

    def synchronize(self):
        assert self.event.wait(10.0)


def test_cancel_before_publication_publishes_nothing(ctx):
    pair = Pair(device_pool())
    try:
        gate = _Gate()
        pair.sink.expect(51, [3])
        pair.links.submit(51, ["decode-session"], [3], wait_event=gate)
        pair.links.cancel(51, "aborted by the prefill scheduler")
        gate.event.set()
        p = pair.links.status(51)
        assert p.state is TransferState.FAILED and "aborted" in p.reason
        time.sleep(0.2)
        assert pair.links.stats.layers_published == 0
        assert pair.sink.status(51).state is TransferState.PENDING  # decode learns it from SGLang's status path
        assert pair.sink.forget(51, "SGLang failed the request")
        assert pair.sink.status(51) is None
        pair.links.forget(51)
        assert pair.links.open_units() == []
    finally:
        pair.close()


def test_decode_gives_up_and_prefill_fails_with_decode_reason(ctx):
    """Decode fails a request while prefill publishes (SGLang aborted it): prefill's
    next batch is answered READ_FAILED, prefill fails, nothing stays gated."""
    pair = Pair(host_pool())
    try:
        gate = _Gate()
        pair.sink.expect(61, [1, 2])
        pair.links.submit(61, ["decode-session"], [1, 2], wait_event=gate)
        pair.sink.fail(61, "aborted by the decode scheduler")
        gate.event.set()
        assert pair.sink.released(61)  # nothing was reading: released (and forgotten) at once
        assert pair.sink.status(61) is None
        p, _ = pair.wait(61, decode=False)
        assert p.state is TransferState.FAILED and "unknown request on decode" in p.reason
        # layer 0 is answered READ_FAILED; layer 2 waits for slot 0, so at most layers 0 and 1 went out
        assert pair.links.stats.layers_published <= 2
        assert_idle(pair.links.links()[0])
    finally:
        pair.close()
