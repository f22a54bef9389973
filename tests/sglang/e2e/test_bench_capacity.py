"""``bench serve --capacity`` (``bench/serve_capacity.py``): the summary logic on made-up
levels (fast), the refusals, and one short served run of both servers at one device
KV budget (~2 min here)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import pytest

from sglang_ascend_offload.bench import serve, serve_capacity
from sglang_ascend_offload.bench.serve_capacity import LevelResult, ServerInfo
from sglang_ascend_offload.testing.servers import REPO, server_env

METRICS = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 3.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="1"} 2.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 7.0
sglang:num_retracted_requests_total{model_name="m"} 4.0
sglang:num_running_reqs_offline_batch{model_name="m"} 99.0
"""


def test_gauges_are_summed_over_label_sets_and_other_metrics_ignored():
    assert serve_capacity.read_gauges(METRICS) == {
        "sglang:num_running_reqs": 5.0,
        "sglang:num_queue_reqs": 7.0,
        "sglang:num_retracted_requests_total": 4.0,
    }


def test_concurrency_list():
    assert serve_capacity.parse_concurrency("16, 2,4,2") == [2, 4, 16]
    for bad in ("0", "2,x", ""):
        with pytest.raises(ValueError):
            serve_capacity.parse_concurrency(bad)


def _level(server, c, tps, limited, cpu=None):
    return LevelResult(
        server,
        f"{server}_c{c}",
        c,
        2 * c,
        completed=2 * c,
        output_tokens_per_s=tps,
        pool_limited=limited,
        server_cpu_ms_per_token=cpu,
    )


def _args(**kw):
    base = dict(
        input_len=256,
        output_len=256,
        seed=0,
        max_running_requests=16,
        low_rounds=3,
        model_path=None,
        offload_config=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_summary_ratios_take_the_largest_pool_limited_concurrency():
    runs = [
        _level("no_offload", 2, 80.0, False),
        _level("offload", 2, 78.0, False),
        _level("no_offload", 8, 100.0, True),
        _level("offload", 8, 150.0, False),
        _level("no_offload", 16, 100.0, True),
        _level("offload", 16, 170.0, True),
    ]
    infos = [
        ServerInfo("no_offload", [], "a.log", max_total_num_tokens=2176),
        ServerInfo("offload", [], "b.log", max_total_num_tokens=7104),
    ]
    doc = serve_capacity.summarize(
        [2, 8, 16],
        runs,
        infos,
        {"no_offload": [24.0, 26.0, 25.0], "offload": [25.0, 24.0, 26.5]},
        True,
        1.0,
        "6MiB",
        _args(),
        1.0,
        "/tmp",
    )
    assert doc["max_total_tokens_ratio"] == round(7104 / 2176, 4)
    assert doc["pool_limited_concurrency"] == 16 and doc["throughput_ratio_pool_limited"] == 1.7
    assert doc["throughput_ratios"] == {"2": round(78 / 80, 4), "8": 1.5, "16": 1.7}
    # per round 25/24, 24/26, 26.5/25: the median of the round ratios, not the ratio of medians (1.0)
    assert doc["low_concurrency_round_ratios"] == [round(25 / 24, 4), round(24 / 26, 4), 1.06]
    assert doc["low_concurrency_cpu_ratio"] == round(25 / 24, 4)
    assert doc["low_concurrency_cpu_ms_per_token"] == {"no_offload": 25.0, "offload": 25.0}
    assert doc["low_concurrency_schedule"] == "side-by-side" == doc["load"]["low_schedule"]
    assert doc["identical_tokens"] is True and doc["low_concurrency_residency"] == "adaptive"  # the default
    assert doc["low_concurrency_short_cpu_ratio"] is None  # no short rounds given
    json.dumps(doc)  # one JSON document
    always = serve_capacity.summarize(
        [2],
        runs[:2],
        infos,
        {"no_offload": [], "offload": []},
        True,
        1.0,
        None,
        _args(offload_config='{"hot_tokens": 128}'),
        1.0,
        "/tmp",
        {"no_offload": [10.0, 12.0], "offload": [11.0]},
    )
    assert always["low_concurrency_residency"] == "always"
    assert always["low_concurrency_short_cpu_ratio"] == 1.1 and always["low_concurrency_short_round_ratios"] == [1.1]


def test_a_round_without_tokens_drops_out_of_the_ratio_but_keeps_the_pairing():
    doc = serve_capacity.summarize(
        [],
        [],
        [ServerInfo("no_offload", [], ""), ServerInfo("offload", [], "")],
        {"no_offload": [10.0, None, 20.0], "offload": [11.0, 12.0, 30.0]},
        True,
        1.0,
        None,
        _args(low_schedule="alternating"),
        1.0,
        "/tmp",
    )
    assert doc["low_concurrency_round_ratios"] == [1.1, None, 1.5]
    assert doc["low_concurrency_cpu_ratio"] == 1.3  # median of 1.1 and 1.5
    assert doc["low_concurrency_schedule"] == "alternating"


class _RoundServer:
    """Stands in for a CapacityServer in serve_round: records when it serves."""

    def __init__(self, name, barrier, log):
        self.name, self.barrier, self.log = name, barrier, log

    def serve(self):
        self.log.append(("start", self.name))
        try:
            self.barrier.wait(timeout=2.0)  # passes only when the other server serves at the same time
            met = True
        except threading.BrokenBarrierError:
            met = False
        self.log.append(("end", self.name))
        return LevelResult(self.name, f"{self.name}_low1", 1, 2, server_cpu_ms_per_token=1.0 if met else 2.0)


@pytest.mark.parametrize("side_by_side", [True, False])
def test_serve_round_serves_both_servers_at_once_only_side_by_side(side_by_side):
    barrier, log = threading.Barrier(2), []
    servers = [_RoundServer("offload", barrier, log), _RoundServer("no_offload", barrier, log)]
    results = serve_capacity.serve_round(servers, lambda s: s.serve(), side_by_side)
    assert [r.server for r in results] == ["offload", "no_offload"]  # the order given
    if side_by_side:
        assert [r.server_cpu_ms_per_token for r in results] == [1.0, 1.0]
        assert [e for e, _ in log[:2]] == ["start", "start"]
    else:  # one after the other: the first waits alone, breaks the barrier; the second finds it broken
        assert [r.server_cpu_ms_per_token for r in results] == [2.0, 2.0]
        assert log == [("start", "offload"), ("end", "offload"), ("start", "no_offload"), ("end", "no_offload")]


def test_serve_round_raises_what_a_server_raised_after_all_are_done():
    done = []

    def serve(s):
        if s == "bad":
            raise RuntimeError("server bad failed")
        time.sleep(0.2)
        done.append(s)
        return LevelResult(s, s, 1, 1)

    with pytest.raises(RuntimeError, match="server bad failed"):
        serve_capacity.serve_round(["bad", "good"], serve, True)
    assert done == ["good"]


def test_metrics_poller_samples_at_its_own_interval():
    """The concurrency-1 rounds sample ``/metrics`` every ``LOW_POLL_S``: within a shorter
    load no scrape reaches the server (each costs it CPU that is not serving); the sweep's
    interval samples it repeatedly and keeps the peaks."""

    class FakeServer:
        def __init__(self):
            self.gets = 0
            self.sampled = threading.Event()

        def get(self, path, timeout=None):
            self.gets += 1
            if self.gets >= 3:
                self.sampled.set()
            return "sglang:num_running_reqs 2\nsglang:num_queue_reqs 1\n"

    slow = FakeServer()
    with serve_capacity.MetricsPoller(slow, serve_capacity.LOW_POLL_S) as poll:
        time.sleep(0.3)
    assert slow.gets == 0 and poll.peak_running == 0
    fast = FakeServer()
    with serve_capacity.MetricsPoller(fast, 0.01) as poll:
        assert fast.sampled.wait(30)
    assert fast.gets >= 3 and (poll.peak_running, poll.peak_queued) == (2, 1)


def test_no_pool_limited_concurrency_gives_no_throughput_ratio():
    runs = [_level("no_offload", 2, 80.0, False), _level("offload", 2, 78.0, False)]
    doc = serve_capacity.summarize(
        [2],
        runs,
        [ServerInfo("no_offload", [], ""), ServerInfo("offload", [], "")],
        {"no_offload": [], "offload": []},
        True,
        1.0,
        None,
        _args(),
        1.0,
        "/tmp",
    )
    assert doc["pool_limited_concurrency"] is None and doc["throughput_ratio_pool_limited"] is None
    assert doc["max_total_tokens_ratio"] is None and doc["low_concurrency_cpu_ratio"] is None


def _parse(*argv):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_capacity_refuses_every_conflicting_flag_at_once(capsys):
    args = _parse(
        "--capacity",
        "--runs",
        "offload_eager",
        "--trained",
        "--clients",
        "8",
        "--rounds",
        "2",
        "--concurrency",
        "4,zero",
        "--device-kv-budget",
        "big",
        "--low-rounds",
        "0",
        "--low-short-len",
        "-1",
    )
    assert serve.main(args) == 2
    err = capsys.readouterr().err
    for part in (
        "drop --runs",
        "--trained",
        "--clients",
        "--rounds",
        "'zero'",
        "--device-kv-budget",
        "--low-rounds",
        "--low-short-len",
    ):
        assert part in err, err


def test_capacity_defaults_differ_from_the_plain_runs():
    args = _parse("--capacity")
    serve._fill_defaults(args)
    assert (args.input_len, args.output_len, args.max_running_requests) == (
        serve_capacity.DEFAULT_INPUT_LEN,
        serve_capacity.DEFAULT_OUTPUT_LEN,
        serve_capacity.DEFAULT_MAX_RUNNING,
    )
    plain = _parse()
    serve._fill_defaults(plain)
    assert (plain.input_len, plain.output_len, plain.max_running_requests) == (64, 32, 4)


@pytest.mark.slow
def test_capacity_bench_serves_both_servers_at_one_budget(tmp_path):
    """Both servers at a 4 MiB device budget and 8 request slots; 16 requests of 256 + 32
    tokens at concurrency 8. The budget sizes each pool exactly as accounted: no offload
    2,816 B per token (2 layers x (latent + rope + index K) bf16); offload 512 B (index K)
    after the hot buffers and residency tables of 8 requests + 2 rows (2 layers x 64 slots x
    (1,152 + 12) B + 8 B per row and layer).
    No offload holds 5 such requests, so it queues; offload runs all 8; tokens agree."""
    cmd = [
        sys.executable,
        "-m",
        "sglang_ascend_offload",
        "bench",
        "serve",
        "--capacity",
        "--device-kv-budget",
        "4MiB",
        "--max-running-requests",
        "8",
        "--concurrency",
        "8",
        "--input-len",
        "256",
        "--output-len",
        "32",
        "--low-rounds",
        "1",
        "--log-dir",
        str(tmp_path),
        "--json",
    ]
    result = subprocess.run(cmd, cwd=REPO, env=server_env(cpu=False), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads(result.stdout)
    page = 64
    budget = 4 * 2**20
    no_off, off = doc["servers"]["no_offload"], doc["servers"]["offload"]
    assert no_off["error"] is None and off["error"] is None
    assert no_off["max_total_num_tokens"] == budget // 2816 // page * page
    # 8 requests + padding slot + sink row, 2 layers, 64 slots of 1,152 B hot buffer + 12 B residency
    # table each, + 8 B residency per row and layer (no overflow area without speculation)
    hot = (8 + 2) * 2 * (64 * (1152 + 12) + 8)
    assert off["max_total_num_tokens"] == (budget - hot) // 512 // page * page
    assert doc["max_total_tokens_ratio"] >= 3
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {
        "no_offload_c8",
        "offload_c8",
        "no_offload_low1",
        "offload_low1",
        "no_offload_short1",
        "offload_short1",
    }
    assert all(r["completed"] == r["requests"] for r in runs.values())
    assert {r["phase"] for r in runs.values()} == {"sweep", "low_concurrency", "low_concurrency_short"}
    # No offload's pool holds 5 such requests: 8 clients keep it queueing. (Offload's own
    # flag is not asserted: a burst arriving at an idle server queues for one prefill, and
    # a 0.2 s sample can see that queue and miss the moment all 8 ran.)
    assert runs["no_offload_c8"]["pool_limited"] and runs["no_offload_c8"]["peak_running"] <= 5
    assert doc["pool_limited_concurrency"] == 8 and doc["throughput_ratio_pool_limited"] > 0
    assert doc["identical_tokens"] and doc["token_agreement"] == 1.0
    assert runs["offload_c8"]["identical_to_no_offload"] is True
    # every slot is taken at c = 8, so the long requests go through the residency
    assert 0 <= runs["offload_c8"]["hit_rate"] <= 1 and runs["offload_c8"]["h2d_bytes_per_token"] > 0
    assert runs["no_offload_c8"]["hit_rate"] is None and runs["no_offload_c8"]["h2d_bytes_per_token"] is None
    assert doc["low_concurrency_cpu_ratio"] > 0 and doc["low_concurrency_short_cpu_ratio"] > 0
    # residency adaptive (the default): at concurrency 1 the short requests fit their own 64-slot hot buffer,
    # and the long ones (288 tokens) span the buffers of idle request slots: all served directly
    assert doc["low_concurrency_residency"] == "adaptive" and doc["low_concurrency_short_direct_rows"] > 0
    assert runs["offload_low1"]["direct_rows"] > 0
    for key in (
        "max_total_tokens_ratio",
        "throughput_ratio_pool_limited",
        "low_concurrency_cpu_ratio",
        "identical_tokens",
        "runs",
    ):
        assert key in doc
    assert doc["load"]["low_poll_s"] == serve_capacity.LOW_POLL_S > doc["load"]["poll_s"] == serve_capacity.POLL_S
