"""The torch_npu operators the project calls, on the stand-in device.

Each op is defined under ``torch.ops.npu`` with the schema recorded from the torch_npu
2.13.0 wheel (``sglang_ascend_offload/npu_api/torch_npu_ops.json``, the dispatcher
strings of ``libtorch_npu.so``), so a call binds its arguments exactly as on a node:
a wrong keyword, a missing argument or a positional past ``*`` is a ``TypeError``.
No kernel is registered for CPU: called with CPU tensors the op fails as torch_npu's
does ("Could not run ... with arguments from the 'CPU' backend"); with ``npu`` and
CPU tensors mixed, the device check of ``device.py`` refuses the CPU ones.

On ``npu`` tensors each op first checks the constraints torch_npu documents for the
stand-in's SoC family, Atlas A2 (``docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md`` of
github.com/Ascend/op-plugin: dtypes, ranks, head dims, contiguity, ``sparse_count`` range,
layouts), then computes with the project's reference op (``ops/reference.py``) on the
CPU data. The reference breaks score ties by lower position; the hardware's ``Sort``
tie order may differ (the npu tests compare with tolerances written for that).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from sglang_ascend_offload.npu_api import torch_npu_schemas
from sglang_ascend_offload.ops import reference

from . import device

NAMESPACE = "npu"
I64_MAX = 9223372036854775807
INDEXER_HEAD_DIM = 128
SFA_LATENT_DIM, SFA_ROPE_DIM = 512, 64
SFA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
INDEXER_SPARSE_COUNTS = set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}


class ConstraintError(RuntimeError):
    """A call torch_npu documents as unsupported on the stand-in's SoC family (A2)."""


def _require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ConstraintError(f"{op}: {what} (torch_npu's documented constraint on Atlas A2)")


def recorded_schemas() -> Dict[str, str]:
    """``{op: schema}`` of the ops the stand-in defines, as recorded from the wheel: the
    project's (``npu_api/torch_npu_ops.json``) and the rest (``torch_npu_surface.json``)."""
    ops = dict(torch_npu_schemas.load().get("ops", {}))
    ops.update(surface()["ops"])
    out = {}
    for name, texts in ops.items():
        texts = [texts] if isinstance(texts, str) else list(texts)
        if len(texts) != 1:
            raise RuntimeError(f"torch_npu_ops.json: {name} has {len(texts)} schemas; the stand-in defines one")
        out[name] = texts[0]
    return out


# ------------------------------------------------------------------ checks
def _int32_vector(op: str, name: str, t: Optional[torch.Tensor], batch: Optional[int] = None) -> None:
    _require(t is not None, op, f"{name} is required with TND / PA_BSND layouts")
    _require(t.dtype == torch.int32 and t.dim() == 1, op, f"{name} must be 1-D int32, got {t.dtype} {tuple(t.shape)}")
    if batch is not None:
        _require(t.shape[0] == batch, op, f"{name} must have B = {batch} entries, got {t.shape[0]}")


def _paged_meta(op: str, query, cu, kv_len, block_table) -> None:
    _int32_vector(op, "actual_seq_lengths_query", cu)
    b = cu.shape[0]
    _int32_vector(op, "actual_seq_lengths_key/kv", kv_len, b)
    _require(block_table is not None and block_table.dtype == torch.int32, op, "block_table must be int32")
    _require(block_table.dim() == 2 and block_table.shape[0] == b, op, f"block_table must be [B={b}, max_blocks]")


def _check_indexer(op, query, key, weights, cu, kv_len, block_table, layouts, sparse_count, sparse_mode, extra):
    layout_query, layout_key = layouts
    _require(layout_query == "TND" and layout_key == "PA_BSND", op, "the stand-in serves layout TND / PA_BSND")
    _require(query.dim() == 3 and query.is_contiguous(), op, "query must be a contiguous TND [T, N1, D]")
    _require(query.shape[1] <= 64, op, f"query N1 must be <= 64, got {query.shape[1]}")
    _require(key.dim() == 4 and key.is_contiguous(), op, "key must be a contiguous PA_BSND [blocks, block_size, 1, D]")
    _require(key.shape[2] == 1, op, "key N2 must be 1")
    _require(key.shape[1] % 16 == 0 and key.shape[1] <= 1024, op, f"block_size {key.shape[1]} must be k*16 <= 1024")
    _require(query.shape[2] == key.shape[3] == INDEXER_HEAD_DIM, op, f"query and key D must be {INDEXER_HEAD_DIM}")
    _require(query.dtype == key.dtype, op, "query and key must have one dtype")
    _require(weights.dim() == 2 and tuple(weights.shape) == tuple(query.shape[:2]), op, "weights must be [T, N1]")
    _require(weights.is_contiguous(), op, "weights must be contiguous")
    _require(int(sparse_count) in INDEXER_SPARSE_COUNTS, op, f"sparse_count {sparse_count} is not supported")
    _require(int(sparse_mode) in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _require(all(int(v) == I64_MAX for v in extra), op, "pre_tokens / next_tokens support the default only")
    _paged_meta(op, query, cu, kv_len, block_table)


# ------------------------------------------------------------------ kernels
def npu_lightning_indexer(
    query,
    key,
    weights,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    pre_tokens=I64_MAX,
    next_tokens=I64_MAX,
    return_value=False,
):
    op = "npu_lightning_indexer"
    cu, kv_len = actual_seq_lengths_query, actual_seq_lengths_key
    layouts = (layout_query, layout_key)
    extra = (pre_tokens, next_tokens)
    _check_indexer(op, query, key, weights, cu, kv_len, block_table, layouts, sparse_count, sparse_mode, extra)
    _require(query.dtype in (torch.bfloat16, torch.float16), op, f"query must be bf16 / fp16, got {query.dtype}")
    _require(weights.dtype in (query.dtype, torch.float32), op, "weights must have query's dtype or be float32")
    _require(not return_value, op, "return_value is for training with a non-paged key")
    indices = reference.lightning_indexer(
        query,
        key,
        weights,
        actual_seq_lengths_query=cu,
        actual_seq_lengths_key=kv_len,
        block_table=block_table,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=int(sparse_count),
        sparse_mode=int(sparse_mode),
    )
    return indices, torch.empty((0,), dtype=query.dtype)


def npu_quant_lightning_indexer(
    query,
    key,
    weights,
    query_dequant_scale,
    key_dequant_scale,
    query_quant_mode,
    key_quant_mode,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    pre_tokens=I64_MAX,
    next_tokens=I64_MAX,
    query_dtype=None,
    key_dtype=None,
):
    op = "npu_quant_lightning_indexer"
    cu, kv_len = actual_seq_lengths_query, actual_seq_lengths_key
    layouts = (layout_query, layout_key)
    extra = (pre_tokens, next_tokens)
    _check_indexer(op, query, key, weights, cu, kv_len, block_table, layouts, sparse_count, sparse_mode, extra)
    _require(int(sparse_count) <= 2048, op, f"sparse_count must be in [1, 2048], got {sparse_count}")
    _require(query.dtype == torch.int8, op, f"query / key must be int8 on A2 / A3, got {query.dtype}")
    fp16 = torch.float16
    _require(
        weights.dtype == query_dequant_scale.dtype == key_dequant_scale.dtype == fp16,
        op,
        "int8 query / key take float16 weights, query_dequant_scale and key_dequant_scale, got "
        f"{weights.dtype}, {query_dequant_scale.dtype}, {key_dequant_scale.dtype}",
    )
    _require(tuple(query_dequant_scale.shape) == tuple(query.shape[:2]), op, "query_dequant_scale must be [T, N1]")
    key_scale_shape = tuple(key.shape[:3])
    _require(tuple(key_dequant_scale.shape) == key_scale_shape, op, f"key_dequant_scale must be {key_scale_shape}")
    _require(int(query_quant_mode) == 0 and int(key_quant_mode) == 0, op, "quant modes support 0 only")
    return reference.quant_lightning_indexer(
        query,
        key,
        weights,
        query_dequant_scale,
        key_dequant_scale,
        actual_seq_lengths_query=cu,
        actual_seq_lengths_key=kv_len,
        block_table=block_table,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=int(sparse_count),
        sparse_mode=int(sparse_mode),
    )


def _check_sparse_indices(op: str, indices: torch.Tensor) -> None:
    """Each row's valid (``>= 0``) entries first, the ``-1`` padding after them."""
    shape_ok = indices.dim() == 3 and indices.shape[1] == 1 and indices.shape[2] > 0
    _require(indices.dtype == torch.int32 and shape_ok, op, "sparse_indices must be int32 [T, KV_N=1, K > 0]")
    _require(indices.is_contiguous(), op, "sparse_indices must be contiguous")
    valid = indices.reshape(indices.shape[0], -1) >= 0
    interleaved = bool((valid[:, 1:] & ~valid[:, :-1]).any())
    _require(not interleaved, op, "each row of sparse_indices must hold its valid entries first, the -1 after them")


def _check_sfa(op, query, key, value, query_rope, key_rope, layouts) -> None:
    _require(layouts == ("TND", "PA_BSND"), op, "the stand-in serves layout TND / PA_BSND")
    _require(query.dim() == 3 and query.is_contiguous(), op, "query must be a contiguous TND [T, N1, D]")
    _require(query.shape[1] in SFA_HEADS, op, f"query N1 must be one of {SFA_HEADS}, got {query.shape[1]}")
    _require(query.shape[2] == SFA_LATENT_DIM, op, f"query D must be {SFA_LATENT_DIM}")
    _require(query.dtype in (torch.bfloat16, torch.float16), op, "query must be bf16 / fp16")
    caches = (("key", key, SFA_LATENT_DIM), ("value", value, SFA_LATENT_DIM), ("key_rope", key_rope, SFA_ROPE_DIM))
    for name, t, dim in caches:
        paged = t is not None and t.dim() == 4 and t.shape[2] == 1 and t.shape[3] == dim
        _require(paged, op, f"{name} must be PA_BSND [blocks, block_size, 1, {dim}]")
        _require(t.is_contiguous(), op, f"{name} must be contiguous (A2 / A3 do not take a non-contiguous {name})")
        _require(t.dtype == query.dtype, op, f"{name} must have query's dtype")
    _require(key.shape[1] % 16 == 0 and key.shape[1] <= 1024, op, f"block_size {key.shape[1]} must be k*16 <= 1024")
    _require(query_rope is not None and query_rope.is_contiguous(), op, "query_rope must be given and contiguous")
    rope_shape = (*query.shape[:2], SFA_ROPE_DIM)
    _require(tuple(query_rope.shape) == rope_shape, op, f"query_rope must be {rope_shape}")


def npu_sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    query_rope=None,
    key_rope=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=I64_MAX,
    next_tokens=I64_MAX,
    attention_mode=0,
    return_softmax_lse=False,
    sinks=None,
):
    op = "npu_sparse_flash_attention"
    _check_sfa(op, query, key, value, query_rope, key_rope, (layout_query, layout_kv))
    sbs = int(sparse_block_size)
    pow2 = 1 <= sbs <= 128 and sbs & (sbs - 1) == 0
    _require(pow2 and key.shape[1] % sbs == 0, op, "sparse_block_size must be a power of 2 <= 128 dividing block_size")
    _require(sinks is None, op, "sinks are not supported on A2 / A3")
    _require(int(sparse_mode) in (0, 3), op, "sparse_mode must be 0 or 3")
    defaults = int(pre_tokens) == I64_MAX and int(next_tokens) == I64_MAX
    _require(defaults, op, "pre_tokens / next_tokens support the default only")
    _require(not return_softmax_lse, op, "return_softmax_lse is for training with a non-paged key")
    _check_sparse_indices(op, sparse_indices)
    _paged_meta(op, query, actual_seq_lengths_query, actual_seq_lengths_kv, block_table)
    out = reference.sparse_mla_attention(
        query,
        key,
        None,
        sparse_indices,
        float(scale_value),
        block_table=block_table,
        actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_kv=actual_seq_lengths_kv,
        query_rope=query_rope,
        key_rope=key_rope,
        sparse_block_size=sbs,
        layout_query=layout_query,
        layout_kv=layout_kv,
        sparse_mode=int(sparse_mode),
        attention_mode=int(attention_mode),
    )
    empty = torch.empty((0,), dtype=torch.float32)
    return out, empty, empty.clone()


def npu_scatter_nd_update_(input, indices, updates):
    """``input[indices[..., 0], ..., indices[..., k-1]] = updates`` in place (SGLang's NPU
    pools write the KV of new tokens with it)."""
    op = "npu_scatter_nd_update_"
    _require(indices.dtype in (torch.int32, torch.int64), op, "indices must be int32 / int64")
    k = indices.shape[-1]
    _require(1 <= k <= input.dim(), op, f"indices' last dim {k} must index 1..{input.dim()} leading dims")
    expected = (*indices.shape[:-1], *input.shape[k:])
    _require(tuple(updates.shape) == expected, op, f"updates must be {expected}, got {tuple(updates.shape)}")
    _require(updates.dtype == input.dtype, op, "updates must have input's dtype")
    where = tuple(indices.to(torch.int64).unbind(-1))
    input[where] = updates
    return input


#: the torch_npu ops the project calls (schemas in npu_api/torch_npu_ops.json)
KERNELS = {
    "npu_lightning_indexer": npu_lightning_indexer,
    "npu_quant_lightning_indexer": npu_quant_lightning_indexer,
    "npu_sparse_flash_attention": npu_sparse_flash_attention,
}
#: torch_npu ops SGLang's NPU paths the npu tests run call (schemas in torch_npu_surface.json)
SGLANG_KERNELS = {"npu_scatter_nd_update_": npu_scatter_nd_update_}

SURFACE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_npu_surface.json")


def surface() -> dict:
    """What ``record_surface.py`` read from the torch_npu wheel."""
    with open(SURFACE_FILE, encoding="utf-8") as f:
        return json.load(f)


def python_binding(name: str):
    """``torch_npu.<name>``: binds its arguments to the recorded schema first (a wrong
    keyword, a missing argument or a positional past ``*`` is a ``TypeError``, as from
    torch_npu's generated Python bindings), then calls ``torch.ops.npu.<name>``."""
    signature = torch_npu_schemas.parse_schema(recorded_schemas()[name]).signature
    op = getattr(getattr(torch.ops, NAMESPACE), name)

    def call(*args, **kwargs):
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name}(): {exc}") from None
        return op(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__signature__ = signature
    return call


#: torch_npu ops that third-party import paths bind by name but the project never calls:
#: present so those imports succeed, refusing when called
UNMODELLED = ("npu_fusion_attention",)


def unmodelled(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"torch_npu.{name}: the npu stand-in does not model this operator (it runs the project's NPU ops; "
            "SGLang's and transformers' own NPU kernels run on an NPU runner)"
        )

    refuse.__name__ = name
    return refuse


_library: Optional[torch.library.Library] = None


def register() -> None:
    """Define the ops under ``torch.ops.npu`` with their recorded schemas and hand their
    kernels to the device."""
    global _library
    if _library is not None:
        return
    schemas = recorded_schemas()
    kernels = {**KERNELS, **SGLANG_KERNELS}
    missing = sorted(set(kernels) - set(schemas))
    if missing:
        raise RuntimeError(f"no recorded schema for {missing} (torch_npu_ops.json / torch_npu_surface.json)")
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, kernel in kernels.items():
        lib.define(schemas[name])
        device.KERNELS[getattr(getattr(torch.ops, NAMESPACE), name).default] = kernel
    _library = lib
