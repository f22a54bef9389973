"""A launcher zygote for test servers: SGLang imported once per test process, each server forked from it.

A tiny CPU test server costs ~14 CPU-s to start even with the harness's ``forkserver`` seam,
and ~10 of them are imports: the launcher's (``python -m sglang.launch_server``) and its
forkserver's. Both import the same SGLang modules from the same environment. The zygote is a
process that imported them once (:data:`..harness.FORKSERVER_PRELOAD`) and never loaded a
plugin. For each server it forks:

* **the launcher** (``A``): a new session (so the server is still one process group the test
  launcher stops), the server's log as stdout / stderr, the server's environment and working
  directory, then ``sglang.launch_server`` run as ``__main__`` with the server's arguments.
  It loads the plugins itself, as a launcher started from a shell does;
* **its forkserver** (``B``): ``A`` forks it before running SGLang, so ``B`` is the zygote's
  clean state in ``A``'s session, and ``A``'s multiprocessing uses it as its forkserver
  (:func:`_adopt_forkserver`). The schedulers and the detokenizer fork from ``B`` and load
  the plugins themselves, as under the ``forkserver`` seam alone.

A server starts this way only when nothing SGLang reads at import can differ from the
zygote's: its environment equals the zygote's except for names in :data:`RUNTIME_ENV`
(read at run time, or by the plugin and harness, which the zygote never imported), it asks
for the ``forkserver`` seam, and Python is a version whose forkserver internals were read
(:data:`CHECKED_PYTHON`). Anything else starts as before, with the reason in the launch log
(``SGLANG_TEST_LAUNCH_LOG``). The owner (the pytest process, or a ``bench`` command a test
runs) starts its zygote at its first eligible server; the zygote exits when its owner does.

Protocol (a Unix socket in a private directory; one JSON object per connection, each way):
``{"argv": [str], "env": {str: str}, "cwd": str, "log": str}`` -> ``{"pid": int}`` or
``{"error": str}``. The zygote writes ``<pid>.rc`` (the exit code) when it reaps a launcher.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence

#: Python versions whose ``multiprocessing.forkserver`` internals :func:`_adopt_forkserver` sets.
CHECKED_PYTHON = ((3, 10), (3, 11), (3, 12))
#: Environment names a zygote-forked server may set differently from the zygote: read at run
#: time, or only by the plugin and the harness (whole names, or prefixes ending in ``_``).
RUNTIME_ENV = (
    "PYTEST_CURRENT_TEST",
    "SGLANG_ASCEND_OFFLOAD_",
    "SGLANG_CPU_OMP_THREADS_BIND",
    "SGLANG_TEST_LAUNCH_LOG",  # read by the test launcher only
)
READY_TIMEOUT_S = 300.0
_REQUEST_LIMIT = 1 << 22  # bytes: argv and environment of one server


def env_problem(env: Dict[str, str], zygote_env: Dict[str, str]) -> str:
    """Empty when a server with ``env`` may fork from a zygote started with ``zygote_env``;
    else the names that differ and are not in :data:`RUNTIME_ENV`."""

    def runtime(name: str) -> bool:
        return any(name == r or (r.endswith("_") and name.startswith(r)) for r in RUNTIME_ENV)

    differ = sorted(n for n in set(env) | set(zygote_env) if env.get(n) != zygote_env.get(n) and not runtime(n))
    return f"environment differs from the zygote's in {', '.join(differ)}" if differ else ""


class ForkedLauncher:
    """The ``subprocess.Popen`` surface the test launcher uses, for a launcher the zygote forked
    (its parent is the zygote, which reaps it and writes its exit code to ``<pid>.rc``)."""

    def __init__(self, pid: int, args: Sequence[str], rc_dir: Path):
        self.pid, self.args, self._rc_file = pid, list(args), rc_dir / f"{pid}.rc"
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._read_rc()
            if self.returncode is None and not Path(f"/proc/{self.pid}").exists():
                time.sleep(0.5)  # reaped: the zygote writes the code right after
                self.returncode = self._read_rc()
                if self.returncode is None:  # gone without a word from the zygote
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def _read_rc(self) -> Optional[int]:
        try:
            return int(self._rc_file.read_text())
        except (OSError, ValueError):
            return None

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The owner's handle on its zygote process."""

    def __init__(self, env: Dict[str, str], cwd: Path):
        self.env, self.cwd = dict(env), Path(cwd)
        self.dir = Path(tempfile.mkdtemp(prefix="sao_zygote_"))
        self.socket_path = self.dir / "zygote.sock"
        self.log_path = self.dir / "zygote.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.dir), str(os.getpid())],
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Empty once the zygote listens; else why it will not."""
        deadline = time.monotonic() + timeout_s
        while not (self.dir / "ready").exists():
            if self.proc.poll() is not None:
                return f"the zygote exited with {self.proc.returncode} (log: {self.log_path})"
            if time.monotonic() > deadline:
                return f"the zygote was not ready after {timeout_s:.0f} s (log: {self.log_path})"
            time.sleep(0.05)
        return ""

    def fork(self, argv: Sequence[str], env: Dict[str, str], cwd: Path, log: Path) -> ForkedLauncher:
        request = {"argv": list(argv[3:]), "env": dict(env), "cwd": str(cwd), "log": str(log)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(60)
            try:
                s.connect(str(self.socket_path))
            except OSError as exc:
                raise RuntimeError(f"the test zygote is not listening at {self.socket_path}: {exc}") from exc
            s.sendall(json.dumps(request).encode() + b"\n")
            s.shutdown(socket.SHUT_WR)
            reply = json.loads(_read_all(s))
        if "pid" not in reply:
            raise RuntimeError(f"the test zygote refused to fork a server: {reply.get('error')}")
        return ForkedLauncher(int(reply["pid"]), argv, self.dir)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_owned: Optional[Zygote] = None
_unavailable = ""
_lock = threading.Lock()  # servers start from several threads at once (servers.start_all)


def launch(argv: Sequence[str], env: Dict[str, str], zygote_env: Dict[str, str], cwd: Path, log: Path):
    """``(launcher, "")`` forked from this process's zygote (started on first use), or
    ``(None, reason)`` when this server must start as a new interpreter."""
    if list(argv[1:3]) != ["-m", "sglang.launch_server"]:
        return None, "not python -m sglang.launch_server"
    if sys.version_info[:2] not in CHECKED_PYTHON:
        return None, f"Python {sys.version_info[0]}.{sys.version_info[1]}: forkserver internals not checked"
    with _lock:
        problem = _unavailable or env_problem(env, zygote_env if _owned is None else _owned.env)
        if problem:
            return None, problem
        owned, problem = _ensure_started(zygote_env, cwd)
        if problem:
            return None, problem
        return owned.fork(argv, env, cwd, log), ""


def ensure_started(zygote_env: Dict[str, str], cwd: Path):
    """``(zygote, "")``: this process's zygote, started now (with ``zygote_env``) if it has none
    and ready; ``(None, reason)`` when it cannot run."""
    with _lock:
        return _ensure_started(zygote_env, cwd)


def _ensure_started(zygote_env: Dict[str, str], cwd: Path):
    global _owned, _unavailable
    if _owned is None and not _unavailable:
        import atexit

        _owned = Zygote(zygote_env, cwd)
        atexit.register(_owned.stop)
        _unavailable = _owned.wait_ready()
        if _unavailable:
            print(f"[zygote] test servers start as new interpreters: {_unavailable}", file=sys.stderr)
    return (None, _unavailable) if _unavailable else (_owned, "")


def _read_all(s: socket.socket) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > _REQUEST_LIMIT:
            raise ValueError("request too large")
        chunks.append(chunk)


def _parse_request(raw: bytes) -> dict:
    """The request's fields, type-checked (raises ``ValueError``)."""
    request = json.loads(raw)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    argv, env, cwd, log = (request.get(k) for k in ("argv", "env", "cwd", "log"))
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv: a list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env: an object of strings")
    if not (isinstance(cwd, str) and os.path.isdir(cwd)):
        raise ValueError("cwd: an existing directory")
    if not (isinstance(log, str) and os.path.isdir(os.path.dirname(log) or ".")):
        raise ValueError("log: a path in an existing directory")
    return {"argv": argv, "env": env, "cwd": cwd, "log": log}


# ---------------------------------------------------------------- the zygote process


def _serve(work_dir: Path, owner_pid: int) -> None:
    from . import forkserver_env, harness

    for module in harness.FORKSERVER_PRELOAD:
        __import__(module)
    __import__("sglang.srt.entrypoints.http_server")  # run_server imports it when the launcher runs
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(work_dir / "zygote.sock"))
    os.chmod(work_dir / "zygote.sock", 0o600)
    listener.listen(16)
    (work_dir / "ready").write_text(str(os.getpid()))
    while os.getppid() == owner_pid:
        _reap(work_dir)
        ready, _, _ = select.select([listener], [], [], 0.2)
        if not ready:
            continue
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(30)
            try:
                request = _parse_request(_read_all(conn))
            except (ValueError, OSError) as exc:
                conn.sendall(json.dumps({"error": str(exc)}).encode())
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _run_launcher(request, forkserver_env)  # raises _LauncherExit: the child's end
            conn.sendall(json.dumps({"pid": pid}).encode())


def _reap(work_dir: Path) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        (work_dir / f"{pid}.rc").write_text(str(os.waitstatus_to_exitcode(status)))


def _run_launcher(request: dict, forkserver_env) -> None:
    """In the forked child: become the server's launcher (``A`` of the module docstring). It
    ends as a launcher started from a shell ends: ``SystemExit`` with its code, raised out of
    the zygote's loop, so the interpreter shuts down as usual (``atexit`` handlers, threads)."""
    code = 1
    try:
        os.setsid()
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        forkserver_env.apply_environment(request["env"])
        os.chdir(request["cwd"])
        import setproctitle

        setproctitle.setproctitle(" ".join(["sglang.launch_server (test zygote)", *request["argv"]])[:1000])
        _adopt_forkserver()
        import runpy

        sys.argv = ["sglang.launch_server", *request["argv"]]
        try:
            runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a launcher prints what stopped it, then exits with 1
        traceback.print_exc()
    raise _LauncherExit(code)


class _LauncherExit(SystemExit):
    """A forked launcher's end (:func:`_run_launcher`); the zygote's loop lets it through."""


def _adopt_forkserver() -> None:
    """Fork ``B`` (the module docstring) as this process's multiprocessing forkserver: what
    ``ForkServer.ensure_running`` does, with ``os.fork`` of the clean state instead of a new
    interpreter importing the preload (the three attributes it sets are the ones it checks)."""
    from multiprocessing import connection, forkserver, util

    server = forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            import setproctitle

            setproctitle.setproctitle("multiprocessing.forkserver (test zygote)")
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def main(argv: List[str]) -> int:
    work_dir, owner_pid = Path(argv[0]), int(argv[1])
    _serve(work_dir, owner_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
