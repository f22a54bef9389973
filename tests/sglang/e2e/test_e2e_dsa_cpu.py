"""End to end on CPU: SGLang serves the trained tiny DeepSeek-V3.2-style checkpoint
(``tests/fixtures/tiny_dsa_trained``: real weights, so a misplaced KV row moves the
argmax; held-out source as prompts) through the plugin (``ascend_offload`` backend,
reference ops) with sparse decode offload off and on; greedy outputs are token-identical; the served top-k trace
replays verified; flags in ``--help``; an invalid configuration stops startup with
every reason listed.

Two servers for the module (each launch costs ~20-60 s on 2 cores), started together.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import IDLE_SLEEP, REPO, ServerProcess, run_launcher, server_env

from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

pytestmark = pytest.mark.slow

INDEX_TOPK = 64  # tests/fixtures/tiny_dsa_trained/config.json
VOCAB = 4096
HOT_TOKENS = 128  # 2 x top-k, a multiple of the page size SGLang forces for DSA off NPU (64)
TRACE_STEPS = 16
# The P/D tests' settings (at most 4 requests, prefill chunks of 128 tokens), so the
# offload-off server is their colocated reference too.
COMMON = pd_servers.COMMON + IDLE_SLEEP
BASE = trained_args(TINY_DSA_TRAINED)


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


def synthetic(n: int, seed: int) -> list:
    """``n`` token ids (any length: the held-out windows are 1,024 tokens)."""
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


# The offload-off server is test_score_policy_serving.py's and test_pd_e2e_cpu.py's
# reference too (same arguments): launched once per session, its cache flushed before each
# module uses it (docs/testing.md).
SHARED_SERVERS = ("trained_reference",)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, shared_servers):
    """(offload off, offload on) servers; the offload one records a trace and exports metrics."""
    root = tmp_path_factory.mktemp("dsa_servers")
    offload_cfg = {
        "hot_tokens": HOT_TOKENS,
        "record_trace": str(root / "served.npz"),
        "record_trace_max_steps": TRACE_STEPS,
    }
    dense = shared_servers.get("trained_reference", COMMON, base_args=BASE)
    offload = ServerProcess(
        COMMON
        + [
            "--enable-metrics",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps(offload_cfg),
        ],
        log_path=root / "offload.log",
        base_args=BASE,
    )
    offload.trace_file = root / "served.npz"
    try:
        shared_servers.start_all(dense, offload)
        print(
            f"\nstartup: dense {dense.startup_s:.1f} s, offload {offload.startup_s:.1f} s (concurrent; dense "
            "may have been started by an earlier module)"
        )
        yield dense, offload
    finally:
        shared_servers.stop_all(request.module.__name__, dense, offload)


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def test_test_servers_start_their_children_from_a_forkserver(servers):
    """The test session's servers (tests/conftest.py) take the harness's ``forkserver`` seam:
    the children are SGLang's own, titled as SGLang titles them (the module's other tests show
    that they serve through the plugin, which each child loaded itself)."""
    for server in servers:
        assert server.child_start_method() == "forkserver"
        titles = server.process_titles()
        assert "sglang::scheduler" in titles and "sglang::detokenizer" in titles, titles


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


def test_a_request_larger_than_the_pools_is_refused_at_once_and_serving_goes_on(servers):
    """Admission by capacity with sparse decode offload. The host pool holds at least
    SGLang's slot space (``max_total_num_tokens``; the pool refuses to be built smaller),
    and SGLang admits no request longer than ``max_req_input_len``, which is below both
    that slot space and the context length. So a request that could not fit is refused
    before it runs, with the reason, while a request in flight and the next one are
    served."""
    import urllib.error

    _, offload = servers
    info = json.loads(offload.get("/server_info"))
    limit = int(info["max_req_input_len"])
    assert limit < int(info["max_total_num_tokens"])  # nothing longer than the host pool's slots gets in
    results: list = []
    running = threading.Thread(target=lambda: results.append(offload.generate(prompt(200, seed=9), max_new_tokens=8)))
    running.start()
    with pytest.raises(urllib.error.HTTPError) as refused:
        offload.generate(synthetic(limit + 1, seed=8), max_new_tokens=4)
    reason = json.loads(refused.value.read().decode())["error"]["message"]
    assert (
        refused.value.code == 400
        and f"({limit + 1} tokens) exceeds the maximum allowed length ({limit} tokens)" in reason
    ), reason
    running.join(timeout=120)
    assert not running.is_alive() and len(results[0]["output_ids"]) == 8
    assert len(offload.generate(prompt(40, seed=10), max_new_tokens=4)["output_ids"]) == 4


def test_offload_on_and_off_are_token_identical(servers):
    """Concurrent requests sharing a cached prefix, prompts longer than hot_tokens."""
    dense, offload = servers
    prefix = prompt(200, seed=11)
    prompts = [prefix + prompt(20 + i, seed=20 + i) for i in range(4)]
    assert min(len(p) for p in prompts) > HOT_TOKENS
    outputs = {}
    for name, srv in (("dense", dense), ("offload", offload)):
        srv.generate(prefix, max_new_tokens=1)  # the shared prefix is now in the radix cache
        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda p: srv.generate(p, max_new_tokens=24, return_logprob=True), prompts))
        assert all(o["meta_info"]["cached_tokens"] >= 64 for o in outs), name
        outputs[name] = outs
    for d, o in zip(outputs["dense"], outputs["offload"]):
        assert o["output_ids"] == d["output_ids"]
        assert o["meta_info"]["output_token_logprobs"] == d["meta_info"]["output_token_logprobs"]


def test_served_trace_replays_verified(servers):
    _, offload = servers
    for i in range(3):  # enough decode steps for the bounded recording to finish
        offload.generate(prompt(70, seed=40 + i), max_new_tokens=TRACE_STEPS + 2)
    assert offload.trace_file.exists()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_ascend_offload",
            "bench",
            "decode",
            "--trace",
            str(offload.trace_file),
            "--hot-tokens",
            str(HOT_TOKENS),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=server_env(),
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["verified"] is True, report["failures"]
    assert report["steps"] == TRACE_STEPS and report["top_k"] == INDEX_TOPK and report["checks"] > 0


def test_offload_metrics_in_sglang_prometheus_endpoint(servers):
    _, offload = servers
    offload.generate(prompt(90, seed=60), max_new_tokens=8)
    text = offload.get("/metrics")
    for name in ("hits_total", "misses_total", "h2d_bytes_total", "d2h_bytes_total", "copy_seconds_total"):
        assert f"sglang:ascend_offload_{name}" in text, name
    hits = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:ascend_offload_selected_total{")
    ]
    assert sum(hits) > 0


def test_model_info_reports_the_tiny_model(server):
    assert "tiny_dsa_trained" in server.get("/model_info")


def test_launch_server_help_lists_the_flags(plugins_loaded, capsys):
    """What ``python -m sglang.launch_server --help`` prints, in this process: the launcher's
    main is ``load_plugins()`` (fixture ``plugins_loaded``) then ``prepare_server_args(argv)``,
    which prints the help and exits 0. That the real launcher loads the plugin before it
    parses is what every served test here relies on (argparse refuses unknown flags: the
    offload server above passes ``--enable-sparse-decode-offload``); a subprocess for
    ``--help`` alone cost one more SGLang import (19-48 s on 2 cores)."""
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(SystemExit) as done:
        prepare_server_args(["--help"])
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in (
        "--enable-sparse-decode-offload",
        "--sparse-decode-offload-config",
        "--enable-layerwise-prefill-offload",
        "--layerwise-prefill-offload-config",
    ):
        assert flag in out
    assert "ascend_offload" in out  # attention backend choice


def test_invalid_config_stops_startup_listing_every_reason():
    out = run_launcher(
        [
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            '{"hot_tokens": 8, "ops": "npu"}',
            "--layerwise-prefill-offload-config",
            "{}",
        ]
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "invalid sglang-ascend-offload configuration" in text
    for rule in (
        "flags.config_without_enable",
        "sparse_decode.hot_tokens_topk",
        "sparse_decode.hot_tokens_page",
        "sparse_decode.main_kv_dtype",
        "sparse_decode.fused_device",
    ):
        assert f"[{rule}]" in text, rule
    assert "KV Cache is allocated" not in text  # stopped before any memory was allocated
