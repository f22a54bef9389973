"""The decode problem a kernel qualification runs (:mod:`.qualify`), at the served shapes.

Two requests, each on its own residency row with ``n`` query tokens (``n`` = verify rows
per request, 1 without speculation), :data:`STEPS` decode steps of one layer:

* row 0 starts empty for a new request: its first step is a first fill, the later ones
  hit and fill free slots;
* row 1 starts full (every slot holds a committed position, with stamps of earlier steps,
  many equal): every step evicts, in LRU order with its slot tie-break, so a kernel whose
  victim order differs from the contract's shows up.

The indexer inputs make every selection unique and exactly computable in float32 in any
summation order, so the fused indexer and the separate one must agree on the top-k
indices, order included (no ties), whatever their arithmetic:

* every position ``p`` of request ``b`` carries a code ``c = 1 .. 8191`` (a permutation)
  written into two key dimensions as ``a = c % 64`` and ``b = c // 64`` (exact in bf16
  and int8), and a cluster (one of :data:`CLUSTERS`, balanced) marked in one more
  dimension;
* every index head's query is ``1`` and ``64`` on the two code dimensions, ``0`` on the
  clusters that are *on* for this request and step, and a large negative value on the
  others; weights and (int8) dequantisation scales are 1. A position's score is
  ``index_heads * c`` on the on clusters (exact: below ``2**24``) and ``0`` elsewhere;
* the on clusters (:data:`ON_CLUSTERS` of them, drawn per request and step) hold more
  than ``K`` visible positions, so the top-k is the ``K`` largest codes among them.

The attention inputs: a host pool of random bf16 rows, a hot buffer whose resident slots
hold their host rows and whose other slots hold random bit patterns (NaNs included), and
random bf16 queries. Everything is drawn from one seeded generator on the CPU, so the
problem is the same on every machine and every run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import platform
from .contract import ResidencyTable

__all__ = ["ServedShape", "StepInputs", "Problem", "STEPS", "REQUESTS", "CLUSTERS", "ON_CLUSTERS"]

STEPS = 3  # decode steps of the problem
REQUESTS = 2  # row 0: first fill; row 1: full, evicting
CLUSTERS = 8
ON_CLUSTERS = 6  # 3/4 of the positions are candidates at each step
CODE_BASE = 64  # code = a + 64 * b, a < 64, b < 128: int8 and bf16 exact
CODE_LIMIT = CODE_BASE * 128  # codes 1 .. 8191
PRESET_STEPS = 4  # row 1's state holds stamps of steps 0 .. 3; the problem's steps follow
_OFF = {"bf16": (1.0, -16384.0), "int8": (127, -128)}  # (key mark, query on an off cluster): dot < 0


@dataclass(frozen=True)
class ServedShape:
    """The shapes a server runs its fused ops at.

    hot_tokens / top_k: the residency shape (slots per row, K); rows_per_request: verify
    rows sharing a request's hot buffer (``n``); indexer_dtype: ``bf16`` (LIM) or
    ``int8`` (LIM-C8); page_size: the index-K cache's block size; index_heads /
    index_dim: the indexer's query heads and head dim; heads: attention heads per rank;
    latent_dim / rope_dim: the main KV row (``latent + rope`` bf16 columns)."""

    hot_tokens: int
    top_k: int
    rows_per_request: int = 1
    indexer_dtype: str = "bf16"
    page_size: int = 128
    index_heads: int = 64
    index_dim: int = 128
    heads: int = 16
    latent_dim: int = 512
    rope_dim: int = 64

    def __post_init__(self):
        problems = [f"{k} must be >= 1" for k, v in asdict(self).items() if isinstance(v, int) and v < 1]
        if self.indexer_dtype not in _OFF:
            problems.append(f"indexer_dtype must be bf16 or int8, got {self.indexer_dtype!r}")
        if self.hot_tokens < self.top_k:
            problems.append(f"hot_tokens {self.hot_tokens} must hold one row's top-k ({self.top_k})")
        if self.index_dim < CLUSTERS + 2:
            problems.append(f"index_dim {self.index_dim} must be >= {CLUSTERS + 2} (code and cluster dimensions)")
        if self.context_len + STEPS >= CODE_LIMIT:
            problems.append(f"the problem's context ({self.context_len}) needs more than {CODE_LIMIT - 1} codes")
        if problems:
            raise ValueError("kernel qualification shape: " + "; ".join(problems))

    @property
    def union_width(self) -> int:
        """``W = min(n * K, hot_tokens)``: entries of a row's residency step (a union beyond
        the buffer overflows, ``ops/fused.union_width``)."""
        return min(self.rows_per_request * self.top_k, self.hot_tokens)

    @property
    def context_len(self) -> int:
        """Positions of each request at the first step: a full hot buffer, half a step's
        union more (new positions to miss on), and the speculative tail."""
        return self.hot_tokens + self.union_width // 2 + self.rows_per_request

    def describe(self) -> str:
        n = self.rows_per_request
        return (
            f"hot_tokens {self.hot_tokens}, top-k {self.top_k}, {n} verify row{'s' if n > 1 else ''} per request, "
            f"indexer {self.indexer_dtype} {self.index_heads} x {self.index_dim}, page {self.page_size}, "
            f"{self.heads} heads x ({self.latent_dim} + {self.rope_dim})"
        )

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


@dataclass
class StepInputs:
    """One decode step of the problem (tensors on the problem's device; ``T = 2n`` tokens,
    request-major). query int8 or bf16 ``[T, Hi, Di]``; weights bf16 ``[T, Hi]``;
    query_scale fp16 ``[T, Hi]`` (int8 only); cu int32 ``[2]`` cumulative query lengths;
    kv_len int32 ``[2]``; token_rows int32 ``[T]``; req_ids int64 ``[2]``; stable int32
    ``[2]``; step int; attn_query bf16 ``[T, N, latent]``; attn_rope bf16 ``[T, N, rope]``."""

    index: int
    query: torch.Tensor
    weights: torch.Tensor
    query_scale: Optional[torch.Tensor]
    cu: torch.Tensor
    kv_len: torch.Tensor
    token_rows: torch.Tensor
    req_ids: torch.Tensor
    stable: torch.Tensor
    step: int
    attn_query: torch.Tensor
    attn_rope: torch.Tensor


_HOST_ROWS: Dict[Tuple[int, int], torch.Tensor] = {}


def _host_rows(rows: int, dim: int) -> torch.Tensor:
    """A host tensor ``[rows, dim]`` bf16 kept for the life of the process: the fused
    Copy-SFA registers the host memory it reads (``aclrtHostRegister`` on an NPU), and a
    freed registered region must never be reused under another tensor."""
    key = (rows, dim)
    if key not in _HOST_ROWS:
        _HOST_ROWS[key] = platform.pinned_empty((rows, dim), torch.bfloat16)
    return _HOST_ROWS[key]


class Problem:
    """The fixed inputs (index-K cache, block table, host pool, token table), the initial
    residency state and hot buffer, and each step's inputs (module docstring)."""

    def __init__(self, shape: ServedShape, device=None, seed: int = 0):
        self.shape = shape
        self.device = torch.device(device) if device is not None else platform.default_device()
        self.g = torch.Generator().manual_seed(seed)
        s, n = shape, shape.rows_per_request
        self.max_len = s.context_len + STEPS
        self.blocks_per_request = -(-self.max_len // s.page_size)
        self.codes = [torch.randperm(CODE_LIMIT - 1, generator=self.g)[: self.max_len] + 1 for _ in range(REQUESTS)]
        self.clusters = [torch.randperm(self.max_len, generator=self.g) % CLUSTERS for _ in range(REQUESTS)]
        self._build_index_cache()
        row_dim = s.latent_dim + s.rope_dim
        self.host = _host_rows(REQUESTS * self.max_len, row_dim)
        self.host.copy_(torch.randn(self.host.shape, generator=self.g).to(torch.bfloat16))
        order = torch.randperm(REQUESTS * self.max_len, generator=self.g).to(torch.int32)
        self.token_table = order.reshape(REQUESTS, self.max_len).to(self.device)
        self.scale = float(row_dim) ** -0.5
        self.req_ids = torch.tensor([100, 200], dtype=torch.int64)
        self.stable_at_start = s.context_len - n
        self._preset_positions = torch.randperm(self.stable_at_start, generator=self.g)[: s.hot_tokens]
        self._preset_stamps = torch.randint(1, 2 * PRESET_STEPS + 1, (s.hot_tokens,), generator=self.g)

    # ------------------------------------------------------------------ fixed inputs
    def _build_index_cache(self) -> None:
        """``key`` ``[blocks, page, 1, Di]`` (block 0 unused), ``key_scale`` fp16 ones
        ``[blocks, page, 1]`` (int8), ``block_table`` int32 ``[2, blocks per request]``."""
        s = self.shape
        nb = self.blocks_per_request
        blocks = REQUESTS * nb + 1
        ids = (torch.randperm(REQUESTS * nb, generator=self.g) + 1).to(torch.int32)
        self.block_table = ids.reshape(REQUESTS, nb).to(self.device)
        mark, _ = _OFF[s.indexer_dtype]
        dtype = torch.int8 if s.indexer_dtype == "int8" else torch.bfloat16
        flat = torch.zeros(blocks * s.page_size, s.index_dim, dtype=torch.float32)
        # the other dimensions hold values the zero queries there must cancel
        flat[:, CLUSTERS:-2] = torch.randint(-3, 4, (flat.shape[0], s.index_dim - CLUSTERS - 2), generator=self.g)
        for b in range(REQUESTS):
            pos = torch.arange(self.max_len)
            blocks_of_b = ids.reshape(REQUESTS, nb)[b].to(torch.int64)
            rows = blocks_of_b.repeat_interleave(s.page_size)[: self.max_len] * s.page_size
            rows = rows + pos % s.page_size
            flat[rows, :CLUSTERS] = 0.0
            flat[rows, s.index_dim - 2] = (self.codes[b] % CODE_BASE).to(torch.float32)
            flat[rows, s.index_dim - 1] = (self.codes[b] // CODE_BASE).to(torch.float32)
            flat[rows, self.clusters[b]] = float(mark)
        self.key = flat.to(dtype).reshape(blocks, s.page_size, 1, s.index_dim).to(self.device)
        self.key_scale = (
            torch.ones(blocks, s.page_size, 1, dtype=torch.float16, device=self.device)
            if s.indexer_dtype == "int8"
            else None
        )

    def initial_state(self) -> Tuple[ResidencyTable, torch.Tensor]:
        """``(table, hot)`` before the first step: row 0 empty (no request), row 1 full for
        request 200 (positions below its committed length, stamps of earlier steps); hot
        ``[2, H, latent + rope]``: random bit patterns, row 1's slots holding their host rows."""
        s = self.shape
        table = ResidencyTable.empty(REQUESTS, s.hot_tokens)
        table.slot_token[1] = self._preset_positions.to(torch.int32)
        table.slot_stamp[1] = self._preset_stamps
        table.row_req[1] = self.req_ids[1]
        g = torch.Generator().manual_seed(1)
        row_dim = s.latent_dim + s.rope_dim
        hot = torch.randint(-32768, 32767, (REQUESTS, s.hot_tokens, row_dim), generator=g, dtype=torch.int16)
        hot = hot.view(torch.bfloat16)
        hot[1] = self.host[self.token_table[1].cpu()[self._preset_positions].long()]
        dev = self.device
        return ResidencyTable(table.slot_token.to(dev), table.slot_stamp.to(dev), table.row_req.to(dev)), hot.to(dev)

    # ------------------------------------------------------------------ one step
    def step(self, index: int) -> StepInputs:
        """The inputs of step ``index`` (0 .. :data:`STEPS` - 1); each request's context
        grows by one position per step, its last ``n`` positions are uncommitted."""
        s, n, dev = self.shape, self.shape.rows_per_request, self.device
        g = torch.Generator().manual_seed(1000 + index)
        kv_len = [s.context_len + index] * REQUESTS
        tokens = REQUESTS * n
        query = torch.zeros(tokens, s.index_heads, s.index_dim, dtype=torch.float32)
        _, off = _OFF[s.indexer_dtype]
        for b in range(REQUESTS):
            on = torch.randperm(CLUSTERS, generator=g)[:ON_CLUSTERS]
            self._check_candidates(b, on, kv_len[b] - n + 1)
            mask = torch.full((CLUSTERS,), float(off))
            mask[on] = 0.0
            query[b * n : (b + 1) * n, :, :CLUSTERS] = mask
        query[:, :, s.index_dim - 2] = 1.0
        query[:, :, s.index_dim - 1] = float(CODE_BASE)
        int8 = s.indexer_dtype == "int8"
        attn = (tokens, s.heads)
        return StepInputs(
            index=index,
            query=query.to(torch.int8 if int8 else torch.bfloat16).to(dev),
            weights=torch.ones(tokens, s.index_heads, dtype=torch.bfloat16, device=dev),
            query_scale=torch.ones(tokens, s.index_heads, dtype=torch.float16, device=dev) if int8 else None,
            cu=torch.tensor([n * (b + 1) for b in range(REQUESTS)], dtype=torch.int32, device=dev),
            kv_len=torch.tensor(kv_len, dtype=torch.int32, device=dev),
            token_rows=torch.arange(REQUESTS, dtype=torch.int32).repeat_interleave(n).to(dev),
            req_ids=self.req_ids.to(dev),
            stable=torch.tensor([k - n for k in kv_len], dtype=torch.int32, device=dev),
            step=PRESET_STEPS + index,
            attn_query=(torch.randn(*attn, s.latent_dim, generator=g) * 0.5).to(torch.bfloat16).to(dev),
            attn_rope=(torch.randn(*attn, s.rope_dim, generator=g) * 0.5).to(torch.bfloat16).to(dev),
        )

    def in_score_order(self, topk: torch.Tensor) -> torch.Tensor:
        """``topk`` (int32 ``[T, 1, K]``, one request's ``n`` tokens after another) with each
        token's positions in the contract's order, score descending: an indexer that returns
        the right set in another order (torch_npu's need not sort) is compared by its set,
        and the residency step that follows sees the order the fused kernel must produce.
        Scores are known exactly here (``index_heads x code``); ``-1`` entries stay last."""
        n = self.shape.rows_per_request
        codes = torch.stack(self.codes).to(topk.device)  # [2, max_len]
        flat = topk.reshape(topk.shape[0], -1).long()
        request = (torch.arange(flat.shape[0], device=topk.device) // n)[:, None].expand_as(flat)
        score = torch.where(flat >= 0, codes[request, flat.clamp(min=0)], torch.full_like(flat, -1))
        order = torch.argsort(score, dim=1, descending=True, stable=True)
        return torch.gather(flat, 1, order).to(topk.dtype).reshape(topk.shape)

    def _check_candidates(self, request: int, on: torch.Tensor, visible: int) -> None:
        """Every query token of ``request`` sees at least ``K`` positions on its on clusters
        (its first token sees ``visible``), so its top-k holds positive, distinct scores only."""
        found = int(torch.isin(self.clusters[request][:visible], on).sum())
        if found < self.shape.top_k:
            raise ValueError(
                f"kernel qualification problem: request {request} sees {found} candidate positions, "
                f"fewer than top-k {self.shape.top_k}"
            )
