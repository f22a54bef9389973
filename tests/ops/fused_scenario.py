"""A small multi-step decode scenario for the fused-op tests (LIM, LIM-C8, Copy-SFA).

Rows churn between requests, go idle, grow by one token per step; query tokens come
in a shuffled order with padding tokens at the end (``token_rows == -1``). Every
request owns fixed blocks of a paged index-K cache and fixed slots of a host pool of
main-KV rows, so the same positions are selected again across steps (hits) while
new ones keep arriving (misses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch


@dataclass(frozen=True)
class Dims:
    rows: int = 5
    hot_tokens: int = 16
    top_k: int = 6
    index_heads: int = 4
    index_dim: int = 16
    block_size: int = 4
    max_len: int = 40
    heads: int = 4
    d_latent: int = 32
    d_rope: int = 8
    host_tokens: int = 400
    padding_tokens: int = 2


@dataclass
class Request:
    rid: int
    length: int
    blocks: List[int]  # index-K cache blocks, in order
    host_slots: torch.Tensor  # int32 [max_len]: host slot of each position
    query_bias: torch.Tensor  # [H, D] per-request query direction (makes selections recur)


@dataclass
class StepInputs:
    """Everything LIM and Copy-SFA take for one step (CPU tensors)."""

    query: torch.Tensor  # bf16 [T, Hi, Di]
    weights: torch.Tensor  # bf16 [T, Hi]
    actual_seq_lengths_query: torch.Tensor  # int32 [B] cumulative
    actual_seq_lengths_key: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    token_rows: torch.Tensor  # int32 [T]
    req_ids: torch.Tensor  # int64 [R]
    stable_len: torch.Tensor  # int32 [R]
    token_table: torch.Tensor  # int32 [R, max_len]
    attn_query: torch.Tensor  # bf16 [T, N, Dl]
    attn_query_rope: torch.Tensor  # bf16 [T, N, Dr]
    step: int


@dataclass
class Scenario:
    dims: Dims
    seed: int
    churn: float = 0.25
    idle: float = 0.15
    speculative: float = 0.2
    gen: torch.Generator = field(init=False)
    index_key: torch.Tensor = field(init=False)  # bf16 [blocks, bs, 1, Di]
    host: torch.Tensor = field(init=False)  # bf16 [S, Dl+Dr]
    rows: List[Optional[Request]] = field(init=False)
    free_blocks: List[int] = field(init=False)
    free_host: List[int] = field(init=False)
    next_rid: int = field(init=False, default=100)
    step: int = field(init=False, default=-1)

    def __post_init__(self):
        d = self.dims
        self.gen = torch.Generator().manual_seed(self.seed)
        blocks_per_req = -(-d.max_len // d.block_size)
        n_blocks = blocks_per_req * d.rows * 4 + 1
        self.index_key = torch.randn(n_blocks, d.block_size, 1, d.index_dim, generator=self.gen).to(torch.bfloat16)
        self.host = torch.randn(d.host_tokens, d.d_latent + d.d_rope, generator=self.gen).to(torch.bfloat16)
        self.free_blocks = torch.randperm(n_blocks, generator=self.gen).tolist()
        self.free_host = torch.randperm(d.host_tokens, generator=self.gen).tolist()
        self.rows = [None] * d.rows

    # ------------------------------------------------------------------ requests
    def _rand(self) -> float:
        return float(torch.rand((), generator=self.gen))

    def _new_request(self) -> Request:
        d = self.dims
        nb = -(-d.max_len // d.block_size)
        blocks = [self.free_blocks.pop() for _ in range(nb)]
        slots = torch.tensor([self.free_host.pop() for _ in range(d.max_len)], dtype=torch.int32)
        length = int(torch.randint(d.top_k - 2, d.max_len // 2, (), generator=self.gen))
        bias = torch.randn(d.index_heads, d.index_dim, generator=self.gen)
        self.next_rid += 1
        return Request(self.next_rid, length, blocks, slots, bias)

    def _release(self, req: Request) -> None:
        self.free_blocks.extend(req.blocks)
        self.free_host.extend(req.host_slots.tolist())

    def _advance_rows(self) -> None:
        d = self.dims
        for r in range(d.rows):
            req = self.rows[r]
            u = self._rand()
            if req is None:
                if u > self.idle:
                    self.rows[r] = self._new_request()
            elif u < self.churn or req.length >= d.max_len:
                self._release(req)
                self.rows[r] = None if self._rand() < self.idle else self._new_request()
            else:
                req.length += 1

    # --------------------------------------------------------------------- steps
    def next_step(self) -> StepInputs:
        d = self.dims
        self.step += 1
        self._advance_rows()
        active = [r for r in range(d.rows) if self.rows[r] is not None]
        order = [active[i] for i in torch.randperm(len(active), generator=self.gen).tolist()]
        n_real, n_tok = len(order), len(order) + d.padding_tokens
        token_rows = torch.tensor(order + [-1] * d.padding_tokens, dtype=torch.int32)

        query = torch.randn(n_tok, d.index_heads, d.index_dim, generator=self.gen) * 0.3
        for t, r in enumerate(order):
            query[t] += self.rows[r].query_bias
        weights = (torch.rand(n_tok, d.index_heads, generator=self.gen) + 0.1).to(torch.bfloat16)
        nb = -(-d.max_len // d.block_size)
        block_table = torch.zeros(max(n_real, 1), nb, dtype=torch.int32)
        kv_len = torch.zeros(max(n_real, 1), dtype=torch.int32)
        for t, r in enumerate(order):
            block_table[t] = torch.tensor(self.rows[r].blocks, dtype=torch.int32)
            kv_len[t] = self.rows[r].length
        cu = torch.arange(1, max(n_real, 1) + 1, dtype=torch.int32) if n_real else torch.zeros(1, dtype=torch.int32)

        req_ids = torch.full((d.rows,), -1, dtype=torch.int64)
        stable = torch.zeros(d.rows, dtype=torch.int32)
        token_table = torch.zeros(d.rows, d.max_len, dtype=torch.int32)
        for r in range(d.rows):
            req = self.rows[r]
            if req is None:
                continue
            req_ids[r] = req.rid
            spec = 1 if self._rand() < self.speculative else 0
            stable[r] = req.length - spec  # the last position may still be rewritten
            token_table[r] = req.host_slots

        attn_query = torch.randn(n_tok, d.heads, d.d_latent, generator=self.gen).to(torch.bfloat16)
        attn_rope = torch.randn(n_tok, d.heads, d.d_rope, generator=self.gen).to(torch.bfloat16)
        return StepInputs(
            query=query.to(torch.bfloat16), weights=weights, actual_seq_lengths_query=cu,
            actual_seq_lengths_key=kv_len, block_table=block_table, token_rows=token_rows, req_ids=req_ids,
            stable_len=stable, token_table=token_table, attn_query=attn_query, attn_query_rope=attn_rope,
            step=self.step,
        )

    def resident_rows_expected(self, slot_token: torch.Tensor, token_table: torch.Tensor) -> Dict[tuple, torch.Tensor]:
        """(row, slot) -> the host row the slot must hold, for every non-empty slot."""
        out = {}
        for r, s in torch.nonzero(slot_token >= 0).tolist():
            out[(r, s)] = self.host[int(token_table[r, int(slot_token[r, s])])]
        return out
