"""Served router P/D into a decode with the int8 (LIM-C8) index-K cache, on CPU.

A plain prefill, a decode with sparse decode offload and ``indexer_dtype: "int8"``, SGLang's
router in front (``testing/pd_servers.py``; Mooncake over TCP). The decode says in its log
that its index-K cache is int8 + fp16 scales; requests of one and two prefill chunks come
back complete and the same when repeated (the prefill's radix cache hit the second time).
The bit-exact content of what arrives (int8 keys + scales == ``rotate_and_quantize`` of
the prefill's bf16 keys) is held in process by ``test_int8_indexer_pd.py``.
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import ServerProcess, free_port, start_all, stop_all
from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.pd_servers import PDRouter

pytestmark = pytest.mark.slow

VOCAB = 1024
ROUTER_READY_S = 120.0


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8_pd")
    bootstrap, kv = free_port(), free_port()
    prefill = ServerProcess(pd_servers.prefill_args(bootstrap, kv), log_path=root / "prefill.log")
    decode = ServerProcess(pd_servers.decode_args(kv) + [
        "--enable-sparse-decode-offload", "--sparse-decode-offload-config",
        json.dumps({"hot_tokens": 64, "indexer_dtype": "int8"})], log_path=root / "decode_int8.log")
    routers = []
    try:
        start_all(prefill, decode)
        routers.append(PDRouter(prefill.url, bootstrap, decode.url, root / "router.log").start())
        routers[0].wait_ready(prompt(5, seed=99), time.monotonic() + ROUTER_READY_S)
        routers[0].decode_log = decode.log_path
        yield routers[0]
    finally:
        for r in routers:
            r.stop()
        stop_all(prefill, decode)


def test_pd_into_an_int8_decode_serves_complete_repeatable_answers(router):
    text = router.decode_log.read_text(errors="replace")
    assert "index K int8 + fp16 scales (Hadamard-rotated, LIM-C8): 130 B per token and layer" in text
    for n, seed in ((40, 1), (200, 2)):  # one prefill chunk, two chunks of 128
        first = router.generate(prompt(n, seed), max_new_tokens=8)["output_ids"]
        assert len(first) == 8 and all(0 <= t < VOCAB for t in first)
        assert router.generate(prompt(n, seed), max_new_tokens=8)["output_ids"] == first
