"""Serving a score-aware residency policy: the serving rank depth.

Config: ``policy`` ``score_rank*`` needs ``rank_depth`` (every problem listed at
once); ``rank_depth`` must be >= top-k, is refused with speculative decoding and with
decode graphs. Served (slow, two servers of the trained checkpoint
``tests/fixtures/tiny_dsa_trained``, held-out source as prompts): offload off and
offload with ``score_rank_guarded`` + ``rank_depth``; the greedy tokens are identical
(residency never changes outputs) and the policy was fed each step's ranking: the
served miss counter equals an offline replay of the same policy over the trace the
server recorded (with its ``ranked`` array) at the same step, which differs from the
same replay under LRU.
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest
from conftest import IDLE_SLEEP, ServerProcess

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.sparse_decode.replay import simulate_policy
from sglang_ascend_offload.sparse_decode.trace import Trace, load_trace
from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

POLICY = "score_rank_guarded"
HOT = 128  # 2 pages of 64 (hot_tokens must be a multiple of the page size); 2 x top-k
DEPTH = 256  # 2 x hot; the checkpoint's top-k is 64


# ------------------------------------------------------------------ config
def test_score_policy_needs_rank_depth_and_lists_every_problem():
    with pytest.raises(cfg.ConfigError) as err:
        cfg.parse_section(cfg.SparseDecodeOffloadConfig, json.dumps({"policy": POLICY, "metrics_log_interval_s": -1}))
    text = str(err.value)
    assert "rank_depth" in text and "metrics_log_interval_s" in text  # both problems at once
    with pytest.raises(cfg.ConfigError, match="does not read the ranking"):
        cfg.parse_section(cfg.SparseDecodeOffloadConfig, json.dumps({"policy": "lru", "rank_depth": 32}))
    with pytest.raises(cfg.ConfigError, match="rank_depth=-1"):
        cfg.parse_section(cfg.SparseDecodeOffloadConfig, json.dumps({"policy": POLICY, "rank_depth": -1}))
    ok = cfg.parse_section(cfg.SparseDecodeOffloadConfig, json.dumps({"policy": POLICY, "rank_depth": DEPTH}))
    assert ok.rank_depth == DEPTH and ok.policy == POLICY


def test_rank_depth_rules_against_the_deployment():
    sd = cfg.SparseDecodeOffloadConfig(policy="score_rank", rank_depth=8)
    rules = [
        v.rule
        for v in cfg.violations(
            cfg.OffloadConfig(sparse_decode=sd), cfg.Deployment(index_topk=16, speculative_method="mtp")
        )
    ]
    assert rules == ["sparse_decode.rank_depth_topk", "sparse_decode.score_speculative"]
    good = cfg.SparseDecodeOffloadConfig(policy="score_rank", rank_depth=16)
    assert cfg.violations(cfg.OffloadConfig(sparse_decode=good), cfg.Deployment(index_topk=16)) == []


def test_score_policy_with_decode_graphs_is_refused_at_startup():
    """The server's whole startup verdict (a deployment-scope rule: check-config says the same)."""
    from startup_verdict import server_verdict

    graphs = dict(
        attention_backend="ascend_offload",
        disable_cuda_graph=False,
        enable_torch_compile=True,
        page_size=64,
        cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")),
    )
    score = cfg.OffloadConfig(
        sparse_decode=cfg.SparseDecodeOffloadConfig(policy=POLICY, rank_depth=DEPTH, hot_tokens=64)
    )
    found = server_verdict(score, **graphs)
    assert [v.rule for v in found] == ["sglang.sparse_decode_graph"] and "rank_depth" in found[0].problem
    assert server_verdict(score, **dict(graphs, disable_cuda_graph=True)) == []


# ------------------------------------------------------------------ served
SUMMARY = re.compile(r"sparse-decode-offload: steps=(\d+) .* misses=(\d+) ")


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


# Both servers run the P/D tests' settings: at most 4 requests at once (the served test
# sends one batch of 3, so its decode batches are those of SGLang's default, 2048) and
# prefill chunks of 128 tokens (its three prompts are prefilled in 128-token chunks before
# the first decode step). The offload-off one is then test_e2e_dsa_cpu.py's and
# test_pd_e2e_cpu.py's reference server, launched once per session, its cache flushed
# before each module uses it (docs/testing.md).
SHARED_SERVERS = ("trained_reference",)
SETTINGS = pd_servers.COMMON
BASE = trained_args(TINY_DSA_TRAINED)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, shared_servers):
    root = tmp_path_factory.mktemp("score_serving")
    trace = root / "trace.npz"
    score_cfg = json.dumps(
        {
            "hot_tokens": HOT,
            "policy": POLICY,
            "rank_depth": DEPTH,
            "metrics_log_interval_s": 0.2,
            "record_trace": str(trace),
            "record_trace_rank_depth": DEPTH,
        }
    )
    off = shared_servers.get("trained_reference", SETTINGS + IDLE_SLEEP, base_args=BASE)
    score = ServerProcess(
        SETTINGS + ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", score_cfg] + IDLE_SLEEP,
        log_path=root / "score.log",
        base_args=BASE,
    )
    try:
        shared_servers.start_all(off, score)
        yield off, score, trace
    finally:
        shared_servers.stop_all(request.module.__name__, off, score)


def _prefix(trace: Trace, steps: int) -> Trace:
    return Trace(
        topk=trace.topk[:steps],
        seq_lens=trace.seq_lens[:steps],
        req_ids=trace.req_ids[:steps],
        meta=trace.meta,
        ranked=trace.ranked[:steps],
    )


@pytest.mark.slow
def test_served_score_policy_same_tokens_and_the_replayed_misses(servers):
    off, score, trace_path = servers
    batch = [prompt(200 + 80 * s, seed=s) for s in range(3)]
    outs = {}
    for name, server in (("off", off), ("score", score)):
        outs[name] = [o["output_ids"] for o in server.generate(batch, max_new_tokens=72, timeout=300)]
    assert outs["score"] == outs["off"], "a residency policy changed the greedy tokens"

    log = score.log_path.read_text(errors="replace")
    assert f"policy {POLICY} reads the indexer's top-{DEPTH} ranking (rank_depth {DEPTH}" in log
    end = time.monotonic() + 10
    while not trace_path.exists() and time.monotonic() < end:
        time.sleep(0.3)
    trace = load_trace(trace_path)
    assert trace.ranked is not None and trace.ranked.shape[-1] == DEPTH
    summaries = [(int(s), int(m)) for s, m in SUMMARY.findall(score.log_path.read_text(errors="replace"))]
    usable = [(s, m) for s, m in summaries if 0 < s <= trace.steps and m > 0]
    assert usable, f"no summary line within the {trace.steps} recorded steps: {summaries}"
    steps, served = usable[-1]
    prefix = _prefix(trace, steps)
    replayed = simulate_policy(prefix, POLICY, HOT).misses
    lru = simulate_policy(prefix, "lru", HOT, manage_impl="auto").misses
    print(f"\n{steps} decode steps: served {POLICY} misses {served}, replayed {replayed}, LRU replay {lru}")
    assert served == replayed  # the manager was fed each step's ranking (same decisions as offline)
    assert replayed != lru, "LRU makes the same decisions on this load: it cannot show the policy at work"
