"""LIM, LIM-C8 and Copy-SFA reference compositions (CPU) and the fused rung's reasons.

* LIM / LIM-C8 == the indexer followed by ``residency_manage`` run separately
  (per-token top-k scattered into rows by a plain loop here): ``torch.equal``
  outputs and residency state, over many steps with churn, idle rows, speculative
  positions and padding tokens.
* Copy-SFA over the hot buffer == the reference sparse attention over the *full*
  KV (the host pool viewed as PA_BSND with ``block_size=1`` and each row's token
  table as block table) with *logical* indices: the invariant the engine relies
  on. Resident hot slots hold exactly their host rows (bit-exact); the hot buffer
  starts as NaN so a leaked unselected row would show.
* The fused rung is registered and, off Ascend, refuses with a reason that says
  how to build it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from sglang_ascend_offload import platform
from sglang_ascend_offload.ops import fused, hadamard, registry
from sglang_ascend_offload.ops.contract import IndexerManageResult, ResidencyTable
from sglang_ascend_offload.ops.registry import OpUnavailableError

from .fused_scenario import Dims, Scenario, StepInputs

STEPS = 12
ON_NPU = platform.device_kind() == "npu"


# ------------------------------------------------------------------ helpers
def indexer_meta(inp: StepInputs) -> dict:
    return dict(
        actual_seq_lengths_query=inp.actual_seq_lengths_query,
        actual_seq_lengths_key=inp.actual_seq_lengths_key,
        block_table=inp.block_table,
    )


def residency_args(inp: StepInputs, table: ResidencyTable) -> dict:
    return dict(
        token_rows=inp.token_rows,
        req_ids=inp.req_ids,
        stable_len=inp.stable_len,
        step=inp.step,
        slot_token=table.slot_token,
        slot_stamp=table.slot_stamp,
        row_req=table.row_req,
    )


def separate_steps(topk: torch.Tensor, inp: StepInputs, table: ResidencyTable, k: int):
    """Indexer top-k -> rows (plain loop) -> residency_manage -> per-token flat indices (plain loop)."""
    rows, hot = table.slot_token.shape
    topk_rows = torch.full((rows, k), -1, dtype=torch.int32)
    for t, r in enumerate(inp.token_rows.tolist()):
        if r >= 0:
            topk_rows[r] = topk[t, 0]
    manage = registry.select("residency_manage", "reference")
    res = manage(table.slot_token, table.slot_stamp, table.row_req, topk_rows, inp.req_ids, inp.stable_len, inp.step)
    flat = torch.full((topk.shape[0], 1, k), -1, dtype=torch.int32)
    for t, r in enumerate(inp.token_rows.tolist()):
        for j in range(k):
            if r >= 0 and int(res.slots[r, j]) >= 0:
                flat[t, 0, j] = r * hot + int(res.slots[r, j])
    return res, flat


def assert_same_step(got: IndexerManageResult, exp_topk, exp_res, exp_flat):
    assert torch.equal(got.topk_indices, exp_topk)
    assert torch.equal(got.sparse_indices, exp_flat)
    for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
        assert torch.equal(getattr(got.residency, name), getattr(exp_res, name)), name


def assert_same_table(a: ResidencyTable, b: ResidencyTable):
    assert torch.equal(a.slot_token, b.slot_token)
    assert torch.equal(a.slot_stamp, b.slot_stamp)
    assert torch.equal(a.row_req, b.row_req)


# ---------------------------------------------------------------------- LIM
def test_lim_equals_indexer_then_residency_manage_over_steps():
    dims = Dims()
    sc = Scenario(dims, seed=1)
    lim = registry.select("lightning_indexer_manage", "reference")
    indexer = registry.select("lightning_indexer", "reference")
    fused_table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    sep_table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    hits = misses = resets = 0
    for _ in range(STEPS):
        inp = sc.next_step()
        before = sep_table.row_req.clone()
        got = lim(
            inp.query,
            sc.index_key,
            inp.weights,
            **indexer_meta(inp),
            **residency_args(inp, fused_table),
            sparse_count=dims.top_k,
        )
        topk = indexer(inp.query, sc.index_key, inp.weights, **indexer_meta(inp), sparse_count=dims.top_k)
        res, flat = separate_steps(topk, inp, sep_table, dims.top_k)
        assert_same_step(got, topk, res, flat)
        assert_same_table(fused_table, sep_table)
        hits += int(res.hit_mask.sum())
        misses += int(res.miss_count.sum())
        resets += int((before != sep_table.row_req).sum())
    # the scenario really exercises both branches (first fill after a reset, steady hits)
    assert hits > 0 and misses > 0 and resets > dims.rows


def test_lim_c8_equals_quant_indexer_then_residency_manage():
    dims = Dims()
    sc = Scenario(dims, seed=2)
    lim = registry.select("quant_lightning_indexer_manage", "reference")
    indexer = registry.select("quant_lightning_indexer", "reference")
    fused_table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    sep_table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    hits = 0
    for _ in range(STEPS // 2):
        inp = sc.next_step()
        q8 = hadamard.prepare_quant_indexer_inputs(inp.query, sc.index_key)
        args = (q8.query, q8.key, inp.weights, q8.query_dequant_scale, q8.key_dequant_scale)
        got = lim(*args, **indexer_meta(inp), **residency_args(inp, fused_table), sparse_count=dims.top_k)
        topk = indexer(*args, **indexer_meta(inp), sparse_count=dims.top_k)
        res, flat = separate_steps(topk, inp, sep_table, dims.top_k)
        assert_same_step(got, topk, res, flat)
        assert_same_table(fused_table, sep_table)
        hits += int(res.hit_mask.sum())
    assert hits > 0


def test_lim_accepts_step_as_a_device_tensor():
    dims = Dims()
    sc = Scenario(dims, seed=3)
    lim = registry.select("lightning_indexer_manage", "reference")
    t_int = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    t_ten = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    for _ in range(3):
        inp = sc.next_step()
        a = lim(
            inp.query,
            sc.index_key,
            inp.weights,
            **indexer_meta(inp),
            **residency_args(inp, t_int),
            sparse_count=dims.top_k,
        )
        kw = residency_args(inp, t_ten)
        kw["step"] = torch.tensor([inp.step], dtype=torch.int64)
        b = lim(inp.query, sc.index_key, inp.weights, **indexer_meta(inp), **kw, sparse_count=dims.top_k)
        assert_same_step(b, a.topk_indices, a.residency, a.sparse_indices)
        assert_same_table(t_int, t_ten)


def test_lim_rejects_two_tokens_on_one_row_and_bad_rows():
    dims = Dims()
    sc = Scenario(dims, seed=4, idle=0.0)
    inp = sc.next_step()
    lim = registry.select("lightning_indexer_manage", "reference")
    table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    dup = inp.token_rows.clone()
    dup[1] = dup[0]
    with pytest.raises(ValueError, match="two query tokens"):
        lim(
            inp.query,
            sc.index_key,
            inp.weights,
            **indexer_meta(inp),
            **{**residency_args(inp, table), "token_rows": dup},
            sparse_count=dims.top_k,
        )
    bad = inp.token_rows.clone()
    bad[0] = dims.rows
    with pytest.raises(ValueError, match="outside"):
        lim(
            inp.query,
            sc.index_key,
            inp.weights,
            **indexer_meta(inp),
            **{**residency_args(inp, table), "token_rows": bad},
            sparse_count=dims.top_k,
        )
    with pytest.raises(ValueError, match="hot_tokens"):
        lim(
            inp.query,
            sc.index_key,
            inp.weights,
            **indexer_meta(inp),
            **residency_args(inp, table),
            sparse_count=dims.hot_tokens + 1,
        )


# ----------------------------------------------------------------- Copy-SFA
def full_kv_attention(sc: Scenario, inp: StepInputs, topk: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference attention over the whole host pool with logical indices (PA_BSND, block_size 1)."""
    d = sc.dims
    real = [r for r in inp.token_rows.tolist() if r >= 0]
    host = sc.host
    latent = host[:, : d.d_latent].reshape(host.shape[0], 1, 1, d.d_latent)
    rope = host[:, d.d_latent :].reshape(host.shape[0], 1, 1, d.d_rope)
    n = max(len(real), 1)
    block_table = torch.zeros(n, d.max_len, dtype=torch.int32)
    kv_len = torch.zeros(n, dtype=torch.int32)
    for b, r in enumerate(real):
        block_table[b] = inp.token_table[r]
        kv_len[b] = int(inp.actual_seq_lengths_key[b])
    cu = torch.arange(1, n + 1, dtype=torch.int32) if real else torch.zeros(1, dtype=torch.int32)
    attend = registry.select("sparse_mla_attention", "reference")
    return attend(
        inp.attn_query,
        latent,
        None,
        topk,
        scale,
        block_table=block_table,
        actual_seq_lengths_query=cu,
        actual_seq_lengths_kv=kv_len,
        query_rope=inp.attn_query_rope,
        key_rope=rope,
        layout_kv="PA_BSND",
        sparse_mode=3,
    )


def test_copy_sfa_equals_full_kv_attention_with_logical_indices():
    dims = Dims()
    sc = Scenario(dims, seed=5)
    lim = registry.select("lightning_indexer_manage", "reference")
    copy_sfa = registry.select("copy_sparse_flash_attention", "reference")
    table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    hot = torch.full((dims.rows, dims.hot_tokens, dims.d_latent + dims.d_rope), float("nan"), dtype=torch.bfloat16)
    scale = (dims.d_latent + dims.d_rope) ** -0.5
    copied = 0
    for _ in range(STEPS):
        inp = sc.next_step()
        step = lim(
            inp.query,
            sc.index_key,
            inp.weights,
            **indexer_meta(inp),
            **residency_args(inp, table),
            sparse_count=dims.top_k,
        )
        res = step.residency
        hot_before = hot.clone()
        out = copy_sfa(
            inp.attn_query,
            sc.host,
            hot,
            step.sparse_indices,
            scale,
            query_rope=inp.attn_query_rope,
            token_rows=inp.token_rows,
            miss_tokens=res.miss_tokens,
            miss_slots=res.miss_slots,
            miss_count=res.miss_count,
            token_table=inp.token_table,
        )
        expected = full_kv_attention(sc, inp, step.topk_indices, scale)
        assert torch.equal(out, expected)
        assert not bool(torch.isnan(out.float()).any())
        # every resident slot holds its host row; only the miss slots changed
        for (r, s), row in sc.resident_rows_expected(table.slot_token, inp.token_table).items():
            assert torch.equal(hot[r, s].view(torch.int16), row.view(torch.int16))
        changed = (hot.view(torch.int16) != hot_before.view(torch.int16)).any(dim=2)
        written = torch.zeros_like(changed)
        for r in range(dims.rows):
            n = int(res.miss_count[r])
            written[r, res.miss_slots[r, :n].long()] = True
        assert not bool((changed & ~written).any())
        copied += int(res.miss_count.sum())
    assert copied > 0


def _one_copy_sfa_step(seed=6):
    dims = Dims()
    sc = Scenario(dims, seed=seed, idle=0.0)
    inp = sc.next_step()
    table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    step = registry.select("lightning_indexer_manage", "reference")(
        inp.query, sc.index_key, inp.weights, **indexer_meta(inp), **residency_args(inp, table), sparse_count=dims.top_k
    )
    hot = torch.zeros(dims.rows, dims.hot_tokens, dims.d_latent + dims.d_rope, dtype=torch.bfloat16)
    res = step.residency
    kw = dict(
        query_rope=inp.attn_query_rope,
        token_rows=inp.token_rows,
        miss_tokens=res.miss_tokens,
        miss_slots=res.miss_slots,
        miss_count=res.miss_count,
        token_table=inp.token_table,
    )
    return sc, inp, step, hot, kw


def test_copy_sfa_rejects_rows_it_would_not_copy_and_foreign_slots():
    sc, inp, step, hot, kw = _one_copy_sfa_step()
    copy_sfa = registry.select("copy_sparse_flash_attention", "reference")
    owner = int(inp.token_rows[0])
    orphan = inp.token_rows.clone()
    orphan[0] = -1  # its row has misses (first step: everything misses) but no token
    with pytest.raises(ValueError, match="no query token"):
        copy_sfa(
            inp.attn_query, sc.host, hot, torch.full_like(step.sparse_indices, -1), 0.1, **{**kw, "token_rows": orphan}
        )
    foreign = step.sparse_indices.clone()
    other = (owner + 1) % sc.dims.rows
    foreign[0, 0, 0] = other * sc.dims.hot_tokens
    with pytest.raises(ValueError, match="outside its own row"):
        copy_sfa(inp.attn_query, sc.host, hot, foreign, 0.1, **kw)
    with pytest.raises(ValueError, match="dtype"):
        copy_sfa(inp.attn_query, sc.host.float(), hot, step.sparse_indices, 0.1, **kw)


# ----------------------------------------------------------------- the fused rung
FUSED_OPS = ("lightning_indexer_manage", "quant_lightning_indexer_manage", "copy_sparse_flash_attention")


def test_fused_ops_are_registered_on_both_rungs():
    for op in FUSED_OPS:
        assert set(registry.implementations(op)) == {"reference", "fused"}
    assert registry.select("lightning_indexer_manage", "reference").fn is fused.lightning_indexer_manage


@pytest.mark.skipif(ON_NPU, reason="checks the reasons given off Ascend")
@pytest.mark.parametrize("op", FUSED_OPS)
def test_fused_rung_refuses_off_ascend_with_build_instructions(op, monkeypatch):
    """Off Ascend, ops=fused runs the kernels on the functional model; where that cannot be
    built (no compiler) it is refused naming what to install and the NPU build."""
    from sglang_ascend_offload.ops import ascendc_cpu_ops

    ascendc_cpu_ops.unregister()
    monkeypatch.setenv("CXX", "sao-no-such-compiler")
    with pytest.raises(OpUnavailableError) as info:
        registry.select(op, "fused")
    msg = str(info.value)
    assert "bash ascendc_ops/build.sh" in msg and "torch_npu" in msg and "install g++" in msg
    assert not ascendc_cpu_ops.registered()
    assert registry.select(op, "auto").rung == "reference"


BUILD_SH = Path(__file__).resolve().parents[2] / "ascendc_ops" / "build.sh"


def test_build_script_refuses_without_cann():
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")}
    out = subprocess.run(["bash", str(BUILD_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "ASCEND_HOME_PATH is not set" in out.stderr and "set_env.sh" in out.stderr
