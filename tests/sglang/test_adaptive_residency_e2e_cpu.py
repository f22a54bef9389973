"""Served: ``residency: "adaptive"`` is token-identical to no offload.

The tiny DSA fixture (top-k 16) serves with sparse decode offload, a 192-slot hot buffer
and ``residency: "adaptive"``, against the session's shared offload-off server (same
launch settings). Requests cover each mode a request can be in:

* short requests whose context stays within the hot buffer: direct for their whole
  decode (no residency step);
* requests that start direct and outgrow the buffer mid-decode: demoted in place;
* a prompt longer than the buffer: offloaded from its first decode step;
* a radix-cache hit (128 cached tokens) that is direct: its cached prefix is copied
  from the host pool into its buffer the step it turns direct;

concurrently, so direct, demoted and offloaded rows share decode batches. Greedy
tokens and their logprobs must equal the offload-off server's exactly (the attention
reads the same rows in the same order), and the server's metrics must show direct
rows and demotions, so the test cannot pass with every request offloaded.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import IDLE_SLEEP, ServerProcess
from sglang_ascend_offload.testing import pd_servers

pytestmark = pytest.mark.slow

VOCAB = 1024
HOT_TOKENS = 192  # three pages of 64
COMMON = pd_servers.COMMON + IDLE_SLEEP  # the shared offload-off server's settings (test_e2e_dsa_cpu.py)
SHARED_SERVERS = ("tiny_dsa_reference",)


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, shared_servers):
    root = tmp_path_factory.mktemp("adaptive_servers")
    dense = shared_servers.get("tiny_dsa_reference", COMMON)
    adaptive = ServerProcess(COMMON + ["--enable-metrics", "--enable-sparse-decode-offload",
                                       "--sparse-decode-offload-config",
                                       json.dumps({"hot_tokens": HOT_TOKENS, "residency": "adaptive"})],
                             log_path=root / "adaptive.log")
    try:
        shared_servers.start_all(dense, adaptive)
        yield dense, adaptive
    finally:
        shared_servers.stop_all(request.module.__name__, dense, adaptive)


def _metric(server, name: str) -> float:
    text = server.get("/metrics")
    values = [float(v) for v in re.findall(rf"^sglang:ascend_offload_{name}_total{{[^}}]*}} ([0-9.e+]+)$", text,
                                            re.M)]
    assert values, f"no sglang:ascend_offload_{name}_total in /metrics"
    return sum(values)


def _serve(server) -> dict:
    # (prompt tokens, new tokens): direct throughout; demoted at 192 mid-decode (x2); never direct
    shapes = [(20, 30), (100, 40), (170, 40), (180, 24), (250, 16)]
    prompts = [prompt(n, seed=60 + i) for i, (n, _) in enumerate(shapes)]
    with ThreadPoolExecutor(len(shapes)) as ex:
        outs = list(ex.map(lambda pn: server.generate(pn[0], max_new_tokens=pn[1], return_logprob=True),
                           zip(prompts, [m for _, m in shapes])))
    shared = prompt(150, seed=70)  # two pages cached on the second request; 150 + 20 fits the buffer
    cold = server.generate(shared, max_new_tokens=20, return_logprob=True)
    warm = server.generate(shared, max_new_tokens=20, return_logprob=True)
    assert warm["meta_info"]["cached_tokens"] >= 128
    return {"batch": [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs],
            "cold": (cold["output_ids"], cold["meta_info"]["output_token_logprobs"]),
            "warm": (warm["output_ids"], warm["meta_info"]["output_token_logprobs"])}


def test_adaptive_residency_is_token_identical_to_no_offload(servers):
    dense, adaptive = servers
    want, got = _serve(dense), _serve(adaptive)
    assert [len(ids) for ids, _ in got["batch"]] == [30, 40, 40, 24, 16]
    for i, (g, w) in enumerate(zip(got["batch"], want["batch"])):
        assert g[0] == w[0], f"request {i}: tokens differ from no offload"
        assert g[1] == w[1], f"request {i}: logprobs differ from no offload"
    assert got["cold"] == want["cold"] and got["warm"] == want["warm"]
    assert got["warm"][0] == got["cold"][0], "radix hit != cold request"
    layers = 2  # tests/fixtures/tiny_dsa
    assert _metric(adaptive, "direct_rows") > 0
    # the two requests that outgrow the buffer, in every layer
    assert _metric(adaptive, "demotions") == 2 * layers
    assert _metric(adaptive, "misses") > 0  # the long prompt and the demoted rows went through the residency
    log = adaptive.log_path.read_text(errors="replace")
    assert f"residency adaptive (a request whose context fits its {HOT_TOKENS} slots" in log
    assert "Traceback" not in log
