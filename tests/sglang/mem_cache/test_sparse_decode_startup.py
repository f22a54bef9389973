"""The sparse decode pool's startup as a node operator reads it in the log
(``sglang_plugin/mem_cache/sparse_decode_startup.py``, ``startup_phases.py``).

The served pool builder is called as SGLang's pool hook calls it, with the pool itself
built the way the served pool builds it on CPU: the attention-DP group's shared host pool
(``allocate_rank_pool``: a shared mapping, here a group of one) under a sparse decode
engine with the fused ops (the AscendC kernels on their functional model). Only the
SGLang pool class around them is left out (a stand-in holding the engine), so the test
does not depend on SGLang's configurator.

* a 2 GiB host pool: every phase is logged with its time -- host-pool allocation,
  population and registration with progress lines (GiB done / total, the rate) at the
  progress interval the test sets, the group rendezvous, the kernel qualification -- and
  one summary line names them all in order;
* a planted faulty LIM, and a planted faulty Copy-SFA, each stop the same startup: the
  qualification error, the failed phase with its fix, and the summary line marking it FAILED;
* a host pool the file system cannot hold fails in the allocation phase, naming the size
  and the fix;
* ``qualify_kernels: false`` logs the warning and no qualification phase (negative
  control of the first test's qualification lines).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from types import SimpleNamespace

import pytest
from kernel_mutations import (
    COPY_SFA_ROPE_OFFSET,
    LIM_VICTIM_ORDER,
    fused_ops_from,
    mutated_library,
    registration_left_as_found,
)

from sglang_ascend_offload.config import SparseDecodeOffloadConfig
from sglang_ascend_offload.ops.qualify import KernelQualificationError
from sglang_ascend_offload.sglang_plugin.mem_cache import sparse_decode_startup as startup
from sglang_ascend_offload.sglang_plugin.mem_cache.pool import sparse_decode as pool_module
from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape
from sglang_ascend_offload.startup_phases import startup_log

LAYERS, HOT, TOPK, PAGE = 4, 256, 128, 64
CONFIGURATOR = SimpleNamespace(
    model_config=SimpleNamespace(hf_config=SimpleNamespace(index_n_heads=8, index_head_dim=128, num_attention_heads=4))
)
PHASES = ["host-pool allocation", "host-pool population", "group rendezvous", "host-pool registration"]


@pytest.fixture(autouse=True, scope="module")
def _fused_ops_left_as_found():
    with registration_left_as_found():
        yield


def _tokens_for(gib: float) -> int:
    return int(gib * 2**30 / (LAYERS * 1152)) // 32 * 32


@pytest.fixture
def served_builder(monkeypatch):
    """Replace the SGLang pool class by a stand-in around the served host pool and engine."""

    def use(tokens: int):
        def build(configurator, offload, **kwargs):
            view = shared.GroupView(0, 1, 0, 1, broadcast_object=lambda obj: obj, barrier=lambda: None)
            rank_pool = shared.allocate_rank_pool(HostPoolShape(LAYERS, tokens), "pinned", view=view)
            engine = SparseDecodeEngine(
                EngineConfig(
                    LAYERS, 3, HOT, TOPK, 512, 64, ops=offload.ops, caller_runs_indexer=True, manage_impl="torch"
                ),
                rank_pool.pool,
                device="cpu",
            )
            return SimpleNamespace(engine=engine, page_size=PAGE, host_pool=rank_pool.pool)

        monkeypatch.setattr(pool_module, "build_offload_pool", build)

    return use


def _messages(caplog):
    return [r.getMessage() for r in caplog.records]


def test_a_multi_gib_startup_logs_every_phase_with_progress_and_one_summary(served_builder, caplog):
    served_builder(_tokens_for(2.0))
    with caplog.at_level(logging.INFO), startup_log(startup.STARTUP, progress_interval_s=0.05):
        pool = startup.build_offload_pool(CONFIGURATOR, SparseDecodeOffloadConfig(ops="fused"))
    lines = _messages(caplog)
    pool.host_pool.close()
    for name in PHASES + ["kernel qualification"]:
        assert any(line.startswith(f"startup phase {name}") and "..." in line for line in lines), name
        assert any(re.match(rf"startup phase {name}: done in \d+\.\d\d s", line) for line in lines), name
    for name in ("host-pool allocation", "host-pool population"):
        progress = [line for line in lines if re.match(rf"startup phase {name}: \d+\.\d\d GiB / 2\.00 GiB", line)]
        assert progress and all("GiB/s" in line for line in progress), (name, lines)
    assert any(line.startswith("kernel qualification: LIM, Copy-SFA qualified in") for line in lines)
    (summary,) = [line for line in lines if line.startswith(startup.STARTUP + ":")]
    names = re.findall(r"(?:, |: )([a-z -]+?) \d+\.\d\d s", summary)
    assert names == PHASES + ["kernel qualification"], summary
    assert "host-pool allocation" in summary and "(2.00 GiB," in summary and "FAILED" not in summary


@pytest.mark.parametrize(
    "mutation,op,setting",
    [(LIM_VICTIM_ORDER, "LIM", "fused_lim"), (COPY_SFA_ROPE_OFFSET, "Copy-SFA", "fused_copy_sfa")],
    ids=["faulty-lim", "faulty-copy-sfa"],
)
def test_a_faulty_kernel_stops_the_startup_in_the_qualification_phase(
    served_builder, caplog, tmp_path, mutation, op, setting
):
    served_builder(_tokens_for(0.01))
    with fused_ops_from(mutated_library(tmp_path, mutation)), caplog.at_level(logging.INFO):
        with pytest.raises(KernelQualificationError, match=f'fused {op} .* fix: set "{setting}": false'):
            startup.build_offload_pool(CONFIGURATOR, SparseDecodeOffloadConfig(ops="fused"))
    lines = _messages(caplog)
    assert any(
        line.startswith("startup phase kernel qualification failed after") and f'"{setting}": false' in line
        for line in lines
    ), lines
    (summary,) = [line for line in lines if line.startswith(startup.STARTUP + ":")]
    assert re.search(r"kernel qualification \d+\.\d\d s FAILED", summary), summary


def test_a_pool_the_file_system_cannot_hold_fails_in_the_allocation_phase(served_builder, caplog, monkeypatch):
    served_builder(_tokens_for(0.6))
    calls = []

    def fallocate(fd, offset, length):
        calls.append(offset)
        if len(calls) == 2:  # the second 256 MiB chunk: the file system is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with caplog.at_level(logging.INFO), pytest.raises(OSError, match="cannot reserve .* MiB for the host pool") as err:
        startup.build_offload_pool(CONFIGURATOR, SparseDecodeOffloadConfig(ops="fused"))
    assert "make /dev/shm larger" in str(err.value) and "256.0 MiB reserved" in str(err.value)
    assert any("startup phase host-pool allocation of 0.60 GiB failed after" in n for n in err.value.__notes__)
    failed = [line for line in _messages(caplog) if line.startswith("startup phase host-pool allocation of")]
    assert any("failed after" in line and "fix: make /dev/shm larger" in line for line in failed), failed


def test_qualify_kernels_false_warns_and_skips_the_phase(served_builder, caplog):
    served_builder(_tokens_for(0.01))
    with caplog.at_level(logging.INFO):
        pool = startup.build_offload_pool(CONFIGURATOR, SparseDecodeOffloadConfig(ops="fused", qualify_kernels=False))
    pool.host_pool.close()
    lines = _messages(caplog)
    assert any("kernel qualification is off (qualify_kernels: false)" in line for line in lines)
    assert not any(line.startswith("kernel qualification: LIM") for line in lines)
    assert not any(line.startswith("startup phase kernel qualification") for line in lines)
    (summary,) = [line for line in lines if line.startswith(startup.STARTUP + ":")]
    assert "host-pool allocation" in summary and "kernel qualification" not in summary
