"""In-process host KV pool (CPU, tests, single node).

Objects are kept as host tensors (pinned where a device exists) in an LRU map.
With ``capacity_bytes`` set, putting a new object evicts least recently used
objects that are not leased; if that cannot make room, :class:`StoreError` is
raised (no silent drop). Copies run outside the lock so several threads copy in
parallel; an evicted object stays valid for a copy already holding it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang_ascend_offload import platform
from sglang_ascend_offload.layerwise_prefill.store import HostKVStore, StoreError, StoreStats, parts_nbytes

__all__ = ["LocalHostKVStore"]


class LocalHostKVStore(HostKVStore):
    """Host pool in this process. ``capacity_bytes=None`` = unbounded."""

    name = "local"

    def __init__(self, capacity_bytes: Optional[int] = None):
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError("capacity_bytes must be >= 1 or None")
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._objects: "OrderedDict[str, Tuple[torch.Tensor, ...]]" = OrderedDict()
        self._leases: Dict[str, int] = {}
        self._used = 0
        self._stats = StoreStats()
        self._closed = False

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("local host KV store is closed")

    @staticmethod
    def _check_parts(keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> None:
        if len(keys) != len(parts):
            raise StoreError(f"{len(keys)} keys but {len(parts)} part lists")
        for k, ps in zip(keys, parts):
            for p in ps:
                if not p.is_contiguous():
                    raise StoreError(f"key {k}: parts must be contiguous tensors")

    def _make_room(self, need: int) -> None:
        """Evict unleased LRU objects until ``need`` more bytes fit (lock held)."""
        if self._capacity is None:
            return
        if need > self._capacity:
            raise StoreError(f"object of {need} B exceeds the store capacity {self._capacity} B")
        for key in list(self._objects.keys()):
            if self._used + need <= self._capacity:
                return
            if self._leases.get(key, 0) > 0:
                continue
            self._used -= parts_nbytes(self._objects.pop(key))
            self._stats.evictions += 1
        if self._used + need > self._capacity:
            raise StoreError(
                f"local host KV store full: {self._used}/{self._capacity} B used, "
                f"{need} B needed and the rest is leased; raise capacity_bytes"
            )

    # ------------------------------------------------------------------ interface
    def exists(self, keys: Sequence[str]) -> List[bool]:
        with self._lock:
            self._check_open()
            return [k in self._objects for k in keys]

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> None:
        self._check_parts(keys, parts)
        with self._lock:
            self._check_open()
            todo = [(k, ps) for k, ps in zip(keys, parts) if k not in self._objects]
            self._stats.skipped_existing += len(keys) - len(todo)
        for key, ps in todo:
            host = tuple(platform.pinned_empty(tuple(p.shape), p.dtype) for p in ps)
            for dst, src in zip(host, ps):
                dst.copy_(src)
            nbytes = parts_nbytes(host)
            with self._lock:
                self._check_open()
                if key in self._objects:  # another thread stored the same content meanwhile
                    self._stats.skipped_existing += 1
                    continue
                self._make_room(nbytes)
                self._objects[key] = host
                self._used += nbytes
                self._stats.puts += 1
                self._stats.bytes_put += nbytes

    def get_into(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> None:
        self._check_parts(keys, parts)
        with self._lock:
            self._check_open()
            missing = [k for k in keys if k not in self._objects]
            if missing:
                raise StoreError(
                    f"local host KV store: {len(missing)} key(s) missing, e.g. {missing[:3]} (evicted or never saved)"
                )
            found = []
            for k in keys:
                self._objects.move_to_end(k)
                found.append(self._objects[k])
        for key, src, dst in zip(keys, found, parts):
            if len(src) != len(dst) or any(s.shape != d.shape or s.dtype != d.dtype for s, d in zip(src, dst)):
                raise StoreError(
                    f"key {key}: stored parts {[(tuple(s.shape), s.dtype) for s in src]} do not "
                    f"match destination {[(tuple(d.shape), d.dtype) for d in dst]}"
                )
            for d, s in zip(dst, src):
                d.copy_(s)
        with self._lock:
            self._stats.gets += len(keys)
            self._stats.bytes_got += sum(parts_nbytes(p) for p in found)

    def add_lease(self, keys: Sequence[str], ttl_ms: int) -> None:
        with self._lock:
            for k in keys:
                self._leases[k] = self._leases.get(k, 0) + 1

    def remove_lease(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                n = self._leases.get(k, 0) - 1
                if n > 0:
                    self._leases[k] = n
                else:
                    self._leases.pop(k, None)

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                obj = self._objects.pop(k, None)
                if obj is not None:
                    self._used -= parts_nbytes(obj)

    @property
    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**vars(self._stats))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._leases.clear()
            self._used = 0
