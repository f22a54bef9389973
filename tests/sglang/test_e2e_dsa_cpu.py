"""End to end on CPU: SGLang serves the tiny random-weight DeepSeek-V3.2-style model
through the plugin (``ascend_offload`` backend, reference ops), flags in ``--help``,
an invalid configuration stops startup with every reason listed.

One server for the module (each launch costs ~20-60 s on 2 cores).
"""

from __future__ import annotations

import pytest

from conftest import ServerProcess, run_launcher

pytestmark = pytest.mark.slow

INDEX_TOPK = 16  # tests/fixtures/tiny_dsa/config.json
VOCAB = 1024


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dsa_server") / "server.log"
    srv = ServerProcess(log_path=log).start()
    yield srv
    srv.stop()


def test_greedy_generate_long_prompt_batch_and_prefix_hit(server):
    long_prompt = prompt(3 * INDEX_TOPK, seed=1)  # the indexer really selects
    first = server.generate(long_prompt, max_new_tokens=8)
    assert len(first["output_ids"]) == 8
    assert all(0 <= t < VOCAB for t in first["output_ids"])
    assert server.generate(long_prompt, max_new_tokens=8)["output_ids"] == first["output_ids"]

    batch = [prompt(n, seed=s) for s, n in ((2, 5), (3, 20), (4, 33))]
    outs = server.generate(batch, max_new_tokens=6)
    assert [len(o["output_ids"]) for o in outs] == [6, 6, 6]

    shared = prompt(150, seed=5)  # > 2 pages of 64: the radix cache can match it
    cold = server.generate(shared, max_new_tokens=8)
    warm = server.generate(shared, max_new_tokens=8)
    assert warm["meta_info"]["cached_tokens"] >= 128
    assert warm["output_ids"] == cold["output_ids"]


def test_model_info_reports_the_tiny_model(server):
    assert "tiny_dsa" in server.get("/model_info")


def test_launch_server_help_lists_the_flags():
    out = run_launcher(["--help"], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--enable-sparse-decode-offload", "--sparse-decode-offload-config",
                 "--enable-layerwise-prefill-offload", "--layerwise-prefill-offload-config"):
        assert flag in out.stdout
    assert "ascend_offload" in out.stdout  # attention backend choice


def test_invalid_config_stops_startup_listing_every_reason():
    out = run_launcher([
        "--kv-cache-dtype", "fp8_e4m3",
        "--enable-sparse-decode-offload",
        "--sparse-decode-offload-config", '{"hot_tokens": 8, "ops": "fused"}',
        "--layerwise-prefill-offload-config", "{}",
    ])
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "invalid sglang-ascend-offload configuration" in text
    for rule in ("flags.config_without_enable", "sparse_decode.hot_tokens_topk",
                 "sparse_decode.hot_tokens_page", "sparse_decode.main_kv_dtype", "sparse_decode.fused_device"):
        assert f"[{rule}]" in text, rule
    assert "KV Cache is allocated" not in text  # stopped before any memory was allocated
