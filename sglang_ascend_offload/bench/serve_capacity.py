"""``bench serve --capacity``: what the same device KV budget serves with sparse decode
offload and without, side by side in one run.

Two servers of the same model get the same device KV byte budget (``--device-kv-budget``,
default :data:`DEFAULT_BUDGET` on CPU, where the plugin then accounts like a device of
that size; on an NPU node without it, both get SGLang's ``--mem-fraction-static``
profile) and the same ``--max-running-requests``:

* ``no_offload``: the device KV pool holds the main KV and the index K of every token;
* ``offload``: ``--enable-sparse-decode-offload``: the device holds the index K and the
  hot buffers, the main KV lives in the host pool.

Each reports its ``max_total_num_tokens`` (``/server_info``). Both stay up for the run
(idle servers sleep), and the same seeded load goes to each in turn at every
concurrency of ``--concurrency`` (default :data:`DEFAULT_CONCURRENCY`): ``2 x c`` long
prompts (``--input-len``) asking for ``--output-len`` tokens, greedy, ``ignore_eos``,
streamed, ``c`` in flight. While a load runs, ``/metrics`` is sampled every
:data:`POLL_S` for the running and queued requests; retractions are the change of
``sglang:num_retracted_requests_total``.

A concurrency is **pool-limited** for a server when it queued requests while fewer than
``c`` ran, or retracted any: its KV pool, not the clients, set the concurrency.

Then ``--low-rounds`` rounds at concurrency 1 give each server's CPU ms per output token
(all its processes): the cost of offload when everything would fit. By default
(``--low-schedule side-by-side``) both servers serve a round's requests at the same
time, one stream each, so both see the same machine: on a shared VM the speed of a
core drifts by 10-20 % between windows of a few seconds, which swamps a 5 % difference
when the servers take turns (``--low-schedule alternating``, the order alternating per
round). The ratio is the median over rounds of each round's offload over no offload
CPU ms per token (``/metrics`` is sampled every :data:`LOW_POLL_S` there, not every
:data:`POLL_S`: each scrape costs the server CPU that is not serving). Each round sends
two of the sweep's long requests
and then two short ones (``--low-short-len`` prompt and output tokens each,
:data:`DEFAULT_LOW_SHORT_LEN`) whose whole context fits the offload server's hot buffer:
with ``residency: adaptive`` (the offload server's default here) those are served
from it directly, with no residency step.

``--json`` prints one document:

* ``runs``: one entry per (server, concurrency) of the sweep and per (server, round) at
  concurrency 1 (``phase``: ``sweep`` / ``low_concurrency``): ``server``, ``name``,
  ``concurrency``, ``requests``, ``completed``, ``output_tokens_per_s``, ``ttft_ms_p50`` / ``_p99``,
  ``itl_ms_p50`` / ``_p99``, ``peak_running``, ``peak_queued``, ``retractions``,
  ``pool_limited``, ``server_cpu_ms_per_token``, ``identical_to_no_offload``; the offload
  server's also ``direct_rows``, ``hit_rate`` (top-k entries found resident by the
  residency, over the level; ``None`` when every row was direct) and
  ``h2d_bytes_per_token`` (host -> device bytes per output token, all layers: miss
  rows plus rows copied into direct spans: what an NPU node's link carries);
* ``servers``: per server ``max_total_num_tokens``, ``max_running_requests``, its
  arguments and log;
* ``max_total_tokens_ratio``: offload over no offload ``max_total_num_tokens``;
* ``throughput_ratio_pool_limited``: offload over no offload output tok/s at
  ``pool_limited_concurrency``, the largest swept concurrency at which no offload was
  pool-limited (``None`` if it never was: sweep further); ``throughput_ratios`` has
  the ratio at every concurrency;
* ``low_concurrency_cpu_ratio``: offload over no offload CPU ms per token at
  concurrency 1 (the long requests; the median of ``low_concurrency_round_ratios``, one
  per round, under ``low_concurrency_schedule``; ``low_concurrency_cpu_ms_per_token``
  has each server's median), with ``low_concurrency_residency`` the residency
  the offload server ran (``always``: every request's main KV is in the host pool;
  ``adaptive``: requests that fit their hot buffer are served from it directly);
  ``low_concurrency_short_cpu_ratio``: the same for the short requests, and
  ``low_concurrency_short_direct_rows``: the offload server's decode rows (summed over
  layers) served directly during them (``runs`` entries of ``phase``
  ``low_concurrency_short``; ``direct_rows`` per entry);
* ``identical_tokens``: every request's output is the same on both servers, at every
  concurrency; ``token_agreement``: the fraction of output tokens that agree.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import served_load
from .served_startup import model_vocab, startup_error

DEFAULT_BUDGET = "6MiB"
DEFAULT_CONCURRENCY = "2,4,8,16"
DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 512  # decode-heavy: prefill costs the same on both servers and would dilute the ratio
DEFAULT_MAX_RUNNING = 16
#: the default hot buffer (2 x top-k); requests that fit it are served from it directly
DEFAULT_OFFLOAD_CONFIG = json.dumps({"metrics_log_interval_s": 0, "residency": "adaptive"})
#: rounds of one server on this 2-core VM spread by up to 1.6x; three rounds left the median
#: at the mercy of one slow round, and side-by-side rounds still spread by +-5-10 % under load
DEFAULT_LOW_ROUNDS = 7
LOW_SCHEDULES = ("side-by-side", "alternating")
DEFAULT_LOW_SHORT_LEN = 24  # 24 + 24 tokens fit the CPU fixture's 64-slot hot buffer
CAPACITY_CONTEXT = 4096
POLL_S = 0.2
#: /metrics sampling of the concurrency-1 rounds: a scrape costs the server ~15 ms of CPU,
#: which at POLL_S would add ~6 % to both servers' CPU per token and pull their ratio towards 1
LOW_POLL_S = 2.0
SERVERS = ("no_offload", "offload")
_GAUGE = re.compile(
    r"^(sglang:num_running_reqs|sglang:num_queue_reqs|sglang:num_retracted_requests_total|"
    r"sglang:ascend_offload_(?:direct_rows|selected|hits|h2d_bytes|direct_h2d_bytes)_total)"
    r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)$"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``bench serve`` flags that only ``--capacity`` reads (the shared ones are serve's)."""
    p.add_argument(
        "--capacity",
        action="store_true",
        help="the capacity benchmark: offload vs no offload at the same device KV budget, "
        "concurrency swept (--concurrency) until no offload is pool-limited",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        metavar="C1,C2,...",
        help=f"--capacity: concurrencies to sweep (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--device-kv-budget",
        default=None,
        metavar="SIZE",
        help=f"--capacity: device KV budget of both servers (default {DEFAULT_BUDGET} on CPU; "
        "on an NPU node SGLang's --mem-fraction-static profile unless given)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="--capacity: write output tok/s and peak running requests per concurrency to this PNG",
    )
    p.add_argument(
        "--low-rounds",
        type=int,
        default=DEFAULT_LOW_ROUNDS,
        help="--capacity: rounds at concurrency 1 for the CPU-per-token ratio (see --low-schedule) "
        f"(default {DEFAULT_LOW_ROUNDS})",
    )
    p.add_argument(
        "--low-schedule",
        choices=LOW_SCHEDULES,
        default=LOW_SCHEDULES[0],
        help="--capacity: the concurrency-1 rounds load both servers at the same time "
        "(side-by-side, the default: both see the same machine) or one after the other, "
        "the order alternating per round",
    )
    p.add_argument(
        "--low-short-len",
        type=int,
        default=DEFAULT_LOW_SHORT_LEN,
        help="--capacity: prompt and output tokens of the short requests of each concurrency-1 round "
        f"(default {DEFAULT_LOW_SHORT_LEN}; 0 = none)",
    )


@dataclass
class LevelResult:
    """One server at one concurrency (an entry of ``runs``; times in ms)."""

    server: str
    name: str
    concurrency: int
    requests: int
    phase: str = "sweep"  # or "low_concurrency" / "low_concurrency_short": the rounds at concurrency 1
    completed: int = 0
    output_tokens_per_s: Optional[float] = None
    ttft_ms_p50: Optional[float] = None
    ttft_ms_p99: Optional[float] = None
    itl_ms_p50: Optional[float] = None
    itl_ms_p99: Optional[float] = None
    peak_running: int = 0
    peak_queued: int = 0
    retractions: int = 0
    pool_limited: bool = False
    server_cpu_ms_per_token: Optional[float] = None
    identical_to_no_offload: Optional[bool] = None
    direct_rows: Optional[int] = None  # offload: decode rows served directly from the hot buffer (all layers)
    # offload, over the level (all layers): top-k hit rate of the residency, and the bytes
    # moved host -> device per output token (miss rows + rows copied into direct spans)
    hit_rate: Optional[float] = None
    h2d_bytes_per_token: Optional[float] = None
    request_errors: List[str] = field(default_factory=list)


@dataclass
class ServerInfo:
    """One server's entry of ``servers``."""

    name: str
    server_args: List[str]
    log: str
    max_total_num_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    error: Optional[str] = None


def parse_concurrency(text: str) -> List[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]`` (sorted, unique); ``ValueError`` naming the bad item."""
    out = set()
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--concurrency: {item!r} is not a positive integer")
        out.add(int(item))
    if not out:
        raise ValueError("--concurrency is empty")
    return sorted(out)


def read_gauges(text: str) -> Dict[str, float]:
    """Sum of each sampled metric over its label sets (``/metrics`` text): running and
    queued requests, retractions, and the offload server's direct decode rows, top-k
    entries selected and hit, and host -> device bytes."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        m = _GAUGE.match(line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


class MetricsPoller:
    """Samples a server's ``/metrics`` every ``poll_s`` on a thread; keeps the peaks."""

    def __init__(self, server: Any, poll_s: float = POLL_S):
        self.server = server
        self.poll_s = float(poll_s)
        self.peak_running = 0
        self.peak_queued = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capacity-metrics", daemon=True)

    def totals(self) -> Dict[str, float]:
        """The counters so far (one ``/metrics`` read), by name without the
        ``sglang:`` / ``sglang:ascend_offload_`` prefix and ``_total``: retracted
        requests, and the offload server's direct rows, selected, hits, h2d_bytes and
        direct_h2d_bytes (0 where absent)."""
        g = read_gauges(self.server.get("/metrics"))
        names = (
            "num_retracted_requests",
            "ascend_offload_direct_rows",
            "ascend_offload_selected",
            "ascend_offload_hits",
            "ascend_offload_h2d_bytes",
            "ascend_offload_direct_h2d_bytes",
        )
        return {n.replace("ascend_offload_", ""): g.get(f"sglang:{n}_total", 0.0) for n in names}

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                g = read_gauges(self.server.get("/metrics", timeout=5.0))
            except served_load.REQUEST_ERRORS:
                continue
            self.peak_running = max(self.peak_running, int(g.get("sglang:num_running_reqs", 0)))
            self.peak_queued = max(self.peak_queued, int(g.get("sglang:num_queue_reqs", 0)))

    def __enter__(self) -> "MetricsPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _progress(msg: str) -> None:
    print(f"[bench serve --capacity] {msg}", file=sys.stderr, flush=True)


def _ms(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v * 1e3, 3)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 4) if a and b else None


def _round4(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 4)


def server_args(name: str, args: argparse.Namespace, budget: Optional[str]) -> Tuple[List[str], List[str], bool]:
    """``(base_args, extra_args, cpu)`` of one of the two servers."""
    from ..testing.servers import CPU_SERVER_ARGS, IDLE_SLEEP

    cpu = args.model_path is None
    extra = ["--max-running-requests", str(args.max_running_requests), "--enable-metrics"]
    if budget is not None:
        extra += ["--device-kv-budget", budget]
    if cpu:
        base = list(CPU_SERVER_ARGS)
        i = base.index("--max-total-tokens")  # the budget sizes the pool, not a token cap
        del base[i : i + 2]
        base[base.index("--context-length") + 1] = str(CAPACITY_CONTEXT)
        extra += IDLE_SLEEP
    else:
        base = ["--model-path", str(args.model_path)]
    if name == "offload":
        config = args.offload_config if args.offload_config is not None else DEFAULT_OFFLOAD_CONFIG
        extra += ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", config]
    for item in args.server_arg:
        import shlex

        extra += shlex.split(item)
    return base, extra, cpu


class CapacityServer:
    """One of the two servers: started once, loads sent to it level by level."""

    def __init__(self, name: str, args: argparse.Namespace, budget: Optional[str], log_dir: Path):
        from ..testing.servers import ServerProcess

        base, extra, cpu = server_args(name, args, budget)
        self.name = name
        self.info = ServerInfo(name, extra, str(log_dir / f"capacity_{name}.log"))
        self.server = ServerProcess(
            extra, log_path=Path(self.info.log), base_args=base, cpu=cpu, startup_timeout_s=args.startup_timeout
        )
        self.request_timeout = args.request_timeout

    def start(self, warmup_len: int, vocab: int) -> bool:
        from ..testing.servers import PortInUse

        _progress(f"{self.name}: starting ({' '.join(self.info.server_args)})")
        try:
            self.server.start()
            state = json.loads(self.server.get("/server_info"))
            internal = (state.get("internal_states") or [{}])[0]
            self.info.max_total_num_tokens = int(
                state.get("max_total_num_tokens") or internal.get("memory_usage", {}).get("token_capacity")
            )
            self.info.max_running_requests = (
                int(internal.get("effective_max_running_requests_per_dp") or state.get("max_running_requests") or 0)
                or None
            )
            served_load.stream_generate(
                self.server.url, served_load.random_prompt(warmup_len, -1, vocab), 4, timeout_s=self.request_timeout
            )
        except (
            RuntimeError,
            TimeoutError,
            PortInUse,
            KeyError,
            TypeError,
            ValueError,
            *served_load.REQUEST_ERRORS,
        ) as exc:
            self.info.error = startup_error(exc, self.server.log_path)
            _progress(f"{self.name}: did not start: {self.info.error}")
            self.server.stop()
            return False
        _progress(f"{self.name}: up, max_total_num_tokens {self.info.max_total_num_tokens}")
        return True

    def level(
        self, prompts: Sequence[List[int]], output_len: int, concurrency: int, tag: str, poll_s: float = POLL_S
    ) -> Tuple[LevelResult, List[Optional[List[int]]]]:
        """One load at ``concurrency``; the result and every request's output ids
        (``poll_s``: how often ``/metrics`` is sampled for the peaks meanwhile)."""
        from ..testing.servers import cpu_seconds

        result = LevelResult(self.name, f"{self.name}_{tag}", concurrency, len(prompts))
        before = MetricsPoller(self.server).totals()
        cpu0 = cpu_seconds(self.server.pids())
        with MetricsPoller(self.server, poll_s) as poll:
            res, _ = served_load.run_load(
                self.server.url, prompts, output_len, concurrency, timeout_s=self.request_timeout
            )
        cpu_s = sum(cpu_seconds(self.server.pids()).values()) - sum(cpu0.values())
        after = MetricsPoller(self.server).totals()
        moved = {k: after[k] - before[k] for k in after}
        result.retractions = int(moved["num_retracted_requests"])
        done = res.completed(output_len)
        tokens = sum(o.tokens for o in done)
        if self.name == "offload":
            result.direct_rows = int(moved["direct_rows"])
            result.hit_rate = round(moved["hits"] / moved["selected"], 4) if moved["selected"] else None
            h2d = moved["h2d_bytes"] + moved["direct_h2d_bytes"]
            result.h2d_bytes_per_token = round(h2d / tokens, 1) if tokens else None
        result.completed = len(done)
        result.request_errors = res.errors
        tps = res.output_tokens_per_s(output_len)
        result.output_tokens_per_s = None if tps is None else round(tps, 3)
        result.server_cpu_ms_per_token = round(cpu_s * 1e3 / tokens, 4) if tokens else None
        ttfts = [o.ttft_s for o in done]
        itls = [x for o in done for x in o.inter_token_s()]
        result.ttft_ms_p50, result.ttft_ms_p99 = (_ms(served_load.percentile(ttfts, q)) for q in (50, 99))
        result.itl_ms_p50, result.itl_ms_p99 = (_ms(served_load.percentile(itls, q)) for q in (50, 99))
        result.peak_running, result.peak_queued = poll.peak_running, poll.peak_queued
        result.pool_limited = result.retractions > 0 or (poll.peak_queued > 0 and poll.peak_running < concurrency)
        _progress(
            f"{result.name}: {result.completed}/{len(prompts)} done, {tps or 0:.1f} output tok/s, peak "
            f"running {poll.peak_running} queued {poll.peak_queued}, retractions {result.retractions}"
        )
        return result, [o.output_ids if o is not None else None for o in res.outputs]

    def stop(self) -> None:
        self.server.stop()


def _agreement(a: Sequence[Optional[List[int]]], b: Sequence[Optional[List[int]]]) -> Tuple[int, int]:
    same = total = 0
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        total += len(y)
        same += sum(1 for i, t in enumerate(y) if i < len(x) and x[i] == t)
    return same, total


def run(args: argparse.Namespace) -> Dict[str, Any]:
    levels = parse_concurrency(args.concurrency or DEFAULT_CONCURRENCY)
    budget = (
        args.device_kv_budget
        if args.device_kv_budget is not None
        else (DEFAULT_BUDGET if args.model_path is None else None)
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_capacity_"))
    log_dir.mkdir(parents=True, exist_ok=True)

    vocab = model_vocab(args.model_path)
    servers = [CapacityServer(name, args, budget, log_dir) for name in SERVERS]
    t0 = time.monotonic()
    runs: List[LevelResult] = []
    same_tokens = total_tokens = 0
    identical = True
    low: Dict[str, List[float]] = {name: [] for name in SERVERS}
    short: Dict[str, List[float]] = {name: [] for name in SERVERS}
    try:
        up = all([s.start(args.input_len, vocab) for s in servers])
        if up:
            for c in levels:
                prompts = [
                    served_load.random_prompt(args.input_len, args.seed * 1_000_003 + 1000 * c + i, vocab)
                    for i in range(2 * c)
                ]
                outs = {}
                order = servers if c % 2 == 0 else servers[::-1]
                for s in order:
                    r, outs[s.name] = s.level(prompts, args.output_len, c, f"c{c}")
                    runs.append(r)
                same, total = _agreement(outs["offload"], outs["no_offload"])
                same_tokens, total_tokens = same_tokens + same, total_tokens + total
                level_identical = outs["offload"] == outs["no_offload"] and None not in outs["offload"]
                identical = identical and level_identical
                for r in runs[-2:]:
                    r.identical_to_no_offload = level_identical if r.server == "offload" else None
            prompts = [served_load.random_prompt(args.input_len, args.seed * 1_000_003 + 7, vocab) for _ in range(2)]
            n_short = args.low_short_len
            short_prompts = (
                [served_load.random_prompt(n_short, args.seed * 1_000_003 + 11 + i, vocab) for i in range(2)]
                if n_short
                else []
            )
            side_by_side = getattr(args, "low_schedule", LOW_SCHEDULES[0]) == "side-by-side"
            for k in range(args.low_rounds):
                for phase, load, out_len, into in (
                    ("low_concurrency", prompts, args.output_len, low),
                    ("low_concurrency_short", short_prompts, n_short, short),
                ):
                    if not load:
                        continue
                    tag = f"low{k + 1}" if phase == "low_concurrency" else f"short{k + 1}"
                    order = servers if k % 2 == 0 else servers[::-1]
                    results = serve_round(order, lambda s: s.level(load, out_len, 1, tag, LOW_POLL_S)[0], side_by_side)
                    for r in sorted(results, key=lambda r: SERVERS.index(r.server)):
                        r.phase = phase
                        runs.append(r)
                        into[r.server].append(r.server_cpu_ms_per_token)
    finally:
        for s in servers:
            s.stop()
    return summarize(
        levels,
        runs,
        [s.info for s in servers],
        low,
        identical and bool(runs),
        (same_tokens / total_tokens) if total_tokens else None,
        budget,
        args,
        round(time.monotonic() - t0, 1),
        str(log_dir),
        short,
    )


def serve_round(servers: Sequence[Any], serve: Callable[[Any], LevelResult], side_by_side: bool) -> List[LevelResult]:
    """``serve(server)`` for each of ``servers``: all at the same time (one thread each)
    when ``side_by_side``, else one after the other in the given order. Results in the
    order given; an exception in any is raised once all are done."""
    if not side_by_side:
        return [serve(s) for s in servers]
    with ThreadPoolExecutor(len(servers), thread_name_prefix="capacity-round") as pool:
        futures = [pool.submit(serve, s) for s in servers]
    return [f.result() for f in futures]  # the pool has waited for every server


def round_ratios(rounds: Dict[str, List[Optional[float]]]) -> List[Optional[float]]:
    """Offload over no offload per round (``rounds[name][k]``: round ``k``'s CPU ms per
    token; ``None`` where a server produced no token that round)."""
    return [_ratio(o, n) for o, n in zip(rounds.get("offload", []), rounds.get("no_offload", []))]


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median of the values that are not ``None`` (``None`` if none is)."""
    valid = [v for v in values if v is not None]
    return statistics.median(valid) if valid else None


def summarize(
    levels: Sequence[int],
    runs: List[LevelResult],
    infos: List[ServerInfo],
    low: Dict[str, List[float]],
    identical: bool,
    agreement: Optional[float],
    budget: Optional[str],
    args: argparse.Namespace,
    wall_s: float,
    logs: str,
    short: Optional[Dict[str, List[float]]] = None,
) -> Dict[str, Any]:
    """The JSON document (module docstring)."""
    short = short or {name: [] for name in SERVERS}
    short_med = {k: _median(v) for k, v in short.items()}
    config = args.offload_config if args.offload_config is not None else DEFAULT_OFFLOAD_CONFIG
    try:
        residency = json.loads(config).get("residency", "always")
    except (ValueError, AttributeError):
        residency = None  # the server refused the configuration (servers[offload].error says why)
    direct = [r.direct_rows for r in runs if r.phase == "low_concurrency_short" and r.direct_rows is not None]
    by = {(r.server, r.concurrency): r for r in runs if r.phase == "sweep"}
    tokens = {i.name: i.max_total_num_tokens for i in infos}
    ratios = {
        str(c): _ratio(by[("offload", c)].output_tokens_per_s, by[("no_offload", c)].output_tokens_per_s)
        for c in levels
        if ("offload", c) in by and ("no_offload", c) in by
    }
    limited = [c for c in levels if ("no_offload", c) in by and by[("no_offload", c)].pool_limited]
    pool_c = max(limited) if limited else None
    low_med = {k: _median(v) for k, v in low.items()}
    low_ratios, short_ratios = round_ratios(low), round_ratios(short)
    schedule = getattr(args, "low_schedule", LOW_SCHEDULES[0])
    return {
        "runs": [asdict(r) for r in runs],
        "servers": {i.name: asdict(i) for i in infos},
        "max_total_tokens_ratio": _ratio(tokens.get("offload"), tokens.get("no_offload")),
        "throughput_ratio_pool_limited": ratios.get(str(pool_c)) if pool_c is not None else None,
        "pool_limited_concurrency": pool_c,
        "throughput_ratios": ratios,
        "low_concurrency_cpu_ratio": _round4(_median(low_ratios)),
        "low_concurrency_round_ratios": low_ratios,
        "low_concurrency_schedule": schedule,
        "low_concurrency_cpu_ms_per_token": {k: (round(v, 4) if v else None) for k, v in low_med.items()},
        "low_concurrency_rounds": {k: v for k, v in low.items()},
        "low_concurrency_residency": residency,
        "low_concurrency_short_cpu_ratio": _round4(_median(short_ratios)),
        "low_concurrency_short_round_ratios": short_ratios,
        "low_concurrency_short_cpu_ms_per_token": {k: (round(v, 4) if v else None) for k, v in short_med.items()},
        "low_concurrency_short_rounds": {k: v for k, v in short.items()},
        "low_concurrency_short_direct_rows": sum(direct) if direct else None,
        "identical_tokens": identical,
        "token_agreement": None if agreement is None else round(agreement, 5),
        "device_kv_budget": budget,
        "load": {
            "concurrency": list(levels),
            "requests_per_level": "2 x concurrency",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "max_running_requests": args.max_running_requests,
            "low_rounds": args.low_rounds,
            "low_short_len": getattr(args, "low_short_len", 0),
            "low_schedule": schedule,
            "poll_s": POLL_S,
            "low_poll_s": LOW_POLL_S,
        },
        "model": args.model_path or "tests/fixtures/tiny_dsa (CPU)",
        "offload_config": config,
        "wall_s": wall_s,
        "logs": logs,
    }


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(res: Dict[str, Any]) -> None:
    load = res["load"]
    print(
        f"bench serve --capacity: device KV budget {res['device_kv_budget'] or 'SGLang profile'}, "
        f"{load['input_len']} -> {load['output_len']} tokens, 2 x c requests per level; model {res['model']}"
    )
    for name, info in res["servers"].items():
        print(
            f"  {name}: max_total_num_tokens {info['max_total_num_tokens']}, max_running_requests "
            f"{info['max_running_requests']}" + (f", error: {info['error']}" if info["error"] else "")
        )
    print(
        f"{'run':18s} {'c':>3s} {'done':>7s} {'out tok/s':>9s} {'TTFT p50':>8s} {'TTFT p99':>8s} {'ITL p50':>7s} "
        f"{'ITL p99':>7s} {'run pk':>6s} {'queue pk':>8s} {'retr':>4s} {'limited':>7s} {'cpu ms/tok':>10s} "
        f"{'hit rate':>8s} {'H2D B/tok':>9s}"
    )
    for r in res["runs"]:
        print(
            f"{r['name']:18s} {r['concurrency']:3d} {r['completed']:3d}/{r['requests']:<3d} "
            f"{_fmt(r['output_tokens_per_s']):>9s} {_fmt(r['ttft_ms_p50']):>8s} {_fmt(r['ttft_ms_p99']):>8s} "
            f"{_fmt(r['itl_ms_p50']):>7s} {_fmt(r['itl_ms_p99']):>7s} {r['peak_running']:6d} {r['peak_queued']:8d} "
            f"{r['retractions']:4d} {str(r['pool_limited']):>7s} {_fmt(r['server_cpu_ms_per_token'], '.2f'):>10s} "
            f"{_fmt(r.get('hit_rate'), '.3f'):>8s} {_fmt(r.get('h2d_bytes_per_token'), '.0f'):>9s}"
        )
    print(
        f"max_total_tokens_ratio {_fmt(res['max_total_tokens_ratio'], '.3f')}; throughput_ratio_pool_limited "
        f"{_fmt(res['throughput_ratio_pool_limited'], '.3f')} (c={res['pool_limited_concurrency']}); "
        f"low_concurrency_cpu_ratio {_fmt(res['low_concurrency_cpu_ratio'], '.3f')} "
        f"(residency {res['low_concurrency_residency']}, {res['low_concurrency_schedule']} rounds); short requests "
        f"{_fmt(res['low_concurrency_short_cpu_ratio'], '.3f')} ({res['low_concurrency_short_direct_rows']} "
        f"rows served directly); identical_tokens {res['identical_tokens']}"
    )
    print(f"server logs: {res['logs']}")


def problems(args: argparse.Namespace, runs_given: bool) -> List[str]:
    """Every conflict of ``--capacity`` with the other flags (all listed)."""
    out = []
    if runs_given:
        out.append("--capacity runs its own pair of servers (no_offload, offload): drop --runs")
    for flag, bad in (
        ("--trained", args.trained),
        ("--interleave", args.interleave),
        ("--spec-model-path", args.spec_model_path is not None),
        ("--clients (use --concurrency)", args.clients != 4),
        ("--requests (each level sends 2 x its concurrency)", args.requests is not None),
        ("--rounds (use --low-rounds for the concurrency-1 rounds)", args.rounds != 1),
    ):
        if bad:
            out.append(f"--capacity does not take {flag}")
    try:
        parse_concurrency(args.concurrency or DEFAULT_CONCURRENCY)
    except ValueError as exc:
        out.append(str(exc))
    if args.device_kv_budget is not None:
        from ..memory_budget import parse_size

        try:
            if parse_size(args.device_kv_budget) <= 0:
                out.append(f"--device-kv-budget {args.device_kv_budget} must be positive")
        except ValueError as exc:
            out.append(f"--device-kv-budget: {exc}")
    if getattr(args, "low_short_len", 0) < 0:
        out.append(f"--low-short-len {args.low_short_len} must be >= 0 (0 = no short requests)")
    if args.low_rounds < 1:
        out.append(f"--low-rounds {args.low_rounds} must be >= 1")
    if args.model_path is None and args.input_len + args.output_len > CAPACITY_CONTEXT:
        out.append(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceed the CPU servers' "
            f"context of {CAPACITY_CONTEXT} tokens"
        )
    return out


def main(args: argparse.Namespace) -> int:
    res = run(args)
    if args.plot:
        from .plots import plot_capacity

        plot_capacity(res, args.plot)
        _progress(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    ok = (
        res["identical_tokens"]
        and not any(i["error"] for i in res["servers"].values())
        and all(r["completed"] == r["requests"] for r in res["runs"])
    )
    return 0 if ok else 1
