"""Score-aware eviction study: LRU, the score policies and the optimum on
latent-score traces over several seeds and top-k sizes, plus an *oracle-latent* bound.

    .venv/bin/python scripts/score_rank_study.py --top-k 64 --seeds 0,1,2 \
        --shapes locality,bursty,random,scan [--oracle]

Prints one JSON document on stdout (progress on stderr): per trace the LRU miss count and
every other column as a ratio to LRU's misses. Traces are exactly those of
``bench decode --top-k K --shape S --rank-depth 4K --seed N`` (160 steps x 4 layers x 8 rows,
hot = 2 x top-k, rank depth = 2 x hot), so each row can be cross-checked there.

``--oracle`` (``locality`` only) adds ``oracle_latent``: ``score_rank`` on the same trace
(same random draws, same top-k) whose ranking *past the top-k* is ordered by the latent
persistent score ``u`` instead of the step's noisy score ``u + noise``. No online policy
that sees only rankings can know ``u`` exactly, so this is a ceiling for "evict by the
best estimate of the latent score" rules: it shows how much of the gap to the optimum is
the per-step score noise. It wraps the synthetic model's private ``_latent_select``; it is
an analysis tool, not part of the package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from sglang_ascend_offload.sparse_decode import trace as trace_mod
from sglang_ascend_offload.sparse_decode.belady import belady_misses
from sglang_ascend_offload.sparse_decode.replay import simulate_policy
from sglang_ascend_offload.sparse_decode.trace import SyntheticTraceSpec, synthesize

POLICIES = ("score_rank", "score_rank_smooth", "score_rank_guarded")


@contextmanager
def latent_oracle_ranking():
    """Within the block, latent ``locality`` rankings keep the step's top-k (first k, the
    noisy selection) and order every other position by its latent score ``u``."""
    original = trace_mod._latent_select

    def oracle(rng, spec, row, layer, n_sink, n_window):
        out = original(rng, spec, row, layer, n_sink, n_window)  # same draws as the plain model
        n, k = row.seq_len, spec.top_k
        if spec.shape != "locality" or n <= k:
            return out
        u = row.score[layer].copy()
        u[: min(n_sink, n)] = np.inf
        u[max(0, n - n_window) :] = np.inf
        rest = np.setdiff1d(np.arange(n), out[:k])
        rest = rest[np.argsort(-u[rest], kind="stable")]
        return np.concatenate([out[:k], rest])[: min(n, spec.rank_depth)].astype(np.int64)

    trace_mod._latent_select = oracle
    try:
        yield
    finally:
        trace_mod._latent_select = original


def spec_for(shape: str, top_k: int, seed: int) -> SyntheticTraceSpec:
    # noise_skew 1.5 is bench decode's default (the latent model does not read it)
    return SyntheticTraceSpec(
        steps=160, layers=4, rows=8, top_k=top_k, shape=shape, seed=seed, noise_skew=1.5, rank_depth=4 * top_k
    )


def study(shape: str, top_k: int, seed: int, oracle: bool) -> dict:
    hot = 2 * top_k
    trace = synthesize(spec_for(shape, top_k, seed))
    lru = simulate_policy(trace, "lru", hot, manage_impl="auto").misses
    row = {
        "shape": shape,
        "top_k": top_k,
        "hot_tokens": hot,
        "rank_depth": 4 * top_k,
        "seed": seed,
        "lru_misses": lru,
        "optimum": belady_misses(trace.topk, trace.req_ids, hot) / lru,
    }
    for policy in POLICIES:
        row[policy] = simulate_policy(trace, policy, hot).misses / lru
    if oracle and shape == "locality":
        with latent_oracle_ranking():
            otrace = synthesize(spec_for(shape, top_k, seed))
        if not np.array_equal(otrace.topk, trace.topk):
            raise AssertionError("the oracle ranking changed the top-k: the comparison would be void")
        row["oracle_latent"] = simulate_policy(otrace, "score_rank", hot).misses / lru
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top-k", type=int, nargs="+", default=[64])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--shapes", default="locality,bursty,random,scan")
    ap.add_argument("--oracle", action="store_true", help="add the oracle-latent bound (locality rows)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for k in args.top_k:
        for shape in args.shapes.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                t0 = time.perf_counter()
                rows.append(study(shape, k, seed, args.oracle))
                print(f"{shape} top-k {k} seed {seed}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps({"rows": rows, "columns_over": "lru_misses"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
