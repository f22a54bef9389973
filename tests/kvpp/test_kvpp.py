"""KVPP: ownership, memory plan, and broadcast + prefetch across real gloo processes."""

import os
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from npu_requirements import npu_present

from sglang_ascend_offload.kvpp.ownership import assign_owners
from sglang_ascend_offload.kvpp.plan import ComponentSpec, bundles_for, mla_bundle, plan_rank
from sglang_ascend_offload.kvpp.runtime import BroadcastTransport, KVPPScheduler, KVPPStorage


def test_contiguous_balanced_ownership():
    own = assign_owners(range(8), 3)
    assert [own.owner_of[i] for i in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
    own = assign_owners([5, 1, 3, 7], 4)
    assert own.owner_of == {1: 0, 3: 1, 5: 2, 7: 3}
    own = assign_owners(range(62), 8, draft_layers=[61])
    assert 61 not in own.owner_of and own.draft_layers == (61,)
    sizes = [len(own.owned_by(r)) for r in range(8)]
    assert sizes == [8] * 5 + [7] * 3 and sum(sizes) == 61
    for r in range(8):  # contiguous
        layers = own.owned_by(r)
        assert list(layers) == list(range(layers[0], layers[-1] + 1))


def test_memory_formula_matches_seed():
    comps = mla_bundle()  # DeepSeek-V3.2 layer per 128-token block: (512+64)*2*128 + 128*2*128
    per_layer = (512 + 64) * 2 * 128 + 128 * 2 * 128
    assert sum(c.bytes_per_block for c in comps) == per_layer
    own = assign_owners(range(62), 8, draft_layers=[61])
    for rank in (0, 7):
        plan = plan_rank(rank, own, bundles_for(range(62), comps))
        owned = len(own.owned_by(rank))
        expected = owned * per_layer + 1 * per_layer + 2 * per_layer
        assert plan.physical_bytes_per_block == expected
        avail = 40 * 2**30
        assert plan.num_blocks(avail) == avail // expected
    # without KVPP every rank holds all 62 layers; with it rank 0 holds 8 + 1 draft + 2 scratch
    full = 62 * per_layer
    assert plan_rank(0, own, bundles_for(range(62), comps)).num_blocks(avail) > 5 * (avail // full)


def test_scratch_alternates_and_is_aligned():
    own = assign_owners(range(6), 2)
    comps = (ComponentSpec("a", 1000), ComponentSpec("b", 24))
    plan = plan_rank(0, own, bundles_for(range(6), comps))
    assert [plan.placement(layer, 3).kind for layer in range(6)] == ["persistent"] * 3 + ["scratch"] * 3
    assert [plan.placement(layer, 3).buffer for layer in (3, 4, 5)] == [1, 0, 1]
    assert plan.scratch_buffer_bytes(3) == 2 * 1024 * 1024
    ranges = plan.placement(4, 3).components
    assert [(r.offset, r.size) for r in ranges] == [(0, 3000), (3000, 72)]


def test_plan_lists_every_problem():
    own = assign_owners(range(3), 2)
    with pytest.raises(ValueError) as err:
        plan_rank(5, own, {0: (ComponentSpec("a", 0),)}, alignment=3)
    text = str(err.value)
    assert "rank 5" in text and "[1, 2]" in text and "bytes_per_block > 0" in text and "power of two" in text


def _free_port() -> int:
    from sglang_ascend_offload.testing.ports import reserve_port

    return reserve_port()  # reserved across processes, below the ephemeral range


NUM_LAYERS, GROUP, BLOCKS = 7, 3, 4
COMPS = (ComponentSpec("kv", 64), ComponentSpec("index", 16))


def _pattern(layer: int, version: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(layer * 1000 + version)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


ACTIVE = [0, 2, 3]  # blocks 0, 2, 3 of 4: two runs (staging path)


def _active_rows(transport, layer: int, blocks) -> torch.Tensor:
    """The ``blocks`` of every component of ``layer``'s bundle, concatenated (CPU)."""
    views = transport._block_views(layer)
    if blocks is None:
        return transport.storage.bundle(layer).cpu()
    idx = torch.tensor(blocks, dtype=torch.long, device=views[0].device)
    return torch.cat([v.index_select(0, idx).reshape(-1) for v in views]).cpu()


def _one_config(rank: int, group, device, prefetch: bool, active):
    own = assign_owners(range(NUM_LAYERS), GROUP)
    plan = plan_rank(rank, own, bundles_for(range(NUM_LAYERS), COMPS))
    storage = KVPPStorage(plan, BLOCKS, device)
    transport = BroadcastTransport(storage, group=group)
    sched = KVPPScheduler(transport, prefetch=prefetch)
    nbytes = sum(c.bytes_per_block for c in COMPS) * BLOCKS
    blocks = None if active is None else torch.tensor(active, dtype=torch.long)
    expected_rows = {}
    rng = random.Random(rank)
    # First prefill: no history -> no broadcast; owners write their layers.
    sched.schedule_forward(has_history=False)
    for layer in range(NUM_LAYERS):
        sched.wait_for_layer(layer)
        storage.bundle(layer).copy_(_pattern(layer, 0, nbytes).to(device))
        expected_rows[layer] = _active_rows(transport, layer, active)
    sched.complete_forward()
    assert transport.broadcasts == 0
    mismatches = 0
    for version in range(1, 4):  # forwards with history: see the owner's latest content
        sched.schedule_forward(has_history=True, active_blocks=blocks)
        for layer in range(NUM_LAYERS):
            sched.wait_for_layer(layer)
            if not torch.equal(_active_rows(transport, layer, active), expected_rows[layer]):
                mismatches += 1
            time.sleep(rng.random() * 0.004)  # compute while the next layer prefetches
            storage.bundle(layer).copy_(_pattern(layer, version, nbytes).to(device))  # KV update
            expected_rows[layer] = _active_rows(transport, layer, active)
        sched.complete_forward()
    sched.close()
    return (rank, mismatches, transport.broadcasts, transport.bytes_received, storage.allocated_bytes)


def _worker(rank: int, port: int, configs, result_q, device_kind: str = "cpu") -> None:
    """Every ``(prefetch, active blocks)`` config in turn, in one process group."""
    try:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        device = torch.device("cpu")
        if device_kind == "npu":
            import torch_npu  # noqa: F401

            torch.npu.set_device(rank)
            device = torch.device(f"npu:{rank}")
        dist.init_process_group("gloo" if device_kind == "cpu" else "hccl", rank=rank, world_size=GROUP)
        group = dist.new_group(list(range(GROUP)))
        on_compute = _count_broadcasts_on_the_compute_stream() if device_kind == "npu" else [0]
        results = [_one_config(rank, group, device, prefetch, active) for prefetch, active in configs]
        result_q.put([r + (on_compute[0],) for r in results])
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        result_q.put([(rank, repr(exc), None, None, None, None)])


def _count_broadcasts_on_the_compute_stream():
    """Wrap ``dist.broadcast`` (the transport looks it up per call): count the calls issued
    while the device's default (compute) stream is current. The transport promises to
    broadcast on its own transfer stream, so the count must stay 0."""
    real = dist.broadcast
    compute = torch.npu.default_stream()
    count = [0]

    def recording(*args, **kwargs):
        if torch.npu.current_stream() == compute:
            count[0] += 1
        return real(*args, **kwargs)

    dist.broadcast = recording
    return count


def _run_group(configs, device_kind: str = "cpu"):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, configs, q, device_kind)) for r in range(GROUP)]
    for p in procs:
        p.start()
    replies = [q.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    own = assign_owners(range(NUM_LAYERS), GROUP)
    per_block = sum(c.bytes_per_block for c in COMPS)
    for reply in replies:
        assert len(reply) == len(configs), reply
        for (prefetch, active), (rank, mismatches, broadcasts, received, allocated, on_compute) in zip(configs, reply):
            what = f"rank {rank}, prefetch={prefetch}, active={active}"
            assert mismatches == 0, (what, mismatches)
            assert broadcasts == 3 * NUM_LAYERS, what
            nbytes = per_block * (BLOCKS if active is None else len(active))
            assert received == 3 * nbytes * (NUM_LAYERS - len(own.owned_by(rank))), what
            assert allocated == per_block * BLOCKS * len(own.owned_by(rank)) + 2 * 2 * 1024 * 1024, what
            assert on_compute == 0, (what, f"{on_compute} broadcasts issued on the compute stream")


def test_broadcast_prefetch_across_processes():
    """Three processes over gloo, whole bundles with and without prefetch, then only the
    active blocks: 0, 2, 3 gathered into staging and scattered on the receivers; the
    single run 1-2 in place, per component. Every receiver's copy equals the owner's
    latest content."""
    _run_group([(True, None), (False, None), (True, ACTIVE), (True, [1, 2])])


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs 3 Ascend NPUs with CANN and torch_npu (HCCL)")
def test_hccl_broadcast_on_transfer_stream():
    """The same over HCCL: bundles on ``npu:r``, broadcasts on the transfer stream after
    the compute stream's ready event (no broadcast is issued on the compute stream:
    counted in every worker), completion events before a layer is used; whole bundles
    and the active blocks (staging path), with and without prefetch, in one process
    group. Every receiver's copy equals the owner's latest content, bit for bit, as in
    the gloo run."""
    if torch.npu.device_count() < GROUP:
        pytest.skip(f"needs {GROUP} NPUs")
    _run_group([(True, None), (False, None), (True, ACTIVE), (False, ACTIVE)], device_kind="npu")


def test_bench_kvpp_json_keys_and_active_bytes():
    """``bench kvpp --json``: one JSON document with exactly the issue's keys; active-block
    bytes are active / pool x full-layer bytes (no metadata travels)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_ascend_offload",
            "bench",
            "kvpp",
            "--json",
            "--layers",
            "3",
            "--pool-blocks",
            "16",
            "--block-tokens",
            "4",
            "--fill",
            "0.25,1",
            "--repeats",
            "1",
            "--compute-ms",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads(out.stdout)["runs"]
    keys = [
        "group",
        "layers",
        "mode",
        "pool_blocks",
        "active_blocks",
        "bytes_per_forward",
        "wall_s",
        "compute_s",
        "broadcast_s",
        "wall_over_max",
    ]
    assert all(list(r) == keys for r in runs)
    assert [(r["mode"], r["active_blocks"]) for r in runs] == [("full", 4), ("active", 4), ("full", 16), ("active", 16)]
    per_block = sum(c.bytes_per_block for c in mla_bundle(block_size=4))
    for r in runs:
        blocks = r["pool_blocks"] if r["mode"] == "full" else r["active_blocks"]
        assert r["bytes_per_forward"] == 3 * per_block * blocks
        assert r["wall_s"] > 0
        assert r["wall_over_max"] > 0  # median of per-round ratios (one round here: the same ratio)
        assert r["wall_over_max"] == pytest.approx(r["wall_s"] / max(r["compute_s"], r["broadcast_s"]), rel=2e-3)
