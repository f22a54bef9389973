"""CPU verify graphs (``sglang_plugin/speculative/cpu_graph.py``) without a server.

* :func:`row_lens`: verify row ``j`` over committed length ``L`` sees ``L + j + 1`` positions.
* The offload verify step of a graph bucket (:func:`begin_graph_verify` filling the
  static row buffers, then ``decode_layer_step`` over them, as the compiled forward
  runs it) equals the eager verify step (``speculative.begin_verify`` +
  ``engine.run_layer``) bit for bit, over two rounds with an accepted and two rejected
  drafts, in a bucket of 2 requests with 1 live (padding entries on ``req_to_token``
  row 0 with arbitrary top-k): live outputs and hit masks equal, attention equal to
  attention over the host pool rows, the padding entries copy nothing and leave the
  live rows' residency as the eager engine's.
* A request's verify rows share its engine row (its ``req_to_token`` row): the graph
  step runs ``decode_layer_step`` with ``rows_per_request = n`` over the bucket's
  request entries, and the hot buffer of the live request equals the eager engine's.
* Negative control: the graph step over a zeroed token table differs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ascend_offload.ops.reference import sparse_mla_attention
from sglang_ascend_offload.ops.request_union import union_of_rows
from sglang_ascend_offload.sglang_plugin.attention.sparse_decode import OffloadGraphBuffers, RowOwners
from sglang_ascend_offload.sglang_plugin.speculative import cpu_graph as cpu_spec_graph
from sglang_ascend_offload.sglang_plugin.speculative import eagle as speculative
from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine, decode_layer_step
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape

REQ_ROWS, N, K, LATENT, ROPE, HEADS, WIDTH = 3, 4, 6, 16, 8, 2, 64
HOT = N * K  # one hot buffer per request holds the union of its rows' top-k
REQ_ROW = 2
BUCKET = 2  # requests per bucket: 1 live + 1 padding
L = 20


class _Verify:
    def is_target_verify(self):
        return True

    def is_decode(self):
        return False

    def is_extend(self):
        return True


def test_row_lens_are_causal_within_the_chain():
    got = cpu_spec_graph.row_lens(torch.tensor([5, 9]), 3)
    assert got.tolist() == [6, 7, 8, 10, 11, 12]


def _backend(pool, r2t, graph: bool):
    engine = SparseDecodeEngine(
        EngineConfig(
            layers=1,
            rows=REQ_ROWS,
            hot_tokens=HOT,
            top_k=K,
            latent_dim=LATENT,
            rope_dim=ROPE,
            dtype=torch.float32,
            manage_impl="torch",
            rows_per_request=N,
        ),
        pool,
        device="cpu",
    )
    backend = SimpleNamespace(
        engine=engine,
        rows=RowOwners(REQ_ROWS),
        req_to_token_pool=SimpleNamespace(req_to_token=r2t),
        verify_rows_per_request=N,
        metrics=SimpleNamespace(on_step_end=lambda: None),
        _batch_rows=None,
        _graph_batch=BUCKET * N,
    )
    if graph:
        t = BUCKET
        backend.offload_graph = OffloadGraphBuffers(
            rows=torch.full((t,), engine.sink_row, dtype=torch.int64),
            req_ids=torch.full((t,), -1, dtype=torch.int64),
            stable=torch.zeros((t,), dtype=torch.int32),
            step=torch.zeros((), dtype=torch.int64),
        )
    return backend


def _write(pool, r2t, positions, slots, gen):
    r2t[REQ_ROW, positions] = torch.tensor(slots, dtype=torch.int32)
    pool.write_rows(0, torch.tensor(slots), torch.randn(len(slots), LATENT + ROPE, generator=gen))


def _topk(committed: int, extra):
    rows = []
    for j in range(N):
        sel = sorted(p for p in set(extra) | {committed + j} if p <= committed + j)
        rows.append(list(range(K - len(sel))) + sel)
    return torch.tensor(rows, dtype=torch.int32)


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


def _graph_step(backend, committed, topk_live, q, q_rope, table=None):
    """One graph verify step of the bucket: live request first, then the padding request
    (``req_to_token`` row 0, fill length 1, arbitrary top-k)."""
    batch = SimpleNamespace(
        forward_mode=_Verify(),
        batch_size=BUCKET,
        rids=["req-a"],
        req_pool_indices=torch.tensor([REQ_ROW, 0]),
        seq_lens=torch.tensor([committed, 1]),
        _original_num_tokens=None,
    )
    cpu_spec_graph.begin_graph_verify(backend, batch)
    g = backend.offload_graph
    topk = torch.cat((topk_live, torch.arange(K, dtype=torch.int32).expand(N, K)))
    qq, qr = torch.cat((q, torch.ones_like(q))), torch.cat((q_rope, torch.ones_like(q_rope)))
    eng = backend.engine
    out, res = decode_layer_step(
        eng.managers[0],
        g.rows,
        topk,
        g.req_ids,
        g.stable,
        g.step,
        eng.pool.layer(0),
        eng.hot.storage(0),
        backend.req_to_token_pool.req_to_token if table is None else table,
        qq,
        qr,
        0.5,
        LATENT,
        rows_per_request=N,
    )
    return out[:N], res


def _eager_step(backend, committed, topk, q, q_rope):
    batch = SimpleNamespace(
        forward_mode=_Verify(),
        spec_info=SimpleNamespace(draft_token_num=N),
        batch_size=1,
        req_pool_indices=torch.tensor([REQ_ROW]),
        rids=["req-a"],
        seq_lens_cpu=torch.tensor([committed]),
        _original_num_tokens=None,
    )
    speculative.begin_verify(backend, batch)
    return backend.engine.run_layer(0, topk, q, q_rope, 0.5)


def _rounds(graph_table=None):
    gen = torch.Generator().manual_seed(0)
    pool = HostKVPool.allocate(HostPoolShape(1, 256, LATENT, ROPE, torch.float32), "pinned")
    r2t = torch.zeros((REQ_ROWS, WIDTH), dtype=torch.int32)
    graph, eager = _backend(pool, r2t, True), _backend(pool, r2t, False)
    _write(pool, r2t, list(range(L)), list(range(64, 64 + L)), gen)
    _write(pool, r2t, list(range(L, L + N)), [100, 101, 102, 103], gen)
    steps = []
    for committed, extra in ((L, [L, L + 1]), (L + 2, [L, L + 1, L + 2, L + 3])):
        if committed != L:  # one draft accepted + bonus; the rejected positions get new slots and rows
            _write(pool, r2t, [L + 2, L + 3, L + 4, L + 5], [110, 111, 112, 113], gen)
        topk = _topk(committed, extra)
        q, q_rope = torch.randn(N, HEADS, LATENT, generator=gen), torch.randn(N, HEADS, ROPE, generator=gen)
        g_out, g_res = _graph_step(
            graph, committed, topk, q, q_rope, table=None if graph_table is None else graph_table(graph)
        )
        e = _eager_step(eager, committed, topk, q, q_rope)
        steps.append((topk, g_out, g_res, e, _reference(pool, r2t, topk, q, q_rope), graph, eager))
    return steps


def test_graph_verify_step_equals_eager_verify_bit_for_bit():
    steps = _rounds()
    for topk, g_out, g_res, e, ref, graph, eager in steps:
        assert torch.equal(g_out, e.output)
        assert torch.equal(g_out, ref)
        assert torch.equal(g_res.hit_mask[:1], e.residency.hit_mask)
        assert int(g_res.miss_count[1:].sum()) == 0  # padding entries copy nothing
    union = union_of_rows(steps[1][0], N).positions  # the live request's lookups, as the step saw them
    hits = steps[1][2].hit_mask[:1]
    assert hits.any() and not (hits & (union >= L + 2)).any()  # accepted rows hit; rejected never
    graph, eager = steps[-1][5], steps[-1][6]
    live = slice(REQ_ROW, REQ_ROW + 1)
    assert torch.equal(graph.engine.hot.storage(0)[live], eager.engine.hot.storage(0)[live])


def test_wrong_token_table_differs():
    """Negative control: the same step over a zeroed token table attends other rows."""
    steps = _rounds(graph_table=lambda backend: torch.zeros((REQ_ROWS, WIDTH), dtype=torch.int32))
    assert any(not torch.equal(g_out, ref) for _, g_out, _, _, ref, _, _ in steps)


@pytest.mark.parametrize("device, refused", [("cpu", False), ("npu", True), ("cuda", True)])
def test_startup_rule_allows_graph_speculation_only_on_the_cpu(device, refused):
    from startup_verdict import server_verdict

    from sglang_ascend_offload import config as cfg

    sd = cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(hot_tokens=4 * 64))
    server = dict(
        speculative_algorithm="NEXTN",
        speculative_eagle_topk=1,
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
        disable_overlap_schedule=True,
        device=device,
        page_size=64,
        disable_cuda_graph=False,
        enable_torch_compile=True,
        attention_backend="ascend_offload",
        cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")),
    )
    problems = [v for v in server_verdict(sd, **server) if v.rule == "sglang.sparse_decode_speculative"]
    assert bool(problems) == refused
    if refused:
        assert "decode graphs" in problems[0].problem and "--disable-cuda-graph" in problems[0].fix
