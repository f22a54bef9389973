"""``bench transfer --served``: time to first token of P/D serving next to colocated serving.

Real SGLang servers on CPU with the tiny DSA fixture (``tests/fixtures/tiny_dsa``, the
launch settings of :mod:`sglang_ascend_offload.testing.servers` and
:mod:`sglang_ascend_offload.testing.pd_servers`, shared with the served P/D tests), the
project's P/D backend with the Mooncake engine over TCP on 127.0.0.1, and SGLang's router in PD
mode. Four configurations, each started alone (its servers in parallel), measured under
the same load, then stopped before the next one starts, so no idle server of another
configuration competes for the CPU:

* ``colocated``: one server (the reference);
* ``pd_device_decode``: prefill server + decode server with the device pool;
* ``pd_offload_decode``: prefill server + decode server with sparse decode offload
  (main KV pulled straight into its host pool);
* ``pd_layerwise_prefill_offload_decode``: prefill server with layerwise prefill
  offload (the model's layers share one buffer) + the offload decode server.

Load: ``requests`` prompts of ``input_len`` tokens, ``concurrency`` in flight at once,
greedy, ``output_len`` new tokens each (``ignore_eos``), streamed; TTFT is the time from
sending a request to its first streamed chunk carrying an output token; output tokens/s
is all output tokens over the wall time of the whole load. One warm-up request runs
before the timed load. Ports come from :func:`~sglang_ascend_offload.testing.ports.reserve_port`
(reserved across processes); a configuration whose log reports a bind failure is
restarted on fresh ports.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import served_load
from .served_load import prompt

logger = logging.getLogger(__name__)

ROUTER_READY_S = 180.0
CONFIG_NAMES = ("colocated", "pd_device_decode", "pd_offload_decode", "pd_layerwise_prefill_offload_decode")


@dataclass(frozen=True)
class ServedLoad:
    """The load every configuration gets (tokens are ids; the fixture has no tokenizer)."""

    requests: int = 8
    concurrency: int = 2
    input_len: int = 256
    output_len: int = 16


@dataclass(frozen=True)
class ServedResult:
    """One configuration's row (``--json``: one entry of ``served``).

    ttft_ms_p50 / ttft_ms_p99: nearest-rank percentiles over the completed requests
    (None when none completed); output_tokens_per_s: output tokens of completed requests
    over the load's wall time; completed: requests that returned every output token.
    """

    name: str
    ttft_ms_p50: Optional[float]
    ttft_ms_p99: Optional[float]
    output_tokens_per_s: Optional[float]
    completed: int


def stream_generate(url: str, input_ids: List[int], max_new_tokens: int, timeout_s: float = 300.0) -> tuple:
    """Streamed greedy ``/generate``: ``(ttft_s or None, output tokens, wall_s)``."""
    out = served_load.stream_generate(url, input_ids, max_new_tokens, timeout_s=timeout_s)
    return out.ttft_s, out.tokens, out.wall_s


def _launch(name: str, root: Path):
    """Servers (started) and the URL to load for configuration ``name``; plus what to stop."""
    from ..testing import pd_servers
    from ..testing.ports import reserve_port
    from ..testing.servers import IDLE_SLEEP, ServerProcess, start_all

    if name == "colocated":
        s = ServerProcess(pd_servers.COMMON + IDLE_SLEEP, log_path=root / f"{name}.log")
        s.start()
        return s.url, [s]
    bootstrap, kv = reserve_port(), reserve_port()
    prefill = pd_servers.prefill_args(bootstrap, kv, layerwise=name == "pd_layerwise_prefill_offload_decode")
    decode = pd_servers.decode_args(kv, offload=name != "pd_device_decode")
    servers = [
        ServerProcess(prefill, log_path=root / f"{name}.prefill.log"),
        ServerProcess(decode, log_path=root / f"{name}.decode.log"),
    ]
    stoppable: list = list(servers)
    try:
        start_all(*servers)
        router = pd_servers.PDRouter(servers[0].url, bootstrap, servers[1].url, root / f"{name}.router.log").start()
        stoppable.append(router)
        router.wait_ready(prompt(5, seed=99), time.monotonic() + ROUTER_READY_S)
        return router.url, stoppable
    except BaseException:
        _stop(stoppable)
        raise


def _stop(procs) -> None:
    from ..testing.servers import stop_all

    stop_all(*procs)


def run_load(url: str, load: ServedLoad, name: str) -> ServedResult:
    """Send the load (after one warm-up request) and summarise it."""
    stream_generate(url, prompt(load.input_len, seed=10_000), load.output_len)  # warm-up
    res, _ = served_load.run_load(
        url,
        [prompt(load.input_len, seed=i) for i in range(load.requests)],
        load.output_len,
        load.concurrency,
        on_error=lambda i, exc: logger.warning("%s: request %d failed: %s", name, i, exc),
    )
    done = res.completed(load.output_len)
    ttfts = [o.ttft_s for o in done]
    p50, p99 = served_load.percentile(ttfts, 50), served_load.percentile(ttfts, 99)
    tokens = sum(o.tokens for o in done)
    return ServedResult(
        name=name,
        ttft_ms_p50=None if p50 is None else p50 * 1e3,
        ttft_ms_p99=None if p99 is None else p99 * 1e3,
        output_tokens_per_s=tokens / res.wall_s if res.wall_s > 0 else None,
        completed=len(done),
    )


def run_served(
    load: ServedLoad, names: Sequence[str] = CONFIG_NAMES, log_dir: Optional[str] = None, attempts: int = 3
) -> List[ServedResult]:
    """Each configuration in turn: start, load, stop. Logs under ``log_dir`` (a temp dir by default)."""
    from ..testing.servers import PortInUse

    unknown = sorted(set(names) - set(CONFIG_NAMES))
    if unknown:
        raise ValueError(f"unknown served configurations {unknown}: choose from {CONFIG_NAMES}")
    if load.input_len < 1 or load.output_len < 1 or load.requests < 1:
        raise ValueError("served load: input_len, output_len and requests must be >= 1")
    root = Path(log_dir or tempfile.mkdtemp(prefix="pd_bench_served_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"served: server logs in {root}", file=sys.stderr)
    out: List[ServedResult] = []
    for name in names:
        t0 = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                url, procs = _launch(name, root)
                break
            except PortInUse:
                if attempt == attempts:
                    raise
                print(f"served: {name}: a port was taken meanwhile; restarting on fresh ports", file=sys.stderr)
        try:
            started = time.monotonic() - t0
            res = run_load(url, load, name)
        finally:
            _stop(procs)
        print(f"served: {name}: started in {started:.0f} s, {res.completed}/{load.requests} completed", file=sys.stderr)
        out.append(res)
    return out


def median_rows(runs: Sequence[Sequence[ServedResult]]) -> List[ServedResult]:
    """One row per configuration (in the first run's order) from several runs of
    :func:`run_served`: each number the median over the runs that have it (``None`` when
    none has), ``completed`` the fewest any run completed."""
    import statistics

    if not runs:
        raise ValueError("median_rows: no runs")
    out = []
    for first in runs[0]:
        rows = [r for run in runs for r in run if r.name == first.name]

        def median(field: str) -> Optional[float]:
            values = [getattr(r, field) for r in rows if getattr(r, field) is not None]
            return statistics.median(values) if values else None

        out.append(
            ServedResult(
                name=first.name,
                ttft_ms_p50=median("ttft_ms_p50"),
                ttft_ms_p99=median("ttft_ms_p99"),
                output_tokens_per_s=median("output_tokens_per_s"),
                completed=min(r.completed for r in rows),
            )
        )
    return out


def offload_over_device_ttft(rows: Sequence[ServedResult]) -> Optional[float]:
    """TTFT p50 of the P/D offload decode over the P/D device decode (``None`` without both)."""
    by_name = {r.name: r.ttft_ms_p50 for r in rows}
    device, offload = by_name.get("pd_device_decode"), by_name.get("pd_offload_decode")
    return offload / device if device and offload is not None else None


def main_argv(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:  # pragma: no cover - manual use
    """``python -m sglang_ascend_offload.bench.transfer_served [NAME...]``: the rows as JSON."""
    from dataclasses import asdict

    names = list(argv if argv is not None else sys.argv[1:]) or list(CONFIG_NAMES)
    return {"served": [asdict(r) for r in run_served(ServedLoad(), names)]}


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(main_argv(), indent=2))
