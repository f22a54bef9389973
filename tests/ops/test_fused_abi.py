"""The fused rung's Python wrappers against the C++ ABI, on CPU.

The schemas registered by the AscendC extension (``ascendc_ops/host/torch_ops.cpp``,
``m.def(...)``) are parsed out of the source and registered here with
``torch.library`` under a test namespace, implemented on CPU by the reference
compositions (arguments looked up by their schema names). The fused wrappers of
``ops/fused.py`` are then pointed at those stand-ins. So:

* a wrapper that passes arguments in an order other than the schema's, or reads the
  returned tuple in another order, or converts a dtype differently from the ABI
  (int32 metadata, int64 ``step`` of shape ``[1]``, in-place state) fails here;
* the schemas themselves must parse (named returns, defaults, alias annotations).

This checks plumbing, not the kernels (those run in ``test_fused_npu.py`` on Ascend).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from sglang_ascend_offload.ops import fused, hadamard, registry, residency
from sglang_ascend_offload.ops.contract import ResidencyTable

from .fused_scenario import Dims, Scenario
from .test_fused_reference import assert_same_step, assert_same_table, indexer_meta, residency_args

TORCH_OPS_CPP = Path(__file__).resolve().parents[2] / "ascendc_ops" / "host" / "torch_ops.cpp"
NAMESPACE = "sao_abi_test"
LIM_RETURNS = ("topk_indices", "sparse_indices", "hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots")


def parse_schemas() -> dict:
    """``{op name: schema string}`` from the ``m.def("...")`` calls of torch_ops.cpp."""
    text = TORCH_OPS_CPP.read_text()
    schemas = {}
    for literal in re.findall(r'm\.def\(\s*"((?:[^"\\]|\\.)*)"\s*\)', text):
        schema = literal.replace('\\"', '"')
        schemas[schema.split("(", 1)[0]] = schema
    return schemas


def argument_names(schema: str):
    args = schema.split("(", 1)[1].rsplit(") ->", 1)[0]
    return [re.split(r"\s+", a.strip().split("=")[0].strip())[-1] for a in args.split(",")]


SCHEMAS = parse_schemas()


def test_every_fused_kernel_has_a_schema_and_an_impl():
    from sglang_ascend_offload.ops.npu_impls import FUSED_KERNELS

    assert set(SCHEMAS) == set(FUSED_KERNELS)
    text = TORCH_OPS_CPP.read_text()
    for name in FUSED_KERNELS:
        assert re.search(rf'm\.impl\("{name}"', text), f"{name} has no m.impl"


def test_lim_schema_returns_are_the_residency_step_fields():
    returns = SCHEMAS["npu_fused_lightning_indexer_manage"].rsplit("->", 1)[1]
    assert [r.split()[-1].strip("()") for r in returns.split(",")] == list(LIM_RETURNS)
    assert SCHEMAS["npu_fused_quant_lightning_indexer_manage"].rsplit("->", 1)[1] == returns


@pytest.mark.parametrize(
    "op,kernel",
    [
        ("lightning_indexer_manage", fused.LIM_KERNEL),
        ("quant_lightning_indexer_manage", fused.LIM_C8_KERNEL),
        ("copy_sparse_flash_attention", fused.COPY_SFA_KERNEL),
    ],
)
def test_wrappers_take_the_reference_arguments_and_the_schema_covers_them(op, kernel):
    impls = registry.implementations(op)
    ref = inspect.signature(impls["reference"].fn).parameters
    fus = inspect.signature(impls["fused"].fn).parameters
    assert [(p.name, p.kind, p.default) for p in ref.values()] == [(p.name, p.kind, p.default) for p in fus.values()]
    python_only = {"layout_query", "attention_mode"} if op == "copy_sparse_flash_attention" else set()
    assert set(ref) - python_only == set(argument_names(SCHEMAS[kernel]))


# ----------------------------------------------------------------- stand-ins
def _check_abi_dtypes(kw: dict) -> None:
    for name in (
        "actual_seq_lengths_query",
        "actual_seq_lengths_key",
        "block_table",
        "token_rows",
        "stable_len",
        "slot_token",
        "sparse_indices",
        "miss_tokens",
        "miss_slots",
        "miss_count",
        "token_table",
    ):
        if name in kw:
            assert kw[name].dtype == torch.int32, name
    for name in ("req_ids", "slot_stamp", "row_req"):
        if name in kw:
            assert kw[name].dtype == torch.int64, name
    if "step" in kw:
        assert kw["step"].dtype == torch.int64 and tuple(kw["step"].shape) == (1,)


def _lim_impl(schema_names, reference):
    def impl(*args):
        kw = dict(zip(schema_names, args))
        _check_abi_dtypes(kw)
        positional = [
            kw.pop(n) for n in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale") if n in kw
        ]
        res = reference(*positional, **kw)
        step = res.residency
        values = dict(
            topk_indices=res.topk_indices,
            sparse_indices=res.sparse_indices,
            hit_mask=step.hit_mask,
            slots=step.slots,
            miss_count=step.miss_count,
            miss_tokens=step.miss_tokens,
            miss_slots=step.miss_slots,
        )
        return tuple(values[n].clone() for n in LIM_RETURNS)

    return impl


def _copy_sfa_impl(schema_names):
    def impl(*args):
        kw = dict(zip(schema_names, args))
        _check_abi_dtypes(kw)
        assert kw["sparse_indices"].dim() == 3 and kw["sparse_indices"].shape[1] == 1
        return fused.copy_sparse_flash_attention(
            kw.pop("query"), kw.pop("host"), kw.pop("hot"), kw.pop("sparse_indices"), kw.pop("scale_value"), **kw
        )

    return impl


def _copy_rows_impl(schema_names):
    def impl(*args):
        kw = dict(zip(schema_names, args))
        _check_abi_dtypes(kw)
        assert kw["rows"].dtype == torch.int32
        residency.copy_miss_rows_rows(*(kw[n] for n in schema_names))

    return impl


@pytest.fixture(scope="module")
def stand_in_library():
    lib = torch.library.Library(NAMESPACE, "DEF")
    impls = {
        fused.LIM_KERNEL: _lim_impl(argument_names(SCHEMAS[fused.LIM_KERNEL]), fused.lightning_indexer_manage),
        fused.LIM_C8_KERNEL: _lim_impl(
            argument_names(SCHEMAS[fused.LIM_C8_KERNEL]), fused.quant_lightning_indexer_manage
        ),
        fused.COPY_SFA_KERNEL: _copy_sfa_impl(argument_names(SCHEMAS[fused.COPY_SFA_KERNEL])),
        fused.COPY_ROWS_KERNEL: _copy_rows_impl(argument_names(SCHEMAS[fused.COPY_ROWS_KERNEL])),
        fused.REGISTER_HOST_KERNEL: lambda host, device_address=0: int(host.data_ptr()),
    }
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, impls[name], "CPU")
    yield getattr(torch.ops, NAMESPACE)
    del lib


@pytest.fixture
def fused_via_stand_ins(stand_in_library, monkeypatch):
    monkeypatch.setattr(fused, "fused_op", lambda kernel: getattr(stand_in_library, kernel))
    monkeypatch.setattr(fused, "_REGISTERED_HOST", {})
    return stand_in_library


def test_fused_lim_wrappers_match_the_reference_through_the_schema(fused_via_stand_ins):
    dims = Dims()
    for quant in (False, True):
        sc = Scenario(dims, seed=11 + quant)
        ref_op = fused.quant_lightning_indexer_manage if quant else fused.lightning_indexer_manage
        fused_op = fused.quant_lightning_indexer_manage_fused if quant else fused.lightning_indexer_manage_fused
        t_ref = ResidencyTable.empty(dims.rows, dims.hot_tokens)
        t_fus = ResidencyTable.empty(dims.rows, dims.hot_tokens)
        for _ in range(4):
            inp = sc.next_step()
            if quant:
                q8 = hadamard.prepare_quant_indexer_inputs(inp.query, sc.index_key)
                key_scale = q8.key_dequant_scale.unsqueeze(-1)  # [..., 1, 1]: the wrapper reshapes it
                args = (q8.query, q8.key, inp.weights, q8.query_dequant_scale, key_scale)
            else:
                args = (inp.query, sc.index_key, inp.weights)
            want = ref_op(*args, **indexer_meta(inp), **residency_args(inp, t_ref), sparse_count=dims.top_k)
            got = fused_op(*args, **indexer_meta(inp), **residency_args(inp, t_fus), sparse_count=dims.top_k)
            assert_same_step(got, want.topk_indices, want.residency, want.sparse_indices)
            assert_same_table(t_fus, t_ref)


def test_fused_copy_sfa_wrapper_matches_the_reference_through_the_schema(fused_via_stand_ins):
    dims = Dims()
    sc = Scenario(dims, seed=13)
    t = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    hot_ref = torch.zeros(dims.rows, dims.hot_tokens, dims.d_latent + dims.d_rope, dtype=torch.bfloat16)
    hot_fus = hot_ref.clone()
    for _ in range(4):
        inp = sc.next_step()
        step = fused.lightning_indexer_manage(
            inp.query, sc.index_key, inp.weights, **indexer_meta(inp), **residency_args(inp, t), sparse_count=dims.top_k
        )
        res = step.residency
        kw = dict(
            query_rope=inp.attn_query_rope,
            token_rows=inp.token_rows,
            miss_tokens=res.miss_tokens,
            miss_slots=res.miss_slots,
            miss_count=res.miss_count,
            token_table=inp.token_table,
        )
        want = fused.copy_sparse_flash_attention(inp.attn_query, sc.host, hot_ref, step.sparse_indices, 0.125, **kw)
        got = fused.copy_sparse_flash_attention_fused(
            inp.attn_query, sc.host, hot_fus, step.sparse_indices.reshape(-1, dims.top_k), 0.125, **kw
        )
        assert torch.equal(got, want)
        assert torch.equal(hot_fus.view(torch.int16), hot_ref.view(torch.int16))
    assert fused._REGISTERED_HOST == {(sc.host.data_ptr(), sc.host.numel() * 2): sc.host.data_ptr()}


def test_fused_miss_copy_wrappers_match_the_reference_through_the_schema(fused_via_stand_ins):
    """The rows form (int64 rows and lists from the engine converted to the ABI's int32)
    and the all-rows form: the same hot buffer as the reference copy, bit for bit; the
    host registered once on first use."""
    gen = torch.Generator().manual_seed(17)
    host = torch.randn(300, 24, generator=gen).to(torch.bfloat16)
    table = torch.randperm(300, generator=gen)[:240].reshape(4, 60).to(torch.int32)
    hot_ref = torch.randn(4, 16, 24, generator=gen).to(torch.bfloat16)
    hot_fus = hot_ref.clone()
    rows = torch.tensor([2, 0, 3], dtype=torch.int64)
    tokens = torch.stack([torch.randperm(60, generator=gen)[:8] for _ in range(3)]).to(torch.int64)
    slots = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(3)]).to(torch.int64)
    count = torch.tensor([8, 0, 5], dtype=torch.int64)
    residency.copy_miss_rows_rows(host, hot_ref, rows, tokens, slots, count, table)
    fused.copy_miss_rows_rows_fused(host, hot_fus, rows, tokens, slots, count, table)
    assert torch.equal(hot_fus.view(torch.int16), hot_ref.view(torch.int16))
    lists = (torch.full((4, 8), -1, dtype=torch.int32),) * 2
    all_tokens, all_slots = lists[0].clone(), lists[1].clone()
    all_tokens[1, :3], all_slots[1, :3] = torch.tensor([5, 7, 9]), torch.tensor([15, 0, 4])
    all_count = torch.tensor([0, 3, 0, 0], dtype=torch.int32)
    residency.copy_miss_rows(host, hot_ref, all_tokens, all_slots, all_count, table)
    fused.copy_miss_rows_fused(host, hot_fus, all_tokens, all_slots, all_count, table)
    assert torch.equal(hot_fus.view(torch.int16), hot_ref.view(torch.int16))
    assert fused._REGISTERED_HOST == {(host.data_ptr(), host.numel() * 2): host.data_ptr()}
