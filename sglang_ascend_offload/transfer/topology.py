"""Non-uniform tensor parallelism between prefill and decode (seed 000 §6).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from .errors import TopologyError

MAX_PORT = 65535
MIN_PORT = 1024


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
                problems.append(f"prefill TP {self.p_tp} < decode TP {self.d_tp}: "
                                "P/D transfer needs p_tp >= d_tp")
            elif self.p_tp % self.d_tp:
                problems.append(f"prefill TP {self.p_tp} is not a multiple of decode TP {self.d_tp}")
        if problems:
            raise TopologyError("invalid P/D topology: " + "; ".join(problems)
                                + " -> choose tensor-parallel sizes with p_tp = k * d_tp")

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


def decode_port(kv_port: int, dp_rank: int, tp_rank: int, d_tp: int) -> int:
    """Control-plane port of decode (dp_rank, tp_rank): ``kv_port + dp_rank * d_tp + tp_rank``.

    Raises :class:`TopologyError` if a rank is out of range or the port leaves
    ``1024..65535``.
    """
    if d_tp < 1 or not 0 <= tp_rank < d_tp or dp_rank < 0:
        raise TopologyError(f"decode port: bad ranks dp_rank={dp_rank} tp_rank={tp_rank} d_tp={d_tp}")
    port = kv_port + dp_rank * d_tp + tp_rank
    if not MIN_PORT <= port <= MAX_PORT:
        raise TopologyError(f"decode control port {port} (kv_port {kv_port} + dp_rank {dp_rank} * "
                            f"d_tp {d_tp} + tp_rank {tp_rank}) is outside {MIN_PORT}..{MAX_PORT} "
                            "-> lower pd_transfer.kv_port")
    return port
