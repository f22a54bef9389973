"""The NPU TP-shared host pool (MemFabric global addresses) across real processes, on CPU.

The ranks are spawned processes running the served allocation
(``allocate_rank_pool(shape, "memfabric", view)`` with the platform reporting an NPU)
over the ``memfabric_hybrid`` stand-in (``fake_memfabric``: rank 0's segment is a
shared file, global addresses a fixed convention, copies ``memmove``). Shown here:
one pool per group at one global address on every rank; rank 0's appends read bit for
bit by the other ranks' miss copies (equal to a one-rank engine with a private pool);
the readers waited for appends (ordering exercised); teardown leaves no file behind;
a rank whose ``bm join`` fails, a rank 0 that dies during setup, and a rank 0 that
dies mid-decode each give every surviving rank a clear error within the deadline.
What only an NPU shows (real BM memory, ``L2G`` / ``G2L`` copies, HCCS / RDMA
transport): ``test_shared_host_pool_npu.py``.
"""

from __future__ import annotations

import os

import memfabric_group_worker as w
import pytest
import torch

pytestmark = pytest.mark.slow

DEADLINE_S = 6.0
# Setup failures must be detected, not waited out: with this wait deadline a rank that
# only waited would still be waiting when run_group gives up (120 s) and report nothing.
NEVER_S = 600.0


def _env(tmp_path, fail: str = "", deadline_s: float = DEADLINE_S) -> dict:
    (tmp_path / "fake").mkdir(exist_ok=True)
    (tmp_path / "shm").mkdir(exist_ok=True)
    return {
        "FAKE_MEMFABRIC_DIR": str(tmp_path / "fake"),
        "FAKE_MEMFABRIC_FAIL": fail,
        "SGLANG_ASCEND_OFFLOAD_SHM_DIR": str(tmp_path / "shm"),
        "SGLANG_ASCEND_OFFLOAD_APPEND_TIMEOUT_S": str(deadline_s),
    }


def _leftovers(tmp_path) -> list:
    return sorted(
        str(p.relative_to(tmp_path))
        for p in tmp_path.rglob("*")
        if p.is_file() or (p.is_dir() and p.name.startswith("store."))
    )


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_read_rank0s_appends_bit_exactly_through_one_global_pool(tmp_path, size):
    got, codes = w.run_group(size, _env(tmp_path))
    assert sorted(got) == list(range(size)), got
    errors = {r: e for r, (_, _, e) in got.items() if e}
    assert not errors, errors
    want = w.reference_outputs().view(torch.int16).numpy()
    for rank, (out, info, _) in got.items():
        assert info["kind"] == "memfabric_gva" and info["tensor_backed"] is False
        assert (out == want).all(), f"rank {rank} outputs differ from the one-rank engine"
    bases = {info["base"] for _, info, _ in got.values()}
    assert len(bases) == 1 and bases != {0}  # one pool, one global address on every rank
    assert sum(got[r][1]["waits"] for r in range(1, size)) > 0  # readers did wait for appends
    assert codes == [0] * size
    assert _leftovers(tmp_path) == []  # BM segment, store and control block all gone


def test_a_failed_join_on_rank1_is_a_clear_error_on_every_rank(tmp_path):
    got, codes = w.run_group(3, _env(tmp_path, fail="join:1", deadline_s=NEVER_S))
    assert sorted(got) == [0, 1, 2]
    assert "bm join returned -1" in got[1][2] and "injected failure on rank 1" in got[1][2]
    for r in (0, 2):
        err = got[r][2]
        assert err and err.startswith("GroupSetupError"), err
        assert "TP rank 1 failed at 'joined'" in err and "injected failure on rank 1" in err  # detected
    assert _leftovers(tmp_path) == []  # every rank released what it had


def test_rank0_dying_during_setup_is_a_clear_error_on_the_others(tmp_path):
    got, codes = w.run_group(3, _env(tmp_path, fail="exit_join:0", deadline_s=NEVER_S))
    assert codes[0] == 17 and 0 not in got
    for r in (1, 2):
        err = got[r][2]
        assert err and err.startswith("GroupSetupError"), err
        assert "TP rank 0 died" in err  # detected, not waited out


def test_rank0_dying_mid_decode_fails_the_readers_within_the_deadline(tmp_path):
    got, codes = w.run_group(2, _env(tmp_path), die_after_step=2)
    assert codes[0] == 19 and 0 not in got
    err = got[1][2]
    assert err and err.startswith("AppendTimeout"), err
    assert "attention-TP rank 1" in err and "TP rank 0 is dead or stuck" in err
    assert got[1][1]["seconds"] >= DEADLINE_S  # the reader waited out its append deadline, then failed


def test_engine_gather_path_matches_the_tensor_path_in_process():
    """A pool without a tensor view goes through ``gather_into``; same outputs as the
    kernels over the tensor (one process, no MemFabric)."""
    from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool

    pool = w.NoViewPool(HostKVPool.allocate(w.shape(), "pinned"))
    out = w.workload(w.engine_for(pool, 0), 0)
    assert torch.equal(out.view(torch.int16), w.reference_outputs().view(torch.int16))
    assert pool.gathers == w.STEPS * w.LAYERS


def test_no_private_pool_per_rank_warning_left():
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp

    src = open(shp.__file__).read()
    assert "private MemFabric host pool per" not in src
    assert os.path.exists(os.path.join(os.path.dirname(shp.__file__), "group_rendezvous.py"))
