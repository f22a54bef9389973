"""Record served top-k selections in the sparse decode trace format (``..npz``).

With ``"record_trace": "path.npz"`` in ``--sparse-decode-offload-config`` the offload
backend records, for every decode step, every layer's logical top-k of every request
in the batch, plus the rows' sequence lengths and request ids: exactly the arrays of
:mod:`sglang_ascend_offload.sparse_decode.trace` (``topk [steps, layers, rows, k]``,
``seq_lens [steps, rows]``, ``req_ids [steps, rows]``). ``python -m
sglang_ascend_offload bench decode --trace path.npz`` replays the file.

Trace rows are compact: a request takes the lowest free trace row when it first
appears in a decode batch and keeps it while it stays in the batches, so the trace
has as many rows as requests were ever live together (not the engine's row capacity,
``--max-running-requests + 1``); per-step recording work is proportional to the batch.

Only rows that were ever active are kept, and their identity is stable: ``meta``
(JSON) has ``row_map``, one ``[step, trace_row, engine_row, req_id]`` entry each time a
request takes a trace row (``engine_row``: its ``req_to_token`` row, ``-1`` when not
given). Replay and ``size-hot`` also skip idle rows and steps
(``sparse_decode.replay.compact_trace``).

Rank depth (``record_trace_rank_depth = R > 0``): the file also holds ``ranked``
int32 ``[steps, layers, rows, R]``. The indexer hook (``backend.run_indexer``) asks
:meth:`TraceRecorder.rank_depth_now` on every call; while a decode step is being
recorded it selects the top-``R`` instead of the top-``k`` (the reference indexer
returns positions in descending score order, so the first ``k`` are the top-k the
model attends to, unchanged) and hands the ``[B, R]`` ranking to
:meth:`record_ranked`. Only recording steps pay: the score computation is the same,
the selection keeps ``R`` instead of ``k`` candidates, and ``B x R x 4`` bytes per
layer come to the host. When the recording stops (``record_trace_max_steps``) the
indexer is back to top-``k``.

Speculative decoding (NextN / MTP, ``rows_per_request = n > 1``): the target model
runs verify rounds, each request's ``n`` verify rows together (the last accepted token
and the drafts). The file is then a speculative trace
(:mod:`sglang_ascend_offload.sparse_decode.spec_trace`: ``topk [rounds, layers, rows x
n, k]``, ``committed`` / ``req_ids`` / ``accepted [rounds, rows]``): a trace row is a
request, its ``n`` lines are its verify rows of the round (draft rows included, as the
target selected for them), ``committed`` is the request's committed length when the
round started, and ``accepted`` is what the round committed, read from the request's
next round (0 for its last). ``bench decode --mtp N --trace FILE`` replays it;
``record_trace_rank_depth`` is refused with it (verify rows get no ranking).

Bounded: at most ``record_trace_max_steps`` steps are kept; the file is rewritten
(atomically, validated) every ``flush_every`` steps and when the bound is reached,
after which recording stops and says so in the log. With DP > 1 each DP rank writes
``path.dp<rank>.npz``; only TP rank 0 records.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from ...sparse_decode.spec_trace import SpecTrace, save_spec_trace
from ...sparse_decode.trace import Trace, save_trace

logger = logging.getLogger(__name__)


def trace_path(path: str, dp_rank: Optional[int], dp_size: int) -> Path:
    """The file this rank writes (``.dp<rank>`` inserted before the suffix when DP > 1)."""
    p = Path(path)
    if dp_size > 1 and dp_rank is not None:
        p = p.with_name(f"{p.stem}.dp{dp_rank}{p.suffix or '.npz'}")
    return p


class TraceRecorder:
    """Collects decode steps of one engine (``layers`` x trace rows x ``top_k``).

    ``rows``: the most trace rows allowed (the engine's capacity); the file has as
    many as were used. ``rows_per_request``: query rows per request and step (``n > 1``:
    speculative verify rounds, recorded as a speculative trace; see the module docstring).
    """

    def __init__(
        self,
        path: Path,
        layers: int,
        rows: int,
        top_k: int,
        max_steps: int,
        meta: dict,
        flush_every: int = 32,
        rank_depth: int = 0,
        rows_per_request: int = 1,
    ):
        if rows_per_request > 1 and rank_depth:
            raise ValueError(
                f"record_trace_rank_depth {rank_depth} with {rows_per_request} verify rows per request: a "
                "speculative trace holds the verify rows' top-k only (set record_trace_rank_depth 0)"
            )
        self.rows_per_request = int(rows_per_request)
        if rank_depth and rank_depth < top_k:
            raise ValueError(
                f"record_trace_rank_depth {rank_depth} < the model's top-k {top_k}: the ranking starts "
                "with the top-k (use 0 to record no ranking)"
            )
        self.rank_depth = int(rank_depth)
        self._ranked: List[np.ndarray] = []
        self._ranked_current: Optional[np.ndarray] = None
        self._row_map: List[List[int]] = []
        self.path = Path(path)
        self.layers, self.rows, self.top_k = layers, rows, top_k
        self._trace_row: dict = {}  # request id -> trace row
        self._width = 0  # trace rows used so far
        self._batch_rows: Optional[np.ndarray] = None
        self.max_steps = max_steps
        self.flush_every = flush_every
        self._meta = dict(meta, rank_depth=self.rank_depth, rows_per_request=self.rows_per_request)
        self._topk: List[np.ndarray] = []
        self._seq_lens: List[np.ndarray] = []
        self._req_ids: List[np.ndarray] = []
        self._current: Optional[np.ndarray] = None
        self._current_rows: Optional[tuple] = None
        self.done = False
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def steps(self) -> int:
        return len(self._topk)

    @property
    def meta(self) -> str:
        return json.dumps(dict(self._meta, row_map=self._row_map), sort_keys=True)

    def rank_depth_now(self) -> int:
        """Top-``R`` the indexer should select for the step being recorded (0 = just top-k)."""
        return self.rank_depth if (self.rank_depth and not self.done and self._current is not None) else 0

    def begin_step(
        self, seq_lens: torch.Tensor, req_ids: torch.Tensor, engine_rows: Optional[torch.Tensor] = None
    ) -> None:
        """Start a step: ``seq_lens`` int ``[B]``, ``req_ids`` int64 ``[B]`` of the batch
        entries (``-1`` = padding / idle), ``engine_rows`` int ``[B]`` their engine rows
        (kept in ``meta['row_map']``). With ``rows_per_request > 1`` a step is a verify
        round and ``seq_lens`` are the requests' committed lengths."""
        if self.done:
            return
        reqs = req_ids.detach().cpu().numpy().astype(np.int64)
        lens = seq_lens.detach().cpu().numpy().astype(np.int32)
        live = [int(r) for r in reqs if r != -1]
        for gone in [r for r in self._trace_row if r not in set(live)]:
            del self._trace_row[gone]
        used = set(self._trace_row.values())
        free = (i for i in range(self.rows) if i not in used)
        batch_rows = np.full(len(reqs), -1, dtype=np.int64)
        for i, r in enumerate(reqs.tolist()):
            if r == -1:
                continue
            if r not in self._trace_row:
                self._trace_row[r] = next(free)
                eng = int(engine_rows[i]) if engine_rows is not None else -1
                self._row_map.append([self.steps, self._trace_row[r], eng, int(r)])
            batch_rows[i] = self._trace_row[r]
        width = int(batch_rows.max()) + 1 if (batch_rows >= 0).any() else 0
        self._width = max(self._width, width)
        self._batch_rows = batch_rows
        self._current = np.full((self.layers, width * self.rows_per_request, self.top_k), -1, dtype=np.int32)
        if self.rank_depth:
            self._ranked_current = np.full((self.layers, width, self.rank_depth), -1, dtype=np.int32)
        step_lens = np.zeros(width, dtype=np.int32)
        step_reqs = np.full(width, -1, dtype=np.int64)
        mine = batch_rows >= 0
        step_lens[batch_rows[mine]] = lens[mine]
        step_reqs[batch_rows[mine]] = reqs[mine]
        self._current_rows = (step_lens, step_reqs)

    def record_layer(self, layer: int, topk: torch.Tensor) -> None:
        """``topk`` int32 ``[B * n, top_k]`` logical positions of ``layer`` for the batch
        entries of :meth:`begin_step` (``n = rows_per_request`` rows per entry,
        request-major; -1 padding)."""
        if self.done or self._current is None:
            return
        mine = self._batch_rows >= 0
        n, k = self.rows_per_request, self.top_k
        rows = topk.detach().cpu().numpy().reshape(-1, n, k)
        self._current[layer].reshape(-1, n, k)[self._batch_rows[mine]] = rows[mine]
        if layer == self.layers - 1:
            self._commit()

    def record_ranked(self, layer: int, ranked: torch.Tensor) -> None:
        """``ranked`` int ``[T, >= rank_depth]`` positions in descending indexer-score order
        for the batch entries of :meth:`begin_step` (``T >= B``: DP-attention padding
        after them; ``-1`` padding). Call before :meth:`record_layer` of the layer."""
        if self.done or self._ranked_current is None:
            return
        mine = self._batch_rows >= 0
        got = ranked[: mine.size, : self.rank_depth].detach().cpu().numpy().astype(np.int32)
        if got.shape[1] < self.rank_depth:
            raise ValueError(f"ranked has {got.shape[1]} columns < record_trace_rank_depth {self.rank_depth}")
        self._ranked_current[layer][self._batch_rows[mine]] = got[mine]

    def _commit(self) -> None:
        seq_lens, req_ids = self._current_rows
        if self.rank_depth:
            self._ranked.append(self._ranked_current)
            self._ranked_current = None
        self._topk.append(self._current)
        self._seq_lens.append(seq_lens)
        self._req_ids.append(req_ids)
        self._current = None
        if self.steps >= self.max_steps:
            self.flush()
            self.done = True
            logger.info(
                "sparse decode trace: %d steps recorded in %s (record_trace_max_steps reached; recording stopped)",
                self.steps,
                self.path,
            )
        elif self.steps % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        """Write the steps so far (validated; atomic rename)."""
        if not self._topk:
            return
        w = max(1, self._width)  # steps recorded before a wider one get padding rows
        n = self.rows_per_request
        topk = np.stack([_pad_rows(t, w * n) for t in self._topk])
        lens = np.stack([np.pad(x, (0, w - x.shape[0]), constant_values=0) for x in self._seq_lens])
        reqs = np.stack([np.pad(x, (0, w - x.shape[0]), constant_values=-1) for x in self._req_ids])
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}.npz")
        if n > 1:
            spec = SpecTrace(topk, lens, reqs, accepted_from_next_round(lens, reqs, n), n)
            save_spec_trace(spec, tmp, meta=self.meta)
        else:
            ranked = np.stack([_pad_rows(t, w) for t in self._ranked]) if self.rank_depth else None
            save_trace(Trace(topk=topk, seq_lens=lens, req_ids=reqs, meta=self.meta, ranked=ranked), tmp)
        os.replace(tmp, self.path)


def _pad_rows(layers_rows: np.ndarray, rows: int) -> np.ndarray:
    """``[layers, r, k]`` padded with ``-1`` rows to ``[layers, rows, k]``."""
    return np.pad(layers_rows, [(0, 0), (0, rows - layers_rows.shape[1]), (0, 0)], constant_values=-1)


def accepted_from_next_round(committed: np.ndarray, req_ids: np.ndarray, rows_per_request: int) -> np.ndarray:
    """int32 ``[rounds, rows]``: tokens each recorded round committed, its request's
    committed length at its next round in the same trace row minus this one's (0 for a
    request's last recorded round, for idle rows, and where the difference is not one
    round's ``1 .. rows_per_request``: rounds the recording did not see)."""
    out = np.zeros(committed.shape, dtype=np.int32)
    for row in range(committed.shape[1]):
        last = {}  # request -> its latest round in this row
        for r in range(committed.shape[0]):
            req = int(req_ids[r, row])
            if req == -1:
                continue
            if req in last:
                step = committed[r, row] - committed[last[req], row]
                out[last[req], row] = step if 1 <= step <= rows_per_request else 0  # else: not seen
            last[req] = r
    return out
