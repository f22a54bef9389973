"""Served: sparse decode offload's per-step engine work follows the live batch, not
``--max-running-requests``.

Two offload servers of the tiny DSA fixture, identical but for
``--max-running-requests`` (4 and 2048: engine row capacity 5 and 2049), get the same
live load (two concurrent greedy requests). The engine counts the batch rows it
stepped (``rows`` in its statistics, ``rows/step`` in the summary line); both servers
must report at most the live requests per step although their hot buffers were
sized for 5 and 2049 rows, and produce identical tokens. The decode throughput of
both runs is printed (``-s``) for the report; it is not asserted (shared CPU).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all

pytestmark = pytest.mark.slow

VOCAB = 1024
NEW_TOKENS = 24
LIVE = 2
CAPACITIES = (4, 2048)
SUMMARY = re.compile(r"sparse-decode-offload: steps=(\d+) .* rows/step=([0-9.]+) ")
HOT = re.compile(r"hot buffers [0-9.]+ MiB \((\d+) rows x (\d+) slots")


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_rows")
    offload_cfg = json.dumps({"hot_tokens": 64, "metrics_log_interval_s": 0.2})
    procs = [ServerProcess(["--max-running-requests", str(mrr), "--enable-sparse-decode-offload",
                            "--sparse-decode-offload-config", offload_cfg] + IDLE_SLEEP,
                           log_path=root / f"mrr{mrr}.log") for mrr in CAPACITIES]
    start_all(*procs)
    yield dict(zip(CAPACITIES, procs))
    stop_all(*procs)


def _run_load(server):
    """Warm-up, then ``LIVE`` concurrent requests; returns (outputs, decode tok/s)."""
    server.generate(prompt(20, seed=9), max_new_tokens=4)
    batch = [prompt(40, seed=s) for s in range(LIVE)]
    t0 = time.perf_counter()
    outs = server.generate(batch, max_new_tokens=NEW_TOKENS, timeout=300)
    wall = time.perf_counter() - t0
    return [o["output_ids"] for o in outs], LIVE * NEW_TOKENS / wall


def _last_summary(server, deadline_s: float = 10.0):
    end = time.monotonic() + deadline_s
    while True:
        text = server.log_path.read_text(errors="replace")
        found = SUMMARY.findall(text)
        if found or time.monotonic() > end:
            return text, found
        time.sleep(0.3)


def test_engine_rows_per_step_follow_the_live_batch(servers):
    results = {}
    for mrr, server in servers.items():  # one after the other: the same CPU for each
        results[mrr] = _run_load(server)
        time.sleep(0.5)  # past the summary interval: the next step logs totals covering the load
        server.generate(prompt(8, seed=7), max_new_tokens=2)
    assert results[CAPACITIES[0]][0] == results[CAPACITIES[1]][0], "greedy tokens differ between capacities"

    for mrr, server in servers.items():
        text, found = _last_summary(server)
        capacity = HOT.search(text)
        assert capacity is not None, f"no hot-buffer line in {server.log_path}"
        assert int(capacity.group(1)) == mrr + 1  # sized for the configured concurrency
        assert found, f"no sparse-decode-offload summary line in {server.log_path}"
        steps, rows_per_step = int(found[-1][0]), float(found[-1][1])
        assert steps >= NEW_TOKENS - 1
        # work counted in rows: each decode step stepped only the live requests' rows
        assert 0 < rows_per_step <= LIVE, f"mrr {mrr}: {rows_per_step} engine rows per step for {LIVE} live requests"

    tps = {mrr: r[1] for mrr, r in results.items()}
    print(f"\ndecode tok/s with offload, {LIVE} live requests: mrr {CAPACITIES[0]}: {tps[CAPACITIES[0]]:.1f}, "
          f"mrr {CAPACITIES[1]}: {tps[CAPACITIES[1]]:.1f}, ratio {tps[CAPACITIES[0]] / tps[CAPACITIES[1]]:.2f}x")
