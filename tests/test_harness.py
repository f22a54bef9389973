"""The test harness's seams (``sglang_ascend_offload/testing/harness.py``): visible only to
servers the test launcher starts, inert without a seam, and each seam changes what it says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_ascend_offload.testing import harness
from sglang_ascend_offload.testing.servers import REPO, server_env

PROBE = r"""
import json, mmap, os, sys
from importlib.metadata import entry_points
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host.append_order import AppendOrder
from sglang_ascend_offload import memory_budget
mapping = mmap.mmap(-1, 4096)
rank0 = AppendOrder(mapping, 2, rank=0, init=True)
rank1 = AppendOrder(mapping, 2, rank=1)
flag = sys.argv[1]
held = []
for exists in (False, True):
    if exists:
        open(flag, "w").close()
    rank0.appended(0)
    held.append(rank0.published(0))
print(json.dumps({
    "plugins": sorted(e.name for e in entry_points(group="sglang.srt.plugins")),
    "published": held,
    "rank1_holds": rank1.hold(),
    "available": memory_budget.available_bytes("cpu"),
}))
"""


def _probe(env, tmp_path):
    flag = tmp_path / "hold"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(flag)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_seams_reach_a_launched_server_process_and_change_what_they_say(tmp_path):
    pinned = {"host": 3 * 2**30, "device": 2**30}
    env = {
        **server_env(),
        **harness.environment({"hold_appends": str(tmp_path / "hold"), "available_bytes": pinned}),
    }
    got = _probe(env, tmp_path)
    assert "ascend_offload_test_harness" in got["plugins"]
    assert got["published"] == [1, 1]  # the second append is written but not published while held
    assert got["rank1_holds"] is False  # only rank 0 is held
    assert got["available"] == pinned


def test_without_the_launcher_the_harness_is_not_even_loaded(tmp_path):
    """Negative control: a process started without the launcher's environment publishes
    every append and probes real memory, even with the seam variable set."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SGLANG_USE_CPU_ENGINE="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.update(harness.environment({"hold_appends": str(tmp_path / "hold")}))
    got = _probe(env, tmp_path)
    assert "ascend_offload_test_harness" not in got["plugins"]
    assert got["published"] == [1, 2]


def test_unknown_seams_are_refused():
    with pytest.raises(ValueError, match="unknown test seams"):
        harness.environment({"force_demotion": "/tmp/x"})
