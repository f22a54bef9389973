"""``bench soak`` end to end, shortened: both offload servers under churn (aborts,
radix hits), one JSON document on stdout with the contract's keys, no failed
request and none of the plugin's shared-memory files left after shutdown."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, server_env

pytestmark = pytest.mark.slow

KEYS = {
    "minutes",
    "requests",
    "failed",
    "rss_growth_ratio_max",
    "leaked_shm_files",
    "sglang_shm_files_left",
    "processes",
}


def test_bench_soak_short_run():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_ascend_offload",
            "bench",
            "soak",
            "--minutes",
            "0.3",
            "--clients",
            "2",
            "--abort-fraction",
            "0.25",
            "--no-baseline",
            "--json",
        ],
        cwd=REPO,
        env=server_env(cpu=False),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads(result.stdout)  # exactly one JSON document: progress went to stderr
    assert KEYS <= set(doc)
    assert doc["requests"] > 0 and doc["failed"] == 0, doc["servers"]
    assert doc["leaked_shm_files"] == 0, doc["leaked_shm_names"]
    assert {p["server"] for p in doc["processes"]} == {"sparse_decode", "layerwise_prefill"}
    assert all(p["rss_warm_mb"] > 0 and p["rss_end_mb"] > 0 for p in doc["processes"])
    assert all(
        abs(p[f"rss_anon_{w}_mb"] + p[f"rss_file_{w}_mb"] + p[f"rss_shmem_{w}_mb"] - p[f"rss_{w}_mb"]) < 0.5
        for p in doc["processes"]
        for w in ("warm", "end")
    )
    # The shared host pool (2 layers x 4160 slots x 1152 B = 9.1 MiB) is resident from
    # its allocation (populated mapping), before the warm-up reading.
    sched = [p for p in doc["processes"] if p["server"] == "sparse_decode" and p["name"].startswith("sglang::sched")]
    assert sched and sched[0]["rss_shmem_warm_mb"] >= 9.1, sched
    # torch's per-shape matmul caches are bounded in every server, and the warm-up is reported.
    assert doc["shape_cache"] == 64
    assert doc["server_env"]["LRU_CACHE_CAPACITY"] == doc["server_env"]["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert doc["warmup_s"] > 0 and "requests per server" in doc["warmup_criterion"]
    servers = {s["name"]: s for s in doc["servers"]}
    assert all(servers[name]["requests"] > 0 for name in ("sparse_decode", "layerwise_prefill"))
    # The offload engine really decoded (its summary is logged every 5 s in the soak; the
    # layerwise pool's only every 60 s, longer than this run).
    assert int(servers["sparse_decode"]["offload_counters"]["steps"]) > 0
