"""End to end on CPU: speculative decoding (NextN / MTP through SGLang's EAGLE worker)
with sparse decode offload off and on, served from the trained checkpoint
``tests/fixtures/tiny_dsa_trained`` (real weights, its trained NextN layer; held-out
source as prompts); greedy outputs are token-identical and SGLang reports the accept
length.

Speculation: ``--speculative-algorithm NEXTN --speculative-num-steps 3
--speculative-eagle-topk 1 --speculative-num-draft-tokens 4`` (DeepSeek-V3.2's defaults
in SGLang 0.5.23): each round verifies 4 rows per request through the residency with
the committed length as the stable prefix (``hot_tokens`` 256 = 4 rows x top-k 64).

Acceptance is real: the trained draft layer agrees with the target often enough
(accept length > 1) that every round has accepted rows (committed: hits in later rounds)
and most have rejected ones (their slots are rewritten next round and must never hit).
On real weights the target's argmax depends on its attention, so a misplaced row moves
the tokens, not only the logprobs. The verify-row residency itself is checked bit for bit
in ``test_speculative_verify_rows.py``.

The same speculation with layerwise prefill offload (``shared_buffers 1,
independent_layers []``: both base layers share one device buffer, so every target
forward, verify included, loads and saves through the pipeline; the draft layer is
the plan's independent layer) is token-identical to the plain server as well: a
verify saves its candidate rows with the page, and the next verify continues a page
whose saved object holds the rejected ones.

Three servers for the module, started together.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import IDLE_SLEEP, ServerProcess

from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

pytestmark = pytest.mark.slow

HOT_TOKENS = 256  # 4 verify rows x top-k 64: prompts longer than this evict
SPEC = [
    "--speculative-algorithm",
    "NEXTN",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
]
# The P/D tests' settings (at most 4 requests, prefill chunks of 128 tokens) on all three
# servers, so the plain one is test_pd_speculative_e2e_cpu.py's colocated reference too.
COMMON = pd_servers.COMMON + SPEC + IDLE_SLEEP
LAYERWISE = [
    "--enable-layerwise-prefill-offload",
    "--layerwise-prefill-offload-config",
    json.dumps({"shared_buffers": 1, "independent_layers": [], "store_backend": "local", "wait_timeout_s": 60}),
]


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


# The plain (dense) server is test_graph_speculative_e2e_cpu.py's eager reference and
# test_pd_speculative_e2e_cpu.py's colocated reference too (same arguments and
# environment): launched once per session, its cache flushed before each module uses it
# (docs/testing.md).
SHARED_SERVERS = ("mtp_reference",)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, shared_servers):
    root = tmp_path_factory.mktemp("spec_servers")
    base = trained_args(TINY_DSA_TRAINED)
    dense = shared_servers.get("mtp_reference", COMMON, base_args=base)
    # shadow verification on every layer step (rate 1): each step recomputes one verify row
    # over the host pool and must match bit for bit
    offload = ServerProcess(
        COMMON
        + [
            "--enable-metrics",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps({"hot_tokens": HOT_TOKENS, "verify_sample_rate": 1.0, "verify_action": "fail"}),
        ],
        log_path=root / "offload.log",
        base_args=base,
    )
    layerwise = ServerProcess(COMMON + LAYERWISE, log_path=root / "layerwise.log", base_args=base)
    try:
        shared_servers.start_all(dense, offload, layerwise)
        print(
            f"\nstartup: dense {dense.startup_s:.1f} s, offload {offload.startup_s:.1f} s, layerwise "
            f"{layerwise.startup_s:.1f} s (concurrent; dense may have been started by an earlier module)"
        )
        yield dense, offload, layerwise
    finally:
        shared_servers.stop_all(request.module.__name__, dense, offload, layerwise)


def _run(srv: ServerProcess) -> list:
    """Two waves of concurrent requests (the second takes the rows the first freed),
    sharing a cached prefix, prompts longer than ``hot_tokens``."""
    prefix = prompt(280, seed=11)
    srv.generate(prefix, max_new_tokens=1)  # the shared prefix is now in the radix cache
    waves = [
        [prefix + prompt(20 + i, seed=20 + i) for i in range(4)],
        [prompt(270 + 9 * i, seed=40 + i) for i in range(3)],
    ]
    outs = []
    for wave in waves:
        with ThreadPoolExecutor(len(wave)) as ex:
            outs += list(ex.map(lambda p: srv.generate(p, max_new_tokens=20, return_logprob=True), wave))
    assert all(o["meta_info"]["cached_tokens"] >= 64 for o in outs[:4])
    return outs


def test_speculative_offload_on_and_off_are_token_identical(servers):
    dense, offload, _ = servers
    want, got = _run(dense), _run(offload)
    for d, o in zip(want, got):
        assert len(o["output_ids"]) == 20
        assert o["output_ids"] == d["output_ids"]
        assert o["meta_info"]["output_token_logprobs"] == d["meta_info"]["output_token_logprobs"]
    for out in want + got:  # SGLang reports the accept length per request
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        assert meta["spec_accept_length"] > 1.0


def test_verify_rows_went_through_the_residency(servers):
    """With speculation every target decode forward is a verify; the offload server's
    engine counters show its rows hit and missed (hits: accepted rows and the prefix)."""
    _, offload, _ = servers
    offload.generate(prompt(300, seed=60), max_new_tokens=8)
    text = offload.get("/metrics")

    def total(name):
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"sglang:ascend_offload_{name}{{")
        )

    assert total("hits_total") > 0 and total("misses_total") > 0
    # shadow verification checked served verify rows against the host pool, and they matched
    assert total("shadow_checks_total") > 0 and total("shadow_mismatches_total") == 0


def _run_layerwise(srv: ServerProcess) -> list:
    """A cached prefix shared by a concurrent wave, then prompts across pages."""
    prefix = prompt(90, seed=5)  # (layerwise: pages, not the hot buffer, matter here)
    srv.generate(prefix, max_new_tokens=1)
    wave = [prefix + prompt(10 + 3 * i, seed=30 + i) for i in range(3)]
    with ThreadPoolExecutor(len(wave)) as ex:
        outs = list(ex.map(lambda p: srv.generate(p, max_new_tokens=14, return_logprob=True), wave))
    for n in (7, 65, 130):
        outs.append(srv.generate(prompt(n, seed=n), max_new_tokens=14, return_logprob=True))
    return outs


def test_layerwise_speculative_is_token_identical(servers):
    dense, _, layerwise = servers
    want, got = _run_layerwise(dense), _run_layerwise(layerwise)
    for w, g in zip(want, got):
        assert len(g["output_ids"]) == 14
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
        assert g["meta_info"]["spec_verify_ct"] > 0 and g["meta_info"]["spec_accept_length"] > 1.0
    log = layerwise.log_path.read_text(errors="replace")
    assert re.search(r"pipelined layers \[0, 1\] \(host store local\), dedicated \[\]", log)  # both share
    assert re.search(r"layerwise prefill offload: draft \(NextN\) KV placement device: 1 layer", log)
    assert "Traceback" not in log
