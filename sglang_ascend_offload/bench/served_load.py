"""The HTTP client and the fixed load of the served benchmarks (``bench serve``,
``bench transfer --served``, ``bench soak``).

A served benchmark sends greedy ``/generate`` requests of token ids (the tiny fixtures
have no tokenizer: servers run with ``--skip-tokenizer-init``) and reads the answer
either streamed (:func:`stream_generate`: time to first token, arrival time of every
output token, the output ids) or whole (``ServerProcess.generate``). The load of
:func:`run_load` is ``requests`` seeded prompts of one length, ``concurrency`` in flight
at once, each asking for ``output_len`` tokens with ``ignore_eos``: the same prompts,
in the same order, for every server it is sent to, so their greedy outputs can be
compared token by token.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

VOCAB = 1024  # the tiny DSA fixtures' vocabulary
FIRST_ID = 4  # ids below are special (bos 0, eos 1) in the fixtures

# What a request to a server can raise (server gone, refused, HTTP error, bad body).
REQUEST_ERRORS = (urllib.error.URLError, ConnectionError, OSError, ValueError)


def prompt(n: int, seed: int, vocab: int = VOCAB) -> List[int]:
    """``n`` deterministic token ids in ``[4, vocab - 4)`` (an arithmetic sequence per seed)."""
    return [(seed * 131 + i * 7) % (vocab - 8) + FIRST_ID for i in range(n)]


def random_prompt(n: int, seed: int, vocab: int = VOCAB) -> List[int]:
    """``n`` token ids in ``[4, vocab)`` drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(q / 100.0 * len(xs)) - 1)]


def post_json(url: str, body: Dict[str, Any], timeout_s: float = 120.0) -> Any:
    """POST ``body`` as JSON to ``url``; the decoded JSON answer (``None`` if empty)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        text = r.read()
    return json.loads(text) if text.strip() else None


def generate_body(input_ids, max_new_tokens: int, stream: bool = False, **extra: Any) -> Dict[str, Any]:
    """Greedy ``/generate`` body for token ids (one prompt or a batch), ``ignore_eos``."""
    return {
        "input_ids": input_ids,
        "stream": stream,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        **extra,
    }


@dataclass
class StreamedOutput:
    """One streamed request.

    ttft_s: seconds from sending to the first chunk that carries an output token
    (``None`` if none came); output_ids: every output token id, in order;
    token_times_s: arrival time of each output token (seconds since sending; tokens of
    one chunk share its time; ``len == len(output_ids)``); wall_s: until the stream
    ended; meta_info: the last chunk's ``meta_info`` (e.g. ``spec_accept_length``).
    """

    ttft_s: Optional[float]
    output_ids: List[int]
    token_times_s: List[float]
    wall_s: float
    meta_info: Dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return len(self.output_ids)

    def inter_token_s(self) -> List[float]:
        """Per-token latency after the first token: each chunk's gap to the previous
        chunk divided evenly over the tokens it delivered (a speculative step that
        commits 3 tokens in one chunk counts as 3 tokens of a third of the gap)."""
        out: List[float] = []
        i = 1
        times = self.token_times_s
        while i < len(times):
            j = i
            while j + 1 < len(times) and times[j + 1] == times[i]:
                j += 1
            n = j - i + 1
            gap = times[i] - times[i - 1]
            out.extend([gap / n] * n)
            i = j + 1
        return out


def stream_generate(
    url: str, input_ids: List[int], max_new_tokens: int, timeout_s: float = 300.0, **extra: Any
) -> StreamedOutput:
    """Streamed greedy ``/generate`` to the server at ``url`` (``http://host:port``).

    SGLang streams cumulative ``output_ids`` by default and deltas with
    ``--incremental-streaming-output``; both are handled (``meta_info.completion_tokens``
    tells which).
    """
    body = generate_body(input_ids, max_new_tokens, stream=True, **extra)
    req = urllib.request.Request(
        f"{url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    ttft: Optional[float] = None
    ids: List[int] = []
    times: List[float] = []
    meta: Dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.monotonic() - t0
            meta = chunk.get("meta_info", {}) or meta
            chunk_ids = [int(t) for t in chunk.get("output_ids", []) or []]
            total = int(meta.get("completion_tokens", len(ids) + len(chunk_ids)))
            if len(chunk_ids) == total and total >= len(ids):  # cumulative
                new = chunk_ids[len(ids) :]
            else:  # incremental
                new = chunk_ids
            if new and ttft is None:
                ttft = now
            ids.extend(new)
            times.extend([now] * len(new))
    return StreamedOutput(ttft, ids, times, time.monotonic() - t0, meta)


@dataclass
class LoadResult:
    """One pass of a fixed load over a server.

    outputs: per prompt (the load's order), the streamed output or ``None`` if the
    request failed; errors: up to 10 failure messages; wall_s: the load's wall time
    (first send to last answer).
    """

    outputs: List[Optional[StreamedOutput]]
    wall_s: float
    errors: List[str] = field(default_factory=list)

    def completed(self, output_len: int) -> List[StreamedOutput]:
        return [o for o in self.outputs if o is not None and o.tokens >= output_len and o.ttft_s is not None]

    def output_tokens_per_s(self, output_len: int) -> Optional[float]:
        """Output tokens of completed requests over the load's wall time."""
        done = self.completed(output_len)
        return sum(o.tokens for o in done) / self.wall_s if done and self.wall_s > 0 else None

    def decode_tokens_per_s(self, output_len: int, t_sent: Sequence[float]) -> Optional[float]:
        """Tokens after each request's first, over the decode window (first request's
        first token to last request's last token, on the load's clock)."""
        done = [
            (o, t)
            for o, t in zip(self.outputs, t_sent)
            if o is not None and o.tokens >= output_len and o.ttft_s is not None
        ]
        if not done:
            return None
        start = min(t + o.ttft_s for o, t in done)
        end = max(t + o.token_times_s[-1] for o, t in done)
        tokens = sum(o.tokens - 1 for o, _ in done)
        return tokens / (end - start) if end > start else None


def run_load(
    url: str, prompts: Sequence[List[int]], output_len: int, concurrency: int, timeout_s: float = 300.0, on_error=None
) -> "tuple[LoadResult, List[float]]":
    """Send every prompt (``concurrency`` in flight at once, in order); returns the
    result and each request's send time (seconds since the load started)."""
    outputs: List[Optional[StreamedOutput]] = [None] * len(prompts)
    sent = [0.0] * len(prompts)
    errors: List[str] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def one(i: int) -> None:
        sent[i] = time.monotonic() - t0
        try:
            outputs[i] = stream_generate(url, list(prompts[i]), output_len, timeout_s=timeout_s)
        except REQUEST_ERRORS as exc:
            with lock:
                if len(errors) < 10:
                    errors.append(f"request {i}: {type(exc).__name__}: {exc}")
            if on_error is not None:
                on_error(i, exc)

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        list(pool.map(one, range(len(prompts))))
    return LoadResult(outputs, time.monotonic() - t0, errors), sent
