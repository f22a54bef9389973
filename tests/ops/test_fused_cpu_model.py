"""The fused rung on CPU: ``ops/fused.py``'s fused wrappers, unchanged, calling the
AscendC kernels run on their functional model (``ops/ascendc_cpu_ops.py``).

Selecting ``ops="fused"`` on a CPU platform registers the four extension ops
(``torch.ops.sglang_ascend_offload.*``, the schemas of ``ascendc_ops/host/torch_ops.cpp``)
implemented by host checks + host tiling + one model launch. Compared with the reference
compositions on the same inputs, at shapes the kernels' host tiling accepts:

* LIM and LIM-C8 over several steps with churn, idle rows, speculative positions, padding
  tokens and a repeated step: top-k, sparse indices, every residency output and the
  mutated state **bit-exact** (indexer inputs on the exact-arithmetic grid of
  ``kernel_check.functional``, so scores and their tie order agree exactly);
* Copy-SFA (16 heads, and 4 heads padded to 8 by the host code): the hot buffer after the
  miss copies bit-exact (NaN garbage included), attention within ``2e-2 + 2e-2·|ref|``;
* the model ops are refused on an NPU platform (the extension owns the namespace there).

The engine with ``ops="fused"`` on CPU: ``tests/sparse_decode/test_engine_fused_cpu_model.py``.

The model ops are unregistered after this module, so other tests see the default state.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_ascend_offload.kernel_check.functional import LimDims, Scenario, _sfa_inputs
from sglang_ascend_offload.ops import ascendc_cpu_ops, fused, registry
from sglang_ascend_offload.ops.contract import ResidencyTable

from .test_fused_abi import parse_schemas

ATTN_ATOL = ATTN_RTOL = 2e-2  # docs/fused_ops.md: the fused Copy-SFA tolerance


@pytest.fixture(scope="module")
def fused_cpu():
    """Select the fused rung as ``ops="fused"`` does on CPU (registers the model ops)."""
    if shutil_which_cxx() is None:
        pytest.skip("needs g++ to build the AscendC functional model")
    registry.select("copy_sparse_flash_attention", "fused")
    assert ascendc_cpu_ops.registered()
    yield
    ascendc_cpu_ops.unregister()


def shutil_which_cxx():
    import os
    import shutil

    return shutil.which(os.environ.get("CXX", "g++"))


def test_schemas_are_the_extensions():
    assert ascendc_cpu_ops.SCHEMAS == parse_schemas()


# ------------------------------------------------------------------ LIM, LIM-C8
def _lim_call(op: str, inp, table: ResidencyTable, dims: LimDims, rung: str):
    common = dict(
        actual_seq_lengths_query=inp.cu,
        actual_seq_lengths_key=inp.kv_len,
        block_table=inp.block_table,
        token_rows=inp.token_rows,
        req_ids=inp.req_ids,
        stable_len=inp.stable,
        step=inp.step,
        slot_token=table.slot_token,
        slot_stamp=table.slot_stamp,
        row_req=table.row_req,
        sparse_count=dims.top_k,
        sparse_mode=dims.sparse_mode,
    )
    fn = registry.select(op, rung).fn
    if dims.quantized:
        return fn(inp.query, inp.key, inp.weights, inp.query_scale, inp.key_scale, **common)
    return fn(inp.query, inp.key, inp.weights, **common)


def _assert_lim_equal(got, ref, t_got: ResidencyTable, t_ref: ResidencyTable, label: str) -> None:
    pairs = [
        ("topk_indices", got.topk_indices, ref.topk_indices),
        ("sparse_indices", got.sparse_indices, ref.sparse_indices),
    ]
    pairs += [
        (f.name, getattr(got.residency, f.name), getattr(ref.residency, f.name))
        for f in dataclasses.fields(ref.residency)
    ]
    pairs += [(name, getattr(t_got, name), getattr(t_ref, name)) for name in ("slot_token", "slot_stamp", "row_req")]
    for name, a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{label}: {name} differs"


@pytest.mark.parametrize("quantized", [False, True], ids=["LIM", "LIM-C8"])
@pytest.mark.parametrize(
    "dims", [LimDims(), LimDims(sparse_mode=0, block_size=64, hot_tokens=128, rows=4)], ids=["mode3", "mode0"]
)
def test_lim_fused_rung_on_cpu_equals_the_composition(fused_cpu, quantized, dims):
    dims = dataclasses.replace(dims, quantized=quantized)
    op = "quant_lightning_indexer_manage" if quantized else "lightning_indexer_manage"
    sc = Scenario(dims, seed=11)
    table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    misses = hits = 0
    for step in range(5):
        if step < 4:
            sc.advance()
            inp = sc.inputs()
        else:  # the same step again: owned rows hit everything they select
            stable = torch.tensor([r.length if r is not None else 0 for r in sc.rows.rows], dtype=torch.int32)
            inp = dataclasses.replace(inp, step=inp.step + 1, stable=stable)
        t_ref, t_got = table.clone(), table.clone()
        ref = _lim_call(op, inp, t_ref, dims, "reference")
        got = _lim_call(op, inp, t_got, dims, "fused")
        _assert_lim_equal(got, ref, t_got, t_ref, f"{op} step {step}")
        misses += int(ref.residency.miss_count.clamp(min=0).sum())
        hits += int(ref.residency.hit_mask.sum())
        table = t_ref
    assert misses > 0 and hits > 0  # both paths of the residency step ran


@pytest.mark.parametrize("quantized", [False, True], ids=["LIM", "LIM-C8"])
@pytest.mark.parametrize("n", [2, 3])
def test_lim_fused_rung_serves_rows_shared_by_verify_tokens(fused_cpu, quantized, n):
    """``tokens_per_row = n``: each request's ``n`` query tokens (one request ``n - 1``) own
    its row; the kernel steps the row on the union of their top-k. Bit-exact against the
    reference composition over steps with churn, idle rows and speculative positions, and
    every token's flat index names a slot that now holds the position it selected."""
    dims = LimDims(quantized=quantized, tokens_per_row=n, hot_tokens=n * 128)
    op = "quant_lightning_indexer_manage" if quantized else "lightning_indexer_manage"
    sc = Scenario(dims, seed=20 + n)
    table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    shared = hits = 0
    for step in range(4):
        sc.advance()
        inp = sc.inputs()
        t_ref, t_got = table.clone(), table.clone()
        common = dict(
            actual_seq_lengths_query=inp.cu,
            actual_seq_lengths_key=inp.kv_len,
            block_table=inp.block_table,
            token_rows=inp.token_rows,
            req_ids=inp.req_ids,
            stable_len=inp.stable,
            step=inp.step,
            sparse_count=dims.top_k,
            sparse_mode=dims.sparse_mode,
            tokens_per_row=n,
        )
        head = (inp.query, inp.key, inp.weights) + ((inp.query_scale, inp.key_scale) if quantized else ())
        ref = registry.select(op, "reference").fn(
            *head, slot_token=t_ref.slot_token, slot_stamp=t_ref.slot_stamp, row_req=t_ref.row_req, **common
        )
        got = registry.select(op, "fused").fn(
            *head, slot_token=t_got.slot_token, slot_stamp=t_got.slot_stamp, row_req=t_got.row_req, **common
        )
        _assert_lim_equal(got, ref, t_got, t_ref, f"{op} n={n} step {step}")
        assert got.residency.slots.shape == (dims.rows, n * dims.top_k)
        owned = inp.token_rows >= 0
        shared += int((torch.bincount(inp.token_rows[owned].long(), minlength=dims.rows) > 1).sum())
        flat = got.sparse_indices.reshape(inp.token_rows.shape[0], -1)
        topk = got.topk_indices.reshape(flat.shape)
        for t in torch.nonzero(owned).flatten().tolist():
            r = int(inp.token_rows[t])
            if int(inp.req_ids[r]) < 0:
                continue
            sel = flat[t] >= 0
            assert torch.equal(sel, topk[t] >= 0)
            slots = flat[t][sel] - r * dims.hot_tokens
            assert bool(((slots >= 0) & (slots < dims.hot_tokens)).all())
            assert torch.equal(t_got.slot_token[r, slots.long()], topk[t][sel]), (step, t)
        hits += int(ref.residency.hit_mask.sum())
        table = t_ref
    assert shared > 0 and hits > 0


def test_lim_verify_rows_at_production_shapes_the_npu_test_on_the_model(fused_cpu):
    """The NPU test of verify rows (``test_fused_npu.check_lim_verify_rows``: 64 x 128
    index heads, block 128, top-k 2048, 4096 hot slots, two tokens per row, 5K-16K
    contexts) with the kernels on their functional model."""
    from .test_fused_npu import check_lim_verify_rows

    check_lim_verify_rows("cpu")


# ------------------------------------------------------------------ Copy-SFA
@pytest.mark.parametrize("heads", [16, 4])
def test_copy_sfa_fused_rung_on_cpu_copies_bit_exact_and_attends_within_tolerance(fused_cpu, heads):
    inp = _sfa_inputs(seed=5, heads=heads, top_k=128, hot_tokens=160, rows=4, tokens=5, pad_rows_with_no_miss=True)
    assert int(inp.miss_count.sum()) > 0
    kw = dict(
        query_rope=inp.query_rope,
        token_rows=inp.token_rows,
        miss_tokens=inp.miss_tokens,
        miss_slots=inp.miss_slots,
        miss_count=inp.miss_count,
        token_table=inp.token_table,
    )
    hot_ref, hot_got = inp.hot.clone(), inp.hot.clone()
    ref = registry.select("copy_sparse_flash_attention", "reference").fn(
        inp.query, inp.host, hot_ref, inp.sparse, inp.scale, **kw
    )
    got = registry.select("copy_sparse_flash_attention", "fused").fn(
        inp.query, inp.host, hot_got, inp.sparse, inp.scale, **kw
    )
    assert torch.equal(hot_got.view(torch.int16), hot_ref.view(torch.int16)), "miss copies differ"
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape == (5, heads, 512)
    err = (got.float() - ref.float()).abs()
    assert bool((err <= ATTN_ATOL + ATTN_RTOL * ref.float().abs()).all()), f"max abs err {float(err.max()):.3g}"


def test_copy_sfa_fused_rung_serves_rows_shared_by_verify_tokens(fused_cpu):
    """Miss lists ``[R, 3 * K]``: up to three tokens attend over a row whose misses are
    copied once; tokens other than a row's first read rows copied for the row."""
    inp = _sfa_inputs(
        seed=9, heads=16, top_k=128, hot_tokens=384, rows=3, tokens=7, pad_rows_with_no_miss=False, tokens_per_row=3
    )
    owned = inp.token_rows[inp.token_rows >= 0].long()
    assert int(torch.bincount(owned).max()) == 3 and inp.miss_tokens.shape == (3, 384)
    kw = dict(
        query_rope=inp.query_rope,
        token_rows=inp.token_rows,
        miss_tokens=inp.miss_tokens,
        miss_slots=inp.miss_slots,
        miss_count=inp.miss_count,
        token_table=inp.token_table,
    )
    hot_ref, hot_got = inp.hot.clone(), inp.hot.clone()
    ref = registry.select("copy_sparse_flash_attention", "reference").fn(
        inp.query, inp.host, hot_ref, inp.sparse, inp.scale, **kw
    )
    got = registry.select("copy_sparse_flash_attention", "fused").fn(
        inp.query, inp.host, hot_got, inp.sparse, inp.scale, **kw
    )
    assert torch.equal(hot_got.view(torch.int16), hot_ref.view(torch.int16)), "miss copies differ"
    err = (got.float() - ref.float()).abs()
    assert bool((err <= ATTN_ATOL + ATTN_RTOL * ref.float().abs()).all()), f"max abs err {float(err.max()):.3g}"
    with pytest.raises(ValueError, match="maps 3 query tokens to one row"):  # miss lists one token wide
        registry.select("copy_sparse_flash_attention", "reference").fn(
            inp.query,
            inp.host,
            inp.hot.clone(),
            inp.sparse,
            inp.scale,
            **dict(kw, miss_tokens=inp.miss_tokens[:, :256], miss_slots=inp.miss_slots[:, :256]),
        )


def test_copy_sfa_refuses_shapes_the_kernel_does_not_serve_and_unregistered_host(fused_cpu):
    inp = _sfa_inputs(seed=6, heads=8, top_k=128, hot_tokens=128, rows=2, tokens=2, pad_rows_with_no_miss=False)
    op = getattr(torch.ops.sglang_ascend_offload, fused.COPY_SFA_KERNEL)
    args = [
        inp.query,
        inp.query_rope,
        inp.host,
        inp.hot,
        inp.sparse,
        inp.token_rows,
        inp.miss_tokens,
        inp.miss_slots,
        inp.miss_count,
        inp.token_table,
        inp.scale,
    ]
    unregistered, kept = inp.host.clone(), []
    while ascendc_cpu_ops._is_registered_host(unregistered):  # memory of a host registered earlier
        kept.append(unregistered)
        unregistered = inp.host.clone()
    with pytest.raises(RuntimeError, match="not in registered host memory"):
        op(*args[:2], unregistered, inp.hot.clone(), *args[4:])
    short = list(args)
    short[0], short[1] = inp.query[:, :, :256].contiguous(), inp.query_rope
    short[2], short[3] = inp.host[:, 256:].contiguous(), inp.hot[:, :, 256:].contiguous()
    with pytest.raises(RuntimeError, match="shape not supported by the fused kernel"):
        op(*short)


# ------------------------------------------------------------------ registration
def test_model_ops_are_refused_on_an_npu_platform(monkeypatch):
    was = ascendc_cpu_ops.registered()
    ascendc_cpu_ops.unregister()
    monkeypatch.setattr(ascendc_cpu_ops.platform, "device_kind", lambda: "npu")
    with pytest.raises(RuntimeError, match="built AscendC extension serves the fused ops"):
        ascendc_cpu_ops.register()
    ascendc_cpu_ops.ensure_for_choice("fused")  # on an NPU: nothing (the extension's checks decide)
    assert not ascendc_cpu_ops.registered()
    monkeypatch.undo()
    if was:
        ascendc_cpu_ops.register()


def test_model_ops_trace_under_torch_compile(fused_cpu):
    """The ops have fake implementations: ``torch.compile(fullgraph=True)`` (aot_eager:
    functionalised, in-place state written back) gives the eager results bit for bit."""
    inp = _sfa_inputs(seed=7, heads=8, top_k=128, hot_tokens=128, rows=3, tokens=3, pad_rows_with_no_miss=False)
    fused.register_host_memory(inp.host)
    ns = torch.ops.sglang_ascend_offload

    def copy_sfa(hot):
        return ns.npu_fused_scatter_copy_sparse_flash_attention(
            inp.query,
            inp.query_rope,
            inp.host,
            hot,
            inp.sparse,
            inp.token_rows,
            inp.miss_tokens,
            inp.miss_slots,
            inp.miss_count,
            inp.token_table,
            inp.scale,
        )

    hot_e, hot_c = inp.hot.clone(), inp.hot.clone()
    out_e = copy_sfa(hot_e)
    out_c = torch.compile(copy_sfa, fullgraph=True, backend="aot_eager")(hot_c)
    assert torch.equal(out_c.view(torch.int16), out_e.view(torch.int16))
    assert torch.equal(hot_c.view(torch.int16), hot_e.view(torch.int16))

    dims = LimDims(rows=3, padding_tokens=1)
    sc = Scenario(dims, seed=3)
    sc.advance()
    lim_in = sc.inputs()

    def lim(table: ResidencyTable):
        return ns.npu_fused_lightning_indexer_manage(
            lim_in.query,
            lim_in.key,
            lim_in.weights,
            lim_in.cu,
            lim_in.kv_len,
            lim_in.block_table,
            lim_in.token_rows,
            lim_in.req_ids,
            lim_in.stable,
            torch.tensor([lim_in.step]),
            table.slot_token,
            table.slot_stamp,
            table.row_req,
            "TND",
            "PA_BSND",
            dims.top_k,
            dims.sparse_mode,
        )

    t_e, t_c = ResidencyTable.empty(dims.rows, dims.hot_tokens), ResidencyTable.empty(dims.rows, dims.hot_tokens)
    outs_e = lim(t_e)
    outs_c = torch.compile(lim, fullgraph=True, backend="aot_eager")(t_c)
    assert all(torch.equal(a, b) for a, b in zip(outs_c, outs_e))
    assert all(torch.equal(getattr(t_c, n), getattr(t_e, n)) for n in ("slot_token", "slot_stamp", "row_req"))
