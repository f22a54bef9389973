"""The ``shared_servers`` fixture's bookkeeping (``tests/sglang/conftest.py``,
docs/testing.md), without launching anything: servers are reused only for identical
arguments, and a shared server is stopped once no module still to run lists it."""

from __future__ import annotations

import pytest
from conftest import IDLE_SLEEP, SharedServers, group_shared_server_users


class Stub:
    """Records that it was stopped (stands in for a started ServerProcess's stop)."""

    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True


def test_same_name_same_arguments_is_the_same_server_and_other_arguments_raise(tmp_path):
    pool = SharedServers(tmp_path, {"ref": {"mod_a", "mod_b"}})
    a = pool.get("ref", ["--max-running-requests", "4"] + IDLE_SLEEP, env={"X": "1"})
    assert pool.get("ref", ["--max-running-requests", "4"] + IDLE_SLEEP, env={"X": "1"}) is a
    for other in (
        dict(extra_args=["--max-running-requests", "8"] + IDLE_SLEEP, env={"X": "1"}),
        dict(extra_args=["--max-running-requests", "4"] + IDLE_SLEEP, env={"X": "2"}),
        dict(
            extra_args=["--max-running-requests", "4"] + IDLE_SLEEP,
            env={"X": "1"},
            base_args=["--model-path", "elsewhere"],
        ),
    ):
        with pytest.raises(ValueError, match="other arguments"):
            pool.get("ref", **other)
    pool.close()


def test_a_shared_server_stops_after_the_last_module_that_lists_it(tmp_path):
    pool = SharedServers(tmp_path, {"ref": {"mod_a", "mod_b"}, "other": {"mod_b"}})
    ref = pool.get("ref", IDLE_SLEEP)
    real_stop, stopped = ref.stop, []
    ref.stop = lambda: stopped.append("ref")  # not started: record the stop instead
    own = Stub()
    pool.stop_all("mod_a", ref, own)
    assert own.stopped and stopped == []  # mod_b still needs the shared one
    assert pool.get("ref", IDLE_SLEEP) is ref
    pool.stop_all("mod_b", ref)
    assert stopped == ["ref"]
    assert "ref" not in pool.servers
    real_stop()  # its reserved ports back
    pool.close()


def test_a_shared_server_that_died_is_replaced_by_a_fresh_one(tmp_path):
    import subprocess
    import sys

    pool = SharedServers(tmp_path, {"ref": {"mod_a"}})
    ref = pool.get("ref", IDLE_SLEEP)
    ref.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    ref.proc.wait()  # as if the server had exited
    fresh = pool.get("ref", IDLE_SLEEP)
    assert fresh is not ref and fresh.proc is None
    pool.close()


class _Module:
    def __init__(self, name, shared=()):
        self.__name__ = name
        self.SHARED_SERVERS = shared


class _Item:
    def __init__(self, module, name):
        self.module, self.name = module, name


def test_modules_sharing_a_server_are_run_back_to_back():
    """Collection order a, b(ref), c, d(other), e(ref), f(other, ref): e joins b, f joins the
    last module sharing either of its servers; the others keep their order and items."""
    a, b, c = _Module("a"), _Module("b", ("ref",)), _Module("c")
    d, e, f = _Module("d", ("other",)), _Module("e", ("ref",)), _Module("f", ("other", "ref"))
    items = [_Item(m, f"{m.__name__}{i}") for m in (a, b, c, d, e, f) for i in range(2)]
    order = [i.name for i in group_shared_server_users(items)]
    assert order == ["a0", "a1", "b0", "b1", "e0", "e1", "c0", "c1", "d0", "d1", "f0", "f1"]
    # negative control: collection order itself would keep b and e apart
    assert [i.name for i in items].index("e0") - [i.name for i in items].index("b1") > 1
