"""Request transfer states and how decode TP ranks' states combine.

A request's transfer is ``pending`` until it is terminal: ``done`` (every byte
arrived and every contributor confirmed it) or ``failed`` (with a reason). On the
decode side a request is *schedulable* only when every decode TP rank reports
``done``; one ``failed`` rank fails the request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class TransferState(str, enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class RequestStatus:
    """State of one request's transfer on one rank; ``reason`` explains a failure."""

    state: TransferState
    reason: str = ""

    @property
    def terminal(self) -> bool:
        return self.state is not TransferState.PENDING


PENDING = RequestStatus(TransferState.PENDING)
DONE = RequestStatus(TransferState.DONE)


def combine_rank_statuses(statuses: Sequence[RequestStatus]) -> RequestStatus:
    """Status of a request across all decode TP ranks of its DP rank.

    ``failed`` if any rank failed (reasons joined), ``done`` only if every rank is
    done, otherwise ``pending``. An empty sequence is a programming error.
    """
    if not statuses:
        raise ValueError("combine_rank_statuses needs the status of every decode TP rank")
    failed = [f"rank {i}: {s.reason}" for i, s in enumerate(statuses) if s.state is TransferState.FAILED]
    if failed:
        return RequestStatus(TransferState.FAILED, "; ".join(failed))
    if all(s.state is TransferState.DONE for s in statuses):
        return DONE
    return PENDING
