"""Two dsa_harness harnesses stepped side by side, one eager and one replaying decode batches
the way SGLang's CPU graph runner does (a bucket padded with entries on the reserved
req_to_token row 0); shared by the graph, fused-indexer, int8-indexer and adaptive-residency
component tests.
"""

from __future__ import annotations

import torch
from dsa_harness import HEADS, HIDDEN, LATENT, Q_LORA, ROPE

BUCKET = 4


def _graph_batch(fb, bucket: int):
    """``fb`` as SGLang's CPU graph runner replays it in ``bucket`` (cpu_graph_runner.prepare_replay):
    padded entries on row 0 with length 1 and slot 0, no rids / seq_lens_cpu; unchanged when full."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    real = int(fb.batch_size)
    if real == bucket:
        return fb
    n = bucket - real

    def pad(t, value=0):
        return torch.cat((t, torch.full((n,), value, dtype=t.dtype)))

    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bucket,
        input_ids=pad(fb.input_ids),
        req_pool_indices=pad(fb.req_pool_indices),
        seq_lens=pad(fb.seq_lens, 1),
        out_cache_loc=pad(fb.out_cache_loc),
        seq_lens_sum=int(fb.seq_lens.sum()) + n,
        positions=pad(fb.positions),
    )


def _inputs(h, tokens):
    return dict(
        x=h._rand(tokens, HIDDEN),
        q_lora=h._rand(tokens, Q_LORA),
        q=h._rand(tokens, HEADS, LATENT + ROPE),
        k=h._rand(tokens, 1, LATENT + ROPE),
    )


def _pad_rows(t, bucket):
    return torch.cat((t, t.new_zeros((bucket - t.shape[0],) + tuple(t.shape[1:])))) if t.shape[0] < bucket else t


def _assert_same_residency(eager, graph):
    r = eager.offload.engine.config.rows
    for layer in range(eager.layers):
        e = eager.offload.engine.managers[layer].table
        g = graph.offload.engine.managers[layer].table
        assert torch.equal(g.slot_token[:r], e.slot_token[:r]), f"layer {layer}: resident positions differ"
        assert bool((g.slot_token[r] == -1).all()) and int(g.row_req[r]) == -1, "the sink row holds something"


def _prepare_extend(h, reqs, lens):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    table = h.req_to_token_pool.req_to_token
    prefix = torch.tensor([r.length for r in reqs], dtype=torch.int64)
    seq = prefix + torch.tensor(lens, dtype=torch.int64)
    last = torch.tensor([int(table[r.row, r.length - 1]) if r.length else -1 for r in reqs], dtype=torch.int64)
    out = h.allocator.alloc_extend(prefix, prefix, seq, seq, last, int(sum(lens)))
    offset, positions = 0, []
    for r, n in zip(reqs, lens):
        table[r.row, r.length : r.length + n] = out[offset : offset + n].to(torch.int32)
        positions.append(torch.arange(r.length, r.length + n))
        offset += n
        r.length += n
    return h._batch(ForwardMode.EXTEND, reqs, out, torch.cat(positions), seq, prefix, lens)


def _prepare_decode(h, reqs):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    table = h.req_to_token_pool.req_to_token
    seq = torch.tensor([r.length + 1 for r in reqs], dtype=torch.int64)
    last = torch.tensor([int(table[r.row, r.length - 1]) for r in reqs], dtype=torch.int64)
    out = h.allocator.alloc_decode(seq, seq, last)
    positions = torch.tensor([r.length for r in reqs], dtype=torch.int64)
    for r, loc in zip(reqs, out.tolist()):
        table[r.row, r.length] = loc
        r.length += 1
    return h._batch(ForwardMode.DECODE, reqs, out, positions, seq, None, None)


def _step(eager, graph, fb_e, fb_g, decode):
    """One forward of both harnesses on the same inputs (the graph harness's decode
    batch as the CPU graph runner replays it); the graph path's live rows must equal
    eager's: top-k and attention of both backends, bit for bit."""
    gfb = _graph_batch(fb_g, BUCKET) if decode else fb_g
    real = int(fb_e.batch_size)
    for h, batch in ((eager, fb_e), (graph, gfb)):
        h.dense.init_forward_metadata(batch)
        h.offload.init_forward_metadata(batch)
    if decode:
        assert graph.dense._graph_batch == BUCKET and graph.offload._graph_batch == BUCKET
    for layer in range(eager.layers):
        inp = _inputs(eager, int(fb_e.positions.numel()))
        ginp = {k: _pad_rows(v, BUCKET) for k, v in inp.items()} if decode else inp
        att = eager.attn_layers[layer]
        outs = {}
        for name, h, batch, x in (("eager", eager, fb_e, inp), ("graph", graph, gfb, ginp)):
            ix = h.indexers[layer]
            with torch.no_grad():
                topk = h.dense.run_indexer(ix, x["x"], x["q_lora"], batch.positions, batch, layer)
                topk_off = h.offload.run_indexer(ix, x["x"], x["q_lora"], batch.positions, batch, layer)
                run_d = h.dense.forward_decode if decode else h.dense.forward_extend
                run_o = h.offload.forward_decode if decode else h.offload.forward_extend
                dense = run_d(x["q"], x["k"], x["k"][..., :LATENT], att, batch, topk_indices=topk)
                off = run_o(x["q"], x["k"], x["k"][..., :LATENT], att, batch, topk_indices=topk_off)
            outs[name] = (topk[:real], topk_off[:real], dense[:real], off[:real])
        for what, e, g in zip(
            ("top-k", "offload top-k", "attention", "offload attention"), outs["eager"], outs["graph"]
        ):
            assert torch.equal(e, g), (
                f"layer {layer}: graph {what} differs from eager ({'decode' if decode else 'extend'})"
            )
        assert torch.equal(outs["graph"][2], outs["graph"][3]), f"layer {layer}: graph offload != graph device KV"


def eager_and_graph_layers(eager, graph, rids, lens=None, bucket: int = BUCKET):
    """One forward of requests ``rids`` on both harnesses (an extend of ``lens`` new tokens,
    or a decode step when ``lens`` is None, replayed in ``bucket`` on ``graph``) with the
    same inputs; per layer ``(eager top-k, graph top-k, eager out, graph out)`` of the live rows."""
    decode = lens is None
    fb_e, fb_g = [
        (
            _prepare_decode(h, [h.requests[r] for r in rids])
            if decode
            else _prepare_extend(h, [h.requests[r] for r in rids], lens)
        )
        for h in (eager, graph)
    ]
    gfb = _graph_batch(fb_g, bucket) if decode else fb_g
    for h, fb in ((eager, fb_e), (graph, gfb)):
        h.offload.init_forward_metadata(fb)
    assert (graph.offload._graph_batch == bucket) == decode
    real = int(fb_e.batch_size)
    layers = []
    for layer in range(eager.layers):
        inp = _inputs(eager, int(fb_e.positions.numel()))
        ginp = {k: _pad_rows(v, bucket) for k, v in inp.items()} if decode else inp
        outs = []
        for h, fb, x in ((eager, fb_e, inp), (graph, gfb, ginp)):
            run = h.offload.forward_decode if decode else h.offload.forward_extend
            with torch.no_grad():
                topk = h.offload.run_indexer(h.indexers[layer], x["x"], x["q_lora"], fb.positions, fb, layer)
                out = run(x["q"], x["k"], x["k"][..., :LATENT], h.attn_layers[layer], fb, topk_indices=topk)
            outs.append((topk[:real], out[:real]))
        layers.append((outs[0][0], outs[1][0], outs[0][1], outs[1][1]))
    return layers
