"""Which host-store object holds each SGLang KV page, and what a forward loads and saves.

The layerwise prefill pool keeps SGLang's slot addressing inside every physical layer
buffer: token slot ``s`` of layer ``L`` is row ``s`` of ``L``'s buffer, so SGLang's block
tables (``req_to_token[r, ::page] // page``), the radix cache and P/D page ids work
unchanged. A buffer shared by several layers holds, for the pages of the current
forward, the KV of the layer being computed; the other layers' rows of those pages
live in the host KV store, one object per (page content, layer).

Object identity is the *page generation*: a page gets a new generation whenever a
forward writes its first row (SGLang allocated it to a new owner), and keeps it while
the same owner appends rows (chunked prefill, decode). The object of a page with
``n`` rows saved is keyed ``lwp/<namespace>/p<page>g<gen>/n<n>/L<layer>``
(:func:`~sglang_ascend_offload.layerwise_prefill.store.object_key` of
``BlockKey(f"{namespace}/p{page}g{gen}", 0, n)``). Keys are slot based, not content
based: SGLang's radix cache decides what is reused, and a hit names pages, so the
pool must find exactly those pages' rows; the namespace carries a per-process
instance id, so two servers sharing one Memcache never alias.

Per request of a forward (``prefix_len`` cached tokens, ``seq_len`` after the forward,
``pages[j]`` = SGLang page of positions ``[j * P, (j + 1) * P)``), page ``j`` has
``n_prefix = clamp(prefix_len - j P, 0, P)`` cached rows and ``n_total =
min(P, seq_len - j P)`` rows after the forward:

* ``n_prefix > 0``: the cached rows are loaded from the store (the page must be
  known with exactly ``n_prefix`` rows saved, or a full page; a page this forward
  continues may hold up to ``n_total``: a speculative verify saved candidate rows
  beyond the next committed length, and this forward rewrites them);
* ``n_total > n_prefix``: new rows are written by the forward, and the page's rows
  ``[0, n_total)`` are saved under the new key (a page continued from ``n_prefix``
  rows keeps its generation; a fresh page gets a new one).

Pages shared by several requests of a batch (radix hits share whole pages) are loaded
once. Superseded objects (the previous generation of a reused page, the shorter
object of a continued page) are reported as ``stale`` so the pool removes them once
the forward's loads are done; the store therefore holds at most about one object per
page and layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ....layerwise_prefill.pipeline import RequestRows
from ....layerwise_prefill.store import BlockKey

__all__ = ["BatchRequest", "PageEntry", "ForwardPages", "PageBook", "PageBookError"]


class PageBookError(RuntimeError):
    """A forward needs page rows the host store does not hold (names page and counts)."""


@dataclass(frozen=True)
class BatchRequest:
    """One request of a forward: its ``req_to_token`` row, token counts and pages.

    pages: SGLang page ids of positions ``[j * page_size, ...)``, ``ceil(seq_len / P)`` of them.
    """

    req_pool_idx: int
    prefix_len: int
    seq_len: int
    pages: Tuple[int, ...]

    @property
    def new_len(self) -> int:
        return self.seq_len - self.prefix_len


@dataclass(frozen=True)
class PageEntry:
    """What one forward does with one page (rows ``[page * P, page * P + P)`` of every buffer).

    load: the object loaded into rows ``[0, load.tokens)`` (``None`` = nothing cached);
    save: the object saved from rows ``[0, save.tokens)`` after the write (``None`` = no new rows).
    """

    page: int
    req_pool_idx: int
    load: Optional[BlockKey]
    save: Optional[BlockKey]

    def request_rows(self, page_size: int) -> RequestRows:
        """The pipeline's row description of this page (block ``start`` is page relative)."""
        blocks = tuple(b for b in (self.load, self.save) if b is not None)
        prefix = self.load.tokens if self.load else 0
        new = (self.save.tokens - prefix) if self.save else 0
        return RequestRows(
            rid=f"r{self.req_pool_idx}@p{self.page}",
            row0=self.page * page_size,
            prefix_len=prefix,
            new_len=new,
            blocks=blocks,
            cached_blocks=1 if self.load is not None else 0,
        )


@dataclass(frozen=True)
class ForwardPages:
    """The page plan of one forward.

    entries: one per distinct page touched (loaded and/or saved), in request order.
    stale: objects (digest, rows) no page refers to after this forward; remove them
        (for every pipelined layer) once the forward's loads are done.
    """

    entries: Tuple[PageEntry, ...]
    stale: Tuple[BlockKey, ...]
    requests: Tuple[BatchRequest, ...]

    @property
    def prefix_rows(self) -> int:
        return sum(e.load.tokens for e in self.entries if e.load is not None)

    @property
    def new_rows(self) -> int:
        return sum(e.save.tokens - (e.load.tokens if e.load else 0) for e in self.entries if e.save)


class PageBook:
    """page -> (generation, rows saved) for every page this pool has written.

    Updated when a forward is planned (the scheduler thread, one forward at a time).
    ``speculative_tails``: the server verifies speculative drafts, so a continued page may
    hold rejected candidate rows beyond its cached rows (see :meth:`_cached_key`); off,
    a page must hold exactly its cached rows.
    """

    def __init__(self, page_size: int, namespace: str, speculative_tails: bool = False):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.namespace = namespace
        self.speculative_tails = speculative_tails
        self._state: Dict[int, Tuple[int, int]] = {}
        self._gen = itertools.count(1)

    def digest(self, page: int, gen: int) -> str:
        return f"{self.namespace}/p{page}g{gen}"

    def state(self, page: int) -> Optional[Tuple[int, int]]:
        """(generation, rows saved) of ``page``, or ``None`` if never written."""
        return self._state.get(page)

    def key(self, page: int) -> BlockKey:
        """The block key of ``page``'s current host object (``KeyError`` if never written)."""
        gen, rows = self._state[page]
        return BlockKey(self.digest(page, gen), 0, rows)

    def pages(self) -> Tuple[int, ...]:
        """Every page this book has a state for."""
        return tuple(self._state)

    def _cached_key(self, page: int, rows: int, req: BatchRequest, rewritten_to: int = 0) -> BlockKey:
        """The host object of ``page``'s first ``rows`` cached rows. ``rewritten_to``: this
        forward writes the page's rows ``[rows, rewritten_to)``; a saved object may then
        hold more than ``rows`` rows (up to ``rewritten_to``): a speculative verify saved
        its candidate rows and the tail beyond the new committed length was rejected. The
        whole object is loaded and the forward overwrites the tail before any read."""
        st = self._state.get(page)
        if self.speculative_tails and st is not None and rows < st[1] <= rewritten_to:
            return BlockKey(self.digest(page, st[0]), 0, st[1])
        if st is None or st[1] != rows:
            have = "nothing" if st is None else f"{st[1]} rows (generation {st[0]})"
            raise PageBookError(
                f"request in req_to_token row {req.req_pool_idx}: page {page} should hold {rows} cached "
                f"token rows but the layerwise pool saved {have} for it; the page's KV was not "
                "written through this pool (radix reuse of foreign pages is not supported)"
            )
        return BlockKey(self.digest(page, st[0]), 0, rows)

    def plan(self, requests: Sequence[BatchRequest]) -> ForwardPages:
        """Plan a forward and record the new page states (see module doc)."""
        P = self.page_size
        entries: Dict[int, PageEntry] = {}
        updates: Dict[int, Tuple[int, int]] = {}
        stale: List[BlockKey] = []
        for req in requests:
            if not 0 <= req.prefix_len < req.seq_len:
                raise ValueError(
                    f"req_to_token row {req.req_pool_idx}: prefix {req.prefix_len} must be < seq_len {req.seq_len}"
                )
            if len(req.pages) != -(-req.seq_len // P):
                raise ValueError(
                    f"req_to_token row {req.req_pool_idx}: {len(req.pages)} pages for "
                    f"{req.seq_len} tokens of page size {P}"
                )
            for j, page in enumerate(req.pages):
                n_prefix = min(P, max(0, req.prefix_len - j * P))
                n_total = min(P, req.seq_len - j * P)
                seen = entries.get(page)
                if n_total == n_prefix:  # cached page only
                    key = self._cached_key(page, n_prefix, req)
                    if seen is not None:
                        if seen.save is not None or seen.load != key:
                            raise PageBookError(
                                f"page {page} is cached for row {req.req_pool_idx} but "
                                f"written by row {seen.req_pool_idx} in the same forward"
                            )
                        continue
                    entries[page] = PageEntry(page, req.req_pool_idx, key, None)
                    continue
                if seen is not None:
                    raise PageBookError(
                        f"page {page} gets new rows from row {req.req_pool_idx} but is "
                        f"also used by row {seen.req_pool_idx} in the same forward"
                    )
                old = self._state.get(page)
                if n_prefix == 0:  # fresh page: a new owner
                    gen = next(self._gen)
                    load = None
                    if old is not None:
                        stale.append(BlockKey(self.digest(page, old[0]), 0, old[1]))
                else:  # the owner appends to its partial page
                    load = self._cached_key(page, n_prefix, req, rewritten_to=n_total)
                    gen = old[0]
                    stale.append(load)
                save = BlockKey(self.digest(page, gen), 0, n_total)
                entries[page] = PageEntry(page, req.req_pool_idx, load, save)
                updates[page] = (gen, n_total)
        self._state.update(updates)
        return ForwardPages(tuple(entries.values()), tuple(stale), tuple(requests))
