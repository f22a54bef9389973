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


def test_forkserver_seam_is_the_session_default_and_a_test_can_keep_sglang_spawn():
    session = {**server_env(), harness.FORKSERVER_ENV: "1"}
    assert json.loads(harness.merge(session, {})[harness.HARNESS_ENV]) == {"forkserver": True}
    kept = harness.merge(session, harness.environment({"forkserver": False}))
    assert harness.HARNESS_ENV not in kept  # no seam left: SGLang's own spawn
    assert harness.HARNESS_ENV not in harness.merge({**server_env(), harness.FORKSERVER_ENV: "0"}, {})


def test_forkserver_seam_targets_sglangs_spawn_step_and_preloads_no_plugin():
    """The seam runs after the SGLang step that sets ``spawn`` (so it wins), and the forkserver
    imports SGLang only: each child must load the plugins itself, as a spawned child does."""
    import inspect
    import pkgutil

    step = pkgutil.resolve_name(harness.SET_START_METHOD)
    assert 'mp.set_start_method("spawn", force=True)' in inspect.getsource(step)
    for module in harness.FORKSERVER_PRELOAD:
        assert module.startswith("sglang.") or module == "sglang_ascend_offload.testing.forkserver_env", module


def test_a_forkserver_child_gets_its_launchers_environment_at_its_start(tmp_path):
    """Two children of one forkserver, the environment changed between their starts: each sees
    the launcher's at its own start, and SGLang's process titles still take. Negative control:
    without ``forkserver_env`` the second child sees the environment of the first's start."""
    script = tmp_path / "children.py"
    script.write_text(
        "import multiprocessing as mp, os, sys\n"
        "def child(out):\n"
        "    import setproctitle\n"
        "    setproctitle.setproctitle('sglang::child')\n"
        "    title = open(f'/proc/{os.getpid()}/cmdline', 'rb').read().split(b'\\0')[0].decode()\n"
        "    out.put((os.environ.get('A'), os.environ.get('B'), title))\n"
        "if __name__ == '__main__':\n"
        "    if sys.argv[1] == 'with':\n"
        "        import sglang_ascend_offload.testing.forkserver_env\n"
        "        mp.set_forkserver_preload(['sglang_ascend_offload.testing.forkserver_env'])\n"
        "    mp.set_start_method('forkserver')\n"
        "    q = mp.Queue()\n"
        "    for _ in range(2):\n"
        "        p = mp.Process(target=child, args=(q,)); p.start(); print(q.get()); p.join()\n"
        "        os.environ['B'] = '2'; os.environ.pop('A', None)\n"
    )
    env = {**os.environ, "A": "1", "PYTHONPATH": str(REPO)}
    env.pop("B", None)
    seen = {}
    for mode in ("with", "without"):
        out = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen[mode] = out.stdout.splitlines()
    assert seen["with"] == ["('1', None, 'sglang::child')", "(None, '2', 'sglang::child')"]
    assert seen["without"] == ["('1', None, 'sglang::child')", "('1', None, 'sglang::child')"]
