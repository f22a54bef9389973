"""Replacement policies behind one small contract.

A :class:`ResidencyManager` owns the residency state of one layer and turns one
step's inputs (``topk``, ``req_ids``, ``stable_len``, ``step``) into a
:class:`~.residency.ResidencyStep`. Every policy shares the mechanism of the
contract (reset, speculative invalidation, lookup, assignment of the ``i``-th miss
to the ``i``-th victim, stamps ``2*step+1`` / ``2*step+2``); a policy only decides
the *victim order* among the slots that are not hit in this step, and may keep
extra per-slot state. Hence every policy satisfies the same invariants (no
duplicate positions, selected tokens resident, no hit evicted, reset on request
change, speculative positions never hit), and the property tests run on all.

Policies (``policy`` in :class:`~sglang_ascend_offload.config.SparseDecodeOffloadConfig`):

``lru``
    Exact LRU, the contract. Runs through the op ladder (``residency_manage``), so
    ``ops=triton`` swaps in the Triton kernel. State: the contract's tables only.
``lru_k2``
    LRU-2: evict first the slots whose *second most recent* use is oldest (slots
    used once have none and go first), ties by last use, then slot. Protects tokens
    that keep coming back (heavy hitters, the recent window) from one-off noise.
    Extra state: ``slot_prev_stamp`` int64 ``[R,H]``.
``lru_k2_guarded``
    LRU-2 with a hard bound against LRU: a ghost exact-LRU table runs on the same
    inputs; per row the policy may deviate from the ghost's content only as far as
    the misses it has saved pay for (plus a small per-request seed budget), so at
    every step ``misses <= lru_misses + seed + lru_misses >> slack_shift``. See
    :class:`GuardedManager` for the argument. Extra state: the LRU-2 state, a ghost
    :class:`~.residency.ResidencyTable` and two int64 ``[R]`` miss counters.

``score_rank``
    Score-aware eviction from the indexer's own ranking: besides the top-k the step
    supplies ``ranked`` int32 ``[R, D]`` (``D >= K``), the row's positions in descending
    indexer-score order (:meth:`ScoreRankManager.set_ranked`, the trace's ``ranked``
    array). Among the non-hit slots, victims go by their position's current rank:
    positions not in the first ``D`` (and empty slots) first, then the lowest ranked;
    ties (all unranked ones) by recency ``(slot_stamp, slot)``. With ``D == K`` it *is*
    LRU. No persistent state beyond the contract's: the ranks are this step's.
``score_rank_guarded``
    ``score_rank`` bounded against a ghost LRU, exactly as ``lru_k2_guarded``.

Both score policies also run on a CPU kernel (``score_kernel.py``, :data:`KERNEL_MANAGERS`;
``manage_impl`` ``kernel``, or ``auto`` on CPU with the reference rung), bit-identical to
the torch managers above and stepping their own state tensors in place.

Why not "never more misses than LRU" literally: for any deterministic online
policy whose cache content ever differs from LRU's, an input exists on which it
has strictly more misses (keep requesting only what LRU holds), so per-input
dominance pins a policy to LRU itself. The guard gives the closest honest thing:
a bounded, configurable loss in the worst case and the gain of LRU-2 where there
is locality (measured in ``docs/sparse_decode.md``).
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar, Dict, List, Optional, Tuple, Type

import torch

from ..ops.contract import INT64_MAX, Lookup, ResidencyStep, ResidencyTable
from ..ops.residency import (
    assign_victims,
    lookup,
    find_slots,
    reset_rows,
    residency_manage,
)

ManageOp = Callable[..., ResidencyStep]

__all__ = [
    "POLICIES",
    "DEFAULT_POLICY",
    "ResidencyManager",
    "LRUManager",
    "LRU2Manager",
    "GuardedManager",
    "ScoreRankManager",
    "ScoreGuardedManager",
    "RankedInputError",
    "KernelLRUManager",
    "KernelScoreRankManager",
    "KernelScoreGuardedManager",
    "KERNEL_MANAGERS",
    "MANAGE_IMPLS",
    "make_manager",
    "needs_ranked",
    "slot_ranks",
    "uses_cpu_kernel",
]

# Stamps are 2*step+2 < 2**32 for step < 2**31 - 1; LRU-2 packs (prev, last) in 64 bits.
_STAMP_BITS = 32
_MAX_STEP = (1 << (_STAMP_BITS - 1)) - 2


def _member(values: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """bool ``[R,A]``: ``values[r,a] >= 0`` and it occurs in ``pool[r,:]`` (``[R,B]``, unique
    non-negative entries per row)."""
    return find_slots(pool, values) >= 0


def _slot_flags(rows: int, hot: int, slots: torch.Tensor) -> torch.Tensor:
    """bool ``[R,H]``: ``True`` at every ``slots[r,j] >= 0``."""
    ext = torch.zeros((rows, hot + 1), dtype=torch.bool, device=slots.device)
    col = torch.where(slots >= 0, slots.to(torch.int64), torch.full_like(slots, hot, dtype=torch.int64))
    ext.scatter_(1, col, True)
    return ext[:, :hot]


class ResidencyManager(abc.ABC):
    """Residency state and policy of one layer.

    ``step(topk, req_ids, stable_len, step)`` with ``topk`` int32 ``[R,K]``,
    ``req_ids`` int64 ``[R]``, ``stable_len`` int32 ``[R]``, ``step`` int (or 0-d int64
    tensor) returns the :class:`ResidencyStep` and updates ``self.table`` (and any
    policy state) in place.

    ``step_rows(rows, topk, req_ids, stable_len, step)`` is the rows form: inputs and
    outputs ``[B, ...]`` for the state rows ``rows`` int64 ``[B]`` only (real rows
    distinct; any number of idle padding entries may share one row). The default
    gathers the ``B`` rows of every state tensor, runs :meth:`step` on them and
    scatters them back: ``O(B*H)``, static shapes, no host read.
    """

    policy: ClassVar[str] = ""
    #: the policy reads the indexer's ranking (``set_ranked``) every step
    needs_ranked: ClassVar[bool] = False

    def __init__(self, rows: int, hot_tokens: int, device=None, manage_op: ManageOp = residency_manage):
        self.table = ResidencyTable.empty(rows, hot_tokens, device)
        self.manage_op = manage_op

    @abc.abstractmethod
    def step(self, topk: torch.Tensor, req_ids: torch.Tensor, stable_len: torch.Tensor,
             step) -> ResidencyStep:
        """Decide which of this step's selected tokens are resident, and where the misses go.

        Args:
            topk: int32 ``[R, K]``, the logical token positions each of the ``R`` state rows
                attends this step (the indexer's top-k); ``-1`` entries are padding.
            req_ids: int64 ``[R]``, the request owning each row; ``-1`` marks an idle row,
                whose entries are all treated as padding. A row whose owner differs from
                the one recorded in ``table.row_req`` starts empty (the previous owner's
                slots are forgotten).
            stable_len: int32 ``[R]``, each row's committed length: positions at or past it
                are a speculative suffix and never counted as hits.
            step: int or 0-d int64 tensor, a stamp that increases every step (recency).

        Returns:
            :class:`ResidencyStep` in top-k order: ``hit_mask``, ``slots`` (the remapped
            top-k: hot-buffer slot of every real entry after the step, ``-1`` for padding),
            and the misses compacted left (``miss_count`` ``[R]``, ``miss_tokens`` /
            ``miss_slots`` ``[R, K]``) that the caller copies host -> hot buffer.

        State: updates ``self.table`` (and any policy state) in place. Invariants the
        tests hold every policy to: each real entry has a distinct slot in its row, a
        hit's slot already held that position, a victim slot is never one of this
        step's hits, and the result has static shapes with no host read of device data.
        The exact algorithm of ``lru`` is in docs/residency_contract.md.
        """
        ...

    def row_state(self) -> List[Tuple[object, str]]:
        """``(owner, attribute)`` of every state tensor whose first dimension is the row."""
        return [(self.table, "slot_token"), (self.table, "slot_stamp"), (self.table, "row_req")]

    def step_rows(self, rows: torch.Tensor, topk: torch.Tensor, req_ids: torch.Tensor,
                  stable_len: torch.Tensor, step) -> ResidencyStep:
        """:meth:`step` for the state rows ``rows`` only (the rows form).

        Args:
            rows: int64 ``[B]``, the state rows this batch uses (real rows distinct; idle
                padding entries may share one row, with ``req_ids = -1``).
            topk, req_ids, stable_len, step: as :meth:`step`, with ``B`` rows.

        Returns:
            :class:`ResidencyStep` with ``[B, ...]`` tensors.

        State: only the ``B`` rows change. This default gathers the rows of every state
        tensor (:meth:`row_state`), runs :meth:`step` on them and scatters them back:
        ``O(B*H)``, static shapes, no host read; a policy with a cheaper in-place form
        overrides it.
        """
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

    def state(self) -> Dict[str, torch.Tensor]:
        """Every state tensor by name (the contract's three first)."""
        t = self.table
        return {"slot_token": t.slot_token, "slot_stamp": t.slot_stamp, "row_req": t.row_req}


class LRUManager(ResidencyManager):
    """Exact LRU through the ``residency_manage`` op (reference or Triton)."""

    policy = "lru"

    def step(self, topk, req_ids, stable_len, step):
        t = self.table
        return self.manage_op(t.slot_token, t.slot_stamp, t.row_req, topk, req_ids, stable_len, step)


class KernelLRUManager(ResidencyManager):
    """Exact LRU on the CPU kernel (``cpu_kernel.py``): the contract's state plus a
    persistent position map and a maintained eviction order, stepped in place for the
    batch rows only. Same results as :class:`LRUManager` (tested bit for bit)."""

    policy = "lru"

    def __init__(self, rows: int, hot_tokens: int, device=None, manage_op: ManageOp = residency_manage,
                 max_positions: Optional[int] = None):
        from .cpu_kernel import KernelLRUState, library

        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the CPU residency kernel keeps its state on the CPU, not on {device}")
        library()  # build / load now: a missing compiler is a startup error, not a mid-step one
        self.kernel_state = KernelLRUState.empty(rows, hot_tokens, max_positions)
        ks = self.kernel_state
        self.table = ResidencyTable(ks.slot_token, ks.slot_stamp, ks.row_req)
        self.manage_op = manage_op

    def step(self, topk, req_ids, stable_len, step):
        rows = torch.arange(self.table.rows, dtype=torch.int64)
        return self.step_rows(rows, topk, req_ids, stable_len, step)

    def step_rows(self, rows, topk, req_ids, stable_len, step):
        from .cpu_kernel import lru_manage_rows

        hit_mask, slots, miss_count, miss_tokens, miss_slots = lru_manage_rows(
            self.kernel_state, rows.to(torch.int64), topk.to(torch.int32).contiguous(), req_ids.to(torch.int64),
            stable_len.to(torch.int32), step)
        return ResidencyStep(hit_mask=hit_mask, slots=slots, miss_count=miss_count, miss_tokens=miss_tokens,
                             miss_slots=miss_slots)


class RankedManager(ResidencyManager):
    """Template for policies that only change the victim order (torch reference)."""

    def step(self, topk, req_ids, stable_len, step):
        if self.table.hot_tokens < topk.shape[1]:
            raise ValueError(f"hot_tokens {self.table.hot_tokens} < top_k {topk.shape[1]}")
        if not isinstance(step, torch.Tensor) and not 0 <= step <= _MAX_STEP:
            raise ValueError(f"step {step} out of range 0..{_MAX_STEP}")
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
        """Clear policy state of reset rows ``[R]`` and emptied slots ``[R,H]``."""

    @abc.abstractmethod
    def victim_order(self, look: Lookup, topk, req_ids, stable_len, step) -> torch.Tensor:
        """int64 ``[R,H]`` permutation: evictable slots first in eviction order, hits last."""

    @abc.abstractmethod
    def record(self, look: Lookup, out: ResidencyStep, stamp_before: torch.Tensor) -> None:
        """Update policy state after the assignment (``stamp_before``: stamps before it)."""


class LRU2Manager(RankedManager):
    """LRU-2 (see module docstring). Extra state ``slot_prev_stamp`` int64 ``[R,H]``."""

    policy = "lru_k2"

    def __init__(self, rows, hot_tokens, device=None, manage_op=residency_manage):
        super().__init__(rows, hot_tokens, device, manage_op)
        self.prev_stamp = torch.zeros((rows, hot_tokens), dtype=torch.int64, device=device)

    def row_state(self):
        return super().row_state() + [(self, "prev_stamp")]

    def on_reset(self, reset, dropped):
        self.prev_stamp.masked_fill_(reset[:, None] | dropped, 0)

    def victim_order(self, look, topk, req_ids, stable_len, step):
        key = (self.prev_stamp << _STAMP_BITS) | self.table.slot_stamp
        key = key.masked_fill(look.slot_hit, INT64_MAX)
        return torch.sort(key, dim=1, stable=True).indices

    def record(self, look, out, stamp_before):
        rows, hot = self.prev_stamp.shape
        filled = _slot_flags(rows, hot, out.miss_slots)
        self.prev_stamp = torch.where(look.slot_hit, stamp_before, self.prev_stamp)
        self.prev_stamp.masked_fill_(filled, 0)

    def state(self):
        s = super().state()
        s["slot_prev_stamp"] = self.prev_stamp
        return s


class RankedInputError(ValueError):
    """A score-aware policy stepped without the indexer's ranking (``ranked``)."""


def slot_ranks(slot_token: torch.Tensor, ranked: torch.Tensor, stable_len: torch.Tensor) -> torch.Tensor:
    """int64 ``[R,H]``: rank (column of ``ranked``) of each slot's position, ``D`` when the
    position is not in the row's first ``D`` ranked positions (or the slot is empty).

    ``slot_token`` int32 ``[R,H]`` (unique per row, ``-1`` empty), ``ranked`` int ``[R,D]``
    (``-1`` padding), ``stable_len`` int ``[R]`` (ranked positions ``>= stable_len`` are
    ignored: such slots were emptied). Static shapes, no host read.
    """
    rows, hot = slot_token.shape
    depth = ranked.shape[1]
    pos = ranked.to(torch.int64)
    pos = torch.where(pos < stable_len.to(torch.int64)[:, None], pos, torch.full_like(pos, -1))
    found = find_slots(slot_token, pos)  # [R,D] slot holding ranked[r,j], -1 if none
    col = torch.where(found >= 0, found, torch.full_like(found, hot))
    out = torch.full((rows, hot + 1), depth, dtype=torch.int64, device=slot_token.device)
    out.scatter_(1, col, torch.arange(depth, dtype=torch.int64, device=slot_token.device).expand(rows, depth))
    return out[:, :hot]


class ScoreRankManager(RankedManager):
    """Score-aware victims (see module docstring). Call :meth:`set_ranked` with the
    step's ranking before :meth:`step` / :meth:`step_rows` (a static buffer updated in
    place also works: the tensor is read at every step).

    ``smooth_shift`` (class attribute; ``None`` = off): keep per slot an exponential
    average of its rank (fixed point, ``avg += (rank - avg) >> smooth_shift`` each
    step, a fill starts at its rank) and evict by that average instead of the current
    rank: one noisy step below the cut does not doom a position that ranked well for
    a while. Extra state ``slot_rank_avg`` int64 ``[R,H]`` when on.
    """

    policy = "score_rank"
    needs_ranked: ClassVar[bool] = True
    smooth_shift: ClassVar[Optional[int]] = None
    _FIX = 4  # fixed-point fraction bits of the rank average

    def __init__(self, rows, hot_tokens, device=None, manage_op=residency_manage):
        super().__init__(rows, hot_tokens, device, manage_op)
        self._ranked: Optional[torch.Tensor] = None
        self.rank_avg = torch.zeros((rows, hot_tokens), dtype=torch.int64, device=device)

    def set_ranked(self, ranked: torch.Tensor) -> None:
        """int32 ``[B, D]`` (``D >= K``) positions in descending score order for the rows of
        the coming step (the ``[B]`` rows of :meth:`step_rows`, or all rows)."""
        self._ranked = ranked

    def ranked_for(self, topk: torch.Tensor) -> torch.Tensor:
        r = self._ranked
        if r is None:
            raise RankedInputError(
                f"policy {self.policy!r} needs the indexer's ranking (ranked [rows, D >= top-k]) every step: "
                "replay a trace that has a 'ranked' array (record it with record_trace_rank_depth > 0, or "
                "synthesise one with rank_depth > 0), or choose a policy that needs only the top-k (lru, lru_k2, "
                "lru_k2_guarded)")
        if r.dim() != 2 or r.shape[0] != topk.shape[0] or r.shape[1] < topk.shape[1]:
            raise RankedInputError(f"ranked has shape {tuple(r.shape)}; expected [{topk.shape[0]}, D >= {topk.shape[1]}]")
        return r

    def row_state(self):
        extra = [(self, "rank_avg")] if self.smooth_shift is not None else []
        return super().row_state() + extra

    def step(self, topk, req_ids, stable_len, step):
        """On the Triton rung (``manage_op`` of rung ``triton``) the four-launch kernel of
        ``triton_ops/score_rank.py`` (bit-identical); else the torch reference."""
        if getattr(self.manage_op, "rung", "reference") == "triton" and self.smooth_shift is None:
            from ..triton_ops.score_rank import score_rank_manage

            t = self.table
            return score_rank_manage(t.slot_token, t.slot_stamp, t.row_req, topk, req_ids, stable_len, step,
                                     self.ranked_for(topk))
        return super().step(topk, req_ids, stable_len, step)

    def on_reset(self, reset, dropped):
        pass

    def victim_order(self, look, topk, req_ids, stable_len, step):
        ranked = self.ranked_for(topk)
        rank = slot_ranks(self.table.slot_token, ranked, stable_len)
        depth = ranked.shape[1]
        if self.smooth_shift is not None:
            fixed = rank << self._FIX
            avg = self.rank_avg + ((fixed - self.rank_avg) >> self.smooth_shift)
            rank = (avg + (1 << self._FIX) - 1) >> self._FIX
            self.rank_avg = avg
        # unranked (rank D) first, then the lowest ranked; ties by (stamp, slot)
        key = ((depth - rank) << _STAMP_BITS) | self.table.slot_stamp
        key = key.masked_fill(look.slot_hit, INT64_MAX)
        return torch.sort(key, dim=1, stable=True).indices

    def record(self, look, out, stamp_before):
        if self.smooth_shift is None:
            return
        rows, hot = self.rank_avg.shape
        filled = _slot_flags(rows, hot, out.miss_slots)
        # a fill starts its average at its current rank (the position is in the top-k)
        ranked = self._ranked
        fresh = slot_ranks(self.table.slot_token, ranked, torch.full_like(self.table.row_req, 1 << 30)) << self._FIX
        self.rank_avg = torch.where(filled, fresh, self.rank_avg)
        self.rank_avg.masked_fill_(self.table.slot_token < 0, ranked.shape[1] << self._FIX)

    def state(self):
        s = super().state()
        if self.smooth_shift is not None:
            s["slot_rank_avg"] = self.rank_avg
        return s


class SmoothScoreRankManager(ScoreRankManager):
    """``score_rank`` evicting by the exponential average of the rank (``smooth_shift = 1``)."""

    policy = "score_rank_smooth"
    smooth_shift: ClassVar[Optional[int]] = 1


class GuardedManager(ResidencyManager):
    """A ranked policy (LRU-2) bounded against a ghost exact-LRU table.

    Notation per row: ``C`` our resident positions, ``L`` the ghost LRU's, ``S`` this
    step's selection, ``m_C`` / ``m_L`` misses since the request took the row,
    ``phi = |L \\ C|``. Invariant: ``m_L - m_C + slack >= phi`` with
    ``slack = seed + m_L >> slack_shift`` (non-decreasing), hence
    ``m_C <= m_L + slack`` at every step.

    Each step the ghost advances to ``L'``. Our victims are taken in the base
    policy's order, except that at most ``allowance = (m_L' - m_C' + slack') - |(L' \\ S) \\ C|``
    of them may be positions that ``L'`` holds. Taking victims outside ``L'`` never
    increases ``phi`` and such victims always suffice (``|L'| <= H``), and with the
    allowance the invariant holds after the step (``docs/sparse_decode.md`` has the
    two-line proof). With ``seed = 0`` and no slack the policy's content equals the
    ghost's: it *is* LRU.
    """

    policy = "lru_k2_guarded"

    def __init__(self, rows, hot_tokens, device=None, manage_op=residency_manage,
                 base: Optional[RankedManager] = None, seed: int = 16, slack_shift: Optional[int] = None):
        super().__init__(rows, hot_tokens, device, manage_op)
        self.base = base if base is not None else self.make_base(rows, hot_tokens, device, manage_op)
        self.base.table = self.table  # one table: the base policy ranks our own slots
        self.ghost = ResidencyTable.empty(rows, hot_tokens, device)
        self.seed = int(seed)
        self.slack_shift = slack_shift
        self.ghost_misses = torch.zeros((rows,), dtype=torch.int64, device=device)
        self.own_misses = torch.zeros((rows,), dtype=torch.int64, device=device)

    @staticmethod
    def make_base(rows, hot_tokens, device, manage_op) -> RankedManager:
        return LRU2Manager(rows, hot_tokens, device, manage_op)

    def step(self, topk, req_ids, stable_len, step):
        table, ghost = self.table, self.ghost
        rows, hot = table.slot_token.shape
        if hot < topk.shape[1]:
            raise ValueError(f"hot_tokens {hot} < top_k {topk.shape[1]}")
        reset, dropped = reset_rows(table, req_ids, stable_len)
        self.base.on_reset(reset, dropped)
        self.ghost_misses.masked_fill_(reset, 0)
        self.own_misses.masked_fill_(reset, 0)
        g = self.manage_op(ghost.slot_token, ghost.slot_stamp, ghost.row_req, topk, req_ids, stable_len, step)
        look = lookup(table, topk, req_ids, stable_len)

        m_l = self.ghost_misses + g.miss_count.to(torch.int64)
        m_c = self.own_misses + look.miss.sum(dim=1)
        slack = torch.full_like(m_l, self.seed)
        if self.slack_shift is not None:
            slack = slack + (m_l >> self.slack_shift)
        ghost_sel = _slot_flags(rows, hot, g.slots)
        ghost_missing = (ghost.slot_token >= 0) & ~ghost_sel & ~_member(ghost.slot_token, table.slot_token)
        allowance = (m_l - m_c + slack) - ghost_missing.sum(dim=1)

        base_order = self.base.victim_order(look, topk, req_ids, stable_len, step)
        protected = _member(table.slot_token, ghost.slot_token) & ~look.slot_hit
        prot_in_order = torch.gather(protected, 1, base_order)
        over = torch.cumsum(prot_in_order.to(torch.int64), dim=1) > allowance[:, None]
        group = torch.where(torch.gather(look.slot_hit, 1, base_order), 2,
                            (prot_in_order & over).to(torch.int64))
        # stable partition of base_order by group; only the first K entries can be used
        width = min(hot, max(1, look.miss.shape[1]))
        key = group * hot + torch.arange(hot, device=group.device)
        first = torch.topk(key, width, dim=1, largest=False, sorted=True).indices
        order = torch.gather(base_order, 1, first)

        before = table.slot_stamp.clone()
        out = assign_victims(table, look, order, topk, step)
        self.base.record(look, out, before)
        self.ghost_misses.copy_(m_l)
        self.own_misses.copy_(m_c)
        return out

    def row_state(self):
        g = self.ghost
        base_extra = self.base.row_state()[3:]  # the base shares our table: its extra state only
        return (super().row_state() + base_extra + [(g, "slot_token"), (g, "slot_stamp"),
                                                    (g, "row_req"), (self, "ghost_misses"), (self, "own_misses")])

    def state(self):
        s = self.base.state()
        s.update({"ghost_slot_token": self.ghost.slot_token, "ghost_slot_stamp": self.ghost.slot_stamp,
                  "ghost_row_req": self.ghost.row_req, "ghost_misses": self.ghost_misses,
                  "own_misses": self.own_misses})
        return s


class ScoreGuardedManager(GuardedManager):
    """``score_rank`` bounded against a ghost LRU (the guard of :class:`GuardedManager`)."""

    policy = "score_rank_guarded"
    needs_ranked: ClassVar[bool] = True

    @staticmethod
    def make_base(rows, hot_tokens, device, manage_op) -> RankedManager:
        return ScoreRankManager(rows, hot_tokens, device, manage_op)

    def set_ranked(self, ranked: torch.Tensor) -> None:
        self.base.set_ranked(ranked)


class _ScoreKernelMixin:
    """Steps a score policy on the CPU kernel of ``score_kernel.py`` in place on the torch
    manager's own state (so :meth:`state` is the torch one); same results, bit for bit."""

    def _init_kernel(self, device) -> None:
        from .score_kernel import library

        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the score-aware CPU kernel keeps its state on the CPU, not on {device}")
        library()  # not built -> a startup error naming the setup script, never a fallback

    def step(self, topk, req_ids, stable_len, step):
        rows = torch.arange(self.table.rows, dtype=torch.int64)
        return self.step_rows(rows, topk, req_ids, stable_len, step)

    def _guard(self):
        return None, 0, None

    def step_rows(self, rows, topk, req_ids, stable_len, step):
        from .score_kernel import score_rank_manage_rows

        t = self.table
        guard, seed, shift = self._guard()
        out = score_rank_manage_rows(
            t.slot_token, t.slot_stamp, t.row_req, rows.to(torch.int64).contiguous(),
            topk.to(torch.int32).contiguous(), req_ids.to(torch.int64).contiguous(),
            stable_len.to(torch.int32).contiguous(), self.ranked_for(topk).to(torch.int32).contiguous(),
            int(step), guard, seed, shift)
        return ResidencyStep(*out)


class KernelScoreRankManager(_ScoreKernelMixin, ScoreRankManager):
    """``score_rank`` on the CPU kernel (``manage_impl`` ``kernel`` / ``auto`` on CPU)."""

    def __init__(self, rows, hot_tokens, device=None, manage_op=residency_manage, max_positions=None):
        self._init_kernel(device)
        super().__init__(rows, hot_tokens, device, manage_op)


class KernelScoreGuardedManager(_ScoreKernelMixin, ScoreGuardedManager):
    """``score_rank_guarded`` on the CPU kernel (ghost LRU, counters and guard included)."""

    def __init__(self, rows, hot_tokens, device=None, manage_op=residency_manage, max_positions=None):
        self._init_kernel(device)
        super().__init__(rows, hot_tokens, device, manage_op)

    def ranked_for(self, topk):
        return self.base.ranked_for(topk)

    def _guard(self):
        g = self.ghost
        return ((g.slot_token, g.slot_stamp, g.row_req, self.ghost_misses, self.own_misses), self.seed,
                self.slack_shift)


POLICIES: Dict[str, Type[ResidencyManager]] = {
    LRUManager.policy: LRUManager,
    LRU2Manager.policy: LRU2Manager,
    GuardedManager.policy: GuardedManager,
    ScoreRankManager.policy: ScoreRankManager,
    ScoreGuardedManager.policy: ScoreGuardedManager,
    SmoothScoreRankManager.policy: SmoothScoreRankManager,
}


def needs_ranked(policy: str) -> bool:
    """Whether ``policy`` must be given the indexer's ranking every step."""
    return bool(getattr(POLICIES.get(policy), "needs_ranked", False))
DEFAULT_POLICY = LRUManager.policy  # the contract; the only policy with Triton kernels


#: ``manage_impl`` choices of :func:`make_manager` / the engine.
MANAGE_IMPLS = ("auto", "kernel", "torch")


#: Policies with a CPU kernel: ``lru`` (``cpu_kernel.py``), the score policies (``score_kernel.py``).
KERNEL_MANAGERS: Dict[str, Type[ResidencyManager]] = {
    LRUManager.policy: KernelLRUManager,
    ScoreRankManager.policy: KernelScoreRankManager,
    ScoreGuardedManager.policy: KernelScoreGuardedManager,
}


def uses_cpu_kernel(policy: str, manage_impl: str, device, manage_op: ManageOp) -> bool:
    """Whether :func:`make_manager` picks a CPU kernel: ``kernel`` always (policies of
    :data:`KERNEL_MANAGERS` only), ``auto`` for those policies on a CPU device when the op
    resolved to the reference rung, ``torch`` never."""
    if manage_impl not in MANAGE_IMPLS:
        raise ValueError(f"manage_impl {manage_impl!r}: expected one of {MANAGE_IMPLS}")
    if manage_impl == "kernel":
        if policy not in KERNEL_MANAGERS:
            raise ValueError(f"the CPU residency kernels implement policies {', '.join(KERNEL_MANAGERS)} only, "
                             f"not {policy!r}")
        return True
    cpu = device is None or torch.device(device).type == "cpu"
    return (manage_impl == "auto" and policy in KERNEL_MANAGERS and cpu
            and getattr(manage_op, "rung", "reference") == "reference")


def make_manager(policy: str, rows: int, hot_tokens: int, device=None,
                 manage_op: ManageOp = residency_manage, *, manage_impl: str = "torch",
                 max_positions: Optional[int] = None) -> ResidencyManager:
    """A fresh manager of ``policy`` for one layer; unknown names list the known ones.

    ``manage_impl``: ``torch`` (default here: the op ladder / torch policies),
    ``kernel`` (a CPU kernel: ``lru``, ``score_rank``, ``score_rank_guarded``) or ``auto`` (see :func:`uses_cpu_kernel`).
    ``max_positions`` sizes the kernel's dense position map (hash map without it).
    """
    cls = POLICIES.get(policy)
    if cls is None:
        raise ValueError(f"unknown residency policy {policy!r}; known: {', '.join(POLICIES)}")
    if uses_cpu_kernel(policy, manage_impl, device, manage_op):
        return KERNEL_MANAGERS[policy](rows, hot_tokens, device, manage_op, max_positions=max_positions)
    return cls(rows, hot_tokens, device, manage_op)
