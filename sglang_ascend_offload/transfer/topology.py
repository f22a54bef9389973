"""Non-uniform tensor parallelism between prefill and decode.

Rules, checked when a :class:`PDTopology` is built (configuration time):

* ``p_tp >= d_tp`` and ``p_tp % d_tp == 0``; ``ratio = p_tp // d_tp``;
* prefill rank ``p`` serves decode rank ``d_rank = p // ratio`` as member
  ``member = p % ratio`` of that decode rank's *contribution group*;
* main KV is replicated on prefill, so only member 0 of each group sends; the
  request's main blocks are split into ``d_tp`` disjoint contiguous ranges, decode
  rank ``d`` receives range ``d`` into the TP-shared host pool (union = all blocks);
* every decode rank needs the whole indexer (it is rank-local); the members of its
  group send disjoint contiguous indexer (and LIC8-scale) ranges whose union is the
  whole; a member whose range is empty still answers every layer;
* decode control port = ``kv_port + dp_rank * d_tp + tp_rank``, range-checked.

Ranges are ``(start, count)`` in units of the request's blocks (index into the
request's block list, not physical block ids).

Decode attention TP > 1. The main-KV split above writes each block exactly once into
the decode DP rank's pool, so it is correct only when that pool is *shared* by the
decode TP ranks (:data:`TP_SHARED`: the sparse-decode host pool, one per attention-DP
group). MLA's latent KV is replicated over attention TP, so every decode rank's
attention reads the whole request from the shared pool; it may do so only once every
decode rank of the DP rank has delivered its range (SGLang schedules a request when
the polls of all its TP ranks, all-reduced with MIN, say done; one rank's failure
fails it on all). A decode pool that is private per rank (:data:`PER_RANK`: the device
pool, or a host pool that is not shared) would miss the other ranks' ranges: such a
decode must run attention TP 1 (:meth:`PDTopology.check_main_kv`). :meth:`PDTopology.plan`
lists, per prefill rank, what it sends where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Tuple

from .errors import TopologyError

MAX_PORT = 65535
MIN_PORT = 1024

#: How a decode DP rank holds the main KV: one pool shared by its TP ranks, or one per rank.
MainKVPlacement = Literal["tp_shared", "per_rank"]
TP_SHARED: MainKVPlacement = "tp_shared"
PER_RANK: MainKVPlacement = "per_rank"


def split_range(total: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, count)`` of part ``index`` of ``total`` items in ``parts`` contiguous parts.

    The first ``total % parts`` parts get one extra item; parts are disjoint and
    their union is ``range(total)``. Empty parts have ``count == 0``.
    """
    if total < 0 or parts < 1 or not 0 <= index < parts:
        raise ValueError(f"split_range(total={total}, parts={parts}, index={index}): bad arguments")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


@dataclass(frozen=True)
class PDTopology:
    """Tensor-parallel sizes of one prefill instance and one decode instance."""

    p_tp: int
    d_tp: int

    def __post_init__(self) -> None:
        problems = []
        for name in ("p_tp", "d_tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{name}={v!r} must be a positive int")
        if not problems:
            if self.p_tp < self.d_tp:
                problems.append(f"prefill TP {self.p_tp} < decode TP {self.d_tp}: P/D transfer needs p_tp >= d_tp")
            elif self.p_tp % self.d_tp:
                problems.append(f"prefill TP {self.p_tp} is not a multiple of decode TP {self.d_tp}")
        if problems:
            raise TopologyError(
                "invalid P/D topology: " + "; ".join(problems) + " -> choose tensor-parallel sizes with p_tp = k * d_tp"
            )

    @property
    def ratio(self) -> int:
        """Prefill ranks per decode rank (size of a contribution group)."""
        return self.p_tp // self.d_tp

    def _check_p_rank(self, p_rank: int) -> None:
        if not 0 <= p_rank < self.p_tp:
            raise TopologyError(f"prefill rank {p_rank} out of range 0..{self.p_tp - 1}")

    def _check_d_rank(self, d_rank: int) -> None:
        if not 0 <= d_rank < self.d_tp:
            raise TopologyError(f"decode rank {d_rank} out of range 0..{self.d_tp - 1}")

    def d_rank_of(self, p_rank: int) -> int:
        """Decode TP rank that prefill rank ``p_rank`` sends to."""
        self._check_p_rank(p_rank)
        return p_rank // self.ratio

    def member_of(self, p_rank: int) -> int:
        """Index of ``p_rank`` within its contribution group."""
        self._check_p_rank(p_rank)
        return p_rank % self.ratio

    def contributors(self, d_rank: int) -> List[int]:
        """Prefill ranks of decode rank ``d_rank``'s group, member 0 first."""
        self._check_d_rank(d_rank)
        return [d_rank * self.ratio + m for m in range(self.ratio)]

    def sends_main(self, member: int) -> bool:
        """Only member 0 of a group sends main KV (it is replicated on prefill)."""
        return member == 0

    def main_share(self, num_blocks: int, d_rank: int) -> Tuple[int, int]:
        """Request blocks whose main KV decode rank ``d_rank`` pulls into the shared host pool."""
        self._check_d_rank(d_rank)
        return split_range(num_blocks, self.d_tp, d_rank)

    def indexer_share(self, num_blocks: int, member: int) -> Tuple[int, int]:
        """Request blocks whose indexer (and scale) member ``member`` contributes."""
        if not 0 <= member < self.ratio:
            raise TopologyError(f"group member {member} out of range 0..{self.ratio - 1}")
        return split_range(num_blocks, self.ratio, member)

    def check_main_kv(self, placement: str) -> None:
        """Raise :class:`TopologyError` unless the decode main KV ``placement`` can take this
        topology's main-KV split: any placement at ``d_tp == 1``, :data:`TP_SHARED` above."""
        if placement not in (TP_SHARED, PER_RANK):
            raise TopologyError(f"unknown decode main-KV placement {placement!r}")
        if self.d_tp > 1 and placement != TP_SHARED:
            raise TopologyError(
                f"decode attention TP {self.d_tp} with a per-rank main-KV pool: the P/D protocol writes each "
                "main-KV block once, into the decode DP rank's TP-shared pool, so every other decode rank would "
                "miss it -> enable sparse decode offload on the decode node (its host pool is shared by the "
                "TP ranks) or run decode with attention TP 1 (DP attention: --tp N --dp N --enable-dp-attention)"
            )

    def contribution(self, p_rank: int, num_blocks: int) -> "Contribution":
        """What prefill rank ``p_rank`` sends for a request of ``num_blocks`` blocks."""
        d_rank, member = self.d_rank_of(p_rank), self.member_of(p_rank)
        main = self.main_share(num_blocks, d_rank) if self.sends_main(member) else (0, 0)
        return Contribution(
            p_rank=p_rank, d_rank=d_rank, member=member, main=main, indexer=self.indexer_share(num_blocks, member)
        )

    def plan(self, num_blocks: int) -> List["Contribution"]:
        """Every prefill rank's :class:`Contribution` for a request of ``num_blocks`` blocks,
        in prefill-rank order. Invariants (checked by :func:`check_plan`): the main ranges
        are disjoint and cover the request (each block written once into the TP-shared
        pool); per decode rank the indexer ranges are disjoint and cover the request."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        return [self.contribution(p, num_blocks) for p in range(self.p_tp)]


@dataclass(frozen=True)
class Contribution:
    """One prefill rank's part of a request (ranges ``(start, count)`` in request blocks).

    p_rank: the prefill attention-TP rank; d_rank: the decode rank it sends to (its
    control port); member: its index in that decode rank's contribution group;
    main: the main-KV blocks it writes into the decode DP rank's TP-shared pool
    (``count == 0`` for members > 0 and for empty shares); indexer: the indexer (and
    LIC8-scale) blocks it writes into ``d_rank``'s own indexer cache. Every layer of
    both ranges goes in that layer's batch.
    """

    p_rank: int
    d_rank: int
    member: int
    main: Tuple[int, int]
    indexer: Tuple[int, int]


def _blocks(r: Tuple[int, int]) -> range:
    return range(r[0], r[0] + r[1])


def check_plan(topology: PDTopology, num_blocks: int, plan: List[Contribution]) -> List[str]:
    """Every way ``plan`` breaks the invariants of :meth:`PDTopology.plan` (empty = sound):
    one contribution per prefill rank; main KV written exactly once per block over the
    whole DP rank; each decode rank's indexer written exactly once per block."""
    problems = []
    if sorted(c.p_rank for c in plan) != list(range(topology.p_tp)):
        problems.append(f"contributors {[c.p_rank for c in plan]} are not prefill ranks 0..{topology.p_tp - 1}")
    main: Dict[int, int] = {}
    indexer: Dict[Tuple[int, int], int] = {}
    for c in plan:
        if c.d_rank != topology.d_rank_of(c.p_rank) or c.member != topology.member_of(c.p_rank):
            problems.append(f"prefill rank {c.p_rank} sends to decode rank {c.d_rank} as member {c.member}")
        for b in _blocks(c.main):
            main[b] = main.get(b, 0) + 1
        for b in _blocks(c.indexer):
            indexer[(c.d_rank, b)] = indexer.get((c.d_rank, b), 0) + 1
    if sorted(main) != list(range(num_blocks)) or any(n != 1 for n in main.values()):
        problems.append(f"main KV blocks written {sorted(main.items())}, want each of 0..{num_blocks - 1} once")
    for d in range(topology.d_tp):
        got = {b: n for (dr, b), n in indexer.items() if dr == d}
        if sorted(got) != list(range(num_blocks)) or any(n != 1 for n in got.values()):
            problems.append(
                f"decode rank {d}'s indexer blocks written {sorted(got.items())}, want each of 0..{num_blocks - 1} once"
            )
    return problems


def decode_port(kv_port: int, dp_rank: int, tp_rank: int, d_tp: int) -> int:
    """Control-plane port of decode (dp_rank, tp_rank): ``kv_port + dp_rank * d_tp + tp_rank``.

    Raises :class:`TopologyError` if a rank is out of range or the port leaves
    ``1024..65535``.
    """
    if d_tp < 1 or not 0 <= tp_rank < d_tp or dp_rank < 0:
        raise TopologyError(f"decode port: bad ranks dp_rank={dp_rank} tp_rank={tp_rank} d_tp={d_tp}")
    port = kv_port + dp_rank * d_tp + tp_rank
    if not MIN_PORT <= port <= MAX_PORT:
        raise TopologyError(
            f"decode control port {port} (kv_port {kv_port} + dp_rank {dp_rank} * "
            f"d_tp {d_tp} + tp_rank {tp_rank}) is outside {MIN_PORT}..{MAX_PORT} "
            "-> lower pd_transfer.kv_port"
        )
    return port
