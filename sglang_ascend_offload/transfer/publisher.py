"""The prefill side of P/D behind one interface: :class:`PrefillPublisher`.

A prefill TP rank publishes each request's KV layer by layer to its decode peer. Two
publishers implement it, chosen by the KV pool the rank serves from:

==========================================  ================================================
publisher                                   when a request is published
==========================================  ================================================
:class:`~.prefill_links.PrefillLinks`       after the forward that computed its last chunk
                                            (device pool: every layer is still in memory);
                                            :meth:`~PrefillPublisher.last_chunk_sent` queues it
:class:`~.layerwise_publisher.LayerwisePublisher`  during that forward, from the layerwise
                                            prefill pool's layer listener (shared layer
                                            buffers are reused); the request is announced
                                            first (:meth:`~PrefillPublisher.begin_batch`,
                                            :meth:`~PrefillPublisher.expect`) and
                                            :meth:`~PrefillPublisher.last_chunk_sent` only
                                            checks the pages that were published
==========================================  ================================================

Both take the same constructor arguments (``config, *, p_tp, p_rank, pool, engine,
max_blocks=None, staging_slots=2, draft_pool=None``) and report the same per-request states
(:class:`~.status.RequestStatus`: ``pending`` / ``done`` / ``failed`` with a reason).
Requests are named by an integer *room* (SGLang's bootstrap room in the plugin);
decode peers by a *session* string with their :class:`~.advert.DecodeAdvert`.
Nothing here imports SGLang: the plugin's KV manager (``sglang_plugin/disaggregation/ascend_offload/conn.py``)
holds one publisher and calls only this interface.
"""

from __future__ import annotations

import abc
import time
from typing import Any, ClassVar, Optional, Sequence

from .. import config as cfg
from . import pool_layouts
from .advert import DecodeAdvert
from .engine import TransferEngine
from .status import RequestStatus

__all__ = ["PrefillPublisher", "unit_id", "wait_terminal"]


def unit_id(room: int) -> str:
    """Protocol request id of room ``room`` (both sides use it)."""
    return str(int(room))


class PrefillPublisher(abc.ABC):
    """What a prefill rank's KV manager calls on its publisher (see module doc).

    ``publishes_during_forward``: ``True`` when requests must be announced before the
    forward that computes their last chunk (:meth:`begin_batch`, :meth:`expect`).
    """

    publishes_during_forward: ClassVar[bool] = False

    def __init__(
        self,
        config: cfg.PDTransferConfig,
        *,
        p_tp: int,
        p_rank: int,
        pool: Any,
        engine: TransferEngine,
        max_blocks: Optional[int] = None,
        staging_slots: int = 2,
        draft_pool: Any = None,
    ):
        """Check ``pool`` (:func:`~.pool_layouts.check_pool`; the layerwise pool only for a
        publisher that publishes during the forward) and keep the arguments.

        config: the P/D config; p_tp / p_rank: this rank's attention TP size and rank;
        engine: the started transfer engine (the publisher registers the pool with it);
        max_blocks: the most pages one request can have (default: the pool's);
        staging_slots: packing staging slots per ``host_rows`` decode peer;
        draft_pool: the speculative draft model's device pool (``None`` without one): its
        layers are published after ``pool``'s, as logical layers ``pool.layer_num ..``.
        """
        pool_layouts.check_pool(pool, allow_layerwise=self.publishes_during_forward)
        if draft_pool is not None:
            pool_layouts.check_draft_pool(pool, draft_pool)
        self.draft_pool = draft_pool
        #: logical layers of every request: the base layers, then the draft layers
        self.num_layers = pool.layer_num + (draft_pool.layer_num if draft_pool is not None else 0)
        self.config = config
        self.p_tp = p_tp
        self.p_rank = p_rank
        self.pool = pool
        self.engine = engine
        self.max_blocks = max_blocks
        self.staging_slots = staging_slots

    @abc.abstractmethod
    def note_peer(self, session: str, advert: Optional[DecodeAdvert], error: str = "") -> None:
        """Record decode peer ``session``'s advert, or (``advert=None``) why it has none:
        every request to it then fails with ``error``."""

    def begin_batch(self) -> None:
        """A new batch is about to run (publishers that publish during the forward drop
        announcements no forward picked up). Default: nothing to do."""

    def expect(self, row: int, room: int, session: str) -> None:
        """The next forward computes ``room``'s last chunk in request row ``row``; send it
        to ``session``. Only for publishers with ``publishes_during_forward``."""
        raise RuntimeError(f"{type(self).__name__} publishes after the forward; nothing is announced to it")

    @abc.abstractmethod
    def last_chunk_sent(self, room: int, sessions: Sequence[str], pages: Sequence[int], wait_event: Any = None) -> None:
        """The scheduler sends ``room``'s last chunk: ``pages`` are all of the request's
        pages in order, ``sessions`` its decode peers (exactly one is supported);
        ``wait_event`` (optional) completes when the forward that wrote them did."""

    @abc.abstractmethod
    def status(self, room: int) -> Optional[RequestStatus]:
        """``None`` while ``room`` is unknown, else its state (terminal once done / failed)."""

    @abc.abstractmethod
    def cancel(self, room: int, reason: str) -> None:
        """The scheduler gave up on ``room``: stop publishing it and fail it with ``reason``."""

    @abc.abstractmethod
    def forget(self, room: int) -> None:
        """Drop ``room``'s bookkeeping (a pending one is cancelled first)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop publishing (open gates answered) and unregister the memory."""


def wait_terminal(publisher: PrefillPublisher, room: int, timeout_s: float) -> Optional[RequestStatus]:
    """Poll ``publisher.status(room)`` until terminal or ``timeout_s`` (tests, tools)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = publisher.status(room)
        if (st is not None and st.terminal) or time.monotonic() >= deadline:
            return st
        time.sleep(0.01)
