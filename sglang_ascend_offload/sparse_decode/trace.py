"""Top-k decode traces: the public ``.npz`` format, validation, and a synthetic model.

Format (a public contract: the server records real traces in it, operators replay
them with ``python -m sglang_ascend_offload bench decode --trace FILE``):

==============  =================================  ===========================================
key             dtype, shape                       meaning
==============  =================================  ===========================================
``topk``        int32 ``[steps, layers, rows, k]``  logical positions selected, ``-1`` = padding
``seq_lens``    int32 ``[steps, rows]``             row's sequence length, ``0`` = idle row
``req_ids``     int64 ``[steps, rows]``             request in the row, ``-1`` = idle
``meta``        optional 0-d str                    JSON text describing the source (free form)
``ranked``      optional int32                      positions in descending indexer-score order,
                ``[steps, layers, rows, R]``        ``R >= k``; the first ``k`` are the step's
                                                    top-k as a set (order free), ``-1`` padding
                                                    only past the row's valid entries
==============  =================================  ===========================================

Rules (:func:`validate_trace` lists every violated one, with counts and examples):
every valid position is ``< seq_len`` of its row; valid entries of a row are
distinct; an idle row (``req_id == -1``) has ``seq_len == 0`` and only padding; an
active row has ``seq_len >= 1``; a request keeps its row's ``seq_len`` non-decreasing
while it stays in that row. ``ranked`` (when present): same leading shape as
``topk``, ``R >= k``, positions ``< seq_len`` and distinct per row, ``-1`` only as a
suffix and everywhere in idle rows, and its first ``k`` columns hold exactly the
valid top-k entries of that ``(step, layer, row)``.

The synthetic model (:class:`SyntheticTraceSpec`, :func:`synthesize`) is described
in ``docs/sparse_decode.md``: attention sinks, a recent window, per-layer heavy
hitters that flicker and drift slowly, uniform noise, request churn with idle rows;
plus two adversarial shapes, ``random`` (noise only) and ``scan`` (cyclic sweep).
With ``rank_depth > 0`` the model is the *latent-score* one instead (every position
has a score that evolves as a persistent noisy process; top-k is the first ``k`` of
the ranking, ``ranked`` its first ``rank_depth``), see :func:`_latent_select`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Literal, Optional, Union

import numpy as np

__all__ = [
    "Trace",
    "TraceError",
    "SyntheticTraceSpec",
    "validate_trace",
    "load_trace",
    "save_trace",
    "synthesize",
]

TRACE_KEYS = {"topk": (np.int32, 4), "seq_lens": (np.int32, 2), "req_ids": (np.int64, 2)}
OPTIONAL_KEYS = {"meta", "ranked"}
_EXAMPLES = 3


class TraceError(ValueError):
    """A trace that breaks the format; ``problems`` lists every problem found."""

    def __init__(self, problems: List[str], source: str = "trace"):
        self.problems = list(problems)
        lines = "\n".join(f"  {i + 1}. {p}" for i, p in enumerate(self.problems))
        super().__init__(f"invalid {source} ({len(self.problems)} problem(s)):\n{lines}")


@dataclass
class Trace:
    """A decode trace in memory (arrays as in the module docstring)."""

    topk: np.ndarray
    seq_lens: np.ndarray
    req_ids: np.ndarray
    meta: str = ""
    ranked: Optional[np.ndarray] = None  # int32 [steps, layers, rows, R], R >= k (optional)

    @property
    def steps(self) -> int:
        return int(self.topk.shape[0])

    @property
    def layers(self) -> int:
        return int(self.topk.shape[1])

    @property
    def rows(self) -> int:
        return int(self.topk.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.topk.shape[3])

    @property
    def rank_depth(self) -> int:
        """``R`` of ``ranked`` (0 when the trace has none)."""
        return 0 if self.ranked is None else int(self.ranked.shape[3])

    def selected(self) -> int:
        """Valid (non-padding) top-k entries over all steps, layers and rows."""
        return int((self.topk >= 0).sum())


# ------------------------------------------------------------------------ validation
def _where(mask: np.ndarray, names: List[str]) -> str:
    idx = np.argwhere(mask)[:_EXAMPLES]
    return "; ".join(", ".join(f"{n}={int(v)}" for n, v in zip(names, row)) for row in idx)


def validate_trace(topk, seq_lens, req_ids, ranked=None) -> List[str]:
    """Every problem of a trace, as sentences (empty list = valid); ``ranked`` optional."""
    problems: List[str] = []
    arrays = {"topk": topk, "seq_lens": seq_lens, "req_ids": req_ids}
    for name, (dtype, ndim) in TRACE_KEYS.items():
        a = arrays[name]
        if not isinstance(a, np.ndarray):
            problems.append(f"{name} is a {type(a).__name__}, expected a numpy array")
            continue
        if a.dtype != dtype:
            problems.append(f"{name} has dtype {a.dtype}, expected {np.dtype(dtype).name}")
        if a.ndim != ndim:
            problems.append(f"{name} has {a.ndim} dimensions {a.shape}, expected {ndim}")
    if problems:
        return problems
    steps, layers, rows, k = topk.shape
    if seq_lens.shape != (steps, rows):
        problems.append(f"seq_lens shape {seq_lens.shape} != (steps, rows) = {(steps, rows)} from topk")
    if req_ids.shape != (steps, rows):
        problems.append(f"req_ids shape {req_ids.shape} != (steps, rows) = {(steps, rows)} from topk")
    if problems:
        return problems
    if min(steps, layers, rows, k) < 1:
        problems.append(f"topk shape {topk.shape} has an empty dimension")
        return problems

    names4 = ["step", "layer", "row", "entry"]
    names2 = ["step", "row"]
    bad = topk < -1
    if bad.any():
        problems.append(f"{int(bad.sum())} top-k entries < -1 (only -1 marks padding), e.g. {_where(bad, names4)}")
    bad = seq_lens < 0
    if bad.any():
        problems.append(f"{int(bad.sum())} negative seq_lens, e.g. {_where(bad, names2)}")
    bad = req_ids < -1
    if bad.any():
        problems.append(f"{int(bad.sum())} req_ids < -1 (only -1 marks an idle row), e.g. {_where(bad, names2)}")
    idle = req_ids == -1
    bad = idle & (seq_lens != 0)
    if bad.any():
        problems.append(f"{int(bad.sum())} idle rows (req_id -1) with seq_len != 0, e.g. {_where(bad, names2)}")
    bad = ~idle & (seq_lens < 1)
    if bad.any():
        problems.append(f"{int(bad.sum())} active rows with seq_len < 1, e.g. {_where(bad, names2)}")
    bad = idle[:, None, :, None] & (topk != -1)
    if bad.any():
        problems.append(f"{int(bad.sum())} top-k entries in idle rows (must be -1), e.g. {_where(bad, names4)}")
    bad = ~idle[:, None, :, None] & (topk >= seq_lens[:, None, :, None].astype(np.int64))
    if bad.any():
        problems.append(f"{int(bad.sum())} top-k positions >= their row's seq_len, e.g. {_where(bad, names4)}")
    srt = np.sort(topk, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    bad = dup.any(axis=-1)
    if bad.any():
        problems.append(
            f"{int(bad.sum())} (step, layer, row) selections with a repeated position, e.g. {_where(bad, names4[:3])}"
        )
    same = (req_ids[1:] == req_ids[:-1]) & (req_ids[1:] != -1)
    bad = same & (seq_lens[1:] < seq_lens[:-1])
    if bad.any():
        problems.append(
            f"{int(bad.sum())} steps where a request's seq_len shrinks in its row, e.g. "
            f"{_where(bad, names2)} (step counted from 1)"
        )
    if ranked is not None:
        problems.extend(_validate_ranked(ranked, topk, seq_lens, idle))
    return problems


def _validate_ranked(ranked, topk: np.ndarray, seq_lens: np.ndarray, idle: np.ndarray) -> List[str]:
    """Problems of the optional ``ranked`` array against a valid ``topk``."""
    if not isinstance(ranked, np.ndarray):
        return [f"ranked is a {type(ranked).__name__}, expected a numpy array"]
    if ranked.dtype != np.int32 or ranked.ndim != 4:
        return [f"ranked has dtype {ranked.dtype} and shape {ranked.shape}, expected int32 [steps, layers, rows, R]"]
    steps, layers, rows, k = topk.shape
    if ranked.shape[:3] != (steps, layers, rows) or ranked.shape[3] < k:
        return [f"ranked shape {ranked.shape} must be {(steps, layers, rows)} + (R,) with R >= top-k {k}"]
    problems: List[str] = []
    names4 = ["step", "layer", "row", "entry"]
    bad = ranked < -1
    if bad.any():
        problems.append(f"{int(bad.sum())} ranked entries < -1, e.g. {_where(bad, names4)}")
    bad = idle[:, None, :, None] & (ranked != -1)
    if bad.any():
        problems.append(f"{int(bad.sum())} ranked entries in idle rows (must be -1), e.g. {_where(bad, names4)}")
    bad = ~idle[:, None, :, None] & (ranked >= seq_lens[:, None, :, None].astype(np.int64))
    if bad.any():
        problems.append(f"{int(bad.sum())} ranked positions >= their row's seq_len, e.g. {_where(bad, names4)}")
    pad = ranked == -1
    bad = (pad[..., :-1] & ~pad[..., 1:]).any(axis=-1)
    if bad.any():
        problems.append(
            f"{int(bad.sum())} ranked rows with a position after -1 padding (padding is a suffix), "
            f"e.g. {_where(bad, names4[:3])}"
        )
    srt = np.sort(ranked, axis=-1)
    bad = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(axis=-1)
    if bad.any():
        problems.append(f"{int(bad.sum())} ranked rows with a repeated position, e.g. {_where(bad, names4[:3])}")
    head = np.sort(ranked[..., :k], axis=-1)
    sel = np.sort(topk, axis=-1)
    bad = (head != sel).any(axis=-1)
    if bad.any():
        problems.append(
            f"{int(bad.sum())} (step, layer, row) whose first top-k ranked entries are not the "
            f"top-k selection as a set, e.g. {_where(bad, names4[:3])}"
        )
    return problems


def _check(trace: Trace, source: str) -> Trace:
    problems = validate_trace(trace.topk, trace.seq_lens, trace.req_ids, trace.ranked)
    if problems:
        raise TraceError(problems, source)
    return trace


def load_trace(path: Union[str, Path]) -> Trace:
    """Load and validate an ``.npz`` trace; :class:`TraceError` lists every problem."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise TraceError([f"cannot read {path}: {exc.strerror}"], str(path)) from exc
    if magic != b"PK\x03\x04":  # every .npz is a zip archive
        raise TraceError(
            [
                f"{path} is not an .npz trace (a zip archive of arrays; the file starts with "
                f"{magic!r}): record one with record_trace or write it with save_trace"
            ],
            str(path),
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as exc:
        raise TraceError([f"cannot read {path} as .npz: {exc}"], str(path)) from exc
    problems = []
    for key in TRACE_KEYS:
        if key not in data:
            problems.append(f"missing array {key!r}")
    for key in data:
        if key not in TRACE_KEYS and key not in OPTIONAL_KEYS:
            problems.append(f"unknown array {key!r} (known: {', '.join(list(TRACE_KEYS) + sorted(OPTIONAL_KEYS))})")
    meta = ""
    if "meta" in data:
        m = data["meta"]
        if m.ndim != 0 or m.dtype.kind != "U":
            problems.append(f"meta must be a 0-d string array, got dtype {m.dtype} shape {m.shape}")
        else:
            meta = str(m)
    if problems:
        raise TraceError(problems, str(path))
    return _check(Trace(data["topk"], data["seq_lens"], data["req_ids"], meta, data.get("ranked")), str(path))


def save_trace(trace: Trace, path: Union[str, Path]) -> None:
    """Validate and write ``trace`` (compressed ``.npz``)."""
    _check(trace, "trace to save")
    extra = {} if trace.ranked is None else {"ranked": trace.ranked}
    np.savez_compressed(
        Path(path), topk=trace.topk, seq_lens=trace.seq_lens, req_ids=trace.req_ids, meta=np.array(trace.meta), **extra
    )


# ------------------------------------------------------------------ synthetic model
@dataclass(frozen=True)
class SyntheticTraceSpec:
    """Parameters of the synthetic decode trace (fractions are of ``top_k``).

    shape: ``locality`` (the model below), ``random`` (every entry uniform noise),
        ``scan`` (each row sweeps its history cyclically, ``top_k`` new positions
        per step: no reuse within ``history / top_k`` steps; LRU's worst case),
        ``bursty`` (latent-score model only: ``locality`` plus score bursts).
    rank_depth: ``0`` = the selection model below, no ``ranked`` array. ``> 0`` (and
        ``>= top_k``) = the *latent-score* model, which also writes ``ranked`` with
        this depth. Per row, layer and position a persistent score ``u`` follows a
        stationary AR(1) process, ``u <- (1 - a) u + sqrt(2a - a^2) N(0,1)`` with
        ``a = score_drift`` (new positions start at ``N(0,1)``); the step's score is
        ``u + score_noise * N(0,1)`` (fresh each step), the sinks and the recent
        window score ``+inf`` (always selected). ``bursty`` adds, per position and
        step with probability ``burst_rate``, a burst of ``burst_size`` that decays by
        ``burst_decay`` per step. ``random`` scores are fresh ``N(0,1)`` every step (no
        persistence); ``scan`` ranks the sweep's next positions first. The ranking is
        the descending score order; top-k is its first ``k``.
    Locality model per active row and step, for ``seq_len > top_k`` (otherwise all
    positions are selected, as DSA does): ``sink_frac`` first positions (attention
    sinks), the last ``window_frac`` positions (recent window), per layer a set of
    ``heavy_frac`` heavy hitters of which each is selected with probability
    ``heavy_active`` and replaced by a fresh position with probability
    ``heavy_drift`` per step, the rest noise over the history: uniform for
    ``noise_skew = 0``, else drawn without replacement with probability proportional
    to a persistent per-position weight ``exp(noise_skew * N(0,1))`` (some positions
    are "warm" and recur more often than others, as attention scores near the
    top-k threshold do).
    Churn: prompts uniform in ``[min_prompt, max_prompt]``, decode lengths uniform
    in ``[min_decode, max_decode]`` steps, then the row idles for a geometric number
    of steps with mean ``mean_idle`` (0 = next request at once).
    """

    steps: int = 256
    layers: int = 4
    rows: int = 8
    top_k: int = 256
    shape: Literal["locality", "random", "scan", "bursty"] = "locality"
    seed: int = 0
    min_prompt: int = 256
    max_prompt: int = 2048
    min_decode: int = 32
    max_decode: int = 192
    mean_idle: float = 2.0
    sink_frac: float = 1 / 64
    window_frac: float = 1 / 8
    heavy_frac: float = 1 / 2
    heavy_active: float = 0.85
    heavy_drift: float = 0.01
    noise_skew: float = 0.0
    rank_depth: int = 0
    score_drift: float = 0.003
    score_noise: float = 0.2
    burst_rate: float = 0.002
    burst_size: float = 3.0
    burst_decay: float = 0.8

    def check(self) -> List[str]:
        errs = []
        for name in ("steps", "layers", "rows", "top_k", "min_prompt", "min_decode"):
            if getattr(self, name) < 1:
                errs.append(f"{name} must be >= 1")
        if self.max_prompt < self.min_prompt:
            errs.append("max_prompt must be >= min_prompt")
        if self.max_decode < self.min_decode:
            errs.append("max_decode must be >= min_decode")
        if self.mean_idle < 0:
            errs.append("mean_idle must be >= 0")
        if self.noise_skew < 0:
            errs.append("noise_skew must be >= 0")
        for name in ("sink_frac", "window_frac", "heavy_frac", "heavy_active", "heavy_drift"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                errs.append(f"{name} must be in [0, 1]")
        if self.sink_frac + self.window_frac + self.heavy_frac > 1.0:
            errs.append("sink_frac + window_frac + heavy_frac must be <= 1")
        if self.shape not in ("locality", "random", "scan", "bursty"):
            errs.append(f"shape {self.shape!r}: expected locality | random | scan | bursty")
        if self.rank_depth != 0 and self.rank_depth < self.top_k:
            errs.append(f"rank_depth {self.rank_depth} must be 0 (off) or >= top_k {self.top_k}")
        if self.shape == "bursty" and self.rank_depth == 0:
            errs.append("shape 'bursty' is a latent-score shape: set rank_depth >= top_k")
        for name in ("score_drift", "burst_rate", "burst_decay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                errs.append(f"{name} must be in [0, 1]")
        if self.score_noise < 0 or self.burst_size < 0:
            errs.append("score_noise and burst_size must be >= 0")
        return errs


class _Row:
    """Synthetic state of one decode row (its current request)."""

    def __init__(self):
        self.req = -1
        self.seq_len = 0
        self.left = 0  # decode steps left of the request
        self.idle_left = 0
        self.heavy: List[np.ndarray] = []  # per layer heavy-hitter positions
        self.log_weight: List[np.ndarray] = []  # per layer noise log-weights per position
        self.cursor = 0  # scan position
        self.score: List[np.ndarray] = []  # latent model: per layer persistent scores per position
        self.burst: List[np.ndarray] = []  # latent model (bursty): per layer burst level per position


def _pick_unique(rng: np.random.Generator, low: int, high: int, n: int, exclude: np.ndarray) -> np.ndarray:
    """``n`` distinct positions in ``[low, high)`` not in ``exclude`` (fewer if impossible)."""
    avail = high - low - int(((exclude >= low) & (exclude < high)).sum())
    n = max(0, min(n, avail))
    if 2 * n >= avail:  # dense: draw from the explicit complement
        pool = np.setdiff1d(np.arange(low, high, dtype=np.int64), exclude)
        return rng.choice(pool, size=n, replace=False)
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        cand = rng.integers(low, high, size=2 * (n - out.size) + 8)
        cand = np.setdiff1d(np.unique(np.concatenate([out, cand])), exclude, assume_unique=False)
        out = cand if cand.size <= n else rng.choice(cand, size=n, replace=False)
    return out


def synthesize(spec: SyntheticTraceSpec = SyntheticTraceSpec()) -> Trace:
    """Generate a valid trace from ``spec`` (deterministic for a given ``seed``)."""
    errs = spec.check()
    if errs:
        raise ValueError("invalid synthetic trace spec: " + "; ".join(errs))
    rng = np.random.default_rng(spec.seed)
    k = spec.top_k
    topk = np.full((spec.steps, spec.layers, spec.rows, k), -1, dtype=np.int32)
    seq_lens = np.zeros((spec.steps, spec.rows), dtype=np.int32)
    req_ids = np.full((spec.steps, spec.rows), -1, dtype=np.int64)
    depth = spec.rank_depth
    ranked = np.full((spec.steps, spec.layers, spec.rows, depth), -1, dtype=np.int32) if depth else None
    rows = [_Row() for _ in range(spec.rows)]
    next_req = 0
    n_sink = int(round(spec.sink_frac * k))
    n_window = int(round(spec.window_frac * k))
    n_heavy = int(round(spec.heavy_frac * k))

    for t in range(spec.steps):
        for r, row in enumerate(rows):
            if row.req == -1:
                if row.idle_left > 0:
                    row.idle_left -= 1
                    continue
                row.req = next_req
                next_req += 1
                row.seq_len = int(rng.integers(spec.min_prompt, spec.max_prompt + 1))
                row.left = int(rng.integers(spec.min_decode, spec.max_decode + 1))
                row.cursor = int(rng.integers(0, row.seq_len))
                row.heavy = [
                    _pick_unique(rng, 0, row.seq_len, n_heavy, np.empty(0, np.int64)) for _ in range(spec.layers)
                ]
                row.log_weight = [np.empty(0) for _ in range(spec.layers)]
                row.score = [np.empty(0) for _ in range(spec.layers)]
                row.burst = [np.empty(0) for _ in range(spec.layers)]
            else:
                row.seq_len += 1
            seq_lens[t, r] = row.seq_len
            req_ids[t, r] = row.req
            for layer in range(spec.layers):
                if depth:
                    order = _latent_select(rng, spec, row, layer, n_sink, n_window)
                    ranked[t, layer, r, : order.size] = order
                    sel = order[:k]
                else:
                    sel = _select(rng, spec, row, layer, n_sink, n_window)
                sel = rng.permutation(sel)
                topk[t, layer, r, : sel.size] = sel
            row.left -= 1
            if row.left <= 0:
                row.req = -1
                row.idle_left = int(rng.geometric(1.0 / (1.0 + spec.mean_idle))) - 1 if spec.mean_idle > 0 else 0
    meta = json.dumps({"generator": "sglang_ascend_offload.sparse_decode.trace.synthesize", **asdict(spec)})
    return Trace(topk, seq_lens, req_ids, meta, ranked)


def _latent_select(rng, spec: SyntheticTraceSpec, row: _Row, layer: int, n_sink: int, n_window: int) -> np.ndarray:
    """Latent-score model (see :class:`SyntheticTraceSpec`): the first ``min(n, rank_depth)``
    positions of the row's ranking this step, best first (int64)."""
    n, depth = row.seq_len, spec.rank_depth
    if spec.shape == "scan":
        if n <= spec.top_k:
            return np.arange(n, dtype=np.int64)
        order = (row.cursor + np.arange(min(n, depth))) % n
        if layer == spec.layers - 1:
            row.cursor = (row.cursor + spec.top_k) % n
        return order.astype(np.int64)
    if spec.shape == "random":
        score = rng.standard_normal(n)
    else:
        u = row.score[layer]
        a = spec.score_drift
        if u.size:
            u = (1.0 - a) * u + np.sqrt(2 * a - a * a) * rng.standard_normal(u.size)
        if u.size < n:
            u = np.concatenate([u, rng.standard_normal(n - u.size)])
        row.score[layer] = u
        score = u + spec.score_noise * rng.standard_normal(n)
        if spec.shape == "bursty":
            b = row.burst[layer]
            if b.size < n:
                b = np.concatenate([b, np.zeros(n - b.size)])
            b = b * spec.burst_decay
            b[rng.random(n) < spec.burst_rate] += spec.burst_size
            row.burst[layer] = b
            score = score + b
    score = score.copy()
    score[: min(n_sink, n)] = np.inf
    score[max(0, n - n_window) :] = np.inf
    m = min(n, depth)
    top = np.argpartition(-score, m - 1)[:m] if m < n else np.arange(n)
    return top[np.argsort(-score[top], kind="stable")].astype(np.int64)


def _select(rng, spec: SyntheticTraceSpec, row: _Row, layer: int, n_sink: int, n_window: int) -> np.ndarray:
    k, n = spec.top_k, row.seq_len
    if n <= k:
        return np.arange(n, dtype=np.int64)
    if spec.shape == "scan":
        sel = (row.cursor + np.arange(k)) % n
        if layer == spec.layers - 1:
            row.cursor = (row.cursor + k) % n
        return sel.astype(np.int64)
    if spec.shape == "random":
        return _pick_unique(rng, 0, n, k, np.empty(0, np.int64))
    parts = [np.arange(min(n_sink, n)), np.arange(max(0, n - n_window), n)]
    heavy = row.heavy[layer]
    drift = rng.random(heavy.size) < spec.heavy_drift
    if drift.any():
        fresh = _pick_unique(rng, 0, n, int(drift.sum()), heavy)
        heavy = heavy.copy()
        heavy[np.flatnonzero(drift)[: fresh.size]] = fresh
        row.heavy[layer] = heavy
    parts.append(heavy[rng.random(heavy.size) < spec.heavy_active])
    sel = np.unique(np.concatenate(parts).astype(np.int64))
    if spec.noise_skew == 0.0:
        noise = _pick_unique(rng, 0, n, k - sel.size, sel)
    else:
        noise = _pick_weighted(rng, row, layer, n, k - sel.size, sel, spec.noise_skew)
    return np.concatenate([sel, noise])


def _pick_weighted(rng, row: _Row, layer: int, n: int, m: int, exclude: np.ndarray, skew: float) -> np.ndarray:
    """``m`` distinct positions of ``[0, n)`` minus ``exclude``, drawn without replacement
    with probability proportional to the row's persistent weights (Gumbel top-k)."""
    lw = row.log_weight[layer]
    if lw.size < n:
        lw = np.concatenate([lw, skew * rng.standard_normal(n - lw.size)])
        row.log_weight[layer] = lw
    if m <= 0:
        return np.empty(0, dtype=np.int64)
    keys = lw[:n] + rng.gumbel(size=n)
    keys[exclude] = -np.inf
    return np.argpartition(-keys, m - 1)[:m].astype(np.int64)
