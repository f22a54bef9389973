"""End to end on CPU: P/D through SGLang's router with the ``ascend_offload`` transfer backend.

One module setup (each launch costs ~30-60 s on 2 cores, started together):

* prefill server P (the trained checkpoint ``tests/fixtures/tiny_dsa_trained``: real
  weights, so a misplaced page moves the argmax; held-out source as prompts;
  ``--disaggregation-mode prefill``),
* prefill server PL with layerwise prefill offload: ``I = []``, ``B = 1``, so the model's
  two layers alias one physical buffer and layer 1 may only overwrite it after decode
  read layer 0 (the request is published layer by layer during its last forward),
* decode server D0 (device pool: main KV pulled into device pages),
* decode server D1 with sparse decode offload (main KV pulled straight into its host pool),
* decode server D2 like D1 with ``residency: "adaptive"`` and SGLang's forced retraction
  (``SGLANG_TEST_RETRACT``: every third decode step retracts requests; their KV is backed
  up from the host pool and restored into new slots,
  ``--disaggregation-decode-retraction-backup cpu_tensor``; a resumed request that turns
  direct reads its whole restored context from the host pool),
* decode server D3 with sparse decode offload and the int8 (LIM-C8) index-K cache
  (``indexer_dtype: "int8"``),
* one colocated server (the reference),
* six routers ``sglang_router.launch_router --pd-disaggregation``: (P, D0), (P, D1), (PL, D0),
  (PL, D1), (P, D2), (P, D3): the fourth is the intended deployment (layerwise offload on the
  prefill node, sparse decode offload on the decode node).

Every server sleeps when idle (``--sleep-on-idle``; the P/D servers in short slices while
a transfer is in flight, ``disaggregation/ascend_offload/idle.py``), so the idle ones
do not take the cores from the others. Every server uses the Mooncake engine over TCP on 127.0.0.1
(``pd_transfer.engine =
mooncake``). Greedy ``/generate`` through each router must return the colocated
server's tokens (and logprobs). Loopback only; every process is killed in teardown.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import IDLE_SLEEP, ServerProcess, free_port

from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.pd_servers import PDRouter, logprobs_float32
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

pytestmark = pytest.mark.slow

VOCAB = 4096
INDEX_TOPK = 64
BASE = trained_args(TINY_DSA_TRAINED)
ROUTER_READY_S = 120.0
#: SGLang's forced retraction: every third decode step of the scheduler retracts requests
FORCED_RETRACTION = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"}


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


@dataclass(frozen=True)
class PDServers:
    """The module's servers: routers by (prefill, decode) pair, the reference, the logs."""

    dense: PDRouter  # P -> D0 (device pool)
    offload: PDRouter  # P -> D1 (sparse decode offload)
    colocated: ServerProcess
    root: Path  # server and router logs
    layerwise: PDRouter  # PL -> D0
    layerwise_offload: PDRouter  # PL -> D1
    retract: PDRouter  # P -> D2 (offload, forced retraction)
    retracting: ServerProcess  # D2
    int8: PDRouter  # P -> D3 (offload, int8 index K)
    offload_decode: ServerProcess  # D1


# The colocated reference is test_e2e_dsa_cpu.py's and test_score_policy_serving.py's
# offload-off server too (same arguments): launched once per session, its cache flushed
# before each module uses it (docs/testing.md).
SHARED_SERVERS = ("trained_reference",)


@pytest.fixture(scope="module")
def pd(request, tmp_path_factory, shared_servers):
    """:class:`PDServers` (every process stopped in teardown)."""
    root = tmp_path_factory.mktemp("pd_servers")
    bootstrap, bootstrap_lw = free_port(), free_port()
    kv0, kv1, kv2, kv3 = free_port(), free_port(), free_port(), free_port()

    prefill = ServerProcess(
        pd_servers.prefill_args(bootstrap, kv0) + IDLE_SLEEP, log_path=root / "prefill.log", base_args=BASE
    )
    prefill_lw = ServerProcess(
        pd_servers.prefill_args(bootstrap_lw, kv0, layerwise=True) + IDLE_SLEEP,
        log_path=root / "prefill_layerwise.log",
        base_args=BASE,
    )
    dense = ServerProcess(pd_servers.decode_args(kv0) + IDLE_SLEEP, log_path=root / "decode_dense.log", base_args=BASE)
    offload = ServerProcess(  # shadow verification of every layer step: a check, not an equality with colocated
        pd_servers.decode_args(kv1, offload=True, verify_sample_rate=1.0) + IDLE_SLEEP + ["--enable-metrics"],
        log_path=root / "decode_offload.log",
        base_args=BASE,
    )
    colocated = shared_servers.get("trained_reference", pd_servers.COMMON + IDLE_SLEEP, base_args=BASE)
    retracting = ServerProcess(
        pd_servers.decode_args(kv2, offload=True, residency="adaptive", verify_sample_rate=1.0)
        + IDLE_SLEEP
        + ["--enable-metrics"],
        log_path=root / "decode_offload_retract.log",
        env=FORCED_RETRACTION,
        base_args=BASE,
    )
    int8 = ServerProcess(
        pd_servers.decode_args(kv3)
        + [
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps({"hot_tokens": 64, "indexer_dtype": "int8"}),
        ]
        + IDLE_SLEEP,
        log_path=root / "decode_int8.log",
        base_args=BASE,
    )
    servers = [prefill, dense, offload, colocated, prefill_lw, retracting, int8]
    routers = []
    try:
        shared_servers.start_all(*servers)
        print(
            "\nstartup (concurrent; colocated may have been started by an earlier module): "
            + ", ".join(
                f"{n} {s.startup_s:.0f} s"
                for n, s in zip(
                    ("prefill", "dense", "offload", "colocated", "prefill_layerwise", "offload_retract", "int8"),
                    servers,
                )
            )
        )
        routers = [
            PDRouter(prefill.url, bootstrap, dense.url, root / "router_dense.log").start(),
            PDRouter(prefill.url, bootstrap, offload.url, root / "router_offload.log").start(),
            PDRouter(prefill_lw.url, bootstrap_lw, dense.url, root / "router_layerwise.log").start(),
            PDRouter(prefill_lw.url, bootstrap_lw, offload.url, root / "router_layerwise_offload.log").start(),
            PDRouter(prefill.url, bootstrap, retracting.url, root / "router_retract.log").start(),
            PDRouter(prefill.url, bootstrap, int8.url, root / "router_int8.log").start(),
        ]
        deadline = time.monotonic() + ROUTER_READY_S
        for r in routers:
            r.wait_ready(prompt(5, seed=99), deadline)
        yield PDServers(*routers[:2], colocated, root, *routers[2:5], retracting, routers[5], offload)
    finally:
        shared_servers.stop_all(request.module.__name__, *routers, *servers)


def _check_same(router: PDRouter, colocated: ServerProcess, prompts, max_new_tokens: int) -> None:
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: router.generate(p, max_new_tokens, return_logprob=True), prompts))
    for p, out in zip(prompts, got):
        ref = colocated.generate(p, max_new_tokens=max_new_tokens, return_logprob=True)
        assert out["output_ids"] == ref["output_ids"], f"prompt of {len(p)} tokens"
        assert len(out["output_ids"]) == max_new_tokens
        assert logprobs_float32(out) == logprobs_float32(ref)


# Prompts: shorter than a page, longer than the top-k, several pages (page size 64 on CPU).
PROMPTS = [prompt(5, seed=1), prompt(3 * INDEX_TOPK, seed=2), prompt(150, seed=3), prompt(201, seed=4)]


def test_router_pd_with_device_decode_matches_colocated(pd):
    _check_same(pd.dense, pd.colocated, PROMPTS, max_new_tokens=12)


def test_router_pd_with_offload_decode_matches_colocated(pd):
    _check_same(pd.offload, pd.colocated, PROMPTS, max_new_tokens=12)


def test_both_decode_servers_at_once_from_one_prefill(pd):
    dense_router, offload_router, colocated = pd.dense, pd.offload, pd.colocated
    p = prompt(130, seed=7)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda r: r.generate(p, 16), [dense_router, offload_router] * 2))
    ref = colocated.generate(p, max_new_tokens=16)["output_ids"]
    assert all(o["output_ids"] == ref for o in outs)


def test_router_pd_from_layerwise_prefill_matches_colocated(pd):
    """Layerwise prefill offload on the prefill node: both layers share one buffer, each is
    read by decode during the forward; chunked prompts (> 128 tokens) load their first
    chunk back from the host store before it is published."""
    colocated, layerwise_router = pd.colocated, pd.layerwise
    _check_same(layerwise_router, colocated, PROMPTS, max_new_tokens=12)
    shared = prompt(140, seed=11)  # a radix-cached prefix, then concurrent requests that hit it
    layerwise_router.generate(shared, max_new_tokens=1)
    _check_same(
        layerwise_router, colocated, [shared + prompt(10 + 7 * i, seed=20 + i) for i in range(3)], max_new_tokens=8
    )


def test_router_pd_from_layerwise_prefill_to_offload_decode_matches_colocated(pd):
    """Layerwise prefill offload -> sparse decode offload: each layer is packed per request
    into the publisher's staging and lands in decode's host pool; concurrent requests
    share a forward (their reads of one layer go one after another)."""
    colocated, layerwise_offload_router = pd.colocated, pd.layerwise_offload
    _check_same(layerwise_offload_router, colocated, PROMPTS, max_new_tokens=12)
    shared = prompt(140, seed=12)
    layerwise_offload_router.generate(shared, max_new_tokens=1)
    _check_same(
        layerwise_offload_router,
        colocated,
        [shared + prompt(9 + 5 * i, seed=30 + i) for i in range(3)],
        max_new_tokens=8,
    )


def test_retracted_requests_on_an_offload_decode_resume_token_identical(pd):
    """Forced retraction on the P/D decode with sparse decode offload (``residency:
    adaptive``): retracted requests' KV is backed up (host rows copied, index K from the
    device) and restored into their new slots when they resume, never recomputed; tokens
    and logprobs equal the colocated server's, and the server counted the retractions
    and served direct rows."""
    router, colocated, retracting = pd.retract, pd.colocated, pd.retracting
    prompts = [prompt(40 + 37 * i, seed=50 + i) for i in range(4)]
    _check_same(router, colocated, prompts, max_new_tokens=20)
    text = retracting.get("/metrics")

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert total("sglang:num_retracted_requests_total") > 0, "no request was retracted"
    assert total("sglang:ascend_offload_direct_rows_total") > 0, "no request was served direct"
    log = (pd.root / "decode_offload_retract.log").read_text(errors="replace")
    assert "Testing retraction" in log and "Traceback" not in log


def test_pd_into_an_int8_decode_serves_complete_repeatable_answers(pd):
    """P/D into a decode with the int8 (LIM-C8) index-K cache: the decode says in its log
    that its index-K cache is int8 + fp16 scales; requests of one and two prefill chunks
    come back complete and the same when repeated (the prefill's radix cache hits the
    second time). The bit-exact content of what arrives (int8 keys + scales ==
    ``rotate_and_quantize`` of the prefill's bf16 keys) is held in process by
    ``test_int8_indexer_pd.py``."""
    log = pd.root / "decode_int8.log"
    assert "index K int8 + fp16 scales (Hadamard-rotated, LIM-C8): 130 B per token and layer" in log.read_text(
        errors="replace"
    )
    for n, seed in ((40, 61), (200, 62)):  # one prefill chunk, two chunks of 128
        first = pd.int8.generate(prompt(n, seed), max_new_tokens=8)["output_ids"]
        assert len(first) == 8 and all(0 <= t < VOCAB for t in first)
        assert pd.int8.generate(prompt(n, seed), max_new_tokens=8)["output_ids"] == first
    assert "Traceback" not in log.read_text(errors="replace")  # read again: after the requests


def test_shadow_verification_on_the_pd_decode_saw_no_mismatch(pd):
    """Both offload decodes (D1, and D2 with retractions) recompute one row of every layer
    step over their host pool (``verify_sample_rate: 1.0``): rows checked, none differed."""
    for router, server in ((pd.offload, pd.offload_decode), (pd.retract, pd.retracting)):
        router.generate(prompt(200, seed=70), 8)
        text = server.get("/metrics")

        def total(name: str) -> float:
            found = re.findall(rf"^sglang:ascend_offload_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
            return sum(float(v) for v in found)

        assert total("shadow_checks") > 0 and total("shadow_mismatches") == 0, server.log_path.name


def test_the_project_protocol_moved_the_kv(pd):
    """The logs show our protocol's endpoints for both layouts, and no SGLang KV engine."""
    root = pd.root
    prefill_log = (root / "prefill.log").read_text(errors="replace")
    assert re.search(r"P/D link to decode rank 0 at 127\.0\.0\.1:\d+ \(split layout", prefill_log)
    assert re.search(r"P/D link to decode rank 0 at 127\.0\.0\.1:\d+ \(host_rows layout", prefill_log)
    assert "SGLang sees 'ascend'" in prefill_log
    dense_log = (root / "decode_dense.log").read_text(errors="replace")
    offload_log = (root / "decode_offload.log").read_text(errors="replace")
    assert re.search(r"P/D decode rank 0 of 1 listening on 127\.0\.0\.1:\d+ \(split destinations, ", dense_log)
    assert re.search(r"P/D decode rank 0 of 1 listening on 127\.0\.0\.1:\d+ \(host_rows destinations, ", offload_log)
    layerwise_log = (root / "prefill_layerwise.log").read_text(errors="replace")
    assert re.search(
        r"P/D layerwise publisher: link to decode rank 0 at 127\.0\.0\.1:\d+ \(split layout, "
        r"ratio 1\) ready; layers \[0, 1\] are published from shared buffers",
        layerwise_log,
    )
    assert re.search(
        r"P/D layerwise publisher: link to decode rank 0 at 127\.0\.0\.1:\d+ \(host_rows layout, "
        r"ratio 1\) ready",
        layerwise_log,
    )
    for log in (prefill_log, dense_log, offload_log, layerwise_log):
        assert "Traceback" not in log
        assert not re.search(r"(prefill|decode) rank \d+: request \S+ failed", log)  # no P/D request failed
