"""Shared setup of the SGLang plugin tests.

* SGLang picks its platform when it is first imported; ``SGLANG_USE_CPU_ENGINE=1``
  selects its CPU platform (what serving on a machine without an NPU needs), so it is
  set here, before any test module imports SGLang, unless an NPU is present.
* :class:`ServerProcess` (``sglang_ascend_offload.testing.servers``, shared with the
  served benchmarks) launches ``python -m sglang.launch_server`` on 127.0.0.1 on a
  reserved port in its own session, waits for ``/health`` with a deadline, restarts on
  a fresh port if the log reports a bind failure, and stops its process group.
* :class:`SharedServers` (fixture ``shared_servers``): a server launched with the same
  arguments by several modules is launched once per session; see docs/testing.md.

Do not add an ``__init__.py`` to this folder: a package named ``sglang`` would
shadow the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import pytest

from sglang_ascend_offload.testing.ports import reserve_port

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
from npu_requirements import npu_present  # noqa: E402 - tests/conftest.py put tests/ on sys.path

if not npu_present():  # an NPU runner tests SGLang's NPU platform; servers set their own (testing/servers.py)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ascend_offload.testing.servers import (  # noqa: E402,F401 - re-exported for the test modules
    CPU_SERVER_ARGS,
    IDLE_SLEEP,
    REPO,
    STARTUP_TIMEOUT_S,
    TINY_DSA,
    PortInUse,
    ServerProcess,
    server_env,
    start_all,
    stop_all,
    stop_process_group,
)


def free_port(span: int = 1) -> int:
    """A port reserved for this test process (see ``sglang_ascend_offload.testing.ports``:
    below the ephemeral range, locked across processes, never handed out twice)."""
    return reserve_port(span)


def run_launcher(extra_args: List[str], timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Run ``launch_server`` to completion (for --help and startup failures)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        *CPU_SERVER_ARGS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
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
    from sglang_ascend_offload.sglang_plugin.args import carrier, flags

    flags.forget()
    carrier.clear()
    yield
    flags.forget()
    carrier.clear()


class SharedServers:
    """Servers that several test modules launch with identical arguments, launched once.

    A module lists the names it uses in ``SHARED_SERVERS`` (module level) and asks for
    each with its own launch arguments: :meth:`get` returns the running server when a
    server of that name was launched with exactly these arguments (base arguments, extra
    arguments, environment), else a new, unstarted :class:`ServerProcess` (a name asked
    for with other arguments is an error: the modules' settings drifted apart).
    :meth:`start_all` starts the module's servers together, skipping the shared ones
    already running, whose radix cache (and KV pools) it flushes instead, so each module
    sees a server in the state a fresh one has. :meth:`stop_all` stops the module's own
    servers and stops a shared one once no module still to run lists its name.
    """

    def __init__(self, root: Path, users: Dict[str, Set[str]]):
        self.root = root
        self.users = users  # name -> modules (``__name__``) still to use it
        self.servers: Dict[str, ServerProcess] = {}
        self.keys: Dict[str, tuple] = {}

    def get(
        self,
        name: str,
        extra_args: Sequence[str],
        *,
        base_args: Sequence[str] = tuple(CPU_SERVER_ARGS),
        env: Optional[Dict[str, str]] = None,
    ) -> ServerProcess:
        key = (tuple(base_args), tuple(extra_args), tuple(sorted((env or {}).items())))
        if name in self.keys and self.keys[name] != key:
            raise ValueError(f"shared server {name!r} asked for with other arguments:\n{key}\nnot\n{self.keys[name]}")
        srv = self.servers.get(name)
        if srv is None or (srv.proc is not None and srv.proc.poll() is not None):  # none yet, or it died
            if srv is not None:
                srv.stop()  # gives its ports back
            n = sum(1 for p in self.root.glob(f"{name}*.log"))
            srv = ServerProcess(
                extra_args,
                base_args=base_args,
                env=env,
                log_path=self.root / (f"{name}.log" if n == 0 else f"{name}.{n}.log"),
            )
            self.servers[name], self.keys[name] = srv, key
        srv.shared_name = name
        return srv

    def start_all(self, *procs: ServerProcess) -> None:
        running = [p for p in procs if p.proc is not None and p.proc.poll() is None]
        for p in running:
            flush_cache(p)
        start_all(*[p for p in procs if p not in running])

    def stop_all(self, module: str, *procs) -> None:
        for users in self.users.values():
            users.discard(module)
        done = [s for n, s in self.servers.items() if not self.users.get(n)]
        stop_all(*[p for p in procs if p is not None and getattr(p, "shared_name", None) is None], *done)
        for n in [n for n, s in self.servers.items() if s in done]:
            del self.servers[n]

    def close(self) -> None:
        stop_all(*self.servers.values())
        self.servers.clear()


def flush_cache(server: ServerProcess, timeout_s: float = 60.0) -> None:
    """SGLang's ``/flush_cache`` (radix cache, request and token pools), waiting up to
    ``timeout_s`` for the server to be idle; fails when it did not flush."""
    req = urllib.request.Request(f"{server.url}/flush_cache?timeout={timeout_s:g}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s + 30) as r:
        assert r.status == 200, r.read()


def group_shared_server_users(items: List) -> List:
    """``items`` reordered so that the modules sharing a server run back to back.

    A module that lists a shared server (``SHARED_SERVERS``) is moved up to run right after
    the last module collected before it that shares one of its servers; everything else
    keeps its collection order, and a module's own items stay together and in order. A
    shared server therefore stays up only while the modules that use it run, whatever the
    files are named or where they live.
    """
    modules: List = []  # modules in collection order, each with its items
    by_module: Dict[int, List] = {}
    for item in items:
        module = getattr(item, "module", None)
        key = id(module)
        if key not in by_module:
            by_module[key] = []
            modules.append(module)
        by_module[key].append(item)
    ordered: List = []
    for module in modules:
        names = set(getattr(module, "SHARED_SERVERS", ()))
        after = max(
            (i for i, m in enumerate(ordered) if names & set(getattr(m, "SHARED_SERVERS", ()))),
            default=len(ordered) - 1,
        )
        ordered.insert(after + 1, module)
    return [item for module in ordered for item in by_module[id(module)]]


def pytest_collection_modifyitems(config, items):
    items[:] = group_shared_server_users(items)
    users: Dict[str, Set[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        for name in getattr(module, "SHARED_SERVERS", ()):
            users.setdefault(name, set()).add(module.__name__)
    config._shared_server_users = users


@pytest.fixture(scope="session")
def shared_servers(request, tmp_path_factory):
    """The session's :class:`SharedServers` (every one stopped at the end at the latest)."""
    pool = SharedServers(tmp_path_factory.mktemp("shared_servers"), getattr(request.config, "_shared_server_users", {}))
    yield pool
    pool.close()
