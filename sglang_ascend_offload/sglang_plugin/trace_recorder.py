"""Record served top-k selections in the sparse decode trace format (``.npz``).

With ``"record_trace": "path.npz"`` in ``--sparse-decode-offload-config`` the offload
backend records, for every decode step, every layer's logical top-k of every engine
row, plus the rows' sequence lengths and request ids: exactly the arrays of
:mod:`sglang_ascend_offload.sparse_decode.trace` (``topk [steps, layers, rows, k]``,
``seq_lens [steps, rows]``, ``req_ids [steps, rows]``). ``python -m
sglang_ascend_offload bench decode --trace path.npz`` replays the file.

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

from ..sparse_decode.trace import Trace, save_trace

logger = logging.getLogger(__name__)


def trace_path(path: str, dp_rank: Optional[int], dp_size: int) -> Path:
    """The file this rank writes (``.dp<rank>`` inserted before the suffix when DP > 1)."""
    p = Path(path)
    if dp_size > 1 and dp_rank is not None:
        p = p.with_name(f"{p.stem}.dp{dp_rank}{p.suffix or '.npz'}")
    return p


class TraceRecorder:
    """Collects decode steps of one engine (``layers`` x ``rows`` x ``top_k``)."""

    def __init__(self, path: Path, layers: int, rows: int, top_k: int, max_steps: int,
                 meta: dict, flush_every: int = 32):
        self.path = Path(path)
        self.layers, self.rows, self.top_k = layers, rows, top_k
        self.max_steps = max_steps
        self.flush_every = flush_every
        self.meta = json.dumps(meta, sort_keys=True)
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

    def begin_step(self, seq_lens: torch.Tensor, req_ids: torch.Tensor) -> None:
        """Start a step: ``seq_lens`` int [rows] (0 = idle), ``req_ids`` int64 [rows] (-1 = idle)."""
        if self.done:
            return
        self._current = np.full((self.layers, self.rows, self.top_k), -1, dtype=np.int32)
        self._current_rows = (seq_lens.detach().cpu().numpy().astype(np.int32),
                              req_ids.detach().cpu().numpy().astype(np.int64))

    def record_layer(self, layer: int, topk: torch.Tensor) -> None:
        """``topk`` int32 [rows, top_k] logical positions of ``layer`` (-1 padding)."""
        if self.done or self._current is None:
            return
        self._current[layer] = topk.detach().cpu().numpy()
        if layer == self.layers - 1:
            self._commit()

    def _commit(self) -> None:
        seq_lens, req_ids = self._current_rows
        self._topk.append(self._current)
        self._seq_lens.append(seq_lens)
        self._req_ids.append(req_ids)
        self._current = None
        if self.steps >= self.max_steps:
            self.flush()
            self.done = True
            logger.info("sparse decode trace: %d steps recorded in %s (record_trace_max_steps reached; "
                        "recording stopped)", self.steps, self.path)
        elif self.steps % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        """Write the steps so far (validated; atomic rename)."""
        if not self._topk:
            return
        trace = Trace(topk=np.stack(self._topk), seq_lens=np.stack(self._seq_lens),
                      req_ids=np.stack(self._req_ids), meta=self.meta)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}.npz")
        save_trace(trace, tmp)
        os.replace(tmp, self.path)
