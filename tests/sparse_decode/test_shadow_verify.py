"""Shadow verification (``verify_sample_rate``): sampled rows' served attention recomputed
over the host pool with logical indices.

* On a correct engine every check is bit-exact (rate 1: every layer step checks a row),
  for the LRU torch path, the CPU kernel path and two verify rows per request.
* A corrupted hot-buffer slot that the next step takes as a hit is caught, with its
  layer and rows in the log and the counters; ``verify_action: fail`` raises.
* Sampling is a host draw: at rate 0.25 about a quarter of the layer steps are checked.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from sglang_ascend_offload.sparse_decode.engine import EngineConfig, SparseDecodeEngine
from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape
from sglang_ascend_offload.sparse_decode.shadow import ShadowMismatch, ShadowVerifier

from .test_engine_equivalence import (
    HOT,
    LATENT,
    LAYERS,
    MAX_CTX,
    ROPE,
    ROWS,
    SCALE,
    K,
    Workload,
    begin_workload_step,
    layer_inputs,
)


def _engine(rate, action="log", manage_impl="torch", rows_per_request=1):
    host_tokens = ROWS * MAX_CTX + 8
    pool = HostKVPool.allocate(HostPoolShape(LAYERS, host_tokens, LATENT, ROPE), "pinned")
    hot = max(HOT, rows_per_request * K)
    engine = SparseDecodeEngine(
        EngineConfig(
            LAYERS,
            ROWS,
            hot,
            K,
            LATENT,
            ROPE,
            policy="lru",
            ops="reference",
            manage_impl=manage_impl,
            max_context=MAX_CTX,
            verify_sample_rate=rate,
            verify_action=action,
            rows_per_request=rows_per_request,
        ),
        pool,
        device="cpu",
    )
    return engine, pool, host_tokens


def _steps(engine, host_tokens, steps, seed, before_layer=None):
    gen = torch.Generator().manual_seed(seed)
    work = Workload(seed, host_tokens)
    written = {}
    for step in range(steps):
        req_ids, seq_lens, stable, table, writes = begin_workload_step(engine, work, written, step)
        idx = torch.tensor(writes, dtype=torch.int64)
        for layer in range(LAYERS):
            if writes:
                engine.append(layer, idx, torch.randn((len(writes), LATENT + ROPE), generator=gen).to(torch.bfloat16))
            topk, q, qr = layer_inputs(work, gen, seq_lens, req_ids)
            if before_layer is not None:
                before_layer(step, layer, topk)
            engine.run_layer(layer, torch.from_numpy(topk), q, qr, SCALE)


@pytest.mark.parametrize("manage_impl", ["torch", "kernel"])
def test_a_correct_engine_passes_every_check_bit_exact(manage_impl):
    engine, _, tokens = _engine(1.0, manage_impl=manage_impl)
    _steps(engine, tokens, 150, seed=5)
    shadow = engine.shadow
    total = engine.stats().total
    assert shadow.checks > 0.9 * 150 * LAYERS  # padding entries drawn are skipped
    assert shadow.mismatches == 0 and total.shadow_mismatches == 0
    assert total.shadow_checks == shadow.checks
    assert shadow.last.exact and shadow.last.max_abs_diff == 0.0


def test_a_corrupted_resident_slot_is_caught_and_named(caplog):
    """After a warm-up, shift every resident slot of layer 1 (the residency still claims
    them): the check of that layer step hits corrupted slots and differs from the host
    pool; layer 0 stays clean."""
    engine, _, tokens = _engine(1.0)
    corrupted = {}

    def corrupt(step, layer, topk):
        if step == 40 and layer == 1:
            occupied = engine.table(1).slot_token[:ROWS] >= 0
            hot = engine.hot.layer(1)
            hot[occupied] = hot[occupied] + 1.0
            corrupted["slots"] = int(occupied.sum())

    with caplog.at_level(logging.ERROR, logger="sglang_ascend_offload.sparse_decode"):
        _steps(engine, tokens, 60, seed=5, before_layer=corrupt)
    assert corrupted["slots"] > 0
    assert engine.shadow.mismatches > 0
    assert engine.stats().per_layer[1].shadow_mismatches == engine.shadow.mismatches
    assert engine.stats().per_layer[0].shadow_mismatches == 0  # only layer 1 was touched
    msg = next(r.getMessage() for r in caplog.records if "shadow verification mismatch" in r.getMessage())
    assert re.search(r"layer 1, batch row \d \(engine row \d, request \d+\): served attention differs", msg)
    assert "bit-exact comparison" in msg


def test_verify_action_fail_raises_with_the_facts():
    engine, _, tokens = _engine(1.0, action="fail")

    def corrupt(step, layer, topk):
        if step == 40 and layer == 0:
            engine.hot.layer(0).add_(1.0)  # every row's resident slots of layer 0

    with pytest.raises(ShadowMismatch, match=r"layer 0, batch row \d+ \(engine row \d+, request \d+\).*'fail'"):
        _steps(engine, tokens, 80, seed=5, before_layer=corrupt)


def test_verify_rows_of_a_request_are_checked_in_the_shared_buffer():
    """Two query rows per request share one hot buffer (speculative verify rows): each
    sampled row's output still equals its own recomputation."""
    host_tokens = ROWS * MAX_CTX + 8
    pool = HostKVPool.allocate(HostPoolShape(LAYERS, host_tokens, LATENT, ROPE), "pinned")
    engine = SparseDecodeEngine(
        EngineConfig(
            LAYERS,
            ROWS,
            2 * K,
            K,
            LATENT,
            ROPE,
            policy="lru",
            ops="reference",
            rows_per_request=2,
            verify_sample_rate=1.0,
        ),
        pool,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(3)
    work = Workload(3, host_tokens)
    written = {}
    for step in range(60):
        # the step starts with the configured rows_per_request (2)
        req_ids, seq_lens, stable, table, writes = begin_workload_step(engine, work, written, step)
        idx = torch.tensor(writes, dtype=torch.int64)
        for layer in range(LAYERS):
            if writes:
                engine.append(layer, idx, torch.randn((len(writes), LATENT + ROPE), generator=gen).to(torch.bfloat16))
            rows = [layer_inputs(work, gen, seq_lens, req_ids) for _ in range(2)]
            topk = torch.from_numpy(np.stack([r[0] for r in rows], axis=1).reshape(2 * ROWS, K))
            q = torch.stack([r[1] for r in rows], dim=1).reshape(2 * ROWS, *rows[0][1].shape[1:])
            qr = torch.stack([r[2] for r in rows], dim=1).reshape(2 * ROWS, *rows[0][2].shape[1:])
            engine.run_layer(layer, topk, q, qr, SCALE)
    assert engine.shadow.checks > 0 and engine.shadow.mismatches == 0


def test_sampling_is_a_host_draw_at_the_rate():
    v = ShadowVerifier(0.25, seed=1)
    drawn = [v.sample(8) for _ in range(4000)]
    hits = [d for d in drawn if d is not None]
    assert 0.22 < len(hits) / len(drawn) < 0.28 and set(hits) == set(range(8))
    with pytest.raises(ValueError, match=r"verify_sample_rate must be in \(0, 1\]"):
        ShadowVerifier(0.0)
    with pytest.raises(ValueError, match="verify_action must be one of"):
        ShadowVerifier(0.5, action="abort")


class _ReachedTheOp(Exception):
    """Raised by :func:`_device_only_op` once it has checked its arguments (``meta``
    tensors carry no values, so the comparison after the op cannot run)."""


def _device_only_op(seen):
    """An attention op that, like a device kernel (torch_npu's), refuses host tensors."""

    def op(query, key, value, sparse_indices, scale_value, *, query_rope=None, key_rope=None, **kw):
        tensors = {"query": query, "key": key, "sparse_indices": sparse_indices}
        tensors.update(query_rope=query_rope, key_rope=key_rope)
        seen.update({name: t.device.type for name, t in tensors.items()})
        host = [name for name, t in tensors.items() if t.device.type == "cpu"]
        if host:
            raise RuntimeError(f"device op given host tensors: {host}")
        raise _ReachedTheOp

    return op


def test_the_recomputation_runs_on_the_served_rows_device():
    """On an NPU the engine's attention op is torch_npu's kernel: the check must hand it
    the row's query, the staged host rows and the indices on the served row's device
    (``meta`` here), never host copies. The host rows are read on the host (the pool's
    own read) and the top-k / token table are read back there to find them."""
    latent, rope, heads = 8, 4, 2
    host = torch.randn(32, latent + rope).to(torch.bfloat16)
    reads = []

    def read_rows(slots):
        reads.append(slots.device.type)
        return host.index_select(0, slots)

    seen = {}
    with pytest.raises(_ReachedTheOp):
        ShadowVerifier(1.0).check(
            layer=0,
            batch_row=0,
            engine_row=0,
            owner=7,
            attention_op=_device_only_op(seen),
            read_rows=read_rows,
            latent_dim=latent,
            topk_row=torch.tensor([3, 0, -1, 2, 1], dtype=torch.int32),
            token_row=torch.tensor([10, 11, 12, 13, 14, 15], dtype=torch.int32),
            query=torch.empty(heads, latent, dtype=torch.bfloat16, device="meta"),
            query_rope=torch.empty(heads, rope, dtype=torch.bfloat16, device="meta"),
            scale=0.5,
            served=torch.empty(heads, latent, dtype=torch.bfloat16, device="meta"),
            exact=True,
        )
    assert seen == dict.fromkeys(("query", "key", "sparse_indices", "query_rope", "key_rope"), "meta")
    assert reads == ["cpu"]
