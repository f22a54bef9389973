"""What one test-server start costs, each way the test launcher can start it.

Run from the repository root with the CPU environment::

    .venv/bin/python scripts/measure_test_launch.py            # a table
    .venv/bin/python scripts/measure_test_launch.py --json     # one JSON document on stdout

Starts the tiny dummy-weight server (``tests/fixtures/tiny_dsa``, the plugin's backend) the
three ways of ``docs/testing.md`` ("Served tests and shared servers"), ``--repeats`` times
each, one at a time:

* ``spawn``: as users start it (no test seam): three new interpreters;
* ``forkserver``: the harness's ``forkserver`` seam without the zygote: the launcher is a new
  interpreter, its children fork from a forkserver that imported SGLang;
* ``zygote``: the seam and the test zygote (the zygote's own start is reported apart).

For each start: the wall time to ``/health`` and the CPU seconds of every process of the
server's group at that moment (launcher, forkserver, scheduler, detokenizer), and the
greedy tokens of one request, which must be the same every way (the exit status is 1 when
they differ). Measure on a quiet machine: CPU seconds are the cost, wall time moves with load.

JSON: ``{"ways": {way: {"starts": [{"wall_s", "cpu_s", "processes": {title: cpu_s}}],
"cpu_s_mean", "wall_s_mean", "tokens"}}, "zygote_start_s", "same_tokens": bool}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_ascend_offload.testing import harness, zygote  # noqa: E402
from sglang_ascend_offload.testing.servers import ServerProcess, cpu_seconds, server_env  # noqa: E402

SERVER_ARGS = ["--attention-backend", "ascend_offload", "--max-running-requests", "2"]
PROMPT = [(11 * i) % 900 + 3 for i in range(48)]


def _title(pid: int) -> str:
    """A short name for a server process: SGLang's title, or the launcher / forkserver / tracker."""
    words = [w.decode(errors="replace") for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    text = " ".join(words)
    if words[0].startswith("sglang::"):
        return words[0]
    for name in ("multiprocessing.forkserver", "resource_tracker", "sglang.launch_server"):
        if name in text:
            return name
    return text[:40]


def one_start(way: str, log_dir: Path) -> Dict:
    seams = {} if way == "spawn" else {"forkserver": True}
    env = harness.environment(seams) if seams else {}
    if way == "forkserver":  # the seam, in an environment the zygote does not have: a new launcher
        env["SGLANG_MEASURE_LAUNCH_WITHOUT_ZYGOTE"] = "1"
    server = ServerProcess(SERVER_ARGS, log_path=log_dir / f"{way}.log", env=env)
    t0 = time.monotonic()
    server.start()
    wall = time.monotonic() - t0
    try:
        cpu = cpu_seconds(server.pids())
        processes: Dict[str, float] = {}
        for pid, seconds in cpu.items():
            title = _title(pid)
            processes[title] = round(processes.get(title, 0.0) + seconds, 2)
        tokens = server.generate(PROMPT, max_new_tokens=8)["output_ids"]
        forked = type(server.proc).__name__ == "ForkedLauncher"
    finally:
        server.stop()
    if forked != (way == "zygote"):
        raise RuntimeError(f"{way}: the launcher was {'' if forked else 'not '}forked from the zygote")
    return {"wall_s": round(wall, 2), "cpu_s": round(sum(cpu.values()), 2), "processes": processes, "tokens": tokens}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="starts per way (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    log_dir = Path(tempfile.mkdtemp(prefix="measure_launch_"))
    ways: Dict[str, Dict] = {}
    zygote_start_s = None
    for way in ("spawn", "forkserver", "zygote"):
        if way == "zygote":
            t0 = time.monotonic()
            _, problem = zygote.ensure_started(server_env(), REPO)
            if problem:
                raise RuntimeError(problem)
            zygote_start_s = round(time.monotonic() - t0, 2)
        starts = []
        for i in range(args.repeats):
            print(f"[measure] {way} start {i + 1}/{args.repeats}", file=sys.stderr)
            starts.append(one_start(way, log_dir))
        ways[way] = {
            "starts": [{k: v for k, v in s.items() if k != "tokens"} for s in starts],
            "cpu_s_mean": round(sum(s["cpu_s"] for s in starts) / len(starts), 2),
            "wall_s_mean": round(sum(s["wall_s"] for s in starts) / len(starts), 2),
            "tokens": starts[0]["tokens"],
        }
    same = len({json.dumps(w["tokens"]) for w in ways.values()}) == 1
    doc = {"ways": ways, "zygote_start_s": zygote_start_s, "same_tokens": same}
    if args.json:
        print(json.dumps(doc))
    else:
        spawn_cpu = ways["spawn"]["cpu_s_mean"]
        print(f"{'way':<11} {'CPU-s':>6} {'x spawn':>8} {'wall s':>7}  processes (CPU-s, last start)")
        for way, w in ways.items():
            procs = ", ".join(f"{t} {c}" for t, c in w["starts"][-1]["processes"].items())
            ratio = w["cpu_s_mean"] / spawn_cpu
            print(f"{way:<11} {w['cpu_s_mean']:>6.1f} {ratio:>8.2f} {w['wall_s_mean']:>7.1f}  {procs}")
        print(f"zygote's own start (once per test process): {zygote_start_s} s wall")
        print(f"same greedy tokens every way: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
