"""The test launcher's zygote (``sglang_ascend_offload/testing/zygote.py``): which servers may
fork from it, what it accepts, that it never outlives its owner, and that a server it forks
answers as one SGLang spawns."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_ascend_offload.testing import harness, zygote
from sglang_ascend_offload.testing.servers import CPU_SERVER_ARGS, REPO, ServerProcess, server_env


def test_only_run_time_names_may_differ_from_the_zygotes_environment():
    base = {"PATH": "/bin", "SGLANG_USE_CPU_ENGINE": "1"}
    same = {
        **base,
        "PYTEST_CURRENT_TEST": "x",
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
        harness.HARNESS_ENV: "{}",
        "SGLANG_ASCEND_OFFLOAD_APPEND_TIMEOUT_S": "30",
    }
    assert zygote.env_problem(same, base) == ""
    # Negative controls: a name SGLang or torch may read at import, changed, added or removed.
    assert "SGLANG_TEST_RETRACT" in zygote.env_problem({**base, "SGLANG_TEST_RETRACT": "1"}, base)
    assert "TORCH_LOGS" in zygote.env_problem({**base, "TORCH_LOGS": "recompiles"}, base)
    assert "SGLANG_USE_CPU_ENGINE" in zygote.env_problem({"PATH": "/bin"}, base)
    assert "PATH" in zygote.env_problem({**base, "PATH": "/usr/bin"}, base)


def test_a_server_whose_environment_differs_starts_as_a_new_interpreter_and_says_why(tmp_path):
    env = {**server_env(), "TORCH_LOGS": "recompiles"}
    launcher, why_not = zygote.launch(["python", "-m", "sglang.launch_server"], env, server_env(), REPO, tmp_path / "x")
    assert launcher is None and "TORCH_LOGS" in why_not
    launcher, why_not = zygote.launch(
        [sys.executable, "fake_server.py"], server_env(), server_env(), REPO, tmp_path / "x"
    )
    assert launcher is None and why_not == "not python -m sglang.launch_server"


@pytest.mark.parametrize(
    "request_text, problem",
    [
        ("[1]", "JSON object"),
        ('{"argv": "--port 1", "env": {}, "cwd": "/", "log": "/tmp/x"}', "argv"),
        ('{"argv": [], "env": {"A": 1}, "cwd": "/", "log": "/tmp/x"}', "env"),
        ('{"argv": [], "env": {}, "cwd": "/no/such/dir", "log": "/tmp/x"}', "cwd"),
        ('{"argv": [], "env": {}, "cwd": "/", "log": "/no/such/dir/x.log"}', "log"),
    ],
)
def test_a_malformed_request_is_refused_with_its_field(request_text, problem):
    with pytest.raises(ValueError, match=problem):
        zygote._parse_request(request_text.encode())


OWNER = """
import os, sys, time
from pathlib import Path
from sglang_ascend_offload.testing import zygote
from sglang_ascend_offload.testing.servers import REPO, server_env
z = zygote.Zygote(server_env(), REPO)
assert z.wait_ready() == "", z.log_path
print(z.proc.pid, flush=True)
os._exit(0)  # no atexit: the zygote must notice on its own
"""


@pytest.mark.slow
def test_the_zygote_exits_when_its_owner_does():
    out = subprocess.run(
        [sys.executable, "-c", OWNER], cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the zygote outlived its owner"


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an exited process its new parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_server_forked_from_the_zygote_answers_as_one_sglang_spawns(tmp_path, monkeypatch):
    """The same tiny server (dummy weights, a fixed seed) started both ways: the same greedy
    tokens for a batch; the forked one's launcher is the zygote's child, its scheduler and
    detokenizer come from its forkserver and carry SGLang's titles; the launch log says
    which way each started."""
    log = tmp_path / "launches.jsonl"
    monkeypatch.setenv("SGLANG_TEST_LAUNCH_LOG", str(log))
    monkeypatch.setenv(harness.FORKSERVER_ENV, "1")
    args = ["--attention-backend", "ascend_offload", "--max-running-requests", "4", "--sleep-on-idle"]
    forked = ServerProcess(args, log_path=tmp_path / "forked.log")
    spawned = ServerProcess(args, log_path=tmp_path / "spawned.log", env=harness.environment({"forkserver": False}))
    prompts = [[(7 * i + j) % 900 + 3 for j in range(40 + 9 * i)] for i in range(3)]
    answers = {}
    for name, server in (("forked", forked), ("spawned", spawned)):
        server.start()
        try:
            out = server.generate(prompts, max_new_tokens=6)
            answers[name] = [o["output_ids"] for o in out]
            titles = server.process_titles()
            kind = type(server.proc).__name__
            method = server.child_start_method()
        finally:
            server.stop()
        assert "sglang::scheduler" in titles and "sglang::detokenizer" in titles, titles
        assert (kind, method) == (("ForkedLauncher", "forkserver") if name == "forked" else ("Popen", "spawn"))
    assert answers["forked"] == answers["spawned"]
    assert all(len(ids) == 6 for ids in answers["forked"])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["zygote"] for r in rows] == [True, False]
    assert rows[1]["zygote_why_not"] == "no forkserver seam"


@pytest.mark.slow
def test_servers_starting_together_share_one_zygote(tmp_path):
    """Two servers started at once from two threads (``start_all``), in a process that has no
    zygote yet: one zygote is started and forks both. Negative control: without the module's
    lock the second start either starts a second zygote or asks the first to fork before it
    listens."""
    script = tmp_path / "two.py"
    script.write_text(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from sglang_ascend_offload.testing import zygote\n"
        "from sglang_ascend_offload.testing.servers import ServerProcess, start_all, stop_all\n"
        "root = Path(sys.argv[1])\n"
        "if sys.argv[2] == 'nolock':\n"
        "    import contextlib; zygote._lock = contextlib.nullcontext()\n"
        "started, init = [], zygote.Zygote.__init__\n"
        "def counted(self, *args, **kwargs):\n"
        "    started.append(1); init(self, *args, **kwargs)\n"
        "zygote.Zygote.__init__ = counted\n"
        "servers = [ServerProcess(['--max-running-requests', '2'], log_path=root / f's{i}.log') for i in range(2)]\n"
        "start_all(*servers)\n"
        "try:\n"
        "    stats = [Path(f'/proc/{s.proc.pid}/stat').read_text() for s in servers]\n"
        "    parents = [int(stat.rsplit(')', 1)[1].split()[1]) for stat in stats]\n"
        "    print(json.dumps({'parents': parents, 'zygote': zygote._owned.proc.pid, 'zygotes': len(started)}))\n"
        "finally:\n"
        "    stop_all(*servers)\n"
    )
    env = {**server_env(), harness.FORKSERVER_ENV: "1"}

    def run(mode):
        cmd = [sys.executable, str(script), str(tmp_path), mode]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    out = run("lock")
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["parents"] == [seen["zygote"], seen["zygote"]] and seen["zygotes"] == 1
    racy = run("nolock")
    if racy.returncode == 0:
        seen = json.loads(racy.stdout.splitlines()[-1])
        assert seen["zygotes"] == 2, seen
    else:
        assert "the test zygote is not listening" in racy.stderr, racy.stderr[-3000:]


@pytest.mark.slow
def test_a_forked_launcher_that_refuses_to_start_exits_as_a_spawned_one(tmp_path, monkeypatch):
    """A server SGLang refuses (no such model): the same exit code and reason either way."""
    monkeypatch.setenv(harness.FORKSERVER_ENV, "1")
    args = ["--model-path", str(tmp_path / "no_such_model"), "--skip-tokenizer-init"]
    base = CPU_SERVER_ARGS[2:]  # all but the model
    outcomes = {}
    for name, env in (("forked", None), ("spawned", harness.environment({"forkserver": False}))):
        server = ServerProcess(args, base_args=base, log_path=tmp_path / f"{name}.log", env=env)
        with pytest.raises(RuntimeError, match="server exited with") as info:
            server.start()
        outcomes[name] = (type(server.proc).__name__, server.proc.returncode, "no_such_model" in str(info.value))
    assert outcomes == {"forked": ("ForkedLauncher", 1, True), "spawned": ("Popen", 1, True)}, outcomes
