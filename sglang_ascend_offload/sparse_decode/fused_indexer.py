"""The fused indexer stage of a decode step: LIM / LIM-C8 in place of the indexer plus
the residency step.

Separately, a decode layer runs the lightning indexer (top-k logical positions per query
token) and then the engine steps the layer's residency manager on the batch rows. The
fused operators (``lightning_indexer_manage`` = LIM for a bf16 index-K cache,
``quant_lightning_indexer_manage`` = LIM-C8 for the int8 one; ``ops/fused.py``) do both
in one call, on the residency contract's state of *every* engine row: ``slot_token``
int32 ``[R+1, H]``, ``slot_stamp`` int64 ``[R+1, H]``, ``row_req`` int64 ``[R+1]`` (the
``R`` engine rows plus the sink row), mutated in place.

This module turns the engine's step (:meth:`SparseDecodeEngine.begin_step`: batch rows,
owners, stable lengths, step number) into the operator's residency arguments, and the
operator's all-rows result back into the batch rows' :class:`ResidencyStep`, which the
engine's :meth:`~.engine.SparseDecodeEngine.run_layer` then takes instead of stepping
the manager itself. Rows outside the batch must come out untouched, so they get:

* ``req_ids[r] = row_req[r]`` (their current owner: no reset),
* ``stable_len[r] = INT32_MAX`` (no slot is dropped as speculative),
* no query token (``token_rows`` never names them: an all-padding top-k, so no hit,
  no miss and no new stamp).

With ``n > 1`` speculative verify rows per request (``rows_per_request``), a batch entry
is a request whose ``n`` query tokens (request-major) all name its engine row, and the
operator steps that row once on the union of their top-k (``tokens_per_row = n``), as
the engine's own step does (``ops/request_union.py``).

The residency step inside the operator is exact LRU, the contract itself, so the layer's
manager must be policy ``lru`` holding the contract's state only (``impl="torch"``: the
CPU kernel's derived position map would go stale under the operator's writes);
:func:`check_manager` says so when it is not. Everything here has static shapes and no
host read of device data, so it can run inside a captured decode graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..ops.contract import ResidencyStep
from .policies import ResidencyManager

__all__ = ["ResidencyArgs", "residency_args", "batch_rows_step", "check_manager", "INT32_MAX"]

INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class ResidencyArgs:
    """The residency keyword arguments of one LIM / LIM-C8 call (``R' = R + 1`` state rows).

    token_rows: int32 ``[T]`` the engine row of each query token (``-1``: none, padding).
    req_ids: int64 ``[R']``; stable_len: int32 ``[R']``; step: int64 ``[1]``.
    slot_token / slot_stamp / row_req: the layer's state (the manager's own tensors).
    tokens_per_row: ``n``, the query tokens of one batch entry (its verify rows).
    """

    token_rows: torch.Tensor
    req_ids: torch.Tensor
    stable_len: torch.Tensor
    step: torch.Tensor
    slot_token: torch.Tensor
    slot_stamp: torch.Tensor
    row_req: torch.Tensor
    tokens_per_row: int = 1

    def as_kwargs(self) -> dict:
        return dict(
            token_rows=self.token_rows,
            req_ids=self.req_ids,
            stable_len=self.stable_len,
            step=self.step,
            slot_token=self.slot_token,
            slot_stamp=self.slot_stamp,
            row_req=self.row_req,
            tokens_per_row=self.tokens_per_row,
        )


def check_manager(manager: ResidencyManager) -> None:
    """Refuse a manager the fused indexer cannot step (see the module docstring)."""
    if manager.policy != "lru":
        raise ValueError(
            f"the fused indexer's residency step is exact LRU: policy {manager.policy!r} cannot be "
            "stepped by it (serve policy lru, or set fused_lim to false)"
        )
    if getattr(manager, "impl", "torch") != "torch":
        raise ValueError(
            "the fused indexer writes the residency contract's state in place; the CPU kernel's "
            "manager keeps derived state it would not update (build the engine with "
            "manage_impl='torch')"
        )


def residency_args(
    manager: ResidencyManager,
    rows: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step,
    num_tokens: int,
    rows_per_request: int = 1,
) -> ResidencyArgs:
    """The operator's residency arguments for one layer of a step.

    manager: the layer's manager (:func:`check_manager`). rows int64 ``[B]``: the engine
    row of each batch entry (padding entries on the sink row with ``req_ids = -1``);
    req_ids int64 ``[B]``, stable_len int32 ``[B]``: the step's (the engine's
    :meth:`~.engine.SparseDecodeEngine.begin_step`); step: int or 0-d / ``[1]`` int64
    tensor. num_tokens: ``T``, the query tokens of the layer call, batch entries first
    (``T >= B * n``; tokens past them are padding). rows_per_request: ``n``, query tokens
    per batch entry (request-major).
    """
    table = manager.table
    device = table.row_req.device
    b, n = rows.shape[0], int(rows_per_request)
    if num_tokens < b * n:
        raise ValueError(f"{num_tokens} query tokens for {b} batch entries x {n} rows")
    rows = rows.to(device, torch.int64)
    owners = req_ids.to(device, torch.int64)
    live = owners >= 0
    token_rows = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
    entry_rows = torch.where(live, rows, torch.full_like(rows, -1)).to(torch.int32)
    token_rows[: b * n] = entry_rows.repeat_interleave(n) if n > 1 else entry_rows
    all_req = table.row_req.clone()
    all_req.index_copy_(0, rows, owners)  # padding entries write -1 on the sink row: it stays idle
    all_stable = torch.full_like(table.row_req, INT32_MAX, dtype=torch.int32)
    all_stable.index_copy_(0, rows, stable_len.to(device, torch.int32))
    step_t = (
        step.reshape(1).to(device, torch.int64)
        if isinstance(step, torch.Tensor)
        else torch.tensor([int(step)], dtype=torch.int64, device=device)
    )
    return ResidencyArgs(token_rows, all_req, all_stable, step_t, table.slot_token, table.slot_stamp, table.row_req, n)


def batch_rows_step(full: ResidencyStep, rows: torch.Tensor) -> ResidencyStep:
    """The batch rows' part of an all-rows step (``[R', ...]`` -> ``[B, ...]``, entry ``b``
    for engine row ``rows[b]``), the form :meth:`~.engine.SparseDecodeEngine.run_layer`
    and the graph step take."""
    idx = rows.to(full.slots.device, torch.int64)
    return ResidencyStep(
        hit_mask=full.hit_mask.index_select(0, idx),
        slots=full.slots.index_select(0, idx),
        miss_count=full.miss_count.index_select(0, idx),
        miss_tokens=full.miss_tokens.index_select(0, idx),
        miss_slots=full.miss_slots.index_select(0, idx),
    )


#: A fused indexer op as the registry returns it: (query, key, weights, [scales,] **kwargs)
#: -> :class:`~sglang_ascend_offload.ops.contract.IndexerManageResult`.
FusedIndexerOp = Callable[..., object]
