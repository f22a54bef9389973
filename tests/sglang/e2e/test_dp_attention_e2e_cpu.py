"""End to end on CPU: sparse decode offload under DP attention (``--tp 2 --dp 2
--enable-dp-attention``, attention TP 1 per DP rank: each rank owns its host pool).

Two servers of the trained checkpoint ``tests/fixtures/tiny_dsa_trained`` (real weights:
a misread row moves the argmax; held-out source as prompts) started together, offload
off and on. Five concurrent requests split 3 / 2
over the DP ranks, so SGLang pads the smaller rank's decode batches to the larger one
(``MAX_LEN``: padding entries alias ``req_to_token`` row 0); greedy tokens and logprobs
must be identical with offload on, and the offload server must have seen the padding
(its log says so) without letting it reach the engine. Each DP rank owns an engine
and records its own trace (``served.dp0.npz``, ``served.dp1.npz``).

SGLang's CPU engine binds one core per rank (``SGLANG_CPU_OMP_THREADS_BIND``), which
it requires when there are more ranks than NUMA nodes.
"""

from __future__ import annotations

import json

import pytest
from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all

from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

pytestmark = pytest.mark.slow

BASE = trained_args(TINY_DSA_TRAINED)
DP_ARGS = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--max-running-requests", "8"] + IDLE_SLEEP
BIND = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_servers")
    off = ServerProcess(DP_ARGS, log_path=root / "off.log", env=BIND, base_args=BASE)
    offload = {"hot_tokens": 64, "record_trace": str(root / "served.npz"), "record_trace_max_steps": 12}
    on = ServerProcess(
        DP_ARGS + ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", json.dumps(offload)],
        log_path=root / "on.log",
        env=BIND,
        base_args=BASE,
    )
    start_all(off, on)
    try:
        yield off, on, root
    finally:
        stop_all(off, on)


def test_dp_attention_offload_matches_device_pool_with_padded_decode_batches(pair):
    off, on, root = pair
    prompts = [prompt(n, seed) for seed, n in ((1, 5), (2, 150), (3, 201), (4, 90), (5, 40))]
    answers = {}
    for name, srv in (("off", off), ("on", on)):
        # one batched request: the scheduler receives the five together, so both servers split
        # them over the DP ranks alike (five client threads arrive in any order, and on real
        # weights another split rounds differently)
        answers[name] = srv.generate(prompts, max_new_tokens=24, return_logprob=True)
    for i, (a, b) in enumerate(zip(answers["off"], answers["on"])):
        assert a["output_ids"] == b["output_ids"], f"prompt {i}"
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"], f"prompt {i}"
    log = (root / "on.log").read_text(errors="replace")
    assert "DP-attention padding seen" in log  # the case under test really happened
    assert "Traceback" not in log


def test_each_dp_rank_records_its_own_trace(pair):
    from sglang_ascend_offload.sparse_decode.trace import load_trace

    _, on, root = pair
    on.generate([prompt(30, seed=9), prompt(70, seed=10)], max_new_tokens=16)  # both ranks decode
    for rank in (0, 1):
        trace = load_trace(root / f"served.dp{rank}.npz")
        assert trace.topk.shape[0] == 12  # the bound was reached and written
        assert (trace.req_ids >= 0).any()
    assert not (root / "served.npz").exists()
