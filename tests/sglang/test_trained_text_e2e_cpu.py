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

Two servers for the module, started together.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, TRAINED_SERVER_ARGS

pytestmark = pytest.mark.slow

HOT_TOKENS = 128  # 2 x the checkpoint's top-k (64)
NLL_TOLERANCE = 0.05
MIN_PROMPT_TOKENS = 1500


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(offload off, offload on) servers of the trained checkpoint; the offload one exports metrics."""
    root = tmp_path_factory.mktemp("trained_servers")
    common = ["--max-running-requests", "2"] + IDLE_SLEEP
    dense = ServerProcess(common, base_args=TRAINED_SERVER_ARGS, log_path=root / "dense.log")
    offload = ServerProcess(common + ["--enable-metrics", "--enable-sparse-decode-offload",
                                      "--sparse-decode-offload-config", json.dumps({"hot_tokens": HOT_TOKENS})],
                            base_args=TRAINED_SERVER_ARGS, log_path=root / "offload.log")
    start_all(dense, offload)
    yield dense, offload
    stop_all(dense, offload)


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300)


def long_prompt() -> str:
    """About 1,600 tokens of held-out standard-library source, as text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_DSA_TRAINED / "tokenizer.json"))
    windows = json.loads((TINY_DSA_TRAINED / "heldout_eval.json").read_text())["windows"]
    return tok.decode(windows[0][1:] + windows[1][:600])


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    return sum(float(v) for v in re.findall(rf"^sglang:ascend_offload_{name}_total{{[^}}]*}} (\S+)$", text, re.M))


def test_text_completions_offload_on_equals_off(servers):
    dense, offload = servers
    prompt = long_prompt()
    args = dict(model="tiny", prompt=prompt, max_tokens=48, temperature=0)
    ref = client(dense).completions.create(**args)
    got = client(offload).completions.create(**args)
    assert ref.usage.prompt_tokens >= MIN_PROMPT_TOKENS
    assert got.choices[0].text == ref.choices[0].text
    assert got.usage.completion_tokens == ref.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].text for c in client(offload).completions.create(stream=True, **args) if c.choices)
    assert streamed == ref.choices[0].text
    # The prompt is 12x the hot buffer: decode had to copy misses from the host pool.
    assert metric(offload, "misses") > 0
    assert metric(offload, "hits") > 0


def test_chat_completions_offload_on_equals_off(servers):
    dense, offload = servers
    messages = [{"role": "user", "content": long_prompt() + "\n\nWhat does this module do?"}]
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
        body = {"input_ids": window, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True, "logprob_start_len": 0}
        req = urllib.request.Request(offload.url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
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
