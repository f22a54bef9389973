"""``bench soak``: serve the tiny DSA fixtures with offload under churn for minutes and
report what long runs break: memory growth, files left behind, failed requests.

Servers run side by side on 127.0.0.1 (one ``launch_server`` each, own process
group):

* ``sparse_decode``: ``tests/fixtures/tiny_dsa`` with sparse decode offload;
* ``layerwise_prefill``: ``tests/fixtures/tiny_dsa_4l`` with layerwise prefill offload
  (``shared_buffers: 1``: layers 1-3 share one device buffer);
* ``baseline`` (unless ``--no-baseline``): ``tiny_dsa`` without offload under the same
  load, so SGLang's own memory growth is measured beside the plugin's
  (``rss_growth_over_baseline``: the offload servers' largest growth over the baseline's).

Each is driven by ``--clients`` threads for ``--minutes``: random prompt lengths
(4-300 tokens) and output lengths (1-48), a quarter of the prompts extending an
earlier prompt (radix-cache hits), and about one request in ten aborted mid-flight
through ``/abort_request``. A request fails when it errors or, not aborted, returns a
different number of tokens than asked.

Resident memory (``VmRSS``, and its parts ``RssAnon`` / ``RssFile`` / ``RssShmem``) of
every process of each server is read after warm-up and at the end;
``rss_growth_ratio_max`` is the largest end / warm-up ``VmRSS`` ratio of the offload
servers. Warm-up (``warmup_criterion`` in the JSON) lasts until every server has
finished ``--warmup-requests`` requests (100) and at least a tenth of the run (20 s or
more), at most half of it: by then SGLang's pools, the radix cache and the plugin's
host pool have been written (the host pool is also pre-faulted at allocation, as pinned
memory is resident at once).

torch's CPU matmul keeps a compiled oneDNN primitive per input shape in two LRU caches
(``LRU_CACHE_CAPACITY``, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; 1024 entries each by
default, about 0.4 MB per entry with these models' weight shapes). Random prompt
lengths bring new shapes for tens of minutes, so with torch's defaults every scheduler
(the baseline's too) grows by hundreds of MB during a soak without leaking anything:
the caches are bounded, but far above what a 10-minute run fills. The soak sets both to ``--shape-cache`` (64)
entries in every server, which they fill during warm-up; ``--shape-cache 0`` keeps
torch's defaults. This only concerns the CPU fixtures; on an Ascend node the matmuls
run on the NPU.

After the servers stop (SIGTERM to the group, as an operator would), new files in
``/dev/shm`` are counted: the plugin's own (``sglang_ascend_offload_*``,
``sao_hostpool.*``) in ``leaked_shm_files``, SGLang's (``sgl_shm_mq_*``,
``sglang_loads_*``, which SGLang itself leaves behind when its group is terminated)
in ``sglang_shm_files_left``. The offload counters are the servers' last periodic
summary lines.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .served_load import REQUEST_ERRORS, VOCAB

SHM = Path("/dev/shm")
PLUGIN_SHM_PREFIXES = ("sglang_ascend_offload", "sao_hostpool")  # host_pool.py, shared_host_pool.py
SGLANG_SHM_PREFIXES = ("sgl_shm_mq_", "sglang_loads_")
# torch's CPU matmul (bf16 ``linear`` through oneDNN) caches a compiled primitive per input
# shape twice: in ideep (torch's oneDNN wrapper, LRU_CACHE_CAPACITY) and in oneDNN itself
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY); 1024 entries each by default.
SHAPE_CACHE_ENV = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
DEFAULT_SHAPE_CACHE = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="load duration in minutes (default 10)")
    p.add_argument("--clients", type=int, default=3, help="concurrent clients per server (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--abort-fraction", type=float, default=0.1, help="fraction of requests aborted mid-flight")
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="do not serve the model without offload beside the offload servers (by default it runs "
        "under the same load: SGLang's own memory growth is the yardstick, "
        "baseline_rss_growth_ratio_max)",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of every server (repeatable), e.g. LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    )
    p.add_argument(
        "--shape-cache",
        type=int,
        default=DEFAULT_SHAPE_CACHE,
        metavar="N",
        help="entries of torch's two per-input-shape CPU matmul caches in every server "
        f"({SHAPE_CACHE_ENV[0]}, {SHAPE_CACHE_ENV[1]}; default {DEFAULT_SHAPE_CACHE}); 0 keeps torch's "
        "defaults (1024 each, about 0.4 MB per entry here: SGLang's scheduler then grows for tens of "
        "minutes as new prompt lengths arrive, see docs/benchmarks.md)",
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=100,
        metavar="N",
        help="warm-up lasts until every server has finished N requests (and at least a tenth of the "
        "run, 20 s or more; at most half of it); default 100",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


@dataclass
class ProcessMemory:
    server: str
    pid: int
    name: str
    rss_warm_mb: float
    rss_end_mb: float
    rss_samples_mb: List[float] = field(default_factory=list)  # every 30 s after warm-up
    # VmRSS = RssAnon (heap, anonymous mappings) + RssFile (mapped files: libraries)
    # + RssShmem (shared memory: /dev/shm mappings such as the shared host pool)
    rss_anon_warm_mb: float = 0.0
    rss_anon_end_mb: float = 0.0
    rss_file_warm_mb: float = 0.0
    rss_file_end_mb: float = 0.0
    rss_shmem_warm_mb: float = 0.0
    rss_shmem_end_mb: float = 0.0

    @property
    def growth_ratio(self) -> float:
        return self.rss_end_mb / self.rss_warm_mb if self.rss_warm_mb > 0 else 1.0


@dataclass
class LoadStats:
    requests: int = 0
    failed: int = 0
    aborted: int = 0
    radix_prompts: int = 0
    output_tokens: int = 0
    errors: List[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **delta) -> None:
        with self.lock:
            for key, value in delta.items():
                if key == "error":
                    if len(self.errors) < 10:
                        self.errors.append(value)
                else:
                    setattr(self, key, getattr(self, key) + value)


def _rss_mb(pid: int) -> Optional[float]:
    return _status_mb(pid).get("VmRSS")


def _status_mb(pid: int) -> Dict[str, float]:
    """``VmRSS`` and its parts (``RssAnon``: heap / anonymous mappings, ``RssFile``: mapped
    files such as shared libraries, ``RssShmem``: shared memory such as ``/dev/shm``
    mappings) of ``pid`` in MiB; empty once the process is gone."""
    out: Dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    except OSError:
        return {}
    return out


def _proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _shm_files() -> set:
    try:
        return {p.name for p in SHM.iterdir()}
    except OSError:
        return set()


def _summary(log: Path, prefix: str) -> Dict[str, str]:
    """``key=value`` pairs of the last line of ``log`` that contains ``prefix``."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if prefix in line]
    except OSError:
        return {}
    if not lines:
        return {}
    return dict(re.findall(r"([\w/]+)=([^\s]+)", lines[-1].split(prefix, 1)[1]))


def _client(server, stats: LoadStats, rng: random.Random, stop_at: float, abort_fraction: float) -> None:
    history: List[List[int]] = []
    while time.monotonic() < stop_at:
        if history and rng.random() < 0.25:
            prompt = rng.choice(history) + [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 40))]
            stats.add(radix_prompts=1)
        else:
            prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(4, 300))]
        prompt = prompt[:1500]
        history = (history + [prompt])[-8:]
        want = rng.randint(1, 48)
        abort = rng.random() < abort_fraction
        rid = f"soak-{threading.get_ident()}-{rng.getrandbits(48):x}"
        if abort:
            threading.Timer(rng.uniform(0.05, 0.5), _abort, (server, rid)).start()
        try:
            out = server.generate(prompt, max_new_tokens=want, timeout=180, rid=rid)
        except REQUEST_ERRORS as exc:
            if abort:
                stats.add(requests=1, aborted=1)
            else:
                stats.add(requests=1, failed=1, error=f"{type(exc).__name__}: {exc}")
            continue
        got = len(out.get("output_ids", []))
        reason = (out.get("meta_info", {}).get("finish_reason") or {}).get("type")
        if abort and (reason == "abort" or got < want):
            stats.add(requests=1, aborted=1, output_tokens=got)
        elif got != want:
            stats.add(requests=1, failed=1, output_tokens=got, error=f"asked {want} tokens, got {got} ({reason})")
        else:
            stats.add(requests=1, output_tokens=got)


def _abort(server, rid: str) -> None:
    try:
        server.post("/abort_request", {"rid": rid}, timeout=30)
    except REQUEST_ERRORS:
        pass  # the request may have finished already


def _progress(msg: str) -> None:
    print(f"[bench soak] {msg}", file=sys.stderr, flush=True)


def _server_specs(baseline: bool) -> Dict[str, Tuple[List[str], List[str]]]:
    """Server name -> (fixture arguments, server arguments) of every server of the soak."""
    from ..testing.servers import IDLE_SLEEP, TINY_DSA, TINY_DSA_4L, fixture_args

    common = ["--max-running-requests", "4", "--chunked-prefill-size", "128"] + IDLE_SLEEP
    specs = {
        "sparse_decode": (
            fixture_args(TINY_DSA),
            [
                "--enable-sparse-decode-offload",
                "--sparse-decode-offload-config",
                json.dumps({"hot_tokens": 64, "metrics_log_interval_s": 5}),
            ],
        ),
        "layerwise_prefill": (
            fixture_args(TINY_DSA_4L),
            [
                "--enable-layerwise-prefill-offload",
                "--layerwise-prefill-offload-config",
                json.dumps({"shared_buffers": 1}),
            ],
        ),
    }
    if baseline:
        specs["baseline"] = (fixture_args(TINY_DSA), [])
    return {name: (base, common + extra) for name, (base, extra) in specs.items()}


def _servers_env(server_env: Optional[Dict[str, str]], shape_cache: int) -> Dict[str, str]:
    """Every server's environment: ``--server-env``, and the shape-cache bound unless it sets one."""
    env = dict(server_env or {})
    if shape_cache > 0:
        for key in SHAPE_CACHE_ENV:
            env.setdefault(key, str(shape_cache))  # --server-env wins
    return env


@dataclass(frozen=True)
class _Schedule:
    """The load's timeline, ``time.monotonic`` seconds."""

    t0: float  # the load starts
    warm_min: float  # warm-up lasts at least until here: a tenth of the run, 20 s or more (half of a short run)
    warm_max: float  # and at most until here: half of the run
    stop_at: float  # clients start no request after this


def _schedule(minutes: float) -> _Schedule:
    t0 = time.monotonic()
    duration = minutes * 60.0
    warm_min = t0 + max(20.0, duration / 10) if duration > 40 else t0 + duration / 2
    warm_max = t0 + max(duration / 2, warm_min - t0)
    return _Schedule(t0, warm_min, warm_max, t0 + max(duration, 1.0))


def _start_clients(
    servers, stats: Dict[str, LoadStats], clients: int, seed: int, stop_at: float, abort_fraction: float
) -> List[threading.Thread]:
    """``clients`` client threads per server, each with its own random stream drawn from ``seed``."""
    rng = random.Random(seed)
    threads = [
        threading.Thread(
            target=_client,
            args=(srv, stats[name], random.Random(rng.getrandbits(64)), stop_at, abort_fraction),
            daemon=True,
        )
        for name, srv in servers.items()
        for _ in range(clients)
    ]
    for t in threads:
        t.start()
    return threads


@dataclass
class _Warm:
    """The servers at the end of warm-up."""

    seconds: float  # warm-up's length
    done: Dict[str, int]  # server -> requests finished by then (answered or aborted)
    status: Dict[str, Dict[int, Dict[str, float]]]  # server -> pid -> its memory (_status_mb) then


def _warm_up(
    servers, stats: Dict[str, LoadStats], threads: List[threading.Thread], sched: _Schedule, warmup_requests: int
) -> _Warm:
    """Wait until every server has finished ``warmup_requests`` requests and ``sched.warm_min``
    has passed (at most until ``sched.warm_max``); read every server process's memory."""
    time.sleep(max(0.0, sched.warm_min - time.monotonic()))
    while (
        time.monotonic() < sched.warm_max
        and any(s.requests - s.failed < warmup_requests for s in stats.values())
        and any(t.is_alive() for t in threads)
    ):
        time.sleep(1.0)
    warmup_s = time.monotonic() - sched.t0
    warmup_done = {name: s.requests - s.failed for name, s in stats.items()}
    warm = {name: {pid: _status_mb(pid) for pid in srv.pids()} for name, srv in servers.items()}
    _progress(f"warm-up done after {warmup_s:.0f} s: " + ", ".join(f"{n} {k} requests" for n, k in warmup_done.items()))
    return _Warm(warmup_s, warmup_done, warm)


def _sample_until_done(
    threads: List[threading.Thread], warm: _Warm, stats: Dict[str, LoadStats], t0: float, minutes: float
) -> Dict[int, List[float]]:
    """Every warm-up process's ``VmRSS`` (MiB) every 30 s until the clients are done, with progress."""
    last = time.monotonic()
    samples: Dict[int, List[float]] = {pid: [] for w in warm.status.values() for pid in w}
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if time.monotonic() - last > 30:
            last = time.monotonic()
            for pid in samples:
                rss = _rss_mb(pid)
                if rss is not None:
                    samples[pid].append(round(rss, 1))
            _progress(
                f"{(last - t0) / 60:.1f}/{minutes:g} min: "
                + ", ".join(f"{n} {s.requests} req {s.failed} failed" for n, s in stats.items())
            )
    return samples


def _process_memory(servers, warm: _Warm, samples: Dict[int, List[float]]) -> List[ProcessMemory]:
    """Warm-up and end memory of every server process still alive at the end."""
    memory: List[ProcessMemory] = []
    for name, srv in servers.items():
        for pid, at_warm in warm.status[name].items():
            at_end = _status_mb(pid)
            if "VmRSS" in at_warm and "VmRSS" in at_end:
                parts = {
                    f"rss_{part}_{when}_mb": round(mb.get(key, 0.0), 1)
                    for part, key in (("anon", "RssAnon"), ("file", "RssFile"), ("shmem", "RssShmem"))
                    for when, mb in (("warm", at_warm), ("end", at_end))
                }
                memory.append(
                    ProcessMemory(
                        name,
                        pid,
                        _proc_name(pid),
                        round(at_warm["VmRSS"], 1),
                        round(at_end["VmRSS"], 1),
                        samples.get(pid, []),
                        **parts,
                    )
                )
    return memory


def _load_keys(minutes: float, stats: Dict[str, LoadStats]) -> dict:
    """The load's totals over every server."""
    total = LoadStats()
    for s in stats.values():
        for key in ("requests", "failed", "aborted", "radix_prompts", "output_tokens"):
            setattr(total, key, getattr(total, key) + getattr(s, key))
    return {
        "minutes": minutes,
        "requests": total.requests,
        "failed": total.failed,
        "aborted": total.aborted,
        "radix_prompts": total.radix_prompts,
        "output_tokens": total.output_tokens,
    }


def _growth_keys(memory: List[ProcessMemory], baseline: bool) -> dict:
    """The largest ``VmRSS`` growth of the offload servers, of the baseline, and their ratio."""
    offload = max((m.growth_ratio for m in memory if m.server != "baseline"), default=1.0)
    base = max((m.growth_ratio for m in memory if m.server == "baseline"), default=1.0)
    return {
        "rss_growth_ratio_max": round(offload, 4),
        "baseline_rss_growth_ratio_max": round(base, 4) if baseline else None,
        "rss_growth_over_baseline": round(offload / base, 4) if baseline else None,
    }


def _leftover_keys(new_files: List[str]) -> dict:
    """The files left in ``/dev/shm``: the plugin's (a leak) and SGLang's own."""
    leaked = [f for f in new_files if f.startswith(PLUGIN_SHM_PREFIXES)]
    sglang_left = [f for f in new_files if f.startswith(SGLANG_SHM_PREFIXES)]
    return {"leaked_shm_files": len(leaked), "leaked_shm_names": leaked, "sglang_shm_files_left": len(sglang_left)}


def run(
    minutes: float,
    clients: int,
    seed: int,
    abort_fraction: float,
    baseline: bool = False,
    server_env: Optional[Dict[str, str]] = None,
    shape_cache: int = DEFAULT_SHAPE_CACHE,
    warmup_requests: int = 100,
) -> dict:
    import tempfile

    from ..testing.servers import ServerProcess, stop_all

    specs = _server_specs(baseline)
    server_env = _servers_env(server_env, shape_cache)
    logs = Path(tempfile.mkdtemp(prefix="bench_soak_"))
    shm_before = _shm_files()
    servers = {
        name: ServerProcess(args, log_path=logs / f"{name}.log", base_args=base, env=server_env)
        for name, (base, args) in specs.items()
    }
    _progress(f"starting {len(servers)} servers (logs in {logs})")
    started = []
    try:
        for server in servers.values():  # one after the other: two start-ups at once starve 2 cores
            started.append(server.start())
        stats = {name: LoadStats() for name in servers}
        sched = _schedule(minutes)
        threads = _start_clients(servers, stats, clients, seed, sched.stop_at, abort_fraction)
        warm = _warm_up(servers, stats, threads, sched, warmup_requests)
        samples = _sample_until_done(threads, warm, stats, sched.t0, minutes)
        memory = _process_memory(servers, warm, samples)
        counters = {
            "sparse_decode": _summary(servers["sparse_decode"].log_path, "sparse-decode-offload:"),
            "layerwise_prefill": _summary(servers["layerwise_prefill"].log_path, "layerwise-prefill:"),
        }
    finally:
        _progress("stopping servers (SIGTERM to each process group)")
        stop_all(*started)
    time.sleep(1.0)
    new_files = sorted(_shm_files() - shm_before)
    return {
        **_load_keys(minutes, stats),
        **_growth_keys(memory, baseline),
        **_leftover_keys(new_files),
        "processes": [{**asdict(m), "growth_ratio": round(m.growth_ratio, 4)} for m in memory],
        "servers": [
            {
                "name": name,
                "requests": s.requests,
                "failed": s.failed,
                "aborted": s.aborted,
                "errors": s.errors,
                "offload_counters": counters.get(name, {}),
            }
            for name, s in stats.items()
        ],
        "server_env": server_env,
        "shape_cache": shape_cache,
        "warmup_s": round(warm.seconds, 1),
        "warmup_requests": warm.done,
        "warmup_criterion": (
            f"at least {warmup_requests} finished (answered or aborted) requests per server "
            f"and at least {sched.warm_min - sched.t0:.0f} s, at most {sched.warm_max - sched.t0:.0f} s"
        ),
        "logs": str(logs),
    }


def main(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.clients < 1 or not 0 <= args.abort_fraction <= 1:
        problems = [
            m
            for bad, m in (
                (args.minutes <= 0, f"--minutes {args.minutes} must be > 0"),
                (args.clients < 1, f"--clients {args.clients} must be >= 1"),
                (not 0 <= args.abort_fraction <= 1, f"--abort-fraction {args.abort_fraction} must be in [0, 1]"),
            )
            if bad
        ]
        print("bench soak: " + "; ".join(problems), file=sys.stderr)
        return 2
    env = {}
    for item in args.server_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"bench soak: --server-env {item!r} is not KEY=VALUE", file=sys.stderr)
            return 2
        env[key] = value
    if args.shape_cache < 0 or args.warmup_requests < 0:
        print("bench soak: --shape-cache and --warmup-requests must be >= 0", file=sys.stderr)
        return 2
    result = run(
        args.minutes,
        args.clients,
        args.seed,
        args.abort_fraction,
        args.baseline,
        env,
        args.shape_cache,
        args.warmup_requests,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"soak {result['minutes']:g} min: {result['requests']} requests ({result['aborted']} aborted, "
            f"{result['radix_prompts']} radix-hit prompts), {result['failed']} failed"
        )
        print(f"{'server':18s} {'pid':>7s} {'process':16s} {'rss warm MB':>11s} {'rss end MB':>10s} {'growth':>7s}")
        for p in result["processes"]:
            print(
                f"{p['server']:18s} {p['pid']:7d} {p['name']:16s} {p['rss_warm_mb']:11.1f} "
                f"{p['rss_end_mb']:10.1f} {p['growth_ratio']:7.3f}"
            )
        if result["baseline_rss_growth_ratio_max"] is not None:
            print(
                f"baseline (no offload) rss growth {result['baseline_rss_growth_ratio_max']:.3f}; offload "
                f"servers' growth over it {result['rss_growth_over_baseline']:.3f}"
            )
        print(
            f"rss_growth_ratio_max {result['rss_growth_ratio_max']:.3f}; plugin shm files left "
            f"{result['leaked_shm_files']}; SGLang's own shm files left {result['sglang_shm_files_left']}"
        )
        for s in result["servers"]:
            print(f"{s['name']}: " + " ".join(f"{k}={v}" for k, v in s["offload_counters"].items()))
    return 0 if result["failed"] == 0 and result["leaked_shm_files"] == 0 else 1
