"""Completion gates keyed by physical storage slot.

Several logical layers alias one physical device buffer ("slot"). Before a slot
is overwritten with layer ``L``'s KV, every consumer of its previous content
(layer ``L'``) must have finished: the host save, and with P/D disaggregation the
decode side's remote read (READ_DONE / READ_FAILED). :class:`SlotGates` holds one
gate per slot:

* the producer calls :meth:`SlotGates.wait_free` (with a deadline), then
  :meth:`SlotGates.begin` naming the new content's layer and its consumers, then
  writes the slot;
* each consumer calls :meth:`SlotGates.done` once it no longer needs the content,
  with ``error=...`` if it failed.

Error semantics (chosen so that a raised :class:`GateError` never leaves a slot
that is still being read): :meth:`wait_free` waits until **every** consumer of the
current content has called :meth:`done`; only then, if any of them reported an
error, it raises :class:`GateError` listing all errors. The slot itself is free at
that point (nobody reads it any more); the error belongs to the request whose
content it was. Errors stay recorded (every later :meth:`wait_free` raises again)
until the next :meth:`begin` replaces the content. A consumer that never answers
makes :meth:`wait_free` raise :class:`GateTimeout` at its deadline, naming the slot,
the layer and the consumers still pending (and errors already reported).

Everything here is thread-safe: one lock guards all slots and each slot has its
own condition variable on that lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["GateTimeout", "GateError", "SlotBusyError", "SlotGates", "SlotState"]


class GateTimeout(TimeoutError):
    """A wait on a slot gate passed its deadline (the message names what is pending)."""


class GateError(RuntimeError):
    """A consumer of a slot's content reported failure.

    ``errors`` maps consumer name -> error text; ``slot`` and ``layer`` name the
    content they failed on.
    """

    def __init__(self, slot: int, layer: int, errors: Dict[str, str]):
        self.slot = slot
        self.layer = layer
        self.errors = dict(errors)
        detail = "; ".join(f"{c}: {e}" for c, e in sorted(self.errors.items()))
        super().__init__(f"slot {slot} (layer {layer}): consumer(s) failed: {detail}")


class SlotBusyError(RuntimeError):
    """:meth:`SlotGates.begin` on a slot whose previous content still has consumers."""


@dataclass
class SlotState:
    """Snapshot of one slot's gate.

    layer: logical layer whose content the slot holds (``None`` = never written).
    pending: consumers that have not called ``done`` yet.
    errors: consumer -> error text for consumers that reported failure.
    generation: number of ``begin`` calls on this slot so far.
    """

    layer: Optional[int] = None
    pending: frozenset = frozenset()
    errors: Dict[str, str] = field(default_factory=dict)
    generation: int = 0


class SlotGates:
    """One completion gate per physical storage slot; thread-safe.

    Invariant: between ``begin(slot, L, C)`` and the last ``done(slot, L, c)`` for
    ``c`` in ``C`` the slot is *busy*: ``begin`` on it raises
    :class:`SlotBusyError` and ``wait_free`` blocks.
    """

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self._num_slots = num_slots
        self._lock = threading.Lock()
        self._conds = [threading.Condition(self._lock) for _ in range(num_slots)]
        self._layer: List[Optional[int]] = [None] * num_slots
        self._pending: List[set] = [set() for _ in range(num_slots)]
        self._errors: List[Dict[str, str]] = [{} for _ in range(num_slots)]
        self._generation: List[int] = [0] * num_slots

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self._num_slots:
            raise ValueError(f"slot {slot!r} out of range 0..{self._num_slots - 1}")

    # ------------------------------------------------------------------ producer
    def begin(self, slot: int, layer: int, consumers: Iterable[str]) -> None:
        """The slot now holds ``layer``'s content; ``consumers`` must finish before reuse.

        Raises :class:`SlotBusyError` if the previous content still has pending
        consumers (call :meth:`wait_free` first), ``ValueError`` on a bad slot or
        duplicate consumer names. Clears errors recorded for the previous content.
        """
        self._check_slot(slot)
        names = list(consumers)
        if len(set(names)) != len(names):
            raise ValueError(f"slot {slot} layer {layer}: duplicate consumers {names}")
        if any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"slot {slot} layer {layer}: consumer names must be non-empty str")
        with self._lock:
            if self._pending[slot]:
                raise SlotBusyError(
                    f"slot {slot} still holds layer {self._layer[slot]} with pending consumers "
                    f"{sorted(self._pending[slot])}; cannot begin layer {layer} "
                    "(call wait_free first)"
                )
            self._layer[slot] = layer
            self._pending[slot] = set(names)
            self._errors[slot] = {}
            self._generation[slot] += 1
            if not names:
                self._conds[slot].notify_all()

    def wait_free(self, slot: int, timeout_s: float) -> None:
        """Block until every consumer of the slot's current content has finished.

        Returns at once for a never-written slot or content without consumers.
        Raises :class:`GateTimeout` after ``timeout_s`` seconds (message: slot,
        layer, pending consumers, errors so far), or :class:`GateError` once all
        consumers finished if any reported an error.
        """
        self._check_slot(slot)
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        cond = self._conds[slot]
        with self._lock:
            while self._pending[slot]:
                left = deadline - time.monotonic()
                if left <= 0:
                    errs = self._errors[slot]
                    extra = f"; errors so far: {dict(sorted(errs.items()))}" if errs else ""
                    raise GateTimeout(
                        f"slot {slot} (layer {self._layer[slot]}) not free after {timeout_s:.3f}s: "
                        f"pending consumers {sorted(self._pending[slot])}{extra}"
                    )
                cond.wait(left)
            if self._errors[slot]:
                raise GateError(slot, self._layer[slot], self._errors[slot])

    # ------------------------------------------------------------------ consumers
    def done(self, slot: int, layer: int, consumer: str, error: Optional[str] = None) -> None:
        """``consumer`` finished with ``layer``'s content of ``slot`` (``error`` = it failed).

        ``ValueError`` if the slot does not hold ``layer`` or ``consumer`` is not
        pending for it (unknown name, or already reported).
        """
        self._check_slot(slot)
        with self._lock:
            if self._layer[slot] != layer or consumer not in self._pending[slot]:
                raise ValueError(
                    f"unknown completion: slot {slot} layer {layer} consumer {consumer!r} "
                    f"(slot holds layer {self._layer[slot]}, pending {sorted(self._pending[slot])})"
                )
            self._pending[slot].discard(consumer)
            if error is not None:
                self._errors[slot][consumer] = str(error)
            if not self._pending[slot]:
                self._conds[slot].notify_all()

    # ------------------------------------------------------------------ queries
    def pending(self, slot: int) -> frozenset:
        """Consumers of the slot's current content that have not finished."""
        self._check_slot(slot)
        with self._lock:
            return frozenset(self._pending[slot])

    def layer(self, slot: int) -> Optional[int]:
        """Layer whose content the slot holds (``None`` = never written)."""
        self._check_slot(slot)
        with self._lock:
            return self._layer[slot]

    def state(self, slot: int) -> SlotState:
        """Consistent snapshot of one slot."""
        self._check_slot(slot)
        with self._lock:
            return SlotState(
                self._layer[slot], frozenset(self._pending[slot]), dict(self._errors[slot]), self._generation[slot]
            )

    def busy_slots(self) -> List[Tuple[int, Optional[int], frozenset]]:
        """``(slot, layer, pending)`` for every slot with pending consumers."""
        with self._lock:
            return [(s, self._layer[s], frozenset(p)) for s, p in enumerate(self._pending) if p]
