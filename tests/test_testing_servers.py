"""The test-server helpers every served test relies on (``sglang_ascend_offload.testing.servers``)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from sglang_ascend_offload.testing.servers import ServerProcess, StartupWatch, process_group_cpu_seconds, start_all


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


# --- how long a start may take (StartupWatch, ServerProcess._start_once) ---------------


def test_startup_watch_waits_past_the_deadline_only_while_the_server_progresses():
    watch = StartupWatch(start=0.0, timeout_s=10, stall_s=3, hard_cap_s=30)
    assert watch.observe(1.0, mark=1) is None
    assert watch.observe(9.0, mark=1) is None  # no progress for 8 s, but inside the deadline
    assert watch.observe(10.5, mark=2) is None  # past it, progressing: keep waiting
    assert watch.extended
    assert watch.observe(13.0, mark=2) is None  # 2.5 s without progress < stall_s
    verdict = watch.observe(13.6, mark=2)  # 3.1 s without progress
    assert verdict is not None and "no CPU time or log output" in verdict


def test_startup_watch_gives_up_at_the_hard_cap_even_while_progressing():
    watch = StartupWatch(start=0.0, timeout_s=10, stall_s=3, hard_cap_s=30)
    for t in range(1, 30):
        assert watch.observe(float(t), mark=t) is None
    verdict = watch.observe(30.0, mark=30)
    assert verdict is not None and "hard cap" in verdict


def test_startup_watch_stalled_server_fails_at_the_deadline_not_later():
    watch = StartupWatch(start=0.0, timeout_s=10, stall_s=3, hard_cap_s=30)
    assert watch.observe(0.5, mark=1) is None
    assert watch.observe(9.9, mark=1) is None
    assert watch.observe(10.0, mark=1) is not None  # silent since 0.5 s: fails at once


FAKE_SERVER = r"""
import http.server, sys, time
port, busy_s = int(sys.argv[1]), float(sys.argv[2])
end = time.monotonic() + busy_s
while time.monotonic() < end:  # "start-up": CPU work and a log line now and then
    sum(i * i for i in range(20000))
    print("starting...", flush=True)
    time.sleep(0.05)
if sys.argv[3] == "hang":
    time.sleep(3600)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class FakeLaunch(ServerProcess):
    """A ServerProcess whose command is the script above instead of SGLang."""

    def __init__(self, script, busy_s, mode, **kw):
        super().__init__([], **kw)
        self.script, self.busy_s, self.mode = script, busy_s, mode

    @property
    def args(self):
        return [sys.executable, str(self.script), str(self.port), str(self.busy_s), self.mode]


def test_a_slow_but_working_start_outlives_the_deadline(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    srv = FakeLaunch(
        script, busy_s=5.0, mode="serve", log_path=tmp_path / "slow.log", startup_timeout_s=3.0, startup_stall_s=3.0
    )  # hard cap 3 x 3 s
    try:
        srv.start()
        assert srv.startup_s is not None and srv.startup_s > 4.5  # healthy only after its 5 s of work
        assert process_group_cpu_seconds(srv.proc.pid) > 0  # what the watch saw moving
        assert process_group_cpu_seconds(2**22 + 12345) == 0  # no such group
    finally:
        srv.stop(grace_s=5)


def test_a_hung_start_fails_once_it_stops_progressing(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    srv = FakeLaunch(
        script, busy_s=1.0, mode="hang", log_path=tmp_path / "hung.log", startup_timeout_s=3.0, startup_stall_s=2.0
    )  # hard cap 3 x 3 s
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no CPU time or log output") as info:
        srv.start()
    took = time.monotonic() - t0
    assert 3.0 <= took < 9.0, took  # the deadline (the stall began at ~1 s), before the hard cap
    assert "starting..." in str(info.value)  # the log tail travels with the error
    assert srv.proc.poll() is not None  # stopped, not left behind


def test_a_missing_fixture_model_is_a_clear_error_from_the_command_line(tmp_path, monkeypatch, capsys):
    """From an installed wheel (no ``tests/fixtures``) a CPU benchmark stops with what to
    do, exit status 2, not a server failing on a missing model path."""
    from sglang_ascend_offload import cli
    from sglang_ascend_offload.bench import soak
    from sglang_ascend_offload.testing import servers

    with pytest.raises(servers.FixtureMissing, match="source checkout"):
        servers.fixture_args(tmp_path / "tiny_dsa")
    assert servers.require_fixture(servers.TINY_DSA) == servers.TINY_DSA  # this checkout has them

    def run_without_fixtures(args):
        return servers.fixture_args(tmp_path / "tiny_dsa")

    monkeypatch.setattr(soak, "main", run_without_fixtures)
    assert cli.main(["bench", "soak"]) == 2
    assert "source checkout" in capsys.readouterr().err


# SGLang's launcher, in miniature: a worker child; on SIGTERM it waits for the worker to
# exit, then sleeps before "crash diagnostics" (SGLang sleeps 5 s there). The worker
# dies at once on SIGTERM, as SGLang's scheduler does.
FAKE_LAUNCHER = r"""
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
def on_term(*_):
    child.wait()
    time.sleep(float(sys.argv[1]))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(3600)
"""


def _fake_launcher(tmp_path, diagnostics_s: float):
    import subprocess

    script = tmp_path / "fake_launcher.py"
    script.write_text(FAKE_LAUNCHER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(diagnostics_s)], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_stop_does_not_wait_out_the_launchers_crash_diagnostics(tmp_path):
    from sglang_ascend_offload.testing.servers import process_group_pids, stop_process_group

    proc = _fake_launcher(tmp_path, diagnostics_s=30.0)
    t0 = time.monotonic()
    stop_process_group(proc, grace_s=20)
    took = time.monotonic() - t0
    assert took < 5.0, took  # not the launcher's 30 s
    assert proc.returncode == -9  # SIGKILLed once its worker had gone
    assert process_group_pids(proc.pid) == []  # nothing of the group left


def test_a_launcher_that_exits_on_its_own_after_its_workers_is_waited_for(tmp_path):
    from sglang_ascend_offload.testing.servers import process_group_pids, stop_process_group

    proc = _fake_launcher(tmp_path, diagnostics_s=0.0)
    stop_process_group(proc, grace_s=20)
    assert proc.returncode in (0, -9)  # exited itself, or was killed an instant before
    assert process_group_pids(proc.pid) == []
