"""Served: sparse decode offload with the int8 (LIM-C8) indexer cache on CPU.

One server of the tiny DSA fixture with ``{"indexer_dtype": "int8"}``: it starts (the
refusal is gone), says in its startup log that the index-K cache is int8 + fp16 scales
and that the indexer is the C8 op, and serves greedy tokens deterministically: the same
prompt twice, a concurrent batch, and a radix-cache hit equal to the cold request. That
the served top-k equals the reference C8 composition bit for bit is held at the served
shapes by ``test_int8_indexer_components.py`` (the same pool and backend, in process).
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all

pytestmark = pytest.mark.slow

INDEX_TOPK = 16  # tests/fixtures/tiny_dsa/config.json
VOCAB = 1024
CACHE_LINE = re.compile(r"index K int8 \+ fp16 scales \(Hadamard-rotated, LIM-C8\): (\d+) B per token and layer")


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8_indexer")
    offload_cfg = {"hot_tokens": 64, "indexer_dtype": "int8", "metrics_log_interval_s": 0.5}
    proc = ServerProcess(
        [
            "--max-running-requests",
            "4",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps(offload_cfg),
        ]
        + IDLE_SLEEP,
        log_path=root / "int8.log",
    )
    start_all(proc)
    yield proc
    stop_all(proc)


def test_int8_indexer_serves_deterministic_tokens_and_says_so(server):
    text = server.log_path.read_text(errors="replace")
    found = CACHE_LINE.search(text)
    assert found, f"no int8 index-K cache line in {server.log_path}"
    assert int(found.group(1)) == 128 + 2  # int8 keys + one fp16 scale (index_head_dim 128)
    assert "op quant_lightning_indexer: using reference implementation" in text
    assert "sparse decode engine indexer: quant_lightning_indexer" in text  # the engine's operator plan

    long_prompt = prompt(3 * INDEX_TOPK, seed=1)  # longer than top-k: the indexer really selects
    first = server.generate(long_prompt, max_new_tokens=12)["output_ids"]
    assert len(first) == 12 and all(0 <= t < VOCAB for t in first)
    assert server.generate(long_prompt, max_new_tokens=12)["output_ids"] == first

    batch = [prompt(n, seed=s) for s, n in ((2, 5), (3, 40), (4, 70))]
    together = [o["output_ids"] for o in server.generate(batch, max_new_tokens=8)]
    assert [len(t) for t in together] == [8, 8, 8]
    assert [server.generate(p, max_new_tokens=8)["output_ids"] for p in batch] == together

    shared = prompt(150, seed=5)  # > 2 pages of 64: the radix cache matches it
    cold = server.generate(shared, max_new_tokens=8)
    warm = server.generate(shared, max_new_tokens=8)
    assert warm["meta_info"]["cached_tokens"] >= 128
    assert warm["output_ids"] == cold["output_ids"]
