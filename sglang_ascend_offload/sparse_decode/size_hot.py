"""Hot-buffer sizing from a trace: misses as a function of ``hot_tokens``.

``python -m sglang_ascend_offload size-hot --trace FILE`` (:mod:`..size_hot_cli`)
computes, for one recorded (or synthetic) trace:

* the **LRU curve for every size** ``top_k .. max_hot`` in one pass over the trace
  (:func:`lru_stack_curve`, Mattson's stack distances): after a step, LRU at capacity
  ``H`` holds the ``H`` positions of highest priority, priority = (last use, then
  top-k column), the same order at every ``H`` (the inclusion
  property). A selected position is a hit at ``H`` iff its stack depth before the
  step is ``<= H``, so one histogram of depths gives every size's misses.
  The engine's LRU (``docs/residency_contract.md``) orders one step's positions
  differently: hits (stamp ``2t+2``) before fills (``2t+1``), and equal stamps by
  *slot index*. Both depend on ``H`` (a position is a hit at one size and a fill at
  another; which slot a fill lands in depends on the victims), so no single stack
  order reproduces them; the curve is exact for its own order ("stack LRU") and the
  engine's counts differ from it only through the order *within* one step's
  selection (both are reported at the sampled sizes; tests bound the difference).
* the **optimum** (Belady, ``belady.py``) and every requested policy **at sampled
  sizes** (per-size replays of the residency decisions, with the layers folded into
  rows so one step is one call).
* the **recommended hot_tokens** for a target hit rate (the smallest size whose
  stack-LRU hit rate reaches it) with its device bytes per request from the capacity
  planner (``capacity.footprints``, mode ``sparse-decode``), for a model preset.

Idle rows and idle steps are skipped (``replay.compact_trace``); old traces without
``ranked`` load unchanged (the score-aware policies then are a clear error).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from .belady import belady_misses, next_use_table
from .replay import check_ranked, compact_trace, simulate_policy
from .trace import Trace

__all__ = ["lru_stack_curve", "stack_lru_misses", "fold_layers", "SizeHotResult", "size_hot", "sampled_sizes"]


def lru_stack_curve(trace: Trace, max_hot: int) -> np.ndarray:
    """int64 ``[max_hot + 1]``: stack-order LRU misses at every capacity ``0 .. max_hot``
    (entries below ``top_k`` count as if the selection could still be held: only
    ``>= top_k`` are meaningful sizes). One pass over the trace."""
    trace = compact_trace(trace)
    steps, layers, rows, k = trace.topk.shape
    width = int(trace.seq_lens.max()) + 1 if trace.seq_lens.size else 1
    hist = np.zeros(max_hot + 2, dtype=np.int64)  # depth histogram; max_hot + 1 = deeper or cold
    req_ids, topk = trace.req_ids, trace.topk
    for layer in range(layers):
        for r in range(rows):
            prio = np.full(width, -1, dtype=np.int64)  # priority per position, -1 = not held
            held = 0
            owner = -1
            for t in range(steps):
                req = int(req_ids[t, r])
                if req != owner:
                    if held:
                        prio.fill(-1)
                        held = 0
                    owner = req
                if req == -1:
                    continue
                row = topk[t, layer, r]
                col = np.flatnonzero(row >= 0)
                sel = row[col].astype(np.int64)
                if sel.size == 0:
                    continue
                v = prio[sel]
                present = v >= 0
                if held and present.any():
                    keys = np.sort(prio[prio >= 0])
                    depth = keys.size - np.searchsorted(keys, v[present], side="right") + 1
                    hist += np.bincount(np.minimum(depth, max_hot + 1), minlength=max_hot + 2)
                hist[max_hot + 1] += int((~present).sum())
                held += int((~present).sum())
                prio[sel] = t * k + col
    deeper = np.cumsum(hist[::-1])[::-1]  # deeper[d] = lookups with depth >= d
    return deeper[1 : max_hot + 2].copy()  # misses(h) = lookups with depth > h


def stack_lru_misses(trace: Trace, hot: int) -> int:
    """Stack-order LRU at one capacity by direct simulation (the definition the curve
    follows; tests compare them). Sets per row, no stacks."""
    steps, layers, rows, k = trace.topk.shape
    misses = 0
    for layer in range(layers):
        for r in range(rows):
            cache: Dict[int, int] = {}
            owner = -1
            for t in range(steps):
                req = int(trace.req_ids[t, r])
                if req != owner:
                    cache = {}
                    owner = req
                if req == -1:
                    continue
                entries = [(j, int(p)) for j, p in enumerate(trace.topk[t, layer, r].tolist()) if p >= 0]
                chosen = {p for _, p in entries}
                new = [p for _, p in entries if p not in cache]
                misses += len(new)
                over = len(cache) + len(new) - hot
                if over > 0:
                    victims = sorted((v, p) for p, v in cache.items() if p not in chosen)[:over]
                    for _, p in victims:
                        del cache[p]
                for j, p in entries:
                    cache[p] = t * k + j
    return misses


def fold_layers(trace: Trace) -> Trace:
    """The same residency problem with the layers folded into rows (``layers = 1``,
    ``rows = layers * rows``): layers are independent, so every policy's total misses
    are unchanged, and one step is one call."""
    s, n_layers, rows, k = trace.topk.shape
    if n_layers == 1:
        return trace
    topk = trace.topk.reshape(s, 1, n_layers * rows, k)
    ranked = None if trace.ranked is None else trace.ranked.reshape(s, 1, n_layers * rows, trace.ranked.shape[3])
    seq = np.tile(trace.seq_lens, (1, n_layers))
    req = np.tile(trace.req_ids, (1, n_layers))
    return Trace(topk, seq, req, trace.meta, ranked)


def sampled_sizes(top_k: int, max_hot: int, samples: int) -> List[int]:
    """``samples`` sizes from ``top_k`` to ``max_hot``, geometric, distinct, ascending."""
    if samples <= 1 or max_hot == top_k:
        return [top_k]
    grid = np.geomspace(top_k, max_hot, samples)
    return sorted({int(round(x)) for x in grid} | {top_k, max_hot})


@dataclass
class SizeHotResult:
    """Outputs of :func:`size_hot` (the JSON of ``size-hot --json``)."""

    top_k: int
    max_hot: int
    selected: int
    steps: int
    active_steps: int
    rows: int
    active_rows: int
    layers: int
    rank_depth: int
    hot_tokens: List[int]  # every size top_k .. max_hot
    lru_misses: List[int]  # stack-order LRU at every size
    sampled: Dict[str, Dict[str, int]] = field(default_factory=dict)  # name -> {str(hot): misses}
    recommended: Optional[Dict[str, object]] = None
    seconds: Dict[str, float] = field(default_factory=dict)  # wall seconds per phase
    cpu_seconds: float = 0.0  # this process's CPU time for the whole analysis (load-independent)

    def hit_rate(self, misses: int) -> float:
        return 1.0 - misses / self.selected if self.selected else 0.0

    def as_dict(self) -> Dict[str, object]:
        d = asdict(self)
        d["lru_hit_rate"] = [self.hit_rate(m) for m in self.lru_misses]
        d["sampled_hit_rate"] = {name: {h: self.hit_rate(m) for h, m in v.items()} for name, v in self.sampled.items()}
        return d


def size_hot(
    trace: Trace,
    policies: Sequence[str] = (),
    max_hot: Optional[int] = None,
    samples: int = 4,
    target_hit_rate: Optional[float] = None,
    model: str = "deepseek-v3.2",
    optimum: bool = True,
) -> SizeHotResult:
    """Miss curves of ``trace`` (see module docstring). ``policies``: names besides LRU
    replayed at the sampled sizes (``lru`` is always replayed there: the engine's own
    tie order, next to the stack curve)."""
    for p in policies:
        check_ranked(trace, p)
    k = trace.top_k
    max_hot = 8 * k if max_hot is None else int(max_hot)
    if max_hot < k:
        raise ValueError(f"max hot_tokens {max_hot} < top-k {k}")
    c_start = time.process_time()
    compact = compact_trace(trace)
    selected = compact.selected()
    seconds: Dict[str, float] = {}
    t0 = time.perf_counter()
    curve = lru_stack_curve(compact, max_hot)
    seconds["lru_curve"] = time.perf_counter() - t0
    sizes = list(range(k, max_hot + 1))
    res = SizeHotResult(
        top_k=k,
        max_hot=max_hot,
        selected=selected,
        steps=trace.steps,
        active_steps=compact.steps,
        rows=trace.rows,
        active_rows=compact.rows,
        layers=trace.layers,
        rank_depth=trace.rank_depth,
        hot_tokens=sizes,
        lru_misses=[int(curve[h]) for h in sizes],
        seconds=seconds,
    )
    folded = fold_layers(compact)
    grid = sampled_sizes(k, max_hot, samples)
    t0 = time.perf_counter()
    res.sampled["lru"] = {str(h): simulate_policy(folded, "lru", h, manage_impl="kernel").misses for h in grid}
    seconds["lru"] = time.perf_counter() - t0
    if optimum:
        t0 = time.perf_counter()
        nxt = next_use_table(compact.topk, compact.req_ids)
        # at hot = top-k there is nothing to choose: every policy, the optimum included, is the curve's value
        res.sampled["belady"] = {
            str(h): (int(curve[h]) if h == k else belady_misses(compact.topk, compact.req_ids, h, nxt)) for h in grid
        }
        seconds["belady"] = time.perf_counter() - t0
    for name in [p for p in policies if p not in ("lru", "belady")]:
        t0 = time.perf_counter()
        res.sampled[name] = {str(h): simulate_policy(folded, name, h).misses for h in grid}
        seconds[name] = time.perf_counter() - t0
    if target_hit_rate is not None:
        res.recommended = recommend(res, target_hit_rate, model)
    res.cpu_seconds = time.process_time() - c_start
    return res


def recommend(res: SizeHotResult, target: float, model: str) -> Dict[str, object]:
    """Smallest size whose stack-LRU hit rate reaches ``target``, with its device bytes
    per request (the hot-buffer plan's bytes of one hot row: one decode row per request)."""
    from ..model_specs import preset
    from .sizing import HotBufferPlan

    if not 0.0 <= target <= 1.0:
        raise ValueError(f"--target-hit-rate {target} must be in [0, 1]")
    hot = next((h for h, m in zip(res.hot_tokens, res.lru_misses) if res.hit_rate(m) >= target), None)
    out: Dict[str, object] = {"target_hit_rate": target, "policy": "lru", "model": model}
    if hot is None:
        out.update(
            hot_tokens=None,
            reason=f"no size up to {res.max_hot} reaches the target; best hit rate "
            f"{res.hit_rate(res.lru_misses[-1]):.4f} at {res.max_hot}",
        )
        return out
    shape = preset(model)
    hot_plan = HotBufferPlan(
        layers=shape.num_layers,
        row_dim=shape.main_kv_dim,
        top_k=shape.index_topk,
        hot_tokens=hot,
        verify_rows=1,
        running_requests=1,
    )
    out.update(
        hot_tokens=hot,
        hit_rate=res.hit_rate(res.lru_misses[hot - res.top_k]),
        device_bytes_per_request=hot_plan.device_bytes_per_row,
        note=f"device bytes: hot buffer + residency table of every layer of {shape.name} for one decode row "
        f"at hot_tokens {hot} (the hot-buffer plan, sparse_decode/sizing.py)",
    )
    return out
