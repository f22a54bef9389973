"""Decode-side destinations of a request and a block pool that leases them.

In SGLang the blocks come from the decode scheduler's own allocator (the same
page ids on every TP rank of a DP rank); :class:`BlockPool` is the stand-in used
by tests and the benchmark, and it counts outstanding leases so leaks are visible.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple


@dataclass(frozen=True)
class RequestDestination:
    """Where one request's KV goes on a decode rank.

    main_blocks: host-pool block ids (TP-shared), in request block order; the
        request has ``len(main_blocks)`` blocks.
    indexer_blocks: rank-local indexer ("device") block ids in request order;
        same length as ``main_blocks``, or empty when the model has no indexer.
    """

    request_id: str
    main_blocks: Tuple[int, ...]
    indexer_blocks: Tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.main_blocks)


class BlockPool:
    """Free list of ``num_blocks`` block ids with leak accounting (thread-safe).

    shuffle: hand out non-contiguous ids (exercises range mapping in tests).
    """

    def __init__(self, num_blocks: int, shuffle_seed: Optional[int] = None):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self._free: List[int] = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self._free)
        self._leased: Set[int] = set()
        self._lock = threading.Lock()

    def allocate(self, n: int) -> Tuple[int, ...]:
        with self._lock:
            if n > len(self._free):
                raise MemoryError(f"block pool exhausted: want {n}, {len(self._free)} free")
            out, self._free = self._free[:n], self._free[n:]
            self._leased.update(out)
            return tuple(out)

    def free(self, blocks) -> None:
        with self._lock:
            for b in blocks:
                if b not in self._leased:
                    raise ValueError(f"block {b} freed but not leased (double free?)")
                self._leased.remove(b)
                self._free.append(b)

    @property
    def leased(self) -> int:
        with self._lock:
            return len(self._leased)
