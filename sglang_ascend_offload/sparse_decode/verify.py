"""Checks that the offloaded path equals the full-KV path (used by replay and tests).

* :func:`resident_mismatches`: every slot that claims a position holds exactly that
  position's host row (bit-exact).
* :func:`full_kv_attention`: the same sparse attention op over the whole host pool
  with the logical top-k mapped through the token table -- what the offloaded output
  must ``torch.equal``.
* :func:`remap_mismatches`: the remapped slot of each valid entry holds that entry.
"""

from __future__ import annotations

import torch

from ..ops.contract import ResidencyStep, ResidencyTable
from .host_pool import HostKVPool

__all__ = ["resident_mismatches", "full_kv_attention", "remap_mismatches", "logical_to_host"]


def logical_to_host(topk: torch.Tensor, token_table: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, K]`` host slots of the logical ``topk`` (``-1`` stays ``-1``)."""
    tt = token_table.to(topk.device)
    slots = torch.gather(tt.to(torch.int64), 1, topk.to(torch.int64).clamp(min=0))
    return torch.where(topk >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


def resident_mismatches(
    table: ResidencyTable, hot_layer: torch.Tensor, host_layer: torch.Tensor, token_table: torch.Tensor
) -> int:
    """Number of occupied slots whose ``[D]`` content differs from their host row.

    table: one layer's residency; hot_layer ``[R, H, D]``; host_layer ``[S, D]``;
    token_table int32 ``[R, max_ctx]``.
    """
    occupied = table.slot_token >= 0
    host_slots = logical_to_host(torch.where(occupied, table.slot_token, -1), token_table).to(torch.int64)
    expected = host_layer[host_slots.clamp(min=0).cpu()].to(hot_layer.device)
    expected = torch.where(occupied[:, :, None], expected, hot_layer)  # free slots: anything goes
    if torch.equal(expected, hot_layer):
        return 0
    differs = (hot_layer != expected).any(dim=2)
    return int(differs.sum())


def remap_mismatches(table: ResidencyTable, topk: torch.Tensor, res: ResidencyStep) -> int:
    """Valid entries whose remapped slot does not hold them (plus padding not ``-1``)."""
    valid = (topk >= 0) & (table.row_req >= 0)[:, None]
    held = torch.gather(table.slot_token, 1, res.slots.to(torch.int64).clamp(min=0))
    bad_valid = valid & (held != topk)
    bad_pad = ~valid & (res.slots != -1)
    return int(bad_valid.sum() + bad_pad.sum())


def full_kv_attention(
    attention_op,
    pool: HostKVPool,
    layer: int,
    topk: torch.Tensor,
    token_table: torch.Tensor,
    query: torch.Tensor,
    query_rope: torch.Tensor,
    scale: float,
    device=None,
) -> torch.Tensor:
    """The attention op over the full host KV of ``layer`` with logical indices, run on
    ``device`` (default the host): a device rung (``npu``) takes device tensors only, so
    the pool's rows, the indices and the queries are copied there (contiguous)."""
    where = torch.device("cpu") if device is None else torch.device(device)
    indices = logical_to_host(topk.cpu(), token_table.cpu()).unsqueeze(1)

    def on(t: torch.Tensor) -> torch.Tensor:
        return t if where.type == "cpu" else t.to(where).contiguous()

    return attention_op(
        on(query.cpu()),
        on(pool.latent(layer)),
        None,
        on(indices),
        scale,
        query_rope=on(query_rope.cpu()),
        key_rope=on(pool.rope(layer)),
        layout_query="TND",
        layout_kv="flat",
    )
