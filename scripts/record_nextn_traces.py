"""Record speculative (NextN / MTP) verify traces from the trained tiny checkpoint, served.

    .venv/bin/python scripts/record_nextn_traces.py [--mtp 1 2 3] [--out-dir tests/fixtures/traces]

For each MTP setting ``N`` serves ``tests/fixtures/tiny_dsa_trained`` (its own trained NextN
layer as the draft; real acceptance) on CPU with ``--speculative-algorithm NEXTN
--speculative-num-steps N --speculative-eagle-topk 1 --speculative-num-draft-tokens N+1``
and sparse decode offload recording its verify rounds (``record_trace``: each round's
``N + 1`` verify rows of every request, drafts included, as the target selected them;
the speculative trace format of ``sparse_decode/spec_trace.py``), sends the four longest
held-out standard-library files of the training corpus (``scripts/train_tiny_dsa.py``),
each cut to ``--prompt-tokens``, as one batch, decodes ``--new-tokens`` greedy tokens
each (EOS ignored), and stops the server. Writes ``tiny_dsa_trained_nextn<N>.npz``.
``bench decode --mtp N --trace FILE`` replays one; ``docs/sparse_decode.md`` ("The union
on real traces") reports their unions. About two minutes per setting on 2 cores.
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


def speculative_args(mtp: int):
    return [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        str(mtp),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(mtp + 1),
    ]


def record(mtp: int, out: Path, prompts, new_tokens: int) -> None:
    cfg = {"record_trace": str(out.resolve()), "record_trace_max_steps": 4096, "metrics_log_interval_s": 0}
    pool = len(prompts) * (max(len(p) for p in prompts) + new_tokens + 64) + 4096
    server = ServerProcess(
        [
            "--max-running-requests",
            str(len(prompts)),
            "--sleep-on-idle",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps(cfg),
            *speculative_args(mtp),
        ],
        base_args=server_args(4096, pool),
    )
    server.start()
    try:

        def generate(ids):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
            }
            req = urllib.request.Request(
                server.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            return json.load(urllib.request.urlopen(req, timeout=1800))

        start = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool_:
            answers = list(pool_.map(generate, prompts))
        accept = [a["meta_info"].get("spec_accept_length") for a in answers]
        print(
            f"MTP {mtp}: decoded {[len(a['output_ids']) for a in answers]} tokens in "
            f"{time.monotonic() - start:.0f} s (accept length per request {accept})",
            file=sys.stderr,
        )
    finally:
        server.stop()
    print(f"trace: {out}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=REPO / "tests" / "fixtures" / "traces")
    ap.add_argument("--mtp", type=int, nargs="+", default=[1, 2, 3], help="draft tokens per round (one server each)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1900)
    ap.add_argument("--new-tokens", type=int, default=192)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_DSA_TRAINED / "tokenizer.json"))
    texts = sorted(train_tiny_dsa.read_corpus().heldout, key=len, reverse=True)[: args.requests]
    prompts = [tok.encode(t).ids[: args.prompt_tokens] for t in texts]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for mtp in args.mtp:
        record(mtp, args.out_dir / f"tiny_dsa_trained_nextn{mtp}.npz", prompts, args.new_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
