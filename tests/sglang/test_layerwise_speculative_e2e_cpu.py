"""End to end on CPU: speculative decoding (NextN / MTP) with layerwise prefill offload
is token-identical to the same speculation without it.

Model: ``tests/fixtures/tiny_dsa_mtp`` (2 base layers + one NextN layer). Layerwise
config ``shared_buffers 1, independent_layers []``: both base layers share one device
buffer, so every forward (extend, verify, draft extend) of the target goes through the
pipeline's loads and saves; the draft layer is the plan's independent layer (device
buffer, ``build_draft_pool``). Acceptance is SGLang's own simulation
(``SGLANG_SIMULATE_ACC_LEN=2``, real draft tokens: one draft accepted and two rejected
per round), so rejected candidate rows are saved, reloaded and rewritten every round.

Two servers for the module, started together.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all
from sglang_ascend_offload.testing.servers import TINY_DSA_MTP, fixture_args

pytestmark = pytest.mark.slow

VOCAB = 1024
SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]
COMMON = ["--max-running-requests", "4"] + SPEC + IDLE_SLEEP
SIMULATED_ACCEPT = {"SGLANG_SIMULATE_ACC_LEN": "2", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}
LAYERWISE = ["--enable-layerwise-prefill-offload", "--layerwise-prefill-offload-config",
             json.dumps({"shared_buffers": 1, "independent_layers": [], "store_backend": "local",
                         "wait_timeout_s": 60})]


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("layerwise_spec_servers")
    base = fixture_args(TINY_DSA_MTP)
    plain = ServerProcess(COMMON, log_path=root / "plain.log", base_args=base, env=SIMULATED_ACCEPT)
    layerwise = ServerProcess(COMMON + LAYERWISE, log_path=root / "layerwise.log", base_args=base,
                              env=SIMULATED_ACCEPT)
    start_all(plain, layerwise)
    print(f"\nstartup: plain {plain.startup_s:.1f} s, layerwise {layerwise.startup_s:.1f} s (concurrent)")
    yield plain, layerwise, root
    stop_all(plain, layerwise)


def _run(srv: ServerProcess) -> list:
    """A cached prefix shared by a concurrent wave, then prompts across pages."""
    prefix = prompt(90, seed=5)
    srv.generate(prefix, max_new_tokens=1)
    outs = []
    wave = [prefix + prompt(10 + 3 * i, seed=30 + i) for i in range(3)]
    with ThreadPoolExecutor(len(wave)) as ex:
        outs += list(ex.map(lambda p: srv.generate(p, max_new_tokens=14, return_logprob=True), wave))
    for n in (7, 65, 130):
        outs.append(srv.generate(prompt(n, seed=n), max_new_tokens=14, return_logprob=True))
    return outs


def test_layerwise_speculative_is_token_identical(servers):
    plain, layerwise, _ = servers
    want, got = _run(plain), _run(layerwise)
    for w, g in zip(want, got):
        assert len(g["output_ids"]) == 14
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
        assert g["meta_info"]["spec_verify_ct"] > 0 and g["meta_info"]["spec_accept_length"] > 1.0


def test_draft_layer_is_the_plans_independent_layer(servers):
    _, _, root = servers
    log = (root / "layerwise.log").read_text(errors="replace")
    assert re.search(r"pipelined layers \[0, 1\] \(host store local\), dedicated \[\]", log)  # both base layers share
    assert re.search(r"layerwise prefill offload: draft \(NextN\) KV placement device: 1 layer", log)
    assert "Traceback" not in log
