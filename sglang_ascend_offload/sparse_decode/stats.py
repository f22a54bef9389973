"""Statistics of the sparse decode engine, per layer and in total.

Counters: ``selected`` (valid top-k entries), ``hits``, ``misses``, ``h2d_bytes``
(miss rows copied host -> device), ``d2h_bytes`` (new-token rows appended device ->
host), ``rows`` (batch rows the engine stepped, summed over steps: its per-step work
is proportional to this, not to the engine's row capacity), ``row_selected`` /
``row_hits`` (the query rows' own top-k entries and those that were resident: with
several query rows per request, as in speculative verify, a position two rows select
is one ``selected`` lookup but two ``row_selected`` entries; with one row per request
the pairs are equal), ``shadow_checks`` / ``shadow_mismatches`` / ``shadow_us`` (shadow verification's
rows recomputed over the host pool, those that differed, and the microseconds the checks
took; host counts), ``direct_rows`` / ``direct_h2d_bytes`` / ``demotions`` (with
``residency: adaptive``: batch entries served from their hot buffer with no residency
step, the rows copied host -> device into such buffers (their context once, then each
step's new tokens), and direct requests demoted to the residency; host counts; not part
of ``selected`` / ``h2d_bytes``), ``lent_rows`` / ``reclaims`` (idle request slots' hot
buffers lent to direct requests' spans, and demotions because a new request needed a
lent one), ``overflow_rounds`` / ``overflow_positions`` (speculative verify: requests
whose round's union did not fit their hot buffer, and the positions served from the
overflow area instead, ``overflow.py``; not part of ``selected``), ``overflow_h2d_bytes``
(those positions' rows copied host -> device). Invariants: ``hits + misses == selected``,
``h2d_bytes == misses * row_bytes`` and ``overflow_h2d_bytes == overflow_positions *
row_bytes``.

Device-side counts are accumulated in one int64 device tensor, so recording a step
never synchronises the device; :meth:`StatsAccumulator.snapshot` reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional

import torch

__all__ = ["Counters", "DecodeStats", "StatsAccumulator"]


@dataclass
class Counters:
    """One set of counters (a layer, or the total)."""

    selected: int = 0
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    rows: int = 0
    row_selected: int = 0
    row_hits: int = 0
    shadow_checks: int = 0
    shadow_mismatches: int = 0
    shadow_us: int = 0
    direct_rows: int = 0
    direct_h2d_bytes: int = 0
    demotions: int = 0
    lent_rows: int = 0
    reclaims: int = 0
    overflow_rounds: int = 0
    overflow_positions: int = 0
    overflow_h2d_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.selected if self.selected else 0.0

    @property
    def row_hit_rate(self) -> float:
        """Share of the query rows' top-k entries that were resident (per-row comparable)."""
        return self.row_hits / self.row_selected if self.row_selected else 0.0

    def __add__(self, other: "Counters") -> "Counters":
        # field by field (``dataclasses.asdict`` deep-copies: ~40 us a call, and the
        # per-step Prometheus export sums every layer)
        return Counters(*(getattr(self, name) + getattr(other, name) for name in _COUNTER_NAMES))

    def as_dict(self) -> Dict[str, float]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["row_hit_rate"] = self.row_hit_rate
        return d


_COUNTER_NAMES = tuple(f.name for f in fields(Counters))
#: counters kept on the device (the rest are host counts)
_DEVICE_COUNTS = 7


@dataclass
class DecodeStats:
    """Counters per layer and their sum; ``steps`` = decode steps recorded."""

    per_layer: List[Counters] = field(default_factory=list)
    steps: int = 0

    @property
    def total(self) -> Counters:
        out = Counters()
        for c in self.per_layer:
            out = out + c
        return out


class StatsAccumulator:
    """Accumulates per-layer counters without device synchronisation."""

    def __init__(self, layers: int, row_bytes: int, device=None):
        self.row_bytes = row_bytes
        # selected, hits, misses, row_selected, row_hits, overflow_rounds, overflow_positions
        self._dev = torch.zeros((layers, _DEVICE_COUNTS), dtype=torch.int64, device=device)
        self._d2h = [0] * layers
        self._rows = [0] * layers
        self._shadow = [[0, 0, 0] for _ in range(layers)]  # checks, mismatches, microseconds
        self._direct = [[0, 0, 0, 0, 0] for _ in range(layers)]  # direct rows, H2D bytes, demotions, lent, reclaims
        self.steps = 0
        # the no-wait read of the device counts: a host copy in flight, and the last one done
        self._host: Optional[torch.Tensor] = None
        self._pending = None  # event recorded after the copy in flight
        self._seen: List[List[int]] = [[0] * _DEVICE_COUNTS for _ in range(layers)]

    def record_residency(
        self,
        layer: int,
        selected: torch.Tensor,
        hits: torch.Tensor,
        misses: torch.Tensor,
        row_selected=None,
        row_hits=None,
    ) -> None:
        """Add 0-d device counts of one layer step (``row_*`` default to the lookups'
        own: one query row per request)."""
        self._dev[layer, 0] += selected
        self._dev[layer, 1] += hits
        self._dev[layer, 2] += misses
        self._dev[layer, 3] += selected if row_selected is None else row_selected
        self._dev[layer, 4] += hits if row_hits is None else row_hits

    def overflow_counters(self, layer: int) -> torch.Tensor:
        """int64 ``[2]`` device view ``(overflow_rounds, overflow_positions)`` of ``layer``,
        added to in place by the overflow stage (``overflow.serve``; capturable)."""
        return self._dev[layer, 5:7]

    def record_rows(self, layer: int, rows: int) -> None:
        """Batch rows stepped in one layer step (a host-side count, no device read)."""
        self._rows[layer] += int(rows)

    def record_d2h(self, layer: int, nbytes: int) -> None:
        self._d2h[layer] += int(nbytes)

    def record_shadow(self, layer: int, ok: bool, seconds: float = 0.0) -> None:
        """One shadow-verification check of ``layer`` that took ``seconds`` (host-side counts)."""
        self._shadow[layer][0] += 1
        self._shadow[layer][1] += 0 if ok else 1
        self._shadow[layer][2] += int(round(seconds * 1e6))

    def record_direct(
        self, layer: int, rows: int, h2d_bytes: int, demotions: int, lent: int = 0, reclaims: int = 0
    ) -> None:
        """Direct-row work of ``layer`` (``residency: adaptive``; host-side counts)."""
        acc = self._direct[layer]
        for i, v in enumerate((rows, h2d_bytes, demotions, lent, reclaims)):
            acc[i] += int(v)

    def record_step(self) -> None:
        self.steps += 1

    def snapshot(self, wait: bool = True) -> DecodeStats:
        """Current totals (one device -> host read). ``wait=False`` never waits for the
        device: the device counts (selected, hits, misses, row_*) are those of the last
        asynchronous host copy that has completed, so on a device they may lag a step or
        two behind the host counts (on CPU the copy is done at once: no lag). For an export
        every step, which must not synchronise the device."""
        dev = self._dev.cpu().tolist() if wait else self._device_counts_nowait()
        per_layer = [
            Counters(
                selected=s,
                hits=h,
                misses=m,
                h2d_bytes=m * self.row_bytes,
                d2h_bytes=d,
                rows=n,
                row_selected=rs,
                row_hits=rh,
                shadow_checks=sc,
                shadow_mismatches=sm,
                shadow_us=su,
                direct_rows=dr,
                direct_h2d_bytes=db,
                demotions=dm,
                lent_rows=dl,
                reclaims=dx,
                overflow_rounds=orr,
                overflow_positions=op,
                overflow_h2d_bytes=op * self.row_bytes,
            )
            for (s, h, m, rs, rh, orr, op), d, n, (sc, sm, su), (dr, db, dm, dl, dx) in zip(
                dev, self._d2h, self._rows, self._shadow, self._direct
            )
        ]
        return DecodeStats(per_layer=per_layer, steps=self.steps)

    def _device_counts_nowait(self) -> List[List[int]]:
        """Take the host copy in flight if the device finished it, start the next one,
        and return the newest counts that have landed."""
        from .. import platform

        if self._pending is not None and self._pending.query():
            self._seen, self._pending = self._host.tolist(), None
        if self._pending is None:
            if self._host is None:
                self._host = platform.pinned_empty(tuple(self._dev.shape), self._dev.dtype)
            self._host.copy_(self._dev, non_blocking=True)
            event = platform.new_event()
            event.record()
            if event.query():  # done already (always on CPU)
                self._seen = self._host.tolist()
            else:
                self._pending = event
        return self._seen
