"""``demo``: the trained tiny checkpoint served on CPU with sparse decode offload, one
request through the OpenAI client, the answer and what offload did to produce it.

Two SGLang servers of ``tests/fixtures/tiny_dsa_trained`` (real weights and tokenizer,
trained by ``scripts/train_tiny_dsa.py`` on the Python standard library's source) start
together on 127.0.0.1:

* ``offload``: ``--enable-sparse-decode-offload`` with a hot buffer of ``--hot-tokens``
  slots per layer (default 128, 2 x the checkpoint's top-k of 64) and Prometheus
  metrics, so the main KV lives in the host pool and each decode step copies only the
  top-k rows that are not resident;
* ``reference``: the same server without offload.

The request goes to both through ``/v1/completions``: a held-out source file of the
standard library (about 1,600 tokens, so the top-k really selects and the hot buffer
really evicts) followed by ``--prompt`` (default: the start of the next test method),
greedy with ``--frequency-penalty`` (default 0.8: without it this 4M-parameter model,
trained on code only, repeats one line; the penalty is deterministic, so both servers
must still agree token for token). The model continues Python; it does not chat
(``tests/sglang/e2e/test_trained_text_e2e_cpu.py`` covers chat completions).

Reported (``--json``: one document on stdout, progress on stderr): the answer, whether it
equals the reference server's (``identical``), and the offload counters of this request
from the server's ``/metrics``: top-k entries selected, hits, misses, ``hit_rate``,
``h2d_bytes`` against ``topk_reload_h2d_bytes`` (what copying the whole top-k every step
would move: selected x ``row_bytes``, one latent + rope row in bf16). Exit status 0 when
the answers are identical and non-empty.

It runs from a checkout (the checkpoint is test data of the repository) and takes about
a minute after ``scripts/setup_cpu_env.sh``, most of it the servers' start.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from .testing.servers import IDLE_SLEEP, TINY_DSA_TRAINED, TRAINED_SERVER_ARGS, ServerProcess, start_all, stop_all

__all__ = [
    "DEFAULT_PROMPT",
    "DEFAULT_HOT_TOKENS",
    "OffloadCounters",
    "DemoResult",
    "build_servers",
    "ask",
    "held_out_source",
    "read_counters",
    "row_bytes",
    "add_arguments",
    "main",
]

DEFAULT_PROMPT = "\n\n    def test_"
DEFAULT_FREQUENCY_PENALTY = 0.8
DEFAULT_HOT_TOKENS = 128  # 2 x the checkpoint's top-k: the recommended size (docs/sparse_decode.md)
DEFAULT_MAX_TOKENS = 48
METRIC_PREFIX = "sglang:ascend_offload_"
COUNTERS = ("selected", "hits", "misses", "h2d_bytes")


@dataclass(frozen=True)
class OffloadCounters:
    """Sparse decode offload counters of one server, summed over layers (``/metrics``)."""

    selected: int
    hits: int
    misses: int
    h2d_bytes: int

    def __sub__(self, before: "OffloadCounters") -> "OffloadCounters":
        return OffloadCounters(*(getattr(self, k) - getattr(before, k) for k in COUNTERS))


@dataclass
class DemoResult:
    """What one request produced on the two servers (the ``--json`` document)."""

    prompt: str
    prompt_tokens: int
    completion_tokens: int
    answer: str
    reference_answer: str
    identical: bool
    hot_tokens: int
    selected: int
    hits: int
    misses: int
    hit_rate: float
    row_bytes: int
    h2d_bytes: int
    topk_reload_h2d_bytes: int
    h2d_vs_topk_reload: Optional[float]
    answer_s: float
    startup_s: Optional[float] = None


def held_out_source() -> str:
    """About 1,600 tokens of held-out standard-library source (the checkpoint's own
    held-out evaluation windows, decoded back to text)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_DSA_TRAINED / "tokenizer.json"))
    windows = json.loads((TINY_DSA_TRAINED / "heldout_eval.json").read_text())["windows"]
    return tok.decode(windows[0][1:] + windows[1][:600])


def row_bytes(model_dir: Path = TINY_DSA_TRAINED) -> int:
    """Bytes of one token's main-KV row in one layer: the MLA latent (``kv_lora_rank``) and
    the rope part (``qk_rope_head_dim``) in bf16, what each miss copies host to device."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return 2 * (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]))


def build_servers(log_dir: Path, hot_tokens: int = DEFAULT_HOT_TOKENS) -> Tuple[ServerProcess, ServerProcess]:
    """(reference, offload) servers of the trained checkpoint, not started yet."""
    common = ["--max-running-requests", "2"] + IDLE_SLEEP
    reference = ServerProcess(common, base_args=TRAINED_SERVER_ARGS, log_path=log_dir / "reference.log")
    offload = ServerProcess(
        common
        + [
            "--enable-metrics",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps({"hot_tokens": hot_tokens}),
        ],
        base_args=TRAINED_SERVER_ARGS,
        log_path=log_dir / "offload.log",
    )
    return reference, offload


def read_counters(server: ServerProcess) -> OffloadCounters:
    """The server's offload counters from its Prometheus text (every layer's series summed)."""
    text = urllib.request.urlopen(server.url + "/metrics", timeout=60).read().decode()
    values: Dict[str, int] = {}
    for key in COUNTERS:
        found = re.findall(rf"^{re.escape(METRIC_PREFIX)}{key}_total{{[^}}]*}} (\S+)$", text, re.M)
        values[key] = int(round(sum(float(v) for v in found)))
    return OffloadCounters(**values)


def _complete(server: ServerProcess, prompt: str, max_tokens: int, frequency_penalty: float):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, frequency_penalty=frequency_penalty
    )


def ask(
    reference: ServerProcess,
    offload: ServerProcess,
    prompt: str = DEFAULT_PROMPT,
    context: Optional[str] = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    hot_tokens: int = DEFAULT_HOT_TOKENS,
    frequency_penalty: float = DEFAULT_FREQUENCY_PENALTY,
) -> DemoResult:
    """Send ``context`` + ``prompt`` to both started servers; the offload server's counters
    are read before and after, so only this request's decode steps are counted."""
    context = held_out_source() if context is None else context
    before = read_counters(offload)
    start = time.monotonic()
    got = _complete(offload, context + prompt, max_tokens, frequency_penalty)
    answer_s = time.monotonic() - start
    used = read_counters(offload) - before
    ref = _complete(reference, context + prompt, max_tokens, frequency_penalty)
    answer = got.choices[0].text or ""
    reference_answer = ref.choices[0].text or ""
    rb = row_bytes()
    reload_bytes = used.selected * rb
    return DemoResult(
        prompt=prompt,
        prompt_tokens=got.usage.prompt_tokens,
        completion_tokens=got.usage.completion_tokens,
        answer=answer,
        reference_answer=reference_answer,
        identical=answer == reference_answer and bool(answer),
        hot_tokens=hot_tokens,
        selected=used.selected,
        hits=used.hits,
        misses=used.misses,
        hit_rate=used.hits / used.selected if used.selected else 0.0,
        row_bytes=rb,
        h2d_bytes=used.h2d_bytes,
        topk_reload_h2d_bytes=reload_bytes,
        h2d_vs_topk_reload=used.h2d_bytes / reload_bytes if reload_bytes else None,
        answer_s=round(answer_s, 3),
    )


def format_result(r: DemoResult) -> str:
    mib = 1024 * 1024
    ratio = "n/a" if r.h2d_vs_topk_reload is None else f"{r.h2d_vs_topk_reload:.2f}x"
    lines = [
        f"prompt: {r.prompt_tokens} tokens of held-out standard-library source, ending in {r.prompt!r}",
        f"answer ({r.completion_tokens} tokens in {r.answer_s:.1f} s, sparse decode offload, hot_tokens "
        f"{r.hot_tokens}; a 4M-parameter model trained on code for 20 minutes):",
        "  " + r.prompt.strip("\n") + r.answer.replace("\n", "\n  "),
        "",
        f"offload: top-k entries {r.selected:,}, hits {r.hits:,}, misses {r.misses:,}, hit rate {r.hit_rate:.3f}",
        f"host->device: {r.h2d_bytes / mib:.2f} MiB vs {r.topk_reload_h2d_bytes / mib:.2f} MiB reloading the top-k "
        f"every step ({ratio})",
        "same answer as the server without offload: " + ("yes" if r.identical else "NO"),
    ]
    if not r.identical:
        lines += ["reference answer:", "  " + r.reference_answer.replace("\n", "\n  ")]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help=f"text after the held-out source, for the model to continue (default {DEFAULT_PROMPT!r})",
    )
    p.add_argument(
        "--context-file",
        type=Path,
        default=None,
        help="text to put before --prompt (default: held-out standard-library source, "
        "~1,600 tokens; the server's context is 2,048 tokens)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=DEFAULT_FREQUENCY_PENALTY,
        help=f"OpenAI frequency_penalty of the request (default {DEFAULT_FREQUENCY_PENALTY})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"answer length in tokens (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--hot-tokens",
        type=int,
        default=DEFAULT_HOT_TOKENS,
        help=f"hot buffer slots per layer of the offload server (default {DEFAULT_HOT_TOKENS})",
    )
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _problems(args) -> list:
    problems = []
    if args.max_tokens < 1:
        problems.append(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if args.hot_tokens < 64:
        problems.append(f"--hot-tokens must be at least the checkpoint's top-k, 64 (got {args.hot_tokens})")
    if args.context_file is not None and not args.context_file.is_file():
        problems.append(f"--context-file {args.context_file} is not a readable file")
    if not args.prompt and args.context_file is None:
        problems.append("--prompt is empty and there is no --context-file: nothing to continue")
    if not -2.0 <= args.frequency_penalty <= 2.0:
        problems.append(f"--frequency-penalty must be within [-2, 2] (got {args.frequency_penalty})")
    return problems


def main(args) -> int:
    problems = _problems(args)
    if problems:
        print(
            "demo: invalid arguments:\n" + "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1)), file=sys.stderr
        )
        return 2
    context = args.context_file.read_text() if args.context_file is not None else None
    with tempfile.TemporaryDirectory(prefix="sao_demo_") as tmp:
        reference, offload = build_servers(Path(tmp), args.hot_tokens)
        print(
            "[demo] starting two servers of tests/fixtures/tiny_dsa_trained on CPU "
            f"(offload with hot_tokens {args.hot_tokens}, and a reference without), about a minute",
            file=sys.stderr,
        )
        start = time.monotonic()
        try:
            start_all(reference, offload)
            startup_s = time.monotonic() - start
            print(f"[demo] servers up in {startup_s:.0f} s; asking", file=sys.stderr)
            result = ask(
                reference, offload, args.prompt, context, args.max_tokens, args.hot_tokens, args.frequency_penalty
            )
            result.startup_s = round(startup_s, 1)
        finally:
            stop_all(reference, offload)
    print(json.dumps(asdict(result), indent=2) if args.json else format_result(result))
    return 0 if result.identical else 1
