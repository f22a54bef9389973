"""``lru``: exact LRU, the residency contract itself (``docs/residency_contract.md``).

Two implementations, chosen per manager by ``impl`` (``make_manager``'s ``manage_impl``
resolves to it):

``"torch"``
    Steps through the ``residency_manage`` op of the operator ladder, so ``ops=triton``
    swaps in the Triton kernel and ``ops=reference`` runs the torch specification. State:
    the contract's table only.
``"kernel"``
    The compiled CPU kernel of :mod:`..cpu_kernel` (``csrc/lru_cpu.cpp``): the contract's
    state plus a persistent position map and a maintained eviction order
    (:class:`~sglang_ascend_offload.sparse_decode.cpu_kernel.KernelLRUState`), stepped in
    place for the batch rows only. Same state and outputs as the reference, bit for bit
    (``tests/sparse_decode/test_cpu_kernel.py``). It is the CPU serving path: keeping
    the eviction order and the position map between steps instead of rebuilding them
    makes a production-shape step about two orders of magnitude cheaper than the torch
    reference (``docs/sparse_decode.md`` has the measurements). The library is built on
    first use when missing;
    :class:`~sglang_ascend_offload.sparse_decode.cpu_kernel.CPUKernelUnavailable` says how
    to fix a missing compiler.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.contract import ResidencyStep, ResidencyTable
from .base import ResidencyManager

__all__ = ["LRUManager"]


class LRUManager(ResidencyManager):
    """Exact LRU: the ``residency_manage`` op (``impl="torch"``) or the CPU kernel
    (``impl="kernel"``; ``max_positions`` sizes its dense position map, a hash map without
    it). The kernel's derived state is ``self.kernel_state``; ``self.table`` views its
    contract part."""

    policy = "lru"
    has_cpu_kernel = True

    def load_kernel(self) -> None:
        from ..cpu_kernel import library

        library()  # builds the library when missing; CPUKernelUnavailable without a compiler

    def new_table(self, rows: int, hot_tokens: int, device, max_positions: Optional[int]) -> ResidencyTable:
        if self.impl != "kernel":
            return super().new_table(rows, hot_tokens, device, max_positions)
        from ..cpu_kernel import KernelLRUState

        self.kernel_state = KernelLRUState.empty(rows, hot_tokens, max_positions)
        ks = self.kernel_state
        return ResidencyTable(ks.slot_token, ks.slot_stamp, ks.row_req)

    def step(self, topk, req_ids, stable_len, step):
        if self.impl == "kernel":
            return self.step_rows(self.all_rows(), topk, req_ids, stable_len, step)
        t = self.table
        return self.manage_op(t.slot_token, t.slot_stamp, t.row_req, topk, req_ids, stable_len, step)

    def kernel_step_rows(self, rows, topk, req_ids, stable_len, step) -> ResidencyStep:
        from ..cpu_kernel import lru_manage_rows

        hit_mask, slots, miss_count, miss_tokens, miss_slots = lru_manage_rows(
            self.kernel_state,
            rows.to(torch.int64),
            topk.to(torch.int32).contiguous(),
            req_ids.to(torch.int64),
            stable_len.to(torch.int32),
            step,
        )
        return ResidencyStep(
            hit_mask=hit_mask, slots=slots, miss_count=miss_count, miss_tokens=miss_tokens, miss_slots=miss_slots
        )
