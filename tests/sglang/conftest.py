"""Shared setup of the SGLang plugin tests.

* SGLang picks its platform when it is first imported; ``SGLANG_USE_CPU_ENGINE=1``
  selects its CPU platform (what serving on this machine needs), so it is set here,
  before any test module imports SGLang.
* :class:`ServerProcess` launches ``python -m sglang.launch_server`` on 127.0.0.1 with
  a free port in its own session, waits for ``/health`` with a deadline, and kills
  its whole process group on ``stop()``.

Do not add an ``__init__.py`` to this folder: a package named ``sglang`` would
shadow the real one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from sglang_ascend_offload.testing.ports import (DP_ATTENTION_PORT_SPAN, log_reports_bind_failure,
                                                  reserve_port)

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

REPO = Path(__file__).resolve().parents[2]
TINY_DSA = REPO / "tests" / "fixtures" / "tiny_dsa"

# What every CPU launch of the tiny DSA model needs (see docs/sglang_integration.md).
CPU_SERVER_ARGS = [
    "--model-path", str(TINY_DSA),
    "--load-format", "dummy",
    "--skip-tokenizer-init",
    "--device", "cpu",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--mem-fraction-static", "0.1",
    "--max-total-tokens", "4096",
    "--context-length", "2048",
]
# Colocated test servers sleep when idle (SGLang's IdleSleeper waits on the tokenizer
# socket instead of spinning), so several servers on 2 cores do not starve each other.
# Not for P/D servers: their idle loop also polls transfers and would stall up to 1 s.
IDLE_SLEEP = ["--sleep-on-idle"]
STARTUP_TIMEOUT_S = float(os.environ.get("SGLANG_TEST_STARTUP_TIMEOUT", "240"))


def server_env(cpu: bool = True) -> Dict[str, str]:
    env = dict(os.environ)
    if cpu:
        env.update(SGLANG_USE_CPU_ENGINE="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    else:
        env.pop("SGLANG_USE_CPU_ENGINE", None)
        env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.pop("SGLANG_ASCEND_OFFLOAD_CONFIG", None)
    return env


def free_port(span: int = 1) -> int:
    """A port reserved for this test process (see ``sglang_ascend_offload.testing.ports``:
    below the ephemeral range, locked across processes, never handed out twice)."""
    return reserve_port(span)


class PortInUse(RuntimeError):
    """A server's log reported that one of its listening sockets could not bind."""


class ServerProcess:
    """One ``sglang.launch_server`` subprocess (own session; killed as a group)."""

    def __init__(self, extra_args: Sequence[str] = (), log_path: Optional[Path] = None,
                 base_args: Sequence[str] = tuple(CPU_SERVER_ARGS), cpu: bool = True,
                 env: Optional[Dict[str, str]] = None):
        self.base_args = list(base_args)
        self.extra_args = list(extra_args)
        self.port_span = DP_ATTENTION_PORT_SPAN if "--enable-dp-attention" in self.extra_args else 1
        self.port = free_port(self.port_span)
        self.log_path = log_path
        self.cpu = cpu
        self.extra_env = dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def args(self) -> List[str]:
        return [sys.executable, "-m", "sglang.launch_server", *self.base_args,
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def start(self, attempts: int = 3) -> "ServerProcess":
        """Launch and wait for ``/health``. A bind failure of the server's HTTP port
        (seen in its log) restarts it on a fresh port within seconds, up to ``attempts``
        times; a bind failure of another port given in ``extra_args`` fails at once."""
        if self.log_path is None:
            import tempfile

            self.log_path = Path(tempfile.mkstemp(prefix="sglang_server_", suffix=".log")[1])
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except PortInUse as exc:
                if attempt == attempts or f"port {self.port} " not in str(exc):
                    raise  # out of attempts, or a port fixed in extra_args: the caller chose it
                self.port = free_port(self.port_span)

    def _start_once(self) -> "ServerProcess":
        log = open(self.log_path, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                     env={**server_env(self.cpu), **self.extra_env}, cwd=REPO, start_new_session=True)
        log.close()
        deadline = t0 + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            failed = self._port_that_failed_to_bind()
            if failed is not None:
                self.stop()
                raise PortInUse(f"port {failed} is in use (server port {self.port}); log: {self.log_path}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not healthy after {STARTUP_TIMEOUT_S:.0f} s; log: {self.log_path}")

    def _port_that_failed_to_bind(self) -> Optional[int]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        numbers = (int(n) for a in self.extra_args for n in re.findall(r"\d+", a))  # incl. ports inside JSON
        ports = [self.port] + [n for n in numbers if 1024 <= n <= 65535]
        return log_reports_bind_failure(text, ports)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generate(self, input_ids, max_new_tokens: int = 8, timeout: float = 120.0, return_logprob: bool = False):
        """Greedy ``/generate`` for one prompt (list of ids) or a batch (list of lists)."""
        body = {"input_ids": input_ids, "return_logprob": return_logprob,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
        req = urllib.request.Request(f"{self.url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as r:
            return r.read().decode()

    def stop(self) -> None:
        stop_process_group(self.proc, grace_s=20)


def stop_process_group(proc: Optional[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM a server's process group, SIGKILL it after ``grace_s``; no-op if gone."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def stop_all(*procs) -> None:
    """Stop servers / routers (anything with ``stop()``) at once: each may take its grace period."""
    from concurrent.futures import ThreadPoolExecutor

    procs = [p for p in procs if p is not None]
    if procs:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.stop(), procs))


def run_launcher(extra_args: List[str], timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Run ``launch_server`` to completion (for --help and startup failures)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", *CPU_SERVER_ARGS,
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=server_env(), cwd=REPO)


@pytest.fixture(scope="session")
def plugins_loaded():
    """SGLang's own ``load_plugins()`` in this process (what every SGLang process does)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ascend_offload.sglang_plugin import entry

    assert entry.is_registered()
    return True


@pytest.fixture
def clean_state():
    """No remembered plugin flags and no published config before and after the test."""
    from sglang_ascend_offload.sglang_plugin import carrier, flags

    flags.forget()
    carrier.clear()
    yield
    flags.forget()
    carrier.clear()
