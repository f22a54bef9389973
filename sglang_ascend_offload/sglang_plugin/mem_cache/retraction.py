"""Retraction backups of the plugin's pools on a P/D decode server.

When a P/D decode server retracts a request under memory pressure, SGLang backs up its
KV (``--disaggregation-decode-retraction-backup cpu_tensor``:
``Req.offload_kv_cache`` -> ``pool.get_cpu_copy(slots)``), frees its slots, and on
resume writes the backup into the request's new slots (``pool.load_cpu_copy(backup,
new_slots)``); the prefill is not asked again. The backup is opaque to SGLang.

:class:`RetractedKV` is the plugin's backup: per layer, the request's rows in slot
order, in host memory:

* main KV as ``[n, kv_lora_rank + rope]`` rows (latent | rope, the host pool's row
  format). From the sparse-decode host pool this is a host-to-host copy of rows that
  are already there (no device traffic for the main KV); from a device pool a gather;
* index K as ``[n, index_head_dim]`` rows of each indexer layer (device -> host); with
  the sparse decode pool's int8 (LIM-C8) cache, its int8 rows and their fp16 scales
  ``[n]``, copied as they are (no re-quantisation).

Restoring writes the main rows back through the pool's own write path (the host pool's
append, in TP rank 0's append order on a TP-shared pool) and the index rows through
``set_index_k_buffer``, so everything downstream (the engine's residency, the append
gates of the other TP ranks) sees an ordinary write. The sparse decode engine keeps
no state for the slots: its residency is per row and position, and the restored rows
are bit-identical to the retracted ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class RetractedKV:
    """One retracted request's KV in host memory (see module doc).

    num_tokens: ``n``, the slots backed up; main: per pool layer ``[n, latent + rope]``;
    index_k: per indexer layer ``[n, index_head_dim]``; index_scale: per indexer layer
    ``[n]`` fp16 for an int8 index-K cache, else ``None``. All in the pool's dtypes.
    """

    num_tokens: int
    main: List[torch.Tensor]
    index_k: List[torch.Tensor]
    index_scale: Optional[List[torch.Tensor]] = None

    def check_restore(self, slots: torch.Tensor) -> None:
        if slots.numel() != self.num_tokens:
            raise ValueError(f"retraction backup of {self.num_tokens} tokens restored into {slots.numel()} slots")


def slot_tensor(indices, device) -> torch.Tensor:
    """int64 ``[n]`` slots on ``device`` from SGLang's indices (a tensor or a list)."""
    return torch.as_tensor(indices, dtype=torch.long).reshape(-1).to(device)


def gather_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Host copy of ``buffer.view(-1, D)[slots]`` (``buffer`` in SGLang's paged layout)."""
    flat = buffer.view(-1, buffer.shape[-1])
    return flat.index_select(0, slots.to(flat.device)).to("cpu")


def index_rows(pool, slots: torch.Tensor) -> List[torch.Tensor]:
    """Per indexer layer of ``pool``, the index K rows at ``slots`` (host)."""
    return [gather_rows(pool.index_k_buffer[pool._get_indexer_slot(lid)], slots) for lid in pool.indexer_layer_ids]


def index_scale_rows(pool, slots: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """Per indexer layer of ``pool``, the fp16 index-K scales ``[n]`` at ``slots`` (host), or
    ``None`` when the pool's index K has no scales."""
    scales = getattr(pool, "index_k_scale_buffer", None)
    if scales is None:
        return None
    return [gather_rows(scales[pool._get_indexer_slot(lid)], slots).reshape(-1) for lid in pool.indexer_layer_ids]


def restore_index_rows(pool, backup: RetractedKV, slots: torch.Tensor) -> None:
    device = pool.index_k_buffer.device
    if (backup.index_scale is None) != (getattr(pool, "index_k_scale_buffer", None) is None):
        raise ValueError("retraction backup and pool disagree on the index-K scales (int8 vs bf16 index K)")
    if backup.index_scale is not None:
        for lid, rows, scales in zip(pool.indexer_layer_ids, backup.index_k, backup.index_scale):
            pool.write_index_rows(lid, slots.to(device), rows.to(device), scales.to(device))
        return
    for lid, rows in zip(pool.indexer_layer_ids, backup.index_k):
        pool.set_index_k_buffer(lid, slots.to(device), rows.to(device))
