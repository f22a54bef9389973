"""Record a real decode trace from the trained tiny checkpoint through a served model.

    .venv/bin/python scripts/record_trained_trace.py [--out tests/fixtures/traces/tiny_dsa_trained_decode.npz]

Serves ``tests/fixtures/tiny_dsa_trained`` on CPU with sparse decode offload
(``hot_tokens`` 128, ``record_trace``, ``record_trace_rank_depth`` 256), sends the four
longest held-out standard-library files of the training corpus (see
``scripts/train_tiny_dsa.py``), each cut to ``--prompt-tokens``, as one batch, decodes
``--new-tokens`` greedy tokens each (EOS ignored), and stops the server. The trace
holds every decode step's top-k and the indexer's ranking down to 256 per layer and
row. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import train_tiny_dsa  # noqa: E402

from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, TRAINED_SERVER_ARGS, ServerProcess  # noqa: E402


def server_args(context: int, pool_tokens: int):
    args = list(TRAINED_SERVER_ARGS)
    args[args.index("--max-total-tokens") + 1] = str(pool_tokens)
    args[args.index("--context-length") + 1] = str(context)
    return args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "traces" / "tiny_dsa_trained_decode.npz")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1900)
    ap.add_argument("--new-tokens", type=int, default=192)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_DSA_TRAINED / "tokenizer.json"))
    texts = sorted(train_tiny_dsa.read_corpus().heldout, key=len, reverse=True)[: args.requests]
    prompts = [tok.encode(t).ids[: args.prompt_tokens] for t in texts]
    cfg = {
        "hot_tokens": 128,
        "record_trace": str(args.out.resolve()),
        "record_trace_max_steps": 1024,
        "record_trace_rank_depth": 256,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(
        [
            "--max-running-requests",
            str(args.requests),
            "--sleep-on-idle",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps(cfg),
        ],
        base_args=server_args(4096, args.requests * (args.prompt_tokens + args.new_tokens) + 4096),
    )
    server.start()
    try:

        def generate(ids):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True},
            }
            req = urllib.request.Request(
                server.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            return json.load(urllib.request.urlopen(req, timeout=900))

        start = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(generate, prompts))
        print(
            f"decoded {[len(a['output_ids']) for a in answers]} tokens in {time.monotonic() - start:.0f} s",
            file=sys.stderr,
        )
    finally:
        server.stop()
    print(f"trace: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
