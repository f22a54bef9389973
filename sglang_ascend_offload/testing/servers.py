"""SGLang servers on this machine, for tests and the served benchmarks.

:class:`ServerProcess` launches ``python -m sglang.launch_server`` on 127.0.0.1 in its
own session (so the whole process group can be stopped), on a port reserved by
:mod:`.ports`, waits for ``/health`` (see :class:`StartupWatch` for how long), restarts
on a fresh port within seconds when its log reports that the port could not be bound,
and stops its group (SIGTERM, then SIGKILL after a grace period).

How long a start may take: a fixed deadline either fails slow-but-healthy starts on a
loaded machine or waits minutes for a server that hung (docs/design/test_servers.md).
So the deadline is ``startup_timeout_s`` *while the server makes no progress*: past
it, the wait goes on only as long as the server's
process group keeps using CPU or writing its log within the last ``STARTUP_STALL_S``,
and never beyond ``STARTUP_HARD_CAP_FACTOR`` times the deadline.

The tiny DeepSeek-V3.2-style models live in the source tree (``tests/fixtures``),
so the served benchmarks run from a checkout, as the README's commands do.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import harness, zygote
from .ports import DP_ATTENTION_OFFSETS, log_reports_bind_failure, release_ports, reserve_port

__all__ = [
    "REPO",
    "FIXTURES",
    "TINY_DSA",
    "TINY_DSA_4L",
    "TINY_DSA_MTP",
    "TINY_DSA_FUSED",
    "TINY_DSA_FUSED_MTP",
    "TINY_DSA_TRAINED",
    "TINY_DSA_TRAINED_K128",
    "CPU_SERVER_ARGS",
    "TRAINED_SERVER_ARGS",
    "IDLE_SLEEP",
    "ServerProcess",
    "PortInUse",
    "FixtureMissing",
    "require_fixture",
    "StartupWatch",
    "cpu_seconds",
    "server_env",
    "stop_process_group",
    "stop_all",
    "fixture_args",
    "trained_args",
]

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
TINY_DSA = FIXTURES / "tiny_dsa"
TINY_DSA_4L = FIXTURES / "tiny_dsa_4l"
TINY_DSA_MTP = FIXTURES / "tiny_dsa_mtp"  # tiny_dsa + one NextN (MTP) layer, for speculative decoding
# tiny_dsa at shapes the fused AscendC kernels take (top-k 128, 8 index heads)
TINY_DSA_FUSED = FIXTURES / "tiny_dsa_fused"
TINY_DSA_FUSED_MTP = FIXTURES / "tiny_dsa_fused_mtp"  # tiny_dsa_fused + one NextN layer: verify rows, fused
# Trained weights + BPE tokenizer (scripts/train_tiny_dsa.py): real text, real indexer rankings.
TINY_DSA_TRAINED = FIXTURES / "tiny_dsa_trained"
# The same training at the fused kernels' shape (top-k 128, 8 index heads; --shape k128).
TINY_DSA_TRAINED_K128 = FIXTURES / "tiny_dsa_trained_k128"

# What every CPU launch of a tiny DSA model needs (see docs/sglang_integration.md).
CPU_SERVER_ARGS: List[str] = [
    "--model-path",
    str(TINY_DSA),
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--device",
    "cpu",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    # SGLang on CPU sizes the KV pool from the drop in *system* available memory while the weights
    # load (kv_cache_configurator: it refuses to start when available < (1 - fraction) x before),
    # so a small fraction makes a server refuse when other servers start at the same moment.
    # --max-total-tokens caps the pool anyway, so 0.5 costs no memory and refuses only when
    # memory really runs out (docs/design/test_servers.md).
    "--mem-fraction-static",
    "0.5",
    "--max-total-tokens",
    "4096",
    "--context-length",
    "2048",
]
# Colocated servers sleep when idle (SGLang's IdleSleeper waits on the tokenizer
# socket instead of spinning), so several servers on 2 cores do not starve each other.
# Not for P/D servers: their idle loop also polls transfers and would stall up to 1 s.
IDLE_SLEEP = ["--sleep-on-idle"]
STARTUP_TIMEOUT_S = float(os.environ.get("SGLANG_TEST_STARTUP_TIMEOUT", "240"))
# Past STARTUP_TIMEOUT_S a start continues while it progresses (CPU time or log output
# within the last STARTUP_STALL_S seconds), up to STARTUP_HARD_CAP_FACTOR x the timeout.
STARTUP_STALL_S = float(os.environ.get("SGLANG_TEST_STARTUP_STALL", "60"))
STARTUP_HARD_CAP_FACTOR = 3.0
# How often a starting server's /health is polled: a start becomes visible at most this late
# (each poll also reads the log and the process group's CPU time: cheap next to a start).
HEALTH_POLL_S = 0.25
# Launch accounting for the test suite (docs/testing.md): when set, every launch appends one
# JSON line (time, pytest's current test, arguments) to this file.
LAUNCH_LOG_ENV = "SGLANG_TEST_LAUNCH_LOG"


# The trained checkpoint: its weights are loaded (no --load-format dummy) and its tokenizer
# serves text through the OpenAI API; the rest as CPU_SERVER_ARGS.
TRAINED_SERVER_ARGS: List[str] = [
    "--model-path",
    str(TINY_DSA_TRAINED),
    *[a for a in CPU_SERVER_ARGS[2:] if a not in ("--load-format", "dummy", "--skip-tokenizer-init")],
]


class FixtureMissing(FileNotFoundError):
    """A CPU benchmark's tiny model is not there: they live in a source checkout's
    ``tests/fixtures``, which an installed wheel does not carry."""


def require_fixture(model: Path) -> Path:
    """``model`` when its ``config.json`` exists; else :class:`FixtureMissing` saying what to do."""
    if not (Path(model) / "config.json").is_file():
        raise FixtureMissing(
            f"the tiny CPU model {model} is missing: the CPU benchmarks serve the fixtures of a source checkout "
            "(git clone the project and run from it), or pass --model-path for a model of your own where the "
            "command accepts one"
        )
    return Path(model)


def fixture_args(model: Path) -> List[str]:
    """:data:`CPU_SERVER_ARGS` with another fixture model (which must exist)."""
    require_fixture(model)
    return [str(model) if a == str(TINY_DSA) else a for a in CPU_SERVER_ARGS]


def trained_args(model: Path = TINY_DSA_TRAINED) -> List[str]:
    """:data:`CPU_SERVER_ARGS` serving a trained fixture's real weights (no ``--load-format
    dummy``), token ids in and out (``--skip-tokenizer-init``, as the dummy-weight tests)."""
    require_fixture(model)
    args = [str(model) if a == str(TINY_DSA) else a for a in CPU_SERVER_ARGS]
    at = args.index("--load-format")
    return args[:at] + args[at + 2 :]


def server_env(cpu: bool = True) -> Dict[str, str]:
    env = dict(os.environ)
    if cpu:
        env.update(SGLANG_USE_CPU_ENGINE="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    else:
        env.pop("SGLANG_USE_CPU_ENGINE", None)
        env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.pop("SGLANG_ASCEND_OFFLOAD_CONFIG", None)
    # the test harness's SGLang plugin (inert unless a seam is asked for: testing/harness.py)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.PLUGIN_PATH), env.get("PYTHONPATH")) if p)
    return env


class PortInUse(RuntimeError):
    """A server's log reported that one of its listening sockets could not bind."""


def process_group_pids(pgid: int) -> List[int]:
    """Live members of process group ``pgid`` (from ``/proc``), sorted."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    out.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return sorted(out)


def cpu_seconds(pids: Sequence[int]) -> Dict[int, float]:
    """User + system CPU seconds of each process (``/proc/<pid>/stat``); gone ones omitted."""
    tick = os.sysconf("SC_CLK_TCK")
    out: Dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def process_group_cpu_seconds(pgid: int) -> float:
    """CPU seconds used so far by the live members of process group ``pgid``; 0 if none is left."""
    return sum(cpu_seconds(process_group_pids(pgid)).values())


class StartupWatch:
    """Decides when a server start has taken too long (the rule in the module docstring).

    ``observe(now, mark)`` is called every ``HEALTH_POLL_S`` with ``time.monotonic()`` and a
    progress mark (any value that changes while the server works: its process group's CPU
    seconds and log size); it returns ``None`` to keep waiting or the reason to give up.
    """

    def __init__(
        self, start: float, timeout_s: float, stall_s: float = STARTUP_STALL_S, hard_cap_s: Optional[float] = None
    ):
        self.start, self.timeout_s, self.stall_s = start, float(timeout_s), float(stall_s)
        self.hard_cap_s = STARTUP_HARD_CAP_FACTOR * self.timeout_s if hard_cap_s is None else float(hard_cap_s)
        self.last_mark: Any = None
        self.last_progress = start
        self.extended = False  # True once the wait went past timeout_s because of progress

    def observe(self, now: float, mark: Any) -> Optional[str]:
        if mark != self.last_mark:
            self.last_mark, self.last_progress = mark, now
        waited = now - self.start
        if waited < self.timeout_s:
            return None
        if waited >= self.hard_cap_s:
            return (
                f"not healthy after {waited:.0f} s (the hard cap: {self.hard_cap_s:.0f} s, "
                f"although it was still working)"
            )
        idle = now - self.last_progress
        if idle >= self.stall_s:
            return (
                f"not healthy after {waited:.0f} s, and no CPU time or log output for the last "
                f"{idle:.0f} s (deadline {self.timeout_s:.0f} s while not progressing)"
            )
        self.extended = True
        return None


class ServerProcess:
    """One ``sglang.launch_server`` subprocess (own session; stopped as a group)."""

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        log_path: Optional[Path] = None,
        base_args: Sequence[str] = tuple(CPU_SERVER_ARGS),
        cpu: bool = True,
        env: Optional[Dict[str, str]] = None,
        startup_timeout_s: Optional[float] = None,
        startup_stall_s: float = STARTUP_STALL_S,
    ):
        self.base_args = list(base_args)
        self.startup_timeout_s = STARTUP_TIMEOUT_S if startup_timeout_s is None else float(startup_timeout_s)
        self.startup_stall_s = float(startup_stall_s)
        self.extra_args = list(extra_args)
        self.port_offsets = DP_ATTENTION_OFFSETS if "--enable-dp-attention" in self.extra_args else ()
        self.port = reserve_port(offsets=self.port_offsets)
        self.nccl_port = reserve_port()
        self.log_path = Path(log_path) if log_path else None
        self.cpu = cpu
        self.extra_env = dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def args(self) -> List[str]:
        # SGLang picks its torch.distributed port itself (a free port in 22000-29999, bound
        # later by the scheduler): two servers starting together can pick the same one.
        # A reserved port closes that race too, unless the caller chose one.
        given = set(self.base_args) | set(self.extra_args)
        nccl = [] if "--nccl-port" in given else ["--nccl-port", str(self.nccl_port)]
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *self.base_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *nccl,
            *self.extra_args,
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, attempts: int = 3) -> "ServerProcess":
        """Launch and wait for ``/health``. A bind failure of the server's HTTP port
        (seen in its log) restarts it on a fresh port within seconds, up to ``attempts``
        times; a bind failure of another port given in ``extra_args`` fails at once."""
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="sglang_server_", suffix=".log")[1])
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except PortInUse as exc:
                ours = (f"port {self.port} " in str(exc)) or (f"port {self.nccl_port} " in str(exc))
                if attempt == attempts or not ours:
                    raise  # out of attempts, or a port fixed in extra_args: the caller chose it
                self._release_ports()
                self.port = reserve_port(offsets=self.port_offsets)
                self.nccl_port = reserve_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> "ServerProcess":
        env = harness.merge(server_env(self.cpu), self.extra_env)
        t0 = time.monotonic()
        self.proc, why_not = None, "no forkserver seam"
        if harness.fast_start(env):
            self.proc, why_not = zygote.launch(self.args, env, server_env(self.cpu), REPO, self.log_path)
        _record_launch(self.args, self.extra_env, forked=self.proc is not None, why_not=why_not)
        if self.proc is None:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self.args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
                )
        watch = StartupWatch(t0, self.startup_timeout_s, self.startup_stall_s)
        while True:
            now = time.monotonic()
            verdict = watch.observe(now, self._progress_mark())
            if verdict is not None:
                break
            failed = self._port_that_failed_to_bind()
            if failed is not None:
                self.stop()
                raise PortInUse(f"port {failed} is in use (server port {self.port}); log: {self.log_path}")
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; log: {self.log_path}\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - t0
                        if watch.extended:
                            print(
                                f"[servers] {self.url} took {self.startup_s:.0f} s to start (past the "
                                f"{self.startup_timeout_s:.0f} s deadline, still progressing)",
                                file=sys.stderr,
                            )
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise TimeoutError(f"server {verdict}; log: {self.log_path}\n{self._log_tail()}")

    def _progress_mark(self):
        """What changes while the starting server works: its group's CPU ticks, its log size."""
        try:
            size = self.log_path.stat().st_size
        except OSError:
            size = -1
        return (process_group_cpu_seconds(self.proc.pid), size)

    def _log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log, for failure messages: pytest's
        temporary directories are rotated away, so the log itself may be gone by the
        time someone reads a CI report."""
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "--- last lines of the server log ---\n" + "\n".join(tail)

    def _port_that_failed_to_bind(self) -> Optional[int]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        numbers = (int(n) for a in self.extra_args for n in re.findall(r"\d+", a))  # incl. ports inside JSON
        ports = [self.port, self.nccl_port] + [n for n in numbers if 1024 <= n <= 65535]
        return log_reports_bind_failure(text, ports)

    def post(self, path: str, body: Dict[str, Any], timeout: float = 120.0) -> Any:
        req = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        return json.loads(text) if text.strip() else None

    def generate(
        self, input_ids, max_new_tokens: int = 8, timeout: float = 120.0, return_logprob: bool = False, **extra: Any
    ):
        """Greedy ``/generate`` for one prompt (list of ids) or a batch (list of lists).

        For a batch, ``max_new_tokens`` may be a list (one length per prompt)."""

        def greedy(n: int) -> dict:
            return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}

        params = [greedy(n) for n in max_new_tokens] if isinstance(max_new_tokens, list) else greedy(max_new_tokens)
        body = {"input_ids": input_ids, "return_logprob": return_logprob, "sampling_params": params, **extra}
        return self.post("/generate", body, timeout)

    def get(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as r:
            return r.read().decode()

    def pids(self) -> List[int]:
        """The server's process group members (launcher, scheduler(s), detokenizer)."""
        return [] if self.proc is None else process_group_pids(self.proc.pid)

    def process_titles(self) -> List[str]:
        """The first word of each live member's command line (SGLang titles its children
        ``sglang::scheduler``, ``sglang::detokenizer``, ...)."""
        titles = []
        for pid in self.pids():
            try:
                titles.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"))
            except OSError:
                continue
        return titles

    def child_start_method(self) -> str:
        """How the launcher started its children: ``"forkserver"`` when a multiprocessing
        forkserver is among the server's processes (the test harness's ``forkserver`` seam),
        else ``"spawn"`` (SGLang's own)."""
        for pid in self.pids():
            try:
                if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return "forkserver"
            except OSError:
                continue
        return "spawn"

    def stop(self, grace_s: float = 20) -> None:
        stop_process_group(self.proc, grace_s=grace_s)
        self._release_ports()

    def _release_ports(self) -> None:
        """Give the ports back once nothing of this server can hold them."""
        if self.proc is None or self.proc.poll() is not None:
            release_ports([self.port, self.nccl_port, *(self.port + o for o in self.port_offsets)])


def _record_launch(args: Sequence[str], env: Dict[str, str], forked: bool = False, why_not: str = "") -> None:
    """One JSON line per launch in ``$SGLANG_TEST_LAUNCH_LOG`` (when set): what a test run launched,
    and whether the launcher was forked from the test zygote (:mod:`.zygote`; if not, why)."""
    path = os.environ.get(LAUNCH_LOG_ENV)
    if not path:
        return
    line = json.dumps(
        {
            "t": time.time(),
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "args": list(args[3:]),
            "env": dict(env),
            "zygote": forked,
            "zygote_why_not": "" if forked else why_not,
        }
    )
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def _workers(proc: subprocess.Popen) -> List[int]:
    """Live members of ``proc``'s process group other than ``proc`` itself and
    multiprocessing's resource tracker (which ignores SIGTERM and exits, after its
    cleanup, once every process holding its pipe is gone); zombies are not live."""
    out = []
    for pid in process_group_pids(proc.pid):
        if pid == proc.pid:
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if state != "Z" and b"multiprocessing.resource_tracker" not in cmdline:
            out.append(pid)
    return out


def stop_process_group(proc: Optional[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM a server's process group, SIGKILL it after ``grace_s``; no-op if gone.

    Once every worker of the group (scheduler ranks, detokenizer, ...) has exited, the
    launcher is SIGKILLed: on a child's exit SGLang's launcher only sleeps 5 s "to let GPU
    activity settle" before crash diagnostics that find nothing (measured: 5.7 s of every
    stop). Then the wait goes on until the group is empty (the resource tracker's cleanup
    included), at most ``grace_s`` more."""
    if proc is None or proc.poll() is not None:
        return
    had_workers = bool(_workers(proc))
    deadline = time.monotonic() + grace_s
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, grace_s)
            if had_workers and not _workers(proc):
                proc.kill()  # only the launcher is left, waiting to run its crash diagnostics
                proc.wait(timeout=10)
                break
            time.sleep(0.05)
        while process_group_pids(proc.pid) and time.monotonic() < deadline + grace_s:
            time.sleep(0.05)  # the resource tracker (and any straggler) finishing
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def start_all(*procs) -> None:
    """Start servers / routers (anything with ``start()`` and ``stop()``) at once and wait
    for all of them. If any fails, every one is stopped and the first failure is raised
    (each failure message carries its server's log tail)."""
    from concurrent.futures import ThreadPoolExecutor

    procs = [p for p in procs if p is not None]
    with ThreadPoolExecutor(max(1, len(procs))) as pool:
        errors = [f.exception() for f in [pool.submit(p.start) for p in procs]]
    if any(errors):
        stop_all(*procs)
        raise next(e for e in errors if e)


def stop_all(*procs) -> None:
    """Stop servers / routers (anything with ``stop()``) at once: each may take its grace period."""
    from concurrent.futures import ThreadPoolExecutor

    procs = [p for p in procs if p is not None]
    if procs:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.stop(), procs))
