"""The residency-manager contract (:class:`ResidencyManager`) and the shared template of
the policies that only change the victim order (:class:`RankedManager`).

Every policy shares the mechanism of the contract (``ops/residency.py``: reset,
speculative invalidation, lookup, assignment of the ``i``-th miss to the ``i``-th
victim, stamps ``2*step+1`` for fills and ``2*step+2`` for hits); a policy only decides
the *victim order* among the slots not hit in the step, and may keep extra per-slot
state. Hence every policy satisfies the same invariants (no duplicate positions,
selected tokens resident, no hit evicted, reset on request change, speculative
positions never hit), and the property tests run on all of them.

A policy may also have a compiled CPU kernel (``has_cpu_kernel``): the constructor's
``impl`` chooses, per instance, between the torch reference (``"torch"``) and that
kernel (``"kernel"``); both give the same state and outputs, bit for bit.
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar, Dict, List, Optional, Tuple

import torch

from ...ops.contract import Lookup, ResidencyStep, ResidencyTable
from ...ops.residency import assign_victims, find_slots, lookup, reset_rows, residency_manage

__all__ = ["ManageOp", "IMPLS", "ResidencyManager", "RankedManager", "STAMP_BITS", "MAX_STEP", "member", "slot_flags"]

ManageOp = Callable[..., ResidencyStep]

#: Values of a manager's ``impl``: the torch reference, or the policy's compiled CPU kernel.
IMPLS = ("torch", "kernel")

# Stamps are 2*step+2 < 2**32 for step < 2**31 - 1, so a policy may pack two stamps (or a
# rank and a stamp) into one int64 sort key.
STAMP_BITS = 32
MAX_STEP = (1 << (STAMP_BITS - 1)) - 2


def member(values: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """bool ``[R,A]``: ``values[r,a] >= 0`` and it occurs in ``pool[r,:]`` (``[R,B]``, unique
    non-negative entries per row)."""
    return find_slots(pool, values) >= 0


def slot_flags(rows: int, hot: int, slots: torch.Tensor) -> torch.Tensor:
    """bool ``[R,H]``: ``True`` at every ``slots[r,j] >= 0``."""
    ext = torch.zeros((rows, hot + 1), dtype=torch.bool, device=slots.device)
    col = torch.where(slots >= 0, slots.to(torch.int64), torch.full_like(slots, hot, dtype=torch.int64))
    ext.scatter_(1, col, True)
    return ext[:, :hot]


class ResidencyManager(abc.ABC):
    """Residency state and replacement policy of one layer.

    The state is ``self.table`` (:class:`~sglang_ascend_offload.ops.contract.ResidencyTable`:
    ``slot_token`` int32 ``[R,H]``, ``slot_stamp`` int64 ``[R,H]``, ``row_req`` int64 ``[R]``)
    plus whatever the policy keeps (:meth:`row_state`, :meth:`state`). ``R`` is the number
    of state rows, ``H`` the hot-buffer slots per row (``hot_tokens``), ``K`` the top-k
    width of a step (``K <= H``). The decode engine builds one manager per layer
    (:func:`~sglang_ascend_offload.sparse_decode.policies.make_manager`) and calls
    :meth:`step_rows` once per layer and step.
    """

    #: the policy's name: its key in ``POLICIES`` and its ``policy`` config value
    policy: ClassVar[str] = ""
    #: the policy reads the indexer's ranking (``set_ranked``) every step
    needs_ranked: ClassVar[bool] = False
    #: the policy has a compiled CPU kernel (``impl="kernel"``)
    has_cpu_kernel: ClassVar[bool] = False
    #: the policy has a Triton kernel it steps through on the ``triton`` rung
    has_triton_kernel: ClassVar[bool] = False
    #: the policy steps a ghost exact-LRU table through ``manage_op`` (the guarded policies)
    steps_ghost_lru: ClassVar[bool] = False

    def __init__(
        self,
        rows: int,
        hot_tokens: int,
        device=None,
        manage_op: ManageOp = residency_manage,
        *,
        impl: str = "torch",
        max_positions: Optional[int] = None,
    ):
        """Empty state: every row unowned, every slot empty.

        Args:
            rows: ``R``, the number of state rows (the engine adds one idle padding row).
            hot_tokens: ``H``, the slots per row; every step needs ``K <= H``.
            device: where the state tensors live (``None``: the CPU).
            manage_op: the exact-LRU ``residency_manage`` op of the chosen operator rung
                (reference or Triton); LRU steps through it, the guarded policies step their
                ghost LRU through it, the others ignore it.
            impl: ``"torch"`` (the torch reference, on any device) or ``"kernel"`` (the
                policy's compiled CPU kernel; only where ``has_cpu_kernel``, only on the CPU).
            max_positions: an upper bound of every position the manager will see (the
                token table's width). Only the LRU kernel uses it (it sizes a dense position
                map); ``None`` there means a hash map.

        Raises:
            ValueError: ``impl`` unknown, or ``"kernel"`` for a policy without one or on a
                device other than the CPU.
            CPUKernelUnavailable: ``impl="kernel"`` and the kernel library cannot be built
                or loaded; the message says how to build it or to choose ``impl="torch"``.
                Nothing falls back to the torch reference behind the caller's back.
        """
        self.impl = self._check_impl(impl, device)
        self.manage_op = manage_op
        if impl == "kernel":
            self.load_kernel()  # not built -> an error now, at startup, never in the middle of a step
        self.table = self.new_table(rows, hot_tokens, device, max_positions)

    @classmethod
    def _check_impl(cls, impl: str, device) -> str:
        if impl not in IMPLS:
            raise ValueError(f"impl {impl!r}: expected one of {IMPLS}")
        if impl == "kernel":
            if not cls.has_cpu_kernel:
                raise ValueError(f"policy {cls.policy!r} has no CPU kernel: use impl='torch'")
            if device is not None and torch.device(device).type != "cpu":
                raise ValueError(f"the CPU residency kernel keeps its state on the CPU, not on {device}")
        return impl

    def load_kernel(self) -> None:
        """Load the policy's CPU kernel library (``impl="kernel"`` only; called once, before
        the state is allocated).

        Raises:
            CPUKernelUnavailable: the library cannot be built or loaded here (the message
                names the fix).
        """
        raise NotImplementedError(f"policy {self.policy!r} has no CPU kernel")

    def new_table(self, rows: int, hot_tokens: int, device, max_positions: Optional[int]) -> ResidencyTable:
        """The contract's empty state ``[R,H]`` / ``[R]`` (a kernel may keep it inside its own
        state and return views of it)."""
        return ResidencyTable.empty(rows, hot_tokens, device)

    def all_rows(self) -> torch.Tensor:
        """int64 ``[R]``: every state row, in order (what :meth:`step` passes to the rows form)."""
        return torch.arange(self.table.rows, dtype=torch.int64, device=self.table.row_req.device)

    @abc.abstractmethod
    def step(self, topk: torch.Tensor, req_ids: torch.Tensor, stable_len: torch.Tensor, step) -> ResidencyStep:
        """Decide which of this step's selected tokens are resident, and where the misses go.

        Args:
            topk: int32 ``[R, K]``, the logical token positions each of the ``R`` state rows
                attends this step (the indexer's top-k); ``-1`` entries are padding; the
                valid entries of a row are distinct.
            req_ids: int64 ``[R]``, the request owning each row; ``-1`` marks an idle row,
                whose entries are all treated as padding. A row whose owner differs from
                the one recorded in ``table.row_req`` starts empty (the previous owner's
                slots are forgotten).
            stable_len: int32 ``[R]``, each row's committed length: positions at or past it
                are a speculative suffix, emptied from the row and never counted as hits.
            step: int or 0-d int64 tensor, ``0 <= step <= 2**31 - 2``, monotone across
                calls (it becomes the slots' stamps, i.e. their recency).

        Returns:
            :class:`~sglang_ascend_offload.ops.contract.ResidencyStep`, in top-k order:
            ``hit_mask`` bool ``[R, K]`` (entry was resident; False for padding), ``slots``
            int32 ``[R, K]`` (the remapped top-k: hot-buffer slot of every real entry after
            the step, ``-1`` for padding), ``miss_count`` int32 ``[R]`` and ``miss_tokens`` /
            ``miss_slots`` int32 ``[R, K]`` (the misses' positions and victim slots,
            compacted left, ``-1`` after ``miss_count``): what the caller copies host ->
            hot buffer.

        State: updates ``self.table`` and any policy state in place (a victim slot now
        holds its miss with stamp ``2*step+1``, a hit slot gets ``2*step+2``). Invariants
        every policy is tested for: each real entry has a distinct slot in its row, a
        hit's slot already held that position, a victim slot is never one of this step's
        hits, and the reference implementations have static shapes with no host read of
        device data. The exact algorithm of ``lru`` is in docs/residency_contract.md.

        Raises:
            ValueError: ``K > H``, or ``step`` out of range (policies that pack stamps).
        """

    def row_state(self) -> List[Tuple[object, str]]:
        """Every state tensor whose first dimension is the state row, as ``(owner,
        attribute)`` pairs (``getattr(owner, attribute)`` is the tensor).

        Returns:
            The contract's three first (``slot_token``, ``slot_stamp``, ``row_req`` of
            ``self.table``), then the policy's own. The default :meth:`step_rows` gathers
            and scatters exactly these, so a policy with per-row state must list it here.

        State: none (read-only).
        """
        return [(self.table, "slot_token"), (self.table, "slot_stamp"), (self.table, "row_req")]

    def step_rows(
        self, rows: torch.Tensor, topk: torch.Tensor, req_ids: torch.Tensor, stable_len: torch.Tensor, step
    ) -> ResidencyStep:
        """:meth:`step` for the state rows ``rows`` only (the rows form the engine calls).

        Args:
            rows: int64 ``[B]``, the state rows this batch uses (real rows distinct; idle
                padding entries, with ``req_ids = -1``, may share one row).
            topk, req_ids, stable_len, step: as :meth:`step`, with ``B`` rows in batch
                order.

        Returns:
            :class:`~sglang_ascend_offload.ops.contract.ResidencyStep` with ``[B, ...]``
            tensors, entry ``b`` for state row ``rows[b]``.

        State: only the ``B`` named rows change; the result for each is what :meth:`step`
        would give on that row. With ``impl="kernel"`` the kernel steps those rows in place
        (:meth:`kernel_step_rows`). Otherwise this default gathers the rows of every state
        tensor (:meth:`row_state`), runs :meth:`step` on them and scatters them back:
        ``O(B*H)``, static shapes, no host read.
        """
        if self.impl == "kernel":
            return self.kernel_step_rows(rows, topk, req_ids, stable_len, step)
        refs = self.row_state()
        full = [getattr(owner, name) for owner, name in refs]
        for (owner, name), t in zip(refs, full):
            setattr(owner, name, t.index_select(0, rows))
        try:
            out = self.step(topk, req_ids, stable_len, step)
        finally:
            for (owner, name), t in zip(refs, full):
                t.index_copy_(0, rows, getattr(owner, name))
                setattr(owner, name, t)
        return out

    def kernel_step_rows(
        self, rows: torch.Tensor, topk: torch.Tensor, req_ids: torch.Tensor, stable_len: torch.Tensor, step
    ) -> ResidencyStep:
        """:meth:`step_rows` on the policy's CPU kernel (``impl="kernel"``): same arguments,
        result and state change, bit for bit with the torch reference."""
        raise NotImplementedError(f"policy {self.policy!r} has no CPU kernel")

    def state(self) -> Dict[str, torch.Tensor]:
        """Every state tensor by name, for comparing implementations and inspecting a run.

        Returns:
            ``{"slot_token", "slot_stamp", "row_req"}`` (the contract's) first, then the
            policy's own (e.g. ``slot_prev_stamp``, the guard's ghost table and counters).
            The tensors themselves, not copies: they change with the next step.

        State: none (read-only).
        """
        t = self.table
        return {"slot_token": t.slot_token, "slot_stamp": t.slot_stamp, "row_req": t.row_req}


class RankedManager(ResidencyManager):
    """Template for policies that only change the victim order (torch reference).

    :meth:`step` runs the contract's reset, lookup and assignment and asks the subclass
    for the order of the victims (:meth:`victim_order`) and to keep its own state in step
    (:meth:`on_reset`, :meth:`record`).
    """

    def step(self, topk, req_ids, stable_len, step):
        if self.table.hot_tokens < topk.shape[1]:
            raise ValueError(f"hot_tokens {self.table.hot_tokens} < top_k {topk.shape[1]}")
        if not isinstance(step, torch.Tensor) and not 0 <= step <= MAX_STEP:
            raise ValueError(f"step {step} out of range 0..{MAX_STEP}")
        reset, dropped = reset_rows(self.table, req_ids, stable_len)
        self.on_reset(reset, dropped)
        look = lookup(self.table, topk, req_ids, stable_len)
        order = self.victim_order(look, topk, req_ids, stable_len, step)
        before = self.table.slot_stamp.clone()
        out = assign_victims(self.table, look, order, topk, step)
        self.record(look, out, before)
        return out

    @abc.abstractmethod
    def on_reset(self, reset: torch.Tensor, dropped: torch.Tensor) -> None:
        """Clear policy state of reset rows (bool ``[R]``) and emptied slots (bool ``[R,H]``)."""

    @abc.abstractmethod
    def victim_order(self, look: Lookup, topk, req_ids, stable_len, step) -> torch.Tensor:
        """int64 ``[R,H]`` permutation: evictable slots first in eviction order, hits last."""

    @abc.abstractmethod
    def record(self, look: Lookup, out: ResidencyStep, stamp_before: torch.Tensor) -> None:
        """Update policy state after the assignment (``stamp_before``: stamps before it)."""
