"""End to end on CPU: speculative decoding (NextN / MTP) on router P/D with the
``ascend_offload`` transfer backend, the decode server running sparse decode offload,
on real weights.

Three servers of the trained checkpoint ``tests/fixtures/tiny_dsa_trained`` (real
weights, its trained NextN layer), started together:

* prefill P: ``--disaggregation-mode prefill`` with the NextN draft (its draft extend
  fills the draft layer's KV and the first draft inputs);
* decode D: ``--disaggregation-mode decode`` with the NextN draft and sparse decode
  offload (``hot_tokens`` 256 = 4 verify rows x top-k 64): the base layers' main KV is
  pulled into its host pool (``host_rows``), the draft layer's into its device draft pool,
  each request layer by layer;
* colocated C: the same speculation without P/D and without offload (the reference).

Acceptance is real: the output tokens are the target's greedy text whatever the draft
proposes, and the draft layer's KV decides how many drafts are accepted. Greedy
``/generate`` through the router must return C's tokens and logprobs, and each request
the same number of verify rounds as on C: a draft layer whose prompt KV did not arrive
in the decode's draft pool (an earlier bug: it landed in a scratch buffer) proposes other
tokens, and the verify counts move. (On dummy weights that fault went unseen: the draft's
argmax barely depends on its attention.) The bytes themselves are proven bit for bit
through real engines by
``test_pd_backend_components.py::test_the_draft_layer_arrives_bit_exact_on_the_device``.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import IDLE_SLEEP, ServerProcess, free_port

from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.pd_servers import PDRouter
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

pytestmark = pytest.mark.slow

ROUTER_READY_S = 120.0
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


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


# The colocated reference is test_graph_speculative_e2e_cpu.py's eager reference and
# test_speculative_offload_e2e_cpu.py's plain server too (same arguments and environment):
# launched once per session, its cache flushed before each module uses it (docs/testing.md).
SHARED_SERVERS = ("mtp_reference",)


@pytest.fixture(scope="module")
def pd(request, tmp_path_factory, shared_servers):
    """(router to the offload decode, colocated reference, logs dir)."""
    root = tmp_path_factory.mktemp("pd_spec_servers")
    base = trained_args(TINY_DSA_TRAINED)
    bootstrap, kv = free_port(), free_port()
    prefill = ServerProcess(
        pd_servers.prefill_args(bootstrap, kv) + SPEC + IDLE_SLEEP,
        log_path=root / "prefill.log",
        base_args=base,
    )
    decode = ServerProcess(
        pd_servers.decode_args(kv, offload=True, hot_tokens=256) + SPEC + IDLE_SLEEP + ["--enable-metrics"],
        log_path=root / "decode.log",
        base_args=base,
    )
    colocated = shared_servers.get("mtp_reference", pd_servers.COMMON + SPEC + IDLE_SLEEP, base_args=base)
    servers = [prefill, decode, colocated]
    router = None
    try:
        shared_servers.start_all(*servers)
        print(
            "\nstartup (concurrent; colocated may have been started by an earlier module): "
            + ", ".join(f"{n} {s.startup_s:.0f} s" for n, s in zip(("prefill", "decode", "colocated"), servers))
        )
        router = PDRouter(prefill.url, bootstrap, decode.url, root / "router.log").start()
        router.wait_ready(prompt(5, seed=99), time.monotonic() + ROUTER_READY_S)
        yield router, colocated, decode, root
    finally:
        shared_servers.stop_all(request.module.__name__, router, *servers)


def test_speculative_pd_decode_with_offload_matches_colocated(pd):
    """Prompts shorter than a page, one page and several pages (chunked prefill: > 128
    tokens reach the sender in several chunks), four at once, 24 tokens each: several verify
    rounds, contexts past the 256-token hot buffer (the verify rows evict)."""
    router, colocated, *_ = pd
    prompts = [prompt(5, seed=1), prompt(70, seed=2), prompt(300, seed=3), prompt(420, seed=4)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: router.generate(p, 24, return_logprob=True), prompts))
    rounds = []
    for p, out in zip(prompts, got):
        ref = colocated.generate(p, max_new_tokens=24, return_logprob=True)
        assert out["output_ids"] == ref["output_ids"], f"prompt of {len(p)} tokens"
        assert len(out["output_ids"]) == 24
        assert pd_servers.logprobs_float32(out) == pd_servers.logprobs_float32(ref)
        # the draft layer's KV decides the accepted drafts: the same rounds as colocated
        assert out["meta_info"]["spec_verify_ct"] == ref["meta_info"]["spec_verify_ct"] > 0, f"prompt of {len(p)}"
        rounds.append(ref["meta_info"]["spec_verify_ct"])
    assert min(rounds) < 24, "no draft was ever accepted: the draft layer's KV was not exercised"


def test_the_draft_layer_went_to_the_decode_device_and_verify_used_the_residency(pd):
    router, _, decode, root = pd
    decode_log = (root / "decode.log").read_text(errors="replace")
    assert re.search(
        r"P/D decode rank 0 of 1 listening on 127\.0\.0\.1:\d+ \(host_rows destinations, "
        r"\w+ main KV, 1 draft layer\(s\) on the device\)",
        decode_log,
    ), decode_log[-3000:]
    prefill_log = (root / "prefill.log").read_text(errors="replace")
    assert re.search(r"P/D link to decode rank 0 at 127\.0\.0\.1:\d+ \(host_rows layout", prefill_log)
    text = decode.get("/metrics")

    def total(name):
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"sglang:ascend_offload_{name}{{")
        )

    # every verify round: 4 rows per request, their top-k entries counted one by one
    assert total("row_selected_total") > total("selected_total") > 0
    assert total("hits_total") > 0 and total("misses_total") > 0
