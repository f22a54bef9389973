"""End to end on CPU: P/D into a decode server with attention TP 2 (sparse decode offload).

Servers (tiny DSA fixture: 2 layers, 4 heads; ranks bound to the two cores):

* decode ``--tp-size 2`` with sparse decode offload: one host pool shared by its two TP
  ranks; each rank listens on its own control port and pulls its half of every
  request's main-KV pages into the shared pool, and the whole indexer into its own
  device cache;
* the reference: a colocated ``--tp-size 2`` server without offload (same attention
  TP, so the same reductions as the decode server);
* a prefill server, first ``--tp-size 2`` (ratio 1: prefill rank ``p`` sends decode rank
  ``p`` its main range and the whole indexer), then ``--tp-size 4`` (ratio 2: prefill
  ranks ``2d`` and ``2d + 1`` serve decode rank ``d``; ``2d`` sends its main range, the two
  split the indexer). The prefill fixture is parametrized at module scope, so the TP-2
  prefill is stopped before the TP-4 one starts (memory and cores).

Greedy tokens through SGLang's router (PD mode) must equal the reference's for prompts
of one page (decode rank 1's main range is empty), a few pages and two prefill chunks.
Loopback only; every process is stopped in teardown.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import IDLE_SLEEP, ServerProcess, free_port, start_all, stop_all

from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.pd_servers import PDRouter

# the first test's setup starts decode + reference, then a prefill (TP 4: four ranks on two
# cores, 6-8 min at load 13): past the suite's 600 s per-test limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

VOCAB = 1024
ROUTER_READY_S = 180.0
TP2 = ["--tp-size", "2"]


def _bind(tp: int) -> dict:
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % 2) for r in range(tp))}


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


# page size 64 on CPU: 1 page (rank 1's main share empty), 3 pages (shares 2 + 1), two chunks
PROMPTS = [prompt(5, seed=1), prompt(150, seed=3), prompt(60, seed=5)]
MAX_NEW = 8


@pytest.fixture(scope="module")
def decode_side(tmp_path_factory):
    """(decode server, colocated reference, reference tokens per prompt, logs dir, kv_port)."""
    root = tmp_path_factory.mktemp("pd_decode_tp")
    kv = free_port(span=2)  # decode control ports kv .. kv + 1 (one per TP rank)
    decode = ServerProcess(TP2 + pd_servers.decode_args(kv, offload=True), log_path=root / "decode_tp2.log",
                           env=_bind(2))
    reference = ServerProcess(TP2 + pd_servers.COMMON + IDLE_SLEEP, log_path=root / "colocated_tp2.log",
                              env=_bind(2))
    start_all(decode, reference)
    try:
        print("\nstartup: decode %.0f s, colocated %.0f s" % (decode.startup_s, reference.startup_s))
        tokens = [reference.generate(p, max_new_tokens=MAX_NEW)["output_ids"] for p in PROMPTS]
        reference.stop()  # its tokens are all it was needed for: free the cores for the prefill
        yield decode, tokens, root, kv
    finally:
        stop_all(decode, reference)


@pytest.fixture(scope="module", params=[2, 4], ids=["prefill_tp2", "prefill_tp4"])
def pd(request, decode_side):
    """(router, prefill TP size, prefill log path) for one prefill TP size."""
    decode, tokens, root, kv = decode_side
    tp = request.param
    bootstrap = free_port()
    prefill = ServerProcess(["--tp-size", str(tp)] + pd_servers.prefill_args(bootstrap, kv),
                            log_path=root / f"prefill_tp{tp}.log", env=_bind(tp))
    router = None
    try:
        t0 = time.monotonic()
        start_all(prefill)
        router = PDRouter(prefill.url, bootstrap, decode.url, root / f"router_tp{tp}.log").start()
        router.wait_ready(prompt(5, seed=99), time.monotonic() + ROUTER_READY_S)
        print(f"\nprefill TP {tp} + router ready in {time.monotonic() - t0:.0f} s")
        yield router, tp, prefill.log_path
    finally:
        stop_all(router, prefill)


def test_router_pd_into_decode_tp2_matches_colocated(pd, decode_side):
    router, tp, _ = pd
    _, tokens, _, _ = decode_side
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(lambda p: router.generate(p, MAX_NEW)["output_ids"], PROMPTS))
    for p, out, ref in zip(PROMPTS, got, tokens):
        assert out == ref, f"prefill TP {tp}, prompt of {len(p)} tokens"


def test_each_prefill_rank_linked_to_its_decode_rank(pd, decode_side):
    """Logs: prefill rank p linked to decode rank p // ratio (host_rows layout); both decode
    ranks listen with TP-shared main KV; no P/D request failed."""
    _, tp, prefill_log_path = pd
    _, _, root, kv = decode_side
    prefill_log = prefill_log_path.read_text(errors="replace")
    ratio = tp // 2
    for d in (0, 1):
        links = re.findall(rf"P/D link to decode rank {d} at 127\.0\.0\.1:{kv + d} \(host_rows layout, "
                           rf"ratio {ratio}\) ready", prefill_log)
        assert len(links) == ratio, (d, links)
    decode_log = (root / "decode_tp2.log").read_text(errors="replace")
    for d in (0, 1):
        assert re.search(rf"P/D decode rank {d} of 2 listening on 127\.0\.0\.1:{kv + d} \(host_rows "
                         r"destinations, tp_shared main KV\)", decode_log)
    for log in (prefill_log, decode_log):
        assert "Traceback" not in log
        assert not re.search(r"(prefill|decode) rank \d+: request \S+ failed", log)
