"""The stand-in's torch_npu ops and AscendC extension: binding, devices, documented limits.

A call binds to the recorded schema (a wrong keyword or a positional past ``*`` is a
``TypeError``), CPU tensors are refused, the documented Atlas A2 constraints are held
(each checked with a call that passes and one that breaks it), and the AscendC ops are
the extension's (device ops for PrivateUse1, host registration for CPU). Stand-in
processes only (``SAO_NPU_STANDIN=1``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import npu_standin
from npu_standin.torch_npu_ops import ConstraintError

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_standin.installed(), reason="tests the npu stand-in (SAO_NPU_STANDIN=1)"),
]


def _attention_args(device, tokens=2, heads=4, slots=32, k=8):
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(tokens, heads, 512, generator=g).to(bf)
    q_rope = torch.randn(tokens, heads, 64, generator=g).to(bf)
    key = torch.randn(slots // 16, 16, 1, 512, generator=g).to(bf)
    key_rope = torch.randn(slots // 16, 16, 1, 64, generator=g).to(bf)
    idx = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)[:, None, :]
    meta = dict(
        block_table=torch.arange(slots // 16, dtype=torch.int32).expand(tokens, -1).contiguous(),
        actual_seq_lengths_query=torch.arange(1, tokens + 1, dtype=torch.int32),
        actual_seq_lengths_kv=torch.full((tokens,), slots, dtype=torch.int32),
    )
    tensors = dict(query=q, key=key, value=key, sparse_indices=idx, query_rope=q_rope, key_rope=key_rope, **meta)
    out = {n: t.to(device) for n, t in tensors.items()}
    out["value"] = out["key"]
    return out


def _sfa(args, **over):
    import torch_npu

    a = dict(args, **over)
    return torch_npu.npu_sparse_flash_attention(
        a.pop("query"),
        a.pop("key"),
        a.pop("value"),
        a.pop("sparse_indices"),
        0.05,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=0,
        attention_mode=2,
        **a,
    )


def test_sparse_flash_attention_binds_to_the_recorded_schema():
    args = _attention_args("npu")
    out, softmax_max, softmax_sum = _sfa(args)
    assert out.shape == (2, 4, 512) and out.device.type == "npu" and softmax_max.numel() == 0
    import torch_npu

    with pytest.raises(TypeError):
        _sfa(args, no_such_keyword=1)
    with pytest.raises(TypeError):  # block_table is keyword-only in the schema
        torch_npu.npu_sparse_flash_attention(
            args["query"], args["key"], args["value"], args["sparse_indices"], 0.05, args["block_table"]
        )


def test_host_tensors_are_refused():
    import torch_npu

    host = _attention_args("cpu")
    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        _sfa(host)
    mixed = dict(_attention_args("npu"), block_table=host["block_table"])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _sfa(mixed)
    assert callable(torch_npu.npu_fusion_attention)
    with pytest.raises(NotImplementedError, match="does not model"):
        torch_npu.npu_fusion_attention()


def test_documented_constraints_are_held():
    args = _attention_args("npu")
    _sfa(args)  # the valid call passes
    wide = torch.zeros(2, 16, 1, 576, dtype=torch.bfloat16, device="npu")
    with pytest.raises(ConstraintError, match="key must be contiguous"):
        _sfa(args, key=wide[..., :512], value=wide[..., :512])
    holes = args["sparse_indices"].clone()
    holes[0, 0, 2] = -1  # a -1 before valid entries
    with pytest.raises(ConstraintError, match="valid entries first"):
        _sfa(args, sparse_indices=holes)
    with pytest.raises(ConstraintError, match="N1 must be one of"):
        _sfa(args, query=args["query"][:, :3].contiguous(), query_rope=args["query_rope"][:, :3].contiguous())


def test_the_indexer_needs_head_dim_128():
    import torch_npu

    def call(dim):
        q = torch.zeros(1, 4, dim, dtype=torch.bfloat16, device="npu")
        key = torch.zeros(1, 16, 1, dim, dtype=torch.bfloat16, device="npu")
        return torch_npu.npu_lightning_indexer(
            q,
            key,
            torch.ones(1, 4, dtype=torch.bfloat16, device="npu"),
            actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32, device="npu"),
            actual_seq_lengths_key=torch.tensor([16], dtype=torch.int32, device="npu"),
            block_table=torch.zeros(1, 1, dtype=torch.int32, device="npu"),
            layout_query="TND",
            layout_key="PA_BSND",
            sparse_count=8,
        )

    indices, values = call(128)
    assert indices.shape == (1, 1, 8) and indices.dtype == torch.int32 and values.numel() == 0
    with pytest.raises(ConstraintError, match="D must be 128"):
        call(64)


def test_the_ascendc_extension_is_importable_with_the_extension_s_dispatch():
    from sglang_ascend_offload.ops import npu_impls

    importlib.import_module(npu_impls.FUSED_EXTENSION_MODULE)
    assert all(npu_impls.fused_op_unavailable(k) is None for k in npu_impls.FUSED_KERNELS)
    register = npu_impls.fused_op("npu_fused_register_host_memory")
    with pytest.raises(NotImplementedError, match="'PrivateUse1' backend"):
        register(torch.zeros(1024, dtype=torch.uint8, device="npu"))
    lim = npu_impls.fused_op("npu_fused_lightning_indexer_manage")
    cpu = [torch.zeros(1)] * 13
    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        lim(*cpu)
