"""Per-forward metadata of the ``ascend_offload`` backend (TND / PA_BSND conventions).

Field names follow SGLang's Ascend backend (``ascend_backend.py::ForwardMetadata``)
so SGLang's NPU indexer (``dsa_npu_indexer.py::forward_npu``), which reads
``forward_metadata.block_tables`` / ``seq_lens`` / ``seq_lens_cpu_int`` /
``actual_seq_lengths_q``, runs unchanged under this backend on an NPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from .. import compat

# SGLang's per-forward batch (its fields are read through compat.field)
FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"


@dataclass
class DSAForwardMetadata:
    """Metadata of one forward batch of ``B`` requests and ``T`` query tokens.

    seq_lens:              int32 [B]  KV length per request after this forward (device)
    seq_lens_cpu_int:      int32 [B]  the same on the host
    actual_seq_lengths_q:  int32 [B]  cumulative query tokens (TND); ends at T
    block_tables:          int32 [B, max_blocks] page ids, ``req_to_token[r, ::page] // page``
    q_lens_cpu:            query tokens per request (host list)
    req_pool_indices:      int64 [B] rows of ``req_to_token``
    real_batch_size:       the first ``real_batch_size`` requests are real, the rest is
                           DP-attention padding (:func:`real_batch_size`); ``None`` = all
    """

    seq_lens: torch.Tensor
    seq_lens_cpu_int: torch.Tensor
    actual_seq_lengths_q: torch.Tensor
    block_tables: torch.Tensor
    q_lens_cpu: List[int]
    req_pool_indices: torch.Tensor
    is_decode: bool
    real_batch_size: Optional[int] = None

    @property
    def real_requests(self) -> int:
        return self.batch_size if self.real_batch_size is None else self.real_batch_size

    @property
    def batch_size(self) -> int:
        return len(self.q_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens_cpu))


def real_batch_size(forward_batch) -> int:
    """Requests of ``forward_batch`` that are not DP-attention padding.

    With DP attention SGLang 0.5.23 pads a rank's batch to the size shared by the DP
    group (``MAX_LEN`` padding, ``ForwardBatch._pad_inputs_to_size``): trailing rows
    with ``req_pool_indices`` 0 and sequence length 1, i.e. aliases of ``req_to_token``
    row 0, which may belong to a live request. ``rids`` is not padded, and for decode
    ``_original_num_tokens`` (one token per request) is the count before padding.
    Per-row state (the sparse decode engine's residency, the layerwise page book) must
    only see the first ``real_batch_size`` rows.
    """
    n = int(forward_batch.batch_size)
    rids = compat.field(forward_batch, FORWARD_BATCH, "rids")
    if rids is not None:
        n = min(n, len(rids))
    original = compat.field(forward_batch, FORWARD_BATCH, "_original_num_tokens")
    if original is not None and forward_batch.forward_mode.is_decode():
        n = min(n, int(original))
    return n


def block_tables_from(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_seq_len: int, page_size: int
) -> torch.Tensor:
    """int32 [B, ceil(max_seq_len / page_size)] page ids of each request's positions."""
    blocks = max(1, -(-max_seq_len // page_size))
    cols = torch.arange(blocks, device=req_to_token.device) * page_size
    cols = cols.clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[req_pool_indices.to(torch.long)][:, cols]
    return torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)


def build_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    q_lens_cpu: Optional[List[int]],
    page_size: int,
    device: torch.device,
    is_decode: bool,
) -> DSAForwardMetadata:
    """Eager metadata for a batch (``q_lens_cpu=None`` means one query token per request)."""
    lens = [int(v) for v in seq_lens_cpu.tolist()]
    q_lens = [1] * len(lens) if q_lens_cpu is None else [int(v) for v in q_lens_cpu]
    seq_cpu = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor(q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return DSAForwardMetadata(
        seq_lens=seq_cpu.to(device),
        seq_lens_cpu_int=seq_cpu,
        actual_seq_lengths_q=cu.to(device),
        block_tables=block_tables_from(req_to_token, req_pool_indices, max(lens, default=1), page_size),
        q_lens_cpu=q_lens,
        req_pool_indices=req_pool_indices.to(torch.long),
        is_decode=is_decode,
    )


def free_request_rows(engine: Any, req_to_token_pool: Any):
    """For a sparse decode engine with ``residency: adaptive``: a callable giving the
    ``req_to_token`` rows no request holds now (SGLang's ``free_slots``), whose hot buffers
    a direct request may borrow (read only when the engine needs them); ``None`` without
    adaptive residency, or where the pool does not list its free rows."""
    if getattr(engine, "direct", None) is None or not hasattr(req_to_token_pool, "free_slots"):
        return None
    return lambda: req_to_token_pool.free_slots
