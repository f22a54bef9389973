"""One prefill TP rank serving several decode instances from the same layer buffers.

A prefill batch can hold requests bound for different decode instances (other
decode servers, or other DP ranks of one server). Each decode rank has its own
control port, so each gets its own :class:`~.prefill_side.PrefillSender`, but a
layer buffer slot holds all of the batch's requests: the slot may be reused only
when *every* decode instance that reads from it has answered. Each sender is
therefore a distinct gate consumer (``pd_read@host:port``), and the slot's gate is
opened once per layer with the consumers of the senders that have live requests
in it (plus, when the layerwise pipeline opens the gate itself, its own save
consumer — it asks :meth:`PrefillFanout.consumers` first).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ..layerwise_prefill.gates import SlotGates
from .prefill_side import PD_CONSUMER, PrefillSender, SourceBlocks
from .status import RequestStatus, TransferState

DecodeAddress = Tuple[str, int]  # (decode host, decode DP rank)
SenderFactory = Callable[[str, int], PrefillSender]  # (decode host, decode dp_rank) -> sender


def consumer_name(sender_host: str, port: int) -> str:
    """Gate consumer of the sender talking to the decode rank at ``host:port``."""
    return f"{PD_CONSUMER}@{sender_host}:{port}"


class PrefillFanout:
    """Senders of one prefill TP rank, one per decode rank it serves, over shared slot gates.

    make_sender(host, dp_rank) must build a :class:`PrefillSender` with ``gates``
    (the same object) and ``begin_gate=False``; the fanout names its consumer.
    """

    def __init__(self, gates: SlotGates, make_sender: SenderFactory):
        self.gates = gates
        self._make_sender = make_sender
        self._lock = threading.Lock()
        self._senders: Dict[DecodeAddress, PrefillSender] = {}
        self._route: Dict[str, PrefillSender] = {}

    def connect(
        self, decode_host: str, decode_dp_rank: int = 0, handshake_timeout_s: Optional[float] = None
    ) -> PrefillSender:
        """The sender for that decode rank, created and handshaken on first use (blocking)."""
        key = (decode_host, decode_dp_rank)
        with self._lock:
            sender = self._senders.get(key)
        if sender is not None:
            return sender
        sender = self._make_sender(decode_host, decode_dp_rank)
        sender.consumer = consumer_name(decode_host, sender.port)
        if sender.begin_gate or sender.gates is not self.gates:
            sender.close()
            raise ValueError("PrefillFanout senders must share its gates and use begin_gate=False")
        try:
            sender.handshake(handshake_timeout_s)
        except Exception:
            sender.close()
            raise
        with self._lock:
            existing = self._senders.setdefault(key, sender)
        if existing is not sender:  # lost a race with another connect
            sender.close()
        return existing

    def add_request(self, request_id: str, num_blocks: int, decode_host: str, decode_dp_rank: int = 0) -> None:
        sender = self.connect(decode_host, decode_dp_rank)
        sender.add_request(request_id, num_blocks)
        with self._lock:
            self._route[request_id] = sender

    def _groups(self, request_ids: Iterable[str]) -> Dict[PrefillSender, List[str]]:
        groups: Dict[PrefillSender, List[str]] = {}
        with self._lock:
            for rid in request_ids:
                sender = self._route.get(rid)
                if sender is None:
                    raise KeyError(f"unknown request {rid!r} (add_request first)")
                groups.setdefault(sender, []).append(rid)
        return groups

    def consumers(self, request_ids: Iterable[str]) -> List[str]:
        """Gate consumers a slot holding ``request_ids`` must wait for (pending requests only)."""
        out = []
        for sender, rids in self._groups(request_ids).items():
            if any(sender.status(r).state is TransferState.PENDING for r in rids):
                out.append(sender.consumer)
        return sorted(out)

    def publish_layer(
        self,
        layer: int,
        slot: int,
        sources: Mapping[str, SourceBlocks],
        finished: Iterable[str] = (),
        begin_gate: bool = True,
        consumers: Optional[List[str]] = None,
    ) -> Dict[str, Optional[int]]:
        """Publish ``layer`` of every request in ``sources`` to its decode rank.

        begin_gate: open the slot's gate here with :meth:`consumers`; pass ``False``
        when the caller opened it with ``consumers`` (the list it got from
        :meth:`consumers`, so the same senders answer). Returns batch id per consumer.
        """
        finished = set(finished)
        groups = self._groups(sources)
        wanted = self.consumers(sources) if consumers is None else list(consumers)
        if begin_gate:
            self.gates.begin(slot, layer, wanted)
        out: Dict[str, Optional[int]] = {}
        todo = [(s, rids) for s, rids in groups.items() if s.consumer in wanted]
        served = {s.consumer for s, _ in todo}
        for name in wanted:  # a P/D consumer with nothing to read here must not hold the slot
            if name.startswith(PD_CONSUMER + "@") and name not in served:
                self.gates.done(slot, layer, name)
        for i, (sender, rids) in enumerate(todo):
            try:
                out[sender.consumer] = sender.publish_layer(
                    layer, slot, {r: sources[r] for r in rids}, finished=[r for r in rids if r in finished]
                )
            except Exception as exc:
                # the gate was opened for senders that will now never answer: release them
                for s, _ in todo[i:]:
                    self.gates.done(slot, layer, s.consumer, error=f"publish failed: {exc}")
                raise
        return out

    def status(self, request_id: str) -> RequestStatus:
        with self._lock:
            sender = self._route.get(request_id)
        if sender is None:
            raise KeyError(f"unknown request {request_id!r}")
        return sender.status(request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            sender = self._route.pop(request_id, None)
        if sender is not None:
            sender.forget(request_id)

    def senders(self) -> List[PrefillSender]:
        with self._lock:
            return list(self._senders.values())

    def close(self) -> None:
        """Close every sender (each releases its open gates with an error)."""
        with self._lock:
            senders, self._senders, self._route = list(self._senders.values()), {}, {}
        for s in senders:
            s.close()
