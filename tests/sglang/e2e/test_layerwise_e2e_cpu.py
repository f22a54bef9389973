"""End to end on CPU: layerwise prefill offload through SGLang gives the same greedy
tokens and logprobs as the device pool.

Model: 4 layers, so buffers are really shared (with ``I = [0]``, ``B = 1`` puts layers
1-3 in one buffer, ``B = 2`` layers 1 and 3), on real weights: the trained checkpoint's
two layers stacked twice (``testing/stacked.py``; on dummy weights a page loaded from the
wrong host object went unseen, ``scripts/plant_faults.py`` fault ``layerwise_page_swap``).
Three servers, started together: without the feature, ``B = 1``,
``B = 2`` (local host store). Colocated servers, so decode steps run through the
pipeline too (the debug path: every shared layer reloads the context each step).

Prompts: several lengths (inside one page, across pages), a batch, a prefix cached
by the radix cache and hit by concurrent requests (its pages come back from the host
store), a repeated prompt whose cache hit includes decoded tokens.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all

from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.stacked import stacked_checkpoint

pytestmark = pytest.mark.slow

VOCAB = 1024  # prompts draw token ids below this (the trained vocabulary has 4,096)


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


def layerwise_args(shared_buffers: int) -> list:
    config = {"shared_buffers": shared_buffers, "store_backend": "local", "wait_timeout_s": 60}
    return ["--enable-layerwise-prefill-offload", "--layerwise-prefill-offload-config", json.dumps(config)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("layerwise_servers")
    model = stacked_checkpoint(TINY_DSA_TRAINED, 4, root / "trained_4l")
    base = trained_args(model) + ["--max-running-requests", "4"] + IDLE_SLEEP
    procs = {
        "off": ServerProcess(log_path=root / "off.log", base_args=base),
        "B1": ServerProcess(layerwise_args(1), log_path=root / "b1.log", base_args=base),
        "B2": ServerProcess(layerwise_args(2), log_path=root / "b2.log", base_args=base),
    }
    start_all(*procs.values())
    print("\nstartup (3 servers launched together): " + ", ".join(f"{k} {p.startup_s:.1f} s" for k, p in procs.items()))
    yield procs
    stop_all(*procs.values())


def run_workload(srv: ServerProcess) -> dict:
    """The same requests, in the same order, against one server; returns the answers."""
    out = {}
    for name, n in (("short", 5), ("one_page", 40), ("pages", 150)):
        out[name] = srv.generate(prompt(n, seed=n), max_new_tokens=12, return_logprob=True)
    out["batch"] = srv.generate(
        [prompt(n, seed=s) for s, n in ((2, 9), (3, 70), (4, 33))], max_new_tokens=10, return_logprob=True
    )
    prefix = prompt(140, seed=11)
    srv.generate(prefix, max_new_tokens=1)  # two pages of the prefix are now in the radix cache
    prompts = [prefix + prompt(10 + 7 * i, seed=20 + i) for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        out["shared"] = list(ex.map(lambda p: srv.generate(p, max_new_tokens=16, return_logprob=True), prompts))
    out["repeat"] = srv.generate(
        prompt(150, seed=150) + out["pages"]["output_ids"][:8], max_new_tokens=12, return_logprob=True
    )
    return out


def answers(result):
    items = result if isinstance(result, list) else [result]
    return [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in items]


def test_layerwise_results_equal_device_pool(servers):
    results = {}
    with ThreadPoolExecutor(len(servers)) as ex:
        futures = {k: ex.submit(run_workload, srv) for k, srv in servers.items()}
        results = {k: f.result() for k, f in futures.items()}
    for key in ("B1", "B2"):
        assert all(o["meta_info"]["cached_tokens"] >= 128 for o in results[key]["shared"]), key
        assert results[key]["repeat"]["meta_info"]["cached_tokens"] >= 128, key
        for name in results["off"]:
            assert answers(results[key][name]) == answers(results["off"][name]), f"{key}: {name} differs"
    assert len(results["off"]["pages"]["output_ids"]) == 12


def _measure(srv: ServerProcess):
    """One request x 128 tokens, then 4 concurrent x 64 tokens sharing a cached 100-token
    prefix: ``(answers, 1x128 tok/s, 4x64 tok/s)``."""
    t0 = time.perf_counter()
    one = srv.generate(prompt(64, seed=7), max_new_tokens=128)
    single = len(one["output_ids"]) / (time.perf_counter() - t0)
    prefix = prompt(100, seed=31)
    srv.generate(prefix, max_new_tokens=1)
    prompts = [prefix + prompt(12 + i, seed=40 + i) for i in range(4)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda p: srv.generate(p, max_new_tokens=64), prompts))
    batch = sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)
    return [one] + outs, single, batch


def test_long_decodes_and_shared_prefix_side_by_side(servers):
    """Long outputs (128 tokens, past the prompt's pages) and concurrent requests on a
    cached prefix: every server returns every requested token, the offload servers'
    greedy tokens equal the device pool's, and the prefix is served from the cache.
    Throughput is printed for the reader (the machine is shared: never asserted)."""
    measured = {key: _measure(srv) for key, srv in servers.items()}
    print("\nserver  startup_s  1x128 tok/s  4x64 shared-prefix tok/s")
    for key, srv in servers.items():
        print(f"{key:6s}  {srv.startup_s:9.1f}  {measured[key][1]:11.1f}  {measured[key][2]:24.1f}")
    reference = [o["output_ids"] for o in measured["off"][0]]
    assert [len(ids) for ids in reference] == [128, 64, 64, 64, 64]
    for key in ("B1", "B2"):
        outs = measured[key][0]
        assert [o["output_ids"] for o in outs] == reference, f"{key}: greedy tokens differ from the device pool"
        assert all(o["meta_info"]["cached_tokens"] >= 64 for o in outs[1:]), f"{key}: prefix not served from cache"
