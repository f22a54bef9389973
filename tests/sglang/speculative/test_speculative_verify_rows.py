"""MTP verify rows through the sparse decode engine (``sglang_plugin/speculative/eagle.py``),
without a server: the plugin's ``begin_verify`` drives the real engine with an
SGLang-shaped ``TARGET_VERIFY`` batch.

Scenario (one layer, one request on ``req_to_token`` row 1, ``n = 4`` verify rows):
round 1 verifies positions ``L .. L+3`` over the committed length ``L``; one draft is
accepted (plus the bonus token), so round 2 has committed length ``L + 2``; the two
rejected positions ``L+2, L+3`` get new slots and new rows in the host pool, as SGLang
does. Checked bit for bit against attention over the host pool rows themselves:

* positions at or beyond the committed length are never hits;
* accepted positions resident from round 1 are hits in round 2;
* rejected positions are copied again (their new rows, never the stale ones);
* the rows share the request's engine row and hot buffer: a position several rows
  select is looked up and copied once;
* negative control: the same rounds with the draft positions taken as committed
  (stable prefix ``L + n``) attend the stale rows and differ.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ascend_offload.ops.reference import sparse_mla_attention
from sglang_ascend_offload.ops.request_union import union_of_rows
from sglang_ascend_offload.sglang_plugin.attention.sparse_decode import RowOwners
from sglang_ascend_offload.sglang_plugin.speculative import eagle as speculative
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape

REQ_ROWS, N, K, LATENT, ROPE, HEADS, WIDTH = 3, 4, 6, 16, 8, 2, 64
HOT = N * K  # the request's hot buffer holds the union of its rows' top-k
REQ_ROW = 1
L = 20  # committed length of round 1


class _Mode:
    def is_target_verify(self):
        return True

    def is_decode(self):
        return False

    def is_extend(self):
        return True


def _batch(committed: int) -> SimpleNamespace:
    return SimpleNamespace(
        forward_mode=_Mode(),
        spec_info=SimpleNamespace(draft_token_num=N),
        req_pool_indices=torch.tensor([REQ_ROW]),
        rids=["req-a"],
        seq_lens_cpu=torch.tensor([committed]),
        batch_size=1,
        _original_num_tokens=None,
    )  # set by SGLang only for DP-attention padding


def _setup(manage_impl: str):
    torch.manual_seed(0)
    pool = HostKVPool.allocate(HostPoolShape(1, 256, LATENT, ROPE, torch.float32), "pinned")
    engine = SparseDecodeEngine(
        EngineConfig(
            layers=1,
            rows=REQ_ROWS,
            hot_tokens=HOT,
            top_k=K,
            latent_dim=LATENT,
            rope_dim=ROPE,
            dtype=torch.float32,
            manage_impl=manage_impl,
            rows_per_request=N,
        ),
        pool,
        device="cpu",
    )
    r2t = torch.zeros((REQ_ROWS, WIDTH), dtype=torch.int32)
    backend = SimpleNamespace(
        engine=engine,
        rows=RowOwners(REQ_ROWS),
        req_to_token_pool=SimpleNamespace(req_to_token=r2t),
        verify_rows_per_request=N,
    )
    return pool, engine, r2t, backend


def _write(pool, r2t, positions, slots):
    """SGLang's allocator gives ``positions`` the host ``slots``; this forward writes their rows."""
    r2t[REQ_ROW, positions] = torch.tensor(slots, dtype=torch.int32)
    pool.write_rows(0, torch.tensor(slots), torch.randn(len(slots), LATENT + ROPE))


def _reference(pool, r2t, topk, q, q_rope):
    flat = pool.layer(0)
    idx = torch.where(topk >= 0, r2t[REQ_ROW][topk.clamp(min=0).long()], torch.full_like(topk, -1))
    return sparse_mla_attention(
        q,
        flat[:, :LATENT],
        None,
        idx.to(torch.int32).unsqueeze(1),
        0.5,
        query_rope=q_rope,
        key_rope=flat[:, LATENT:],
        layout_query="TND",
        layout_kv="flat",
    )


def _verify_round(backend, pool, r2t, committed, topk, stable_override=None):
    batch = _batch(committed)
    rows = speculative.begin_verify(backend, batch)
    assert rows.tolist() == [REQ_ROW]  # the request's rows share its engine row
    if stable_override is not None:  # negative control: the engine is told the drafts are committed
        backend.engine._stable_len = torch.full((1,), stable_override, dtype=torch.int32)
    q, q_rope = torch.randn(N, HEADS, LATENT), torch.randn(N, HEADS, ROPE)
    result = backend.engine.run_layer(0, topk, q, q_rope, 0.5)
    return result, _reference(pool, r2t, topk, q, q_rope)


def _topk(committed: int, extra):
    """Row j selects committed positions 0..(K - 2 - len(extra)) plus ``extra`` and its own position."""
    rows = []
    for j in range(N):
        sel = sorted(set(extra) | {committed + j})
        rows.append(list(range(K - len(sel))) + sel)
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("manage_impl", ["torch", "kernel"])
def test_verify_rows_hit_accepted_and_never_rejected_positions(manage_impl):
    pool, engine, r2t, backend = _setup(manage_impl)
    _write(pool, r2t, list(range(L)), list(range(64, 64 + L)))  # the prompt (prefill)
    _write(pool, r2t, list(range(L, L + N)), [100, 101, 102, 103])  # round 1: last token + 3 drafts
    topk1 = _topk(L, [L, L + 1])  # every row selects L and L + 1 (rows 0..1 only up to their own position)
    topk1 = torch.where(topk1 <= L + torch.arange(N)[:, None], topk1, torch.full_like(topk1, -1))
    r1, ref1 = _verify_round(backend, pool, r2t, L, topk1)
    assert torch.equal(r1.output, ref1)
    union1 = union_of_rows(topk1, N).positions
    assert not (r1.residency.hit_mask & (union1 >= L)).any()  # the speculative suffix never hits
    distinct = {int(p) for p in topk1.reshape(-1).tolist() if p >= 0}
    assert int(r1.residency.miss_count.sum()) == len(distinct)  # shared positions copied once

    # One draft accepted + the bonus: committed L + 2. Rejected L+2, L+3 get new slots and new rows.
    _write(pool, r2t, [L + 2, L + 3, L + 4, L + 5], [110, 111, 112, 113])
    topk2 = _topk(L + 2, [L, L + 1, L + 2, L + 3])
    topk2 = torch.where(topk2 <= L + 2 + torch.arange(N)[:, None], topk2, torch.full_like(topk2, -1))
    r2, ref2 = _verify_round(backend, pool, r2t, L + 2, topk2)
    assert torch.equal(r2.output, ref2)
    hit = r2.residency.hit_mask[0]
    union2 = union_of_rows(topk2, N).positions[0]
    assert not (hit & (union2 >= L + 2)).any()  # rejected (rewritten) positions: copied again
    for pos in (L, L + 1):  # accepted positions resident since round 1 are hits now
        col = (union2 == pos).nonzero()
        assert col.numel() and bool(hit[col[0, 0]]), pos
    assert hit.any()


def test_drafts_taken_as_committed_attend_stale_rows():
    """Negative control: with the drafts inside the stable prefix, the rejected
    positions' stale rows stay resident and round 2 differs from the host pool."""
    pool, engine, r2t, backend = _setup("torch")
    _write(pool, r2t, list(range(L)), list(range(64, 64 + L)))
    _write(pool, r2t, list(range(L, L + N)), [100, 101, 102, 103])
    topk1 = _topk(L, [L, L + 1, L + 2, L + 3])
    _verify_round(backend, pool, r2t, L, topk1, stable_override=L + N)
    _write(pool, r2t, [L + 2, L + 3, L + 4, L + 5], [110, 111, 112, 113])
    topk2 = _topk(L + 2, [L, L + 1, L + 2, L + 3])
    r2, ref2 = _verify_round(backend, pool, r2t, L + 2, topk2, stable_override=L + 2 + N)
    assert not torch.equal(r2.output, ref2)


def test_variable_draft_counts_are_refused():
    pool, engine, r2t, backend = _setup("torch")
    batch = _batch(L)
    batch.spec_info.draft_token_num = N - 1
    with pytest.raises(RuntimeError, match="variable draft counts"):
        speculative.begin_verify(backend, batch)
