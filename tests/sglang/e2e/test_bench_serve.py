"""``bench serve``: the comparison logic on made-up outputs (fast), and one short served
run pair end to end (no offload vs offload at ``--max-running-requests 2048``): one
JSON document on stdout with the issue's keys, every request completed, greedy
outputs identical, the offload engine stepping only the live rows."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, server_env

from sglang_ascend_offload.bench import serve, served_startup
from sglang_ascend_offload.bench.served_load import StreamedOutput, percentile

# the offload pool's startup line: the hot-buffer plan's rows and the requests they serve
HOT_LINE = re.compile(r"hot buffers and residency tables [0-9.]+ MiB \((\d+) hot rows \((\d+) requests? ")
RUN_KEYS = {
    "name",
    "offload",
    "graph",
    "speculative",
    "requests",
    "completed",
    "output_tokens_per_s",
    "ttft_ms_p50",
    "itl_ms_p50",
    "itl_ms_p99",
    "accept_length",
    "token_agreement",
}


def _result(spec, **kw):
    return serve.RunResult(
        spec.name, spec.offload, spec.graph, spec.speculative, spec.max_running_requests, requests=2, **kw
    )


def test_run_names_parse_and_reject():
    specs = serve.parse_runs("no_offload_eager,offload_graph_spec,offload_mrr2048", 4)
    assert [(s.offload, s.graph, s.speculative, s.max_running_requests) for s in specs] == [
        (False, False, False, 4),
        (True, True, True, 4),
        (True, False, False, 2048),
    ]
    with pytest.raises(ValueError, match="unknown runs"):
        serve.parse_runs("offload,offload_fast", 4)
    with pytest.raises(ValueError, match="more than once"):
        serve.parse_runs("offload,offload", 4)


def test_compare_pairs_offload_runs_with_their_no_offload_counterpart():
    specs = serve.parse_runs("no_offload_eager,offload_eager,no_offload_graph,offload_graph,offload_mrr2048", 4)
    ref = [[5, 6, 7, 8], [9, 10, 11, 12]]
    outputs = {
        "no_offload_eager": ref,
        "offload_eager": [list(r) for r in ref],
        "no_offload_graph": [[5, 6, 7, 9], [9, 10, 11, 12]],  # compiled arithmetic: one token differs
        "offload_graph": [[5, 6, 7, 9], [9, 10, 11, 12]],
        "offload_mrr2048": [list(r) for r in ref],
    }
    results = {s.name: _result(s) for s in specs}
    identical, problems = serve.compare(specs, results, outputs)
    assert identical, problems
    assert results["offload_graph"].reference == "no_offload_graph"
    assert results["offload_mrr2048"].reference == "no_offload_eager"
    assert results["no_offload_graph"].token_agreement == pytest.approx(7 / 8)
    assert results["offload_eager"].token_agreement == 1.0

    # negative controls: one differing token, a failed reference, a missing counterpart
    outputs["offload_graph"] = [[5, 6, 7, 8], [9, 10, 11, 12]]
    identical, problems = serve.compare(specs, {s.name: _result(s) for s in specs}, outputs)
    assert not identical and any("offload_graph: greedy outputs differ" in p for p in problems)
    outputs["offload_graph"] = outputs["no_offload_graph"]
    results = {s.name: _result(s) for s in specs}
    results["no_offload_graph"].error = "RuntimeError: server exited with 1"
    outputs_failed = dict(outputs, no_offload_graph=None)
    identical, problems = serve.compare(specs, results, outputs_failed)
    assert not identical and any("cannot compare with no_offload_graph" in p for p in problems)
    only = serve.parse_runs("no_offload_eager,offload_graph", 4)
    identical, problems = serve.compare(only, {s.name: _result(s) for s in only}, outputs)
    assert not identical and any("no no-offload run with graph=True" in p for p in problems)


def test_mrr_ratio_is_small_over_large():
    specs = serve.parse_runs("offload_mrr4,offload_mrr2048,no_offload_eager", 4)
    results = {s.name: _result(s) for s in specs}
    results["offload_mrr4"].decode_tokens_per_s, results["offload_mrr2048"].decode_tokens_per_s = 120.0, 100.0
    results["offload_mrr4"].output_tokens_per_s, results["offload_mrr2048"].output_tokens_per_s = 90.0, 60.0
    outs = {"offload_mrr4": [[1, 2]], "offload_mrr2048": [[1, 2]], "no_offload_eager": [[1, 2]]}
    (ratio,) = serve.mrr_ratios(specs, results, outs)
    assert ratio["runs"] == ["offload_mrr4", "offload_mrr2048"]
    assert ratio["decode_tokens_per_s_ratio"] == pytest.approx(1.2)
    assert ratio["output_tokens_per_s_ratio"] == pytest.approx(1.5)
    assert ratio["identical_tokens"]


def test_inter_token_latency_splits_multi_token_chunks():
    out = StreamedOutput(0.1, [1, 2, 3, 4], [0.1, 0.2, 0.5, 0.5], 0.5)  # last chunk carried 2 tokens
    assert out.inter_token_s() == pytest.approx([0.1, 0.15, 0.15])
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 50) is None


def test_startup_error_keeps_the_problem_lines(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        'INFO loading\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "    raise ConfigError(problems)\n"
        "sglang_ascend_offload.config.ConfigError: invalid configuration (1 problem(s)):\n"
        "  1. [rule.name] the reason -> the fix\n"
    )
    msg = served_startup.startup_error(RuntimeError("server exited with 1"), log)
    assert "server exited with 1" in msg and "ConfigError: invalid configuration" in msg
    assert "[rule.name] the reason -> the fix" in msg and "raise ConfigError" not in msg


def test_cpu_server_args_per_run():
    ns = argparse.Namespace(
        model_path=None,
        spec_model_path=None,
        graph_args=None,
        clients=4,
        spec_env=None,
        offload_config='{"hot_tokens": 64}',
        spec_args=serve.DEFAULT_SPEC_ARGS,
        server_arg=[],
    )
    (spec,) = serve.parse_runs("offload_graph_spec_mrr2048", 4)
    base, extra, cpu = serve.server_args(spec, ns)
    assert cpu and base[base.index("--model-path") + 1].endswith("tiny_dsa_mtp")
    assert extra[:2] == ["--max-running-requests", "2048"]
    for flag in ("--enable-torch-compile", "--enable-sparse-decode-offload", "--speculative-algorithm"):
        assert flag in extra
    assert extra[extra.index("--cuda-graph-bs-decode") + 1 :][:3] == ["1", "2", "4"]
    assert "--disable-cuda-graph" not in base  # the CPU graph runner must not be switched off
    assert serve.spec_env(ns)["SGLANG_SIMULATE_ACC_LEN"] == "2"
    (eager,) = serve.parse_runs("offload_eager", 4)
    assert "--speculative-algorithm" not in serve.server_args(eager, ns)[1]
    ns.spec_env = "none"
    assert serve.spec_env(ns) == {}


def test_trained_server_args_prompts_and_real_acceptance():
    ns = argparse.Namespace(
        model_path=None,
        spec_model_path=None,
        graph_args=None,
        clients=2,
        spec_env=None,
        offload_config=None,
        spec_args=serve.DEFAULT_SPEC_ARGS,
        server_arg=[],
        trained=True,
    )
    (spec,) = serve.parse_runs("offload_spec", 4)
    base, extra, cpu = serve.server_args(spec, ns)
    assert cpu and base[base.index("--model-path") + 1].endswith("tiny_dsa_trained")
    assert "--load-format" not in base and "--skip-tokenizer-init" not in base  # real weights, real tokenizer
    # the resolved default hot buffer (no hot_tokens), and no acceptance simulation
    assert extra[extra.index("--sparse-decode-offload-config") + 1] == serve.TRAINED_OFFLOAD_CONFIG
    assert serve.spec_env(ns) == {}
    prompts = serve.heldout_prompts(3, 100, seed=0)
    held = json.loads((REPO / "tests/fixtures/tiny_dsa_trained/heldout_eval.json").read_text())["windows"]
    text = [t for w in held for t in w]
    assert [len(p) for p in prompts] == [100] * 3 and len({tuple(p) for p in prompts}) == 3
    for p in prompts:  # each a contiguous window of the held-out text
        assert any(text[i : i + 100] == p for i in range(len(text) - 99))
    assert serve.heldout_prompts(3, 100, seed=0) == prompts


def test_trained_rejects_every_conflict(capsys):
    from sglang_ascend_offload.cli import main

    rc = main(
        [
            "bench",
            "serve",
            "--trained",
            "--model-path",
            "/x",
            "--spec-model-path",
            "/y",
            "--input-len",
            "2040",
            "--output-len",
            "32",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    for part in ("drop --model-path", "drop --spec-model-path", "context of 2048 tokens"):
        assert part in err, err


@pytest.mark.slow
def test_bench_serve_trained_speculative_pair_measures_real_acceptance(tmp_path):
    """The trained checkpoint's own NextN layer drafts (no simulation): two servers
    (~1-2 min here), offload on and off, the same tokens, an accept length above 1."""
    cmd = [
        sys.executable,
        "-m",
        "sglang_ascend_offload",
        "bench",
        "serve",
        "--trained",
        "--runs",
        "no_offload_spec,offload_spec",
        "--clients",
        "2",
        "--requests",
        "2",
        "--input-len",
        "512",
        "--output-len",
        "24",
        "--log-dir",
        str(tmp_path),
        "--json",
    ]
    result = subprocess.run(cmd, cwd=REPO, env=server_env(cpu=False), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads(result.stdout)
    assert doc["identical_tokens"], doc["identical_tokens_problems"]
    assert doc["model"].startswith("tests/fixtures/tiny_dsa_trained")
    runs = {r["name"]: r for r in doc["runs"]}
    for r in runs.values():
        assert r["error"] is None and r["completed"] == r["requests"] == 2
        assert r["server_env"] == {}  # SGLANG_SIMULATE_ACC_LEN is not set: acceptance is the model's
        assert r["accept_length"] > 1.0
    assert runs["offload_spec"]["identical_to_reference"] and runs["offload_spec"]["reference"] == "no_offload_spec"
    assert runs["offload_spec"]["accept_length"] == runs["no_offload_spec"]["accept_length"]


@pytest.mark.slow
def test_bench_serve_short_run_pair(tmp_path):
    """Three servers, one after the other (~2 min here): no offload, and offload at
    --max-running-requests 4 and 2048 with shadow verification on every layer step (its
    checks and their cost reported). The offload engine's per-step work follows the live
    batch, not the request slots: both offload servers size their hot buffers for their
    slots (5 and 2,049 rows) and step at most the 2 live rows per step."""
    offload_config = json.dumps({"hot_tokens": 64, "metrics_log_interval_s": 1.0, "verify_sample_rate": 1.0})
    cmd = [
        sys.executable,
        "-m",
        "sglang_ascend_offload",
        "bench",
        "serve",
        "--runs",
        "no_offload_eager,offload_eager,offload_eager_mrr2048",
        "--clients",
        "2",
        "--requests",
        "2",
        "--input-len",
        "40",
        "--output-len",
        "12",
        "--offload-config",
        offload_config,
        "--log-dir",
        str(tmp_path),
        "--json",
    ]
    result = subprocess.run(cmd, cwd=REPO, env=server_env(cpu=False), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads(result.stdout)  # exactly one JSON document: progress went to stderr
    assert isinstance(doc["identical_tokens"], bool) and doc["identical_tokens"], doc["identical_tokens_problems"]
    runs = {r["name"]: r for r in doc["runs"]}
    assert list(runs) == ["no_offload_eager", "offload_eager", "offload_eager_mrr2048"]
    for r in runs.values():
        assert RUN_KEYS <= set(r)
        assert r["error"] is None and r["completed"] == r["requests"] == 2
        assert r["output_tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["itl_ms_p99"] >= r["itl_ms_p50"] > 0
        assert r["accept_length"] is None and r["token_agreement"] == 1.0
        assert r["server_cpu_ms_per_token"] > 0
    for name, slots in (("offload_eager", 4), ("offload_eager_mrr2048", 2048)):
        off = runs[name]
        assert off["offload"] and off["reference"] == "no_offload_eager" and off["identical_to_reference"]
        assert off["server_args"][:2] == ["--max-running-requests", str(slots)]
        hot = HOT_LINE.search(Path(off["log"]).read_text(errors="replace"))
        assert hot is not None, "no hot-buffer plan line in the server log"
        # sized for the request slots: one hot row per request + the padding slot + the sink row
        assert (int(hot.group(1)), int(hot.group(2))) == (slots + 2, slots)
        # the engine stepped the live rows only, not the rows its hot buffers hold
        assert 0 < float(off["offload_summary"]["rows/step"]) <= 2, off["offload_summary"]
        assert off["shadow_checks"] > 0 and off["shadow_mismatches"] == 0
        assert 0 < off["shadow_share_of_server_cpu"] < 1
    assert runs["no_offload_eager"]["shadow_checks"] is None


class _FakeStreamingServer:
    """``/generate`` that streams SGLang-shaped chunks: cumulative ``output_ids`` (the
    default) or deltas (``--incremental-streaming-output``), the last chunk carrying two
    tokens, as a speculative step does."""

    def __init__(self, incremental: bool):
        import http.server
        import threading

        from sglang_ascend_offload.testing.ports import reserve_port

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = body["sampling_params"]["max_new_tokens"]
                ids = [body["input_ids"][0] + i for i in range(n)]
                cuts = list(range(1, n - 1)) + [n]  # one token per chunk, then two at once
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                prev = 0
                for cut in cuts:
                    chunk = ids[prev:cut] if outer.incremental else ids[:cut]
                    msg = {"output_ids": chunk, "meta_info": {"completion_tokens": cut, "spec_verify_ct": 3}}
                    self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                    self.wfile.flush()
                    prev = cut
                self.wfile.write(b"data: [DONE]\n\n")

        self.incremental = incremental
        self.port = reserve_port()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        from sglang_ascend_offload.testing.ports import release_ports

        self.httpd.shutdown()
        self.httpd.server_close()
        release_ports([self.port])


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_client_reads_cumulative_and_incremental_chunks(incremental):
    from sglang_ascend_offload.bench import served_load
    from sglang_ascend_offload.bench.transfer_served import ServedLoad
    from sglang_ascend_offload.bench.transfer_served import run_load as transfer_run_load

    srv = _FakeStreamingServer(incremental)
    try:
        out = served_load.stream_generate(srv.url, [100, 5, 6], 6)
        assert out.output_ids == [100, 101, 102, 103, 104, 105]
        assert len(out.token_times_s) == 6 and out.token_times_s[-1] == out.token_times_s[-2]
        assert out.ttft_s is not None and out.ttft_s <= out.token_times_s[1]
        assert len(out.inter_token_s()) == 5 and out.meta_info["spec_verify_ct"] == 3
        res, sent = served_load.run_load(srv.url, [[10] * 4, [20] * 4, [30] * 4], 5, concurrency=2)
        assert [o.output_ids[0] for o in res.outputs] == [10, 20, 30] and len(sent) == 3
        assert len(res.completed(5)) == 3 and res.output_tokens_per_s(5) > 0
        # bench transfer --served summarises the same client's load
        row = transfer_run_load(srv.url, ServedLoad(requests=3, concurrency=2, input_len=4, output_len=5), "fake")
        assert row.completed == 3 and row.ttft_ms_p50 is not None and row.output_tokens_per_s > 0
    finally:
        srv.stop()
