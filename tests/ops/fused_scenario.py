"""A small multi-step decode scenario for the fused-op tests (LIM, LIM-C8, Copy-SFA).

Rows churn between requests, go idle, grow by one token per step
(:class:`~sglang_ascend_offload.kernel_check.decode_rows.DecodeRows`, shared with the
kernel functional check); query tokens come in a shuffled order with padding tokens
at the end (``token_rows == -1``). Every request owns fixed blocks of a paged index-K
cache and fixed slots of a host pool of main-KV rows, so the same positions are
selected again across steps (hits) while new ones keep arriving (misses). Here the
values are random with a per-request query direction (selections recur); the
functional check draws exact-arithmetic values instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from sglang_ascend_offload.kernel_check.decode_rows import DecodeRows


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
    rows: DecodeRows = field(init=False)
    step: int = field(init=False, default=-1)

    def __post_init__(self):
        d = self.dims
        self.gen = torch.Generator().manual_seed(self.seed)
        blocks_per_req = -(-d.max_len // d.block_size)
        n_blocks = blocks_per_req * d.rows * 4 + 1
        self.index_key = torch.randn(n_blocks, d.block_size, 1, d.index_dim, generator=self.gen).to(torch.bfloat16)
        self.host = torch.randn(d.host_tokens, d.d_latent + d.d_rope, generator=self.gen).to(torch.bfloat16)
        self.rows = DecodeRows(
            self.gen,
            rows=d.rows,
            max_len=d.max_len,
            block_size=d.block_size,
            n_blocks=n_blocks,
            host_slots=d.host_tokens,
            churn=self.churn,
            idle=self.idle,
            spec=self.speculative,
            first_rid=100,
            draw_length=lambda g: int(torch.randint(d.top_k - 2, d.max_len // 2, (), generator=g)),
            # per-request query direction [Hi, Di]: makes selections recur
            draw_extra=lambda g: torch.randn(d.index_heads, d.index_dim, generator=g),
        )

    def next_step(self) -> StepInputs:
        d = self.dims
        self.step += 1
        self.rows.advance()
        order = self.rows.token_order()
        n_tok = len(order) + d.padding_tokens
        query = torch.randn(n_tok, d.index_heads, d.index_dim, generator=self.gen) * 0.3
        for t, r in enumerate(order):
            query[t] += self.rows.rows[r].extra
        weights = (torch.rand(n_tok, d.index_heads, generator=self.gen) + 0.1).to(torch.bfloat16)
        lay = self.rows.layout(order, d.padding_tokens)
        req_ids, stable, token_table = self.rows.row_state()
        attn_query = torch.randn(n_tok, d.heads, d.d_latent, generator=self.gen).to(torch.bfloat16)
        attn_rope = torch.randn(n_tok, d.heads, d.d_rope, generator=self.gen).to(torch.bfloat16)
        return StepInputs(
            query=query.to(torch.bfloat16),
            weights=weights,
            actual_seq_lengths_query=lay.cu,
            actual_seq_lengths_key=lay.kv_len,
            block_table=lay.block_table,
            token_rows=lay.token_rows,
            req_ids=req_ids,
            stable_len=stable,
            token_table=token_table,
            attn_query=attn_query,
            attn_query_rope=attn_rope,
            step=self.step,
        )

    def resident_rows_expected(self, slot_token: torch.Tensor, token_table: torch.Tensor) -> Dict[tuple, torch.Tensor]:
        """(row, slot) -> the host row the slot must hold, for every non-empty slot."""
        out = {}
        for r, s in torch.nonzero(slot_token >= 0).tolist():
            out[(r, s)] = self.host[int(token_table[r, int(slot_token[r, s])])]
        return out
