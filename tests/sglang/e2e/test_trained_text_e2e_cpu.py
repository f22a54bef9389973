"""The trained tiny checkpoint served with text on CPU, sparse decode offload on and off.

``tests/fixtures/tiny_dsa_trained`` (``scripts/train_tiny_dsa.py``) has real weights and a
BPE tokenizer, so these checks run through SGLang's OpenAI API with the ``openai``
client, on a prompt long enough (> 1,500 tokens) that the 64-entry top-k and the
128-slot hot buffer really select, evict and copy:

* offload on == off for ``/v1/completions`` (plain and streamed) and
  ``/v1/chat/completions`` (the tokenizer's chat template), greedy;
* the held-out NLL through the offload server's prompt logprobs matches the training
  script's own evaluation of the exported weights (``heldout_eval.json``) within
  0.05 nats/token: the server computes in bf16, the script in fp32 on the same bf16
  weights (measured difference 0.005-0.03).

The same module runs the README's command (1), ``python -m sglang_ascend_offload demo``,
on these servers (they are the demo's own, built by :func:`demo.build_servers`): its
answer equals the reference server's and its offload counters add up.

Two servers for the module, started together. Unlike the other test servers they start
their children with SGLang's own spawn, as a user's server does (no ``forkserver`` seam:
``sglang_ascend_offload/testing/harness.py``).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import REPO, start_all, stop_all

from sglang_ascend_offload import demo
from sglang_ascend_offload.testing import harness
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED

pytestmark = pytest.mark.slow

HOT_TOKENS = demo.DEFAULT_HOT_TOKENS  # 2 x the checkpoint's top-k (64)
TOP_K = 64
NLL_TOLERANCE = 0.05
MIN_PROMPT_TOKENS = 1500


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(offload off, offload on) servers of the trained checkpoint; the offload one exports metrics."""
    dense, offload = demo.build_servers(tmp_path_factory.mktemp("trained_servers"), HOT_TOKENS)
    for server in (dense, offload):
        server.extra_env.update(harness.environment({"forkserver": False}))
    start_all(dense, offload)
    yield dense, offload
    stop_all(dense, offload)


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300)


def test_the_demo_servers_spawn_their_children_as_users_run_them(servers):
    for server in servers:
        assert server.child_start_method() == "spawn"
        titles = server.process_titles()
        assert "sglang::scheduler" in titles and "sglang::detokenizer" in titles, titles


def test_text_completions_offload_on_equals_off(servers):
    dense, offload = servers
    prompt = demo.held_out_source()
    args = dict(model="tiny", prompt=prompt, max_tokens=48, temperature=0)
    ref = client(dense).completions.create(**args)
    got = client(offload).completions.create(**args)
    assert ref.usage.prompt_tokens >= MIN_PROMPT_TOKENS
    assert got.choices[0].text == ref.choices[0].text
    assert got.usage.completion_tokens == ref.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].text for c in client(offload).completions.create(stream=True, **args) if c.choices)
    assert streamed == ref.choices[0].text
    # The prompt is 12x the hot buffer: decode had to copy misses from the host pool.
    counters = demo.read_counters(offload)
    assert counters.misses > 0 and counters.hits > 0


def test_chat_completions_offload_on_equals_off(servers):
    dense, offload = servers
    messages = [{"role": "user", "content": demo.held_out_source() + "\n\nWhat does this module do?"}]
    args = dict(model="tiny", messages=messages, max_tokens=32, temperature=0)
    ref = client(dense).chat.completions.create(**args)
    got = client(offload).chat.completions.create(**args)
    assert ref.usage.prompt_tokens >= MIN_PROMPT_TOKENS
    assert ref.choices[0].message.content
    assert got.choices[0].message.content == ref.choices[0].message.content


def test_heldout_nll_through_the_server_matches_training_eval(servers):
    _, offload = servers
    held = json.loads((TINY_DSA_TRAINED / "heldout_eval.json").read_text())
    served = []
    for window in held["windows"]:
        body = {
            "input_ids": window,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        req = urllib.request.Request(
            offload.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        out = json.load(urllib.request.urlopen(req, timeout=300))
        logprobs = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None]
        assert len(logprobs) == len(window) - 1
        served.append(-sum(logprobs) / len(logprobs))
    expected = sum(held["nll"]) / len(held["nll"])
    got = sum(served) / len(served)
    assert abs(got - expected) <= NLL_TOLERANCE, (served, held["nll"])
    # And the checkpoint learned something: far below the unigram baseline.
    unigram = json.loads((TINY_DSA_TRAINED / "training.json").read_text())["heldout"]["unigram_nll"]
    assert got < unigram - 1.0


def test_demo_answers_like_the_reference_and_reports_what_offload_moved(servers):
    """README command (1)'s request and report, on the demo's own two servers."""
    dense, offload = servers
    r = demo.ask(dense, offload)
    assert r.identical and r.answer == r.reference_answer and r.completion_tokens == demo.DEFAULT_MAX_TOKENS
    assert r.prompt_tokens >= MIN_PROMPT_TOKENS
    layers = json.loads((TINY_DSA_TRAINED / "config.json").read_text())["num_hidden_layers"]
    # Every decode step after the first token selects the whole top-k in every layer (the
    # context is far longer than top-k); the prefill's first token selects in prefill.
    assert r.selected == (r.completion_tokens - 1) * layers * TOP_K
    assert r.hits + r.misses == r.selected and 0 < r.misses < r.selected
    # Each miss copies one latent + rope row: the byte counter agrees with the model's row size.
    assert r.row_bytes == 2 * (512 + 64) and r.h2d_bytes == r.misses * r.row_bytes
    assert r.topk_reload_h2d_bytes == r.selected * r.row_bytes and r.h2d_vs_topk_reload < 1.0
    text = demo.format_result(r)
    assert "same answer as the server without offload: yes" in text and f"hit rate {r.hit_rate:.3f}" in text


def test_readme_command_one_is_the_demo_and_ci_runs_command_two():
    readme = (REPO / "README.md").read_text().splitlines()
    assert readme[0] == "```bash"
    assert readme[1] == "bash scripts/setup_cpu_env.sh && .venv/bin/python -m sglang_ascend_offload demo"
    assert readme[2] in (REPO / ".ci" / "run").read_text().splitlines()


def test_demo_lists_every_bad_argument(capsys, tmp_path):
    from sglang_ascend_offload.cli import main

    rc = main(
        [
            "demo",
            "--max-tokens",
            "0",
            "--hot-tokens",
            "8",
            "--frequency-penalty",
            "3",
            "--context-file",
            str(tmp_path / "missing.txt"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    for flag in ("--max-tokens", "--hot-tokens", "--frequency-penalty", "--context-file"):
        assert flag in err, err
