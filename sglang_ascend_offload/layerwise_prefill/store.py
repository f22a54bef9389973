"""Host KV store interface shared by the layerwise prefill backends.

The store holds *objects*: one per (token block, layer). An object is the
concatenation of its *parts*: the rows of that block in each tensor of the layer
buffer (main-KV parts, then indexer parts), e.g. ``[latent [n, 512] bf16,
rope [n, 64] bf16, indexer [n, 128] bf16]`` for a block of ``n`` tokens.

Keys are content addresses: :func:`block_keys` hashes each block of token ids
chained with all blocks before it (so a key identifies the whole prefix up to that
block), and :func:`object_key` adds the layer. Equal keys therefore mean equal
content, which is what makes prefix reuse safe; a partial tail block carries its
length in the key and never aliases a full block.

Backends: :mod:`.store_local` (in-process host pool; CPU, tests, single node)
and :mod:`.store_memcache` (Memcache via ``memcache_hybrid``; Ascend).
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass
from typing import List, Sequence

import torch

__all__ = [
    "StoreError",
    "StoreUnavailable",
    "BlockKey",
    "block_keys",
    "object_key",
    "HostKVStore",
    "StoreStats",
    "parts_nbytes",
    "make_store",
]


class StoreError(RuntimeError):
    """A host store operation failed (message names the keys and the backend's code)."""


class StoreUnavailable(StoreError):
    """The backend cannot run here (missing package, driver, or service); says what to do."""


@dataclass(frozen=True)
class BlockKey:
    """Content address of one token block.

    digest: hex digest of the chained hash of all token ids up to the block's end.
    start: index of the block's first token in the request.
    tokens: token rows in the block (``< block_tokens`` only for a partial tail).
    """

    digest: str
    start: int
    tokens: int


def block_keys(token_ids: Sequence[int], block_tokens: int, namespace: str = "") -> List[BlockKey]:
    """Chained content keys of ``token_ids`` split into blocks of ``block_tokens`` (last may be partial)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    keys: List[BlockKey] = []
    prev = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    ids = [int(t) for t in token_ids]
    for start in range(0, len(ids), block_tokens):
        chunk = ids[start : start + block_tokens]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(len(chunk).to_bytes(4, "little"))
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in chunk))
        prev = h.digest()
        keys.append(BlockKey(prev.hex(), start, len(chunk)))
    return keys


def object_key(block: BlockKey, layer: int) -> str:
    """Store key of one (block, layer) object."""
    return f"lwp/{block.digest}/n{block.tokens}/L{layer}"


def parts_nbytes(parts: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


@dataclass
class StoreStats:
    """Counters of one store (cumulative)."""

    puts: int = 0
    gets: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    skipped_existing: int = 0
    evictions: int = 0


class HostKVStore(abc.ABC):
    """One host KV pool. Thread-safe: the pipeline's loader and saver threads call it.

    Every ``parts`` argument is a sequence (one entry per key) of sequences of
    contiguous tensors (device or host); their bytes, in order, form the object.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> List[bool]:
        """Whether each key is stored (complete)."""

    @abc.abstractmethod
    def put(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> None:
        """Copy each key's parts into the store; keys already stored are skipped
        (content addressing: same key, same bytes). Returns only after the copy has
        finished, so the source may be overwritten afterwards. Raises StoreError."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> None:
        """Copy each stored object into the given tensors (shapes/sizes must match).
        Returns after the copy finished. Raises StoreError naming missing keys."""

    def add_lease(self, keys: Sequence[str], ttl_ms: int) -> None:
        """Protect keys from eviction until :meth:`remove_lease` (or the TTL)."""

    def remove_lease(self, keys: Sequence[str]) -> None:
        """Undo :meth:`add_lease`."""

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register long-lived buffers (the physical layer buffers) for direct copies."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> None:
        """Delete keys (missing keys are ignored)."""

    def stats(self) -> StoreStats:
        return StoreStats()

    def close(self) -> None:
        """Release resources; the store is unusable afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_store(cfg, device_id=None) -> HostKVStore:
    """The host KV store a :class:`~sglang_ascend_offload.config.LayerwisePrefillOffloadConfig`
    asks for. ``memcache`` raises :class:`StoreUnavailable` (saying what to install or
    start) where it cannot run; there is no silent fallback to ``local``. An unset
    ``store_backend`` means the device's default: ``memcache`` on an Ascend NPU,
    ``local`` elsewhere (decided once, from the device, never from a failure)."""
    from sglang_ascend_offload import platform

    backend = cfg.effective_store_backend(platform.device_kind())
    if backend == "local":
        from sglang_ascend_offload.layerwise_prefill.store_local import LocalHostKVStore

        return LocalHostKVStore()
    if backend == "memcache":
        from sglang_ascend_offload.layerwise_prefill.store_memcache import MemcacheHostKVStore

        return MemcacheHostKVStore(cfg.memcache, device_id)
    raise ValueError(f"unknown store_backend {backend!r}: expected 'memcache' or 'local'")
