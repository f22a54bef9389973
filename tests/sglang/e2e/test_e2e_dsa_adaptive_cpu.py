"""Served: ``residency: "adaptive"`` is token-identical to no offload, under pressure too.

The trained checkpoint ``tests/fixtures/tiny_dsa_trained`` (real weights: a misread row
moves the argmax; top-k 64, hot buffer 64 slots, four request slots; held-out source as
prompts) serves with sparse decode offload and ``residency: "adaptive"``, against the session's shared
offload-off server (same launch settings). Every request's greedy tokens and logprobs
must equal the offload-off server's exactly (the attention reads the same rows in the
same order), in each situation a request can be in:

* **pressure**: a request decodes alone, its context spanning the hot buffers of idle
  request slots (direct). Once the server reports a lent buffer, three short
  requests arrive and take every free slot, so the borrowed one is needed back: the
  long request is demoted mid-decode to the residency (``reclaims``), and finishes
  there;
* **the test switch**: a request decoding direct is demoted mid-decode because the
  server's fault-injection file appears (no pressure at all), finishes under the
  residency, and the next request is direct again once the file is gone;
* short requests that stay direct in their own buffer; a radix-cache hit (128 cached
  tokens) served direct over a span; a prompt longer than every free buffer together
  (offloaded from its first step); a concurrent mix of all of these.

The metrics must show direct rows, lent buffers and the reclaim, so the test cannot
pass with every request simply offloaded.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import IDLE_SLEEP, ServerProcess

from sglang_ascend_offload.testing import harness, pd_servers
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

pytestmark = pytest.mark.slow

LAYERS = 2  # tests/fixtures/tiny_dsa_trained
HOT_TOKENS = 64  # = top-k: one page per request slot, so contexts outgrow it and span idle slots' buffers
COMMON = pd_servers.COMMON + IDLE_SLEEP  # the shared offload-off server's settings (test_e2e_dsa_cpu.py)
BASE = trained_args(TINY_DSA_TRAINED)
SHARED_SERVERS = ("trained_reference",)


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, shared_servers):
    root = tmp_path_factory.mktemp("adaptive_servers")
    dense = shared_servers.get("trained_reference", COMMON, base_args=BASE)
    hold_flag = root / "hold_direct"  # created by a test to force demotions (absent otherwise)
    adaptive = ServerProcess(
        COMMON
        + [
            "--enable-metrics",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps({"residency": "adaptive", "hot_tokens": HOT_TOKENS, "metrics_export_interval_s": 0}),
        ],
        log_path=root / "adaptive.log",
        base_args=BASE,
        env=harness.environment({"force_demote": str(hold_flag)}),
    )
    adaptive.hold_flag = hold_flag
    try:
        shared_servers.start_all(dense, adaptive)
        yield dense, adaptive
    finally:
        shared_servers.stop_all(request.module.__name__, dense, adaptive)


def metric(server, name: str) -> float:
    text = server.get("/metrics")
    values = [float(v) for v in re.findall(rf"^sglang:ascend_offload_{name}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M)]
    return sum(values)


def _record(out) -> tuple:
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


def _pressure(server, wait_for_lend: bool) -> list:
    """The long request, then (once it holds a lent buffer, on the offload server) three
    short ones that take every free request slot."""
    results = {}
    long_req = threading.Thread(
        target=lambda: results.__setitem__(
            "long", _record(server.generate(prompt(100, seed=80), max_new_tokens=120, return_logprob=True))
        )
    )
    long_req.start()
    deadline = time.monotonic() + 120
    if wait_for_lend:
        while metric(server, "lent_rows") == 0:
            assert time.monotonic() < deadline and long_req.is_alive(), "the long request never borrowed a buffer"
            time.sleep(0.05)
    with ThreadPoolExecutor(3) as ex:
        shorts = list(
            ex.map(
                lambda n: _record(server.generate(prompt(n, seed=81 + n), max_new_tokens=20, return_logprob=True)),
                (30, 40, 50),
            )
        )
    long_req.join(timeout=300)
    assert not long_req.is_alive()
    return [results["long"]] + shorts


def _rest(server) -> dict:
    shared = prompt(150, seed=70)  # two pages cached on the second request; 170 tokens span 3 buffers
    cold = _record(server.generate(shared, max_new_tokens=20, return_logprob=True))
    warm = server.generate(shared, max_new_tokens=20, return_logprob=True)
    assert warm["meta_info"]["cached_tokens"] >= 128
    long_prompt = _record(server.generate(prompt(300, seed=71), max_new_tokens=16, return_logprob=True))
    shapes = [(20, 30), (100, 40), (170, 40), (180, 24)]
    with ThreadPoolExecutor(len(shapes)) as ex:
        mix = list(
            ex.map(
                lambda s: _record(
                    server.generate(prompt(s[0], seed=60 + s[0]), max_new_tokens=s[1], return_logprob=True)
                ),
                shapes,
            )
        )
    return {"cold": cold, "warm": _record(warm), "long_prompt": long_prompt, "mix": mix}


def test_adaptive_residency_is_token_identical_to_no_offload(servers):
    dense, adaptive = servers
    want = _pressure(dense, wait_for_lend=False)
    got = _pressure(adaptive, wait_for_lend=True)
    assert [len(ids) for ids, _ in got] == [120, 20, 20, 20]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], f"pressure request {i}: tokens differ from no offload"
        assert g[1] == w[1], f"pressure request {i}: logprobs differ from no offload"
    # the long request was demoted when a short one needed the buffer it had borrowed
    assert metric(adaptive, "reclaims") == LAYERS and metric(adaptive, "demotions") >= LAYERS
    assert metric(adaptive, "direct_rows") > 0

    want, got = _rest(dense), _rest(adaptive)
    for key in want:
        assert got[key] == want[key], f"{key}: differs from no offload"
    assert got["warm"][0] == got["cold"][0], "radix hit != cold request"
    assert metric(adaptive, "misses") > 0  # offloaded requests went through the residency
    log = adaptive.log_path.read_text(errors="replace")
    assert "residency adaptive (a request whose context fits its 64 slots, or those of idle request slots" in log
    assert "Traceback" not in log


def test_a_forced_demotion_mid_decode_is_token_identical(servers):
    dense, adaptive = servers
    ids = prompt(40, seed=90)
    want = _record(dense.generate(ids, max_new_tokens=160, return_logprob=True))
    demotions, direct = metric(adaptive, "demotions"), metric(adaptive, "direct_rows")
    result = {}
    req = threading.Thread(
        target=lambda: result.__setitem__(
            "out", _record(adaptive.generate(ids, max_new_tokens=160, return_logprob=True))
        )
    )
    req.start()
    deadline = time.monotonic() + 120
    try:
        while metric(adaptive, "direct_rows") < direct + 10 * LAYERS:  # ten direct steps first
            assert time.monotonic() < deadline and req.is_alive(), "the request never decoded direct"
            time.sleep(0.02)
        adaptive.hold_flag.touch()
        while metric(adaptive, "demotions") < demotions + LAYERS:
            assert time.monotonic() < deadline and req.is_alive(), "the switch demoted nothing"
            time.sleep(0.02)
    finally:
        adaptive.hold_flag.unlink(missing_ok=True)
    req.join(timeout=300)
    assert not req.is_alive() and result["out"] == want
    assert metric(adaptive, "demotions") == demotions + LAYERS
    # the switch is off: a new request is direct again, token-identical too
    direct = metric(adaptive, "direct_rows")
    short = prompt(20, seed=91)
    assert _record(adaptive.generate(short, max_new_tokens=12, return_logprob=True)) == _record(
        dense.generate(short, max_new_tokens=12, return_logprob=True)
    )
    assert metric(adaptive, "direct_rows") > direct
