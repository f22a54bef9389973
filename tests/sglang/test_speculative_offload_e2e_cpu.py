"""End to end on CPU: speculative decoding (NextN / MTP through SGLang's EAGLE worker)
with sparse decode offload off and on, served from ``tests/fixtures/tiny_dsa_mtp`` (the
tiny DSA model with one NextN layer); greedy outputs are token-identical and SGLang
reports the accept length.

Speculation: ``--speculative-algorithm NEXTN --speculative-num-steps 3
--speculative-eagle-topk 1 --speculative-num-draft-tokens 4`` (DeepSeek-V3.2's defaults
in SGLang 0.5.23): each round verifies 4 rows per request through the residency with
the committed length as the stable prefix.

Acceptance. With random (dummy) weights the draft layer never agrees with the target
(accept length 1.0: every draft rejected, measured). To exercise accepted *and*
rejected rows every round, both servers run SGLang's own acceptance simulation
``SGLANG_SIMULATE_ACC_LEN=2`` with ``SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token``:
the first draft of each round is accepted (its KV row becomes committed and is a hit
in later rounds), the other two are rejected (their slots are rewritten next round
and must never hit), and the bonus token is the target's prediction after the
accepted row, so the output still depends on every verify row's attention. The
verify-row residency itself is checked bit for bit in ``test_speculative_verify_rows.py``.

Two servers for the module, started together.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all
from sglang_ascend_offload.testing.servers import TINY_DSA_MTP, fixture_args

pytestmark = pytest.mark.slow

VOCAB = 1024
HOT_TOKENS = 64  # 4 x top-k 16, one page: prompts longer than this evict
SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]
COMMON = ["--max-running-requests", "4"] + SPEC + IDLE_SLEEP
SIMULATED_ACCEPT = {"SGLANG_SIMULATE_ACC_LEN": "2", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_servers")
    base = fixture_args(TINY_DSA_MTP)
    dense = ServerProcess(COMMON, log_path=root / "dense.log", base_args=base, env=SIMULATED_ACCEPT)
    offload = ServerProcess(COMMON + ["--enable-metrics", "--enable-sparse-decode-offload",
                                      "--sparse-decode-offload-config", json.dumps({"hot_tokens": HOT_TOKENS})],
                            log_path=root / "offload.log", base_args=base, env=SIMULATED_ACCEPT)
    start_all(dense, offload)
    print(f"\nstartup: dense {dense.startup_s:.1f} s, offload {offload.startup_s:.1f} s (concurrent)")
    yield dense, offload
    stop_all(dense, offload)


def _run(srv: ServerProcess) -> list:
    """Two waves of concurrent requests (the second takes the rows the first freed),
    sharing a cached prefix, prompts longer than ``hot_tokens``."""
    prefix = prompt(100, seed=11)
    srv.generate(prefix, max_new_tokens=1)  # the shared prefix is now in the radix cache
    waves = [[prefix + prompt(20 + i, seed=20 + i) for i in range(4)],
             [prompt(70 + 9 * i, seed=40 + i) for i in range(3)]]
    outs = []
    for wave in waves:
        with ThreadPoolExecutor(len(wave)) as ex:
            outs += list(ex.map(lambda p: srv.generate(p, max_new_tokens=20, return_logprob=True), wave))
    assert all(o["meta_info"]["cached_tokens"] >= 64 for o in outs[:4])
    return outs


def test_speculative_offload_on_and_off_are_token_identical(servers):
    dense, offload = servers
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
    _, offload = servers
    offload.generate(prompt(90, seed=60), max_new_tokens=8)
    text = offload.get("/metrics")

    def total(name):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"sglang:ascend_offload_{name}{{"))

    assert total("hits_total") > 0 and total("misses_total") > 0
