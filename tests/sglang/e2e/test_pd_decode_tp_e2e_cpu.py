"""End to end on CPU: P/D into a decode server with attention TP 2 (sparse decode offload).

Servers (the trained checkpoint ``tiny_dsa_trained``: 2 layers, 4 heads, real weights, so a
misplaced main-KV block changes the tokens -- on dummy weights a shifted block range went
unseen, ``scripts/plant_faults.py`` fault ``pd_main_block_shift``; ranks bound to the two
cores):

* decode ``--tp-size 2`` with sparse decode offload: one host pool shared by its two TP
  ranks; each rank listens on its own control port and pulls its half of every
  request's main-KV pages into the shared pool, and the whole indexer into its own
  device cache;
* the reference: a colocated ``--tp-size 2`` server without offload (same attention
  TP, so the same reductions as the decode server);
* a prefill server, first ``--tp-size 2`` (ratio 1: prefill rank ``p`` sends decode rank
  ``p`` its main range and the whole indexer), then ``--tp-size 4`` (ratio 2: prefill
  ranks ``2d`` and ``2d + 1`` serve decode rank ``d``; ``2d`` sends its main range, the two
  split the indexer). The TP-2 prefill starts with the decode and the reference; it is
  stopped before the TP-4 one starts (memory and cores).

Greedy tokens through SGLang's router (PD mode) must equal the reference's for prompts
of one page (decode rank 1's main range is empty), a few pages and two prefill chunks
(see :data:`PROMPTS` for why these prompts).
Loopback only; every process is stopped in teardown.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import IDLE_SLEEP, ServerProcess, free_port, start_all, stop_all

from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.pd_servers import PDRouter
from sglang_ascend_offload.testing.servers import trained_args

# the first test's setup starts decode + reference, then a prefill (TP 4: four ranks on two
# cores, 6-8 min at load 13): past the suite's 600 s per-test limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

VOCAB = 1024  # prompts draw token ids below this (the trained vocabulary has 4,096)
BASE = trained_args()
ROUTER_READY_S = 180.0
TP2 = ["--tp-size", "2"]


def _bind(tp: int) -> dict:
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % 2) for r in range(tp))}


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


# Page size 64 on CPU: 1 page (decode rank 1's main share is empty), 3 pages (shares 2 + 1)
# and 4 pages (2 + 2), the last two in two prefill chunks. Chosen among 48 candidates
# (lengths 5-201, seeds 1-6; 2026-12-02) as prompts on which colocated --tp 2 and --tp 4
# servers of the dummy-weight fixture returned the same 8 greedy tokens (the opt-in TP-4
# case has not been rerun on the trained checkpoint since): on 34 of the 48 they differ, mostly from the
# first token on (the token prefill samples), so with a TP-4 prefill no colocated server
# is a reference for them. The reference below is computed live, at TP 2.
PROMPTS = [prompt(30, seed=3), prompt(150, seed=4), prompt(201, seed=1)]
MAX_NEW = 8


def _prefill(tp: int, kv: int, root) -> tuple:
    bootstrap = free_port()
    return ServerProcess(
        ["--tp-size", str(tp)] + pd_servers.prefill_args(bootstrap, kv) + IDLE_SLEEP,
        log_path=root / f"prefill_tp{tp}.log",
        env=_bind(tp),
        base_args=BASE,
    ), bootstrap


@pytest.fixture(scope="module")
def decode_side(tmp_path_factory):
    """Decode, the colocated reference's tokens, logs dir, kv_port, and the TP-2 prefill
    (started with the other two: one wait instead of two)."""
    root = tmp_path_factory.mktemp("pd_decode_tp")
    kv = free_port(span=2)  # decode control ports kv .. kv + 1 (one per TP rank)
    decode = ServerProcess(
        TP2 + pd_servers.decode_args(kv, offload=True) + IDLE_SLEEP,
        log_path=root / "decode_tp2.log",
        env=_bind(2),
        base_args=BASE,
    )
    reference = ServerProcess(
        TP2 + pd_servers.COMMON + IDLE_SLEEP, log_path=root / "colocated_tp2.log", env=_bind(2), base_args=BASE
    )
    prefill2 = _prefill(2, kv, root)
    try:
        start_all(decode, reference, prefill2[0])
        print(
            "\nstartup (concurrent): decode %.0f s, colocated %.0f s, prefill TP 2 %.0f s"
            % (decode.startup_s, reference.startup_s, prefill2[0].startup_s)
        )
        tokens = [reference.generate(p, max_new_tokens=MAX_NEW)["output_ids"] for p in PROMPTS]
        reference.stop()  # its tokens are all it was needed for: free the cores for the prefill
        yield {"decode": decode, "tokens": tokens, "root": root, "kv": kv, "prefill2": prefill2}
    finally:
        stop_all(decode, reference, prefill2[0])


# The decode receiver takes each request's topology from its first contributor, so a TP-4
# prefill after a TP-2 one is served (4 passed in 283 s with the variable set, 2026-12-03).
# Its four ranks on two cores start in 3-8 minutes, past what the default suite spends on
# one case; the TP-4 plan is also covered by test_pd_decode_tp_components.py in every run.
_P4_REASON = (
    "a served TP-4 prefill (four ranks on two cores) starts in 3-8 min, beyond the default suite's "
    "time budget (set SGLANG_TEST_PD_DECODE_TP_P4=1 to run it)"
)


@pytest.fixture(
    scope="module",
    params=[
        2,
        pytest.param(
            4, marks=pytest.mark.skipif(os.environ.get("SGLANG_TEST_PD_DECODE_TP_P4") != "1", reason=_P4_REASON)
        ),
    ],
    ids=["prefill_tp2", "prefill_tp4"],
)
def pd(request, decode_side):
    """(router, prefill TP size, prefill log path) for one prefill TP size."""
    decode, root, kv = decode_side["decode"], decode_side["root"], decode_side["kv"]
    tp = request.param
    if tp == 2:
        prefill, bootstrap = decode_side["prefill2"]
    else:
        decode_side["prefill2"][0].stop()  # memory and cores for the four ranks
        prefill, bootstrap = _prefill(tp, kv, root)
    router = None
    try:
        t0 = time.monotonic()
        if tp != 2:
            start_all(prefill)
        router = PDRouter(prefill.url, bootstrap, decode.url, root / f"router_tp{tp}.log").start()
        router.wait_ready(prompt(5, seed=99), time.monotonic() + ROUTER_READY_S)
        print(f"\nprefill TP {tp} + router ready in {time.monotonic() - t0:.0f} s")
        yield router, tp, prefill.log_path
    finally:
        stop_all(router, prefill)


def test_router_pd_into_decode_tp2_matches_colocated(pd, decode_side):
    router, tp, _ = pd
    tokens = decode_side["tokens"]
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(lambda p: router.generate(p, MAX_NEW)["output_ids"], PROMPTS))
    for p, out, ref in zip(PROMPTS, got, tokens):
        assert out == ref, f"prefill TP {tp}, prompt of {len(p)} tokens"


def test_each_prefill_rank_linked_to_its_decode_rank(pd, decode_side):
    """Logs: prefill rank p linked to decode rank p // ratio (host_rows layout); both decode
    ranks listen with TP-shared main KV; no P/D request failed."""
    _, tp, prefill_log_path = pd
    root, kv = decode_side["root"], decode_side["kv"]
    prefill_log = prefill_log_path.read_text(errors="replace")
    ratio = tp // 2
    for d in (0, 1):
        links = re.findall(
            rf"P/D link to decode rank {d} at 127\.0\.0\.1:{kv + d} \(host_rows layout, "
            rf"ratio {ratio}\) ready",
            prefill_log,
        )
        assert len(links) == ratio, (d, links)
    decode_log = (root / "decode_tp2.log").read_text(errors="replace")
    for d in (0, 1):
        assert re.search(
            rf"P/D decode rank {d} of 2 listening on 127\.0\.0\.1:{kv + d} \(host_rows "
            r"destinations, tp_shared main KV\)",
            decode_log,
        )
    for log in (prefill_log, decode_log):
        assert "Traceback" not in log
        assert not re.search(r"(prefill|decode) rank \d+: request \S+ failed", log)
