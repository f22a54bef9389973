"""The test-server helpers every served test relies on (``sglang_ascend_offload.testing.servers``)."""

from __future__ import annotations

import threading

import pytest

from sglang_ascend_offload.testing.servers import ServerProcess, start_all


class FakeServer:
    """Stands in for a ServerProcess: ``start`` waits until every fake has been asked to
    start (so the starts overlap, as real startups do) and then succeeds or fails."""

    def __init__(self, name: str, barrier: threading.Barrier, fail: bool = False):
        self.name, self.barrier, self.fail = name, barrier, fail
        self.started = self.stopped = False

    def start(self):
        self.barrier.wait(timeout=10)  # all three are starting at once
        if self.fail:
            raise RuntimeError(f"{self.name} exited with -9")
        self.started = True
        return self

    def stop(self):
        self.stopped = True


def test_start_all_starts_concurrently_and_stops_nothing_when_all_start():
    barrier = threading.Barrier(3)
    fakes = [FakeServer(n, barrier) for n in "abc"]
    start_all(*fakes, None)  # None entries are skipped, like stop_all
    assert all(f.started for f in fakes)
    assert not any(f.stopped for f in fakes)


def test_start_all_stops_every_server_and_raises_the_first_failure():
    barrier = threading.Barrier(3)
    fakes = [FakeServer("a", barrier), FakeServer("b", barrier, fail=True), FakeServer("c", barrier, fail=True)]
    with pytest.raises(RuntimeError, match="b exited"):
        start_all(*fakes)
    assert all(f.stopped for f in fakes)  # also the one that started: nothing left running


def test_startup_failure_message_carries_the_log_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    srv = ServerProcess([], log_path=log)
    tail = srv._log_tail(lines=5)
    assert tail.splitlines()[1:] == [f"line {i}" for i in range(95, 100)]
    srv._release_ports()
    gone = ServerProcess([], log_path=tmp_path / "missing.log")
    assert "log unreadable" in gone._log_tail()
    gone._release_ports()
