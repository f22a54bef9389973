"""The fused rung on CPU: the AscendC kernels run on the functional model as torch ops.

On a machine without an NPU, :func:`register` builds (first use; cached) the library of
:mod:`.ascendc_model` -- the kernel sources of ``ascendc_ops/kernels/`` and the host
tiling ``ascendc_ops/host/tiling.cpp`` compiled unchanged against a functional model of
the AscendC API -- and registers the five ops of the AscendC extension under the same
namespace, names and schemas (``ascendc_ops/host/torch_ops.cpp``, :data:`SCHEMAS`), for
CPU tensors:

=============================================== =============================================
op (``torch.ops.sglang_ascend_offload``)        CPU implementation
=============================================== =============================================
``npu_fused_lightning_indexer_manage``           host checks, host tiling, one model launch
``npu_fused_quant_lightning_indexer_manage``     same, the C8 kernel entry
``npu_fused_scatter_copy_sparse_flash_attention`` same (heads < 8 zero-padded as the host code does)
``npu_fused_copy_miss_rows``                     host checks, host tiling, one model launch
``npu_fused_register_host_memory``               records the region (CPU memory is the
                                                 kernel's "device" memory: identity mapping)
=============================================== =============================================

So ``ops/fused.py``'s fused rung runs unchanged on CPU. It is a correctness path, not a
speed path: every core of a launch runs one after the other in the model (seconds per
call at production shapes). What the model does not check (real rounding, ``Sort`` tie
order on the hardware, pipeline synchronisation) is in ``docs/fused_ops.md``.

Registration is explicit: selecting ``ops="fused"`` on a CPU platform
(:func:`~sglang_ascend_offload.ops.registry.select` calls :func:`ensure_for_choice`) or
calling :func:`register`. It is refused on an NPU (the built ``_C_ascend`` extension
serves the ops there) and when the namespace already holds the ops (the extension is
loaded): the two never share the namespace. A missing compiler is an error naming what
to install; nothing falls back to the reference compositions.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .. import platform
from . import ascendc_model as am

logger = logging.getLogger(__name__)

NAMESPACE = "sglang_ascend_offload"
MIN_HEADS = 8  # Copy-SFA pads fewer heads to this (kMinHeads of the host code)
_EXTENSION_MODULE = "sglang_ascend_offload._C_ascend"

#: The extension's schemas, verbatim from ``TORCH_LIBRARY(sglang_ascend_offload)`` in
#: ``ascendc_ops/host/torch_ops.cpp`` (a test holds the two equal).
SCHEMAS = {
    "npu_fused_lightning_indexer_manage": 'npu_fused_lightning_indexer_manage(Tensor query, Tensor key, Tensor weights, Tensor actual_seq_lengths_query, Tensor actual_seq_lengths_key, Tensor block_table, Tensor token_rows, Tensor req_ids, Tensor stable_len, Tensor step, Tensor(a!) slot_token, Tensor(b!) slot_stamp, Tensor(c!) row_req, str layout_query="TND", str layout_key="PA_BSND", int sparse_count=2048, int sparse_mode=3, int tokens_per_row=1) -> (Tensor topk_indices, Tensor sparse_indices, Tensor hit_mask, Tensor slots, Tensor miss_count, Tensor miss_tokens, Tensor miss_slots)',  # noqa: E501
    "npu_fused_quant_lightning_indexer_manage": 'npu_fused_quant_lightning_indexer_manage(Tensor query, Tensor key, Tensor weights, Tensor query_dequant_scale, Tensor key_dequant_scale, Tensor actual_seq_lengths_query, Tensor actual_seq_lengths_key, Tensor block_table, Tensor token_rows, Tensor req_ids, Tensor stable_len, Tensor step, Tensor(a!) slot_token, Tensor(b!) slot_stamp, Tensor(c!) row_req, int query_quant_mode=0, int key_quant_mode=0, str layout_query="TND", str layout_key="PA_BSND", int sparse_count=2048, int sparse_mode=3, int tokens_per_row=1) -> (Tensor topk_indices, Tensor sparse_indices, Tensor hit_mask, Tensor slots, Tensor miss_count, Tensor miss_tokens, Tensor miss_slots)',  # noqa: E501
    "npu_fused_scatter_copy_sparse_flash_attention": "npu_fused_scatter_copy_sparse_flash_attention(Tensor query, Tensor query_rope, Tensor host, Tensor(a!) hot, Tensor sparse_indices, Tensor token_rows, Tensor miss_tokens, Tensor miss_slots, Tensor miss_count, Tensor token_table, float scale_value, Tensor? overflow=None, int tokens_per_row=1) -> Tensor",  # noqa: E501
    "npu_fused_copy_miss_rows": "npu_fused_copy_miss_rows(Tensor host, Tensor(a!) hot, Tensor rows, Tensor miss_tokens, Tensor miss_slots, Tensor miss_count, Tensor token_table) -> ()",  # noqa: E501
    "npu_fused_register_host_memory": "npu_fused_register_host_memory(Tensor host, int device_address=0) -> int",
}


@dataclass
class _State:
    """What is registered: the torch.library fragment, the loaded model, host regions
    ``(base, bytes, device address)`` (kept across re-registration, like the extension's
    process-wide map, since ``ops/fused.py`` caches registrations by address)."""

    library: Optional[torch.library.Library] = None
    model: Optional[am.KernelModel] = None
    regions: List[Tuple[int, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def registered() -> bool:
    """Whether the model ops are registered in this process."""
    return _STATE.library is not None


def provides(kernel: str) -> bool:
    """Whether ``torch.ops.sglang_ascend_offload.<kernel>`` is this module's CPU model op."""
    return registered() and kernel in SCHEMAS


def model() -> am.KernelModel:
    """The loaded functional model (:func:`register` first)."""
    if _STATE.model is None:
        raise RuntimeError("the AscendC functional model ops are not registered: call ascendc_cpu_ops.register()")
    return _STATE.model


def _refusal() -> Optional[str]:
    """Why the model ops must not take the namespace here (``None``: they may)."""
    if platform.device_kind() == "npu":
        return (
            "on an Ascend NPU the built AscendC extension serves the fused ops "
            f"({_EXTENSION_MODULE}); the CPU functional model is for machines without one"
        )
    if _EXTENSION_MODULE in sys.modules:
        return f"the AscendC extension {_EXTENSION_MODULE} is loaded and owns the op namespace"
    namespace = getattr(torch.ops, NAMESPACE)
    taken = [k for k in SCHEMAS if hasattr(namespace, k)]
    if taken:
        return f"torch.ops.{NAMESPACE} already provides {', '.join(taken)} (another registration owns them)"
    return None


def register(path=None) -> None:
    """Build (first use, ~10-30 s, logged; cached by source hash) and load the model library,
    and register the five ops for CPU tensors. Idempotent. Raises
    :class:`~.ascendc_model.ModelBuildError` (no compiler: says what to install; compile
    error) or ``RuntimeError`` where :func:`_refusal` says the namespace is not ours."""
    with _STATE.lock:
        if registered():
            return
        reason = _refusal()
        if reason is not None:
            raise RuntimeError(f"the CPU functional-model fused ops are not registered: {reason}")
        lib_path = path or am.library_path()
        if not lib_path.is_file():
            logger.info(
                "ops=fused on CPU: building the AscendC kernels against the functional model "
                "(first use, ~10-30 s; scripts/setup_cpu_env.sh prebuilds it)"
            )
            lib_path = am.build()
        loaded = am.KernelModel(lib_path)
        library = torch.library.Library(NAMESPACE, "FRAGMENT")
        for name, schema in SCHEMAS.items():
            library.define(schema)
        library.impl("npu_fused_lightning_indexer_manage", _lim, "CPU")
        library.impl("npu_fused_quant_lightning_indexer_manage", _lim_c8, "CPU")
        library.impl("npu_fused_scatter_copy_sparse_flash_attention", _copy_sfa, "CPU")
        library.impl("npu_fused_copy_miss_rows", _copy_rows, "CPU")
        library.impl("npu_fused_register_host_memory", _register_host_memory, "CPU")
        for name, fake in (
            ("npu_fused_lightning_indexer_manage", _lim_fake),
            ("npu_fused_quant_lightning_indexer_manage", _lim_c8_fake),
            ("npu_fused_scatter_copy_sparse_flash_attention", _copy_sfa_fake),
            ("npu_fused_copy_miss_rows", _copy_rows_fake),
        ):
            torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=library)
        _STATE.model, _STATE.library = loaded, library
        logger.info(
            "fused ops on CPU: torch.ops.%s.{%s} run the AscendC kernels on the functional model (%s)",
            NAMESPACE,
            ",".join(SCHEMAS),
            lib_path.name,
        )


def unregister() -> None:
    """Remove the ops from the namespace (tests; the host-region map is kept)."""
    with _STATE.lock:
        if _STATE.library is not None:
            _STATE.library._destroy()
        _STATE.library = None
        _STATE.model = None


def ensure_for_choice(choice: str) -> None:
    """The registry's hook: ``ops="fused"`` on a CPU platform registers the model ops.
    Elsewhere, and for other choices, nothing happens."""
    if choice == "fused" and platform.device_kind() == "cpu" and not registered():
        register()


# ---------------------------------------------------------------- host checks
def _check(t: torch.Tensor, name: str, dtype: torch.dtype, dim: int) -> None:
    """The extension's ``CheckTensor`` on CPU: dtype, rank, CPU, contiguous."""
    if t.dtype != dtype:
        raise RuntimeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != dim:
        raise RuntimeError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise RuntimeError(f"{name} must be on cpu (the functional model), got {t.device}")
    if not t.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")


def _shape(t: torch.Tensor, name: str, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise RuntimeError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _unsupported(op: str, exc: am.ShapeUnsupported) -> RuntimeError:
    return RuntimeError(
        f"{op}: shape not supported by the fused kernel: {exc}use ops=reference (or npu) for this shape"
    )


# ------------------------------------------------------------------ LIM, LIM-C8
def _check_lim(query, key, weights, query_scale, key_scale, meta, state, quantized: bool) -> Tuple[int, ...]:
    """The extension's argument checks of LIM / LIM-C8; returns ``(T, B, Hi, Di, bs, R, Hh)``.
    ``meta``: cumulative query lengths, KV lengths, block table, token_rows, req_ids,
    stable_len, step; ``state``: slot_token, slot_stamp, row_req."""
    q_type = torch.int8 if quantized else torch.bfloat16
    _check(query, "query", q_type, 3)
    _check(key, "key", q_type, 4)
    _check(weights, "weights", torch.bfloat16, 2)
    t, hi, di = query.shape
    blocks, bs = key.shape[:2]
    if key.shape[2] != 1 or key.shape[3] != di:
        raise RuntimeError(f"key must be [blocks, block_size, 1, {di}]")
    _shape(weights, "weights", (t, hi))
    if quantized:
        _check(query_scale, "query_dequant_scale", torch.float16, 2)
        _shape(query_scale, "query_dequant_scale", (t, hi))
        _check(key_scale, "key_dequant_scale", torch.float16, 3)
        _shape(key_scale, "key_dequant_scale", (blocks, bs, 1))
    cu, kv_len, block_table, token_rows, req_ids, stable_len, step = meta
    slot_token, slot_stamp, row_req = state
    _check(cu, "actual_seq_lengths_query", torch.int32, 1)
    b = cu.shape[0]
    _check(kv_len, "actual_seq_lengths_key", torch.int32, 1)
    _shape(kv_len, "actual_seq_lengths_key", (b,))
    _check(block_table, "block_table", torch.int32, 2)
    if block_table.shape[0] != b:
        raise RuntimeError("block_table must have one row per request")
    _check(token_rows, "token_rows", torch.int32, 1)
    _shape(token_rows, "token_rows", (t,))
    _check(slot_token, "slot_token", torch.int32, 2)
    r, hh = slot_token.shape
    for tensor, name, dtype, shape in (
        (slot_stamp, "slot_stamp", torch.int64, (r, hh)),
        (row_req, "row_req", torch.int64, (r,)),
        (req_ids, "req_ids", torch.int64, (r,)),
        (stable_len, "stable_len", torch.int32, (r,)),
        (step, "step", torch.int64, (1,)),
    ):
        _check(tensor, name, dtype, len(shape))
        _shape(tensor, name, shape)
    return t, b, hi, di, bs, r, hh


def _run_lim(
    query,
    key,
    weights,
    query_scale,
    key_scale,
    meta,
    state,
    layout_query: str,
    layout_key: str,
    sparse_count: int,
    sparse_mode: int,
    quantized: bool,
    tokens_per_row: int = 1,
):
    """One LIM / LIM-C8 launch on the model. Outputs as the schema: topk_indices and
    sparse_indices int32 ``[T, 1, K]``, hit_mask bool ``[R, W]``, slots int32 ``[R, W]``,
    miss_count int32 ``[R]``, miss_tokens / miss_slots int32 ``[R, W]`` with
    ``W = min(tokens_per_row * K, Hh)``; the state tensors are updated in place by the kernel."""
    op = "npu_fused_quant_lightning_indexer_manage" if quantized else "npu_fused_lightning_indexer_manage"
    if layout_query != "TND" or layout_key != "PA_BSND":
        raise RuntimeError(f"{op}: layouts must be TND / PA_BSND")
    t, b, hi, di, bs, r, hh = _check_lim(query, key, weights, query_scale, key_scale, meta, state, quantized)
    m, k, n = model(), int(sparse_count), int(tokens_per_row)
    try:
        launch = m.tile_lim(
            tokens=t,
            requests=b,
            index_heads=hi,
            index_dim=di,
            block_size=bs,
            max_blocks=meta[2].shape[1],
            rows=r,
            hot_tokens=hh,
            top_k=k,
            sparse_mode=int(sparse_mode),
            quantized=quantized,
            tokens_per_row=n,
        )
    except am.ShapeUnsupported as exc:
        raise _unsupported(op, exc) from None
    i32, w = torch.int32, min(n * k, hh)
    outs = (
        torch.empty((t, 1, k), dtype=i32),
        torch.empty((t, 1, k), dtype=i32),
        torch.empty((r, w), dtype=torch.bool),
        torch.empty((r, w), dtype=i32),
        torch.empty((r,), dtype=i32),
        torch.empty((r, w), dtype=i32),
        torch.empty((r, w), dtype=i32),
    )
    if t == 0 and r == 0:
        return outs
    head = [query, key, weights] + ([query_scale, key_scale] if quantized else [])
    m.run(am.LIM_C8 if quantized else am.LIM, head + list(meta) + list(state) + list(outs), launch)
    return outs


def _lim(
    query,
    key,
    weights,
    cu,
    kv_len,
    block_table,
    token_rows,
    req_ids,
    stable_len,
    step,
    slot_token,
    slot_stamp,
    row_req,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=2048,
    sparse_mode=3,
    tokens_per_row=1,
):
    """``npu_fused_lightning_indexer_manage`` on the model (schema in :data:`SCHEMAS`; the
    dispatcher drops trailing arguments equal to their defaults, so the defaults are repeated)."""
    return _run_lim(
        query,
        key,
        weights,
        None,
        None,
        (cu, kv_len, block_table, token_rows, req_ids, stable_len, step),
        (slot_token, slot_stamp, row_req),
        layout_query,
        layout_key,
        sparse_count,
        sparse_mode,
        quantized=False,
        tokens_per_row=tokens_per_row,
    )


def _lim_c8(
    query,
    key,
    weights,
    query_scale,
    key_scale,
    cu,
    kv_len,
    block_table,
    token_rows,
    req_ids,
    stable_len,
    step,
    slot_token,
    slot_stamp,
    row_req,
    query_quant_mode=0,
    key_quant_mode=0,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=2048,
    sparse_mode=3,
    tokens_per_row=1,
):
    """``npu_fused_quant_lightning_indexer_manage`` on the model (quant modes 0 only)."""
    if query_quant_mode != 0 or key_quant_mode != 0:
        raise RuntimeError("npu_fused_quant_lightning_indexer_manage: only per-token quantisation (quant mode 0)")
    return _run_lim(
        query,
        key,
        weights,
        query_scale,
        key_scale,
        (cu, kv_len, block_table, token_rows, req_ids, stable_len, step),
        (slot_token, slot_stamp, row_req),
        layout_query,
        layout_key,
        sparse_count,
        sparse_mode,
        quantized=True,
        tokens_per_row=tokens_per_row,
    )


# ------------------------------------------------------------------ Copy-SFA
def _register_host_memory(host: torch.Tensor, device_address: int = 0) -> int:
    """``npu_fused_register_host_memory`` on CPU: records ``host``'s region (whole pool, or a
    view starting 4 KiB into its storage as ``aclrtHostRegister`` needs of page-aligned
    pinned memory, unless ``device_address`` is given) and
    returns the address the kernel reads it at (its own address: CPU memory is the model's
    device memory, or ``device_address`` when given). A view inside a recorded region
    returns that region's address plus its offset."""
    if host.device.type != "cpu":
        raise RuntimeError("npu_fused_register_host_memory: host must be a CPU tensor")
    if not host.is_contiguous():
        raise RuntimeError("npu_fused_register_host_memory: host must be contiguous")
    base, nbytes = host.data_ptr(), host.numel() * host.element_size()
    with _STATE.lock:
        for r_base, r_bytes, r_dev in _STATE.regions:
            if r_base <= base and base + nbytes <= r_base + r_bytes:
                return r_dev + (base - r_base)
        # On an NPU the pool's storage is page-aligned pinned memory, so what decides is the
        # view's offset in its storage; CPU storage is only 64-byte aligned: check the offset.
        if device_address == 0 and (base - host.untyped_storage().data_ptr()) % 4096:
            raise RuntimeError(
                "npu_fused_register_host_memory: aclrtHostRegister needs 4 KiB-aligned host memory; "
                "register the whole host pool (HostKVPool storage), not an unaligned view"
            )
        device = int(device_address) or base
        _STATE.regions.append((base, nbytes, device))
        return device


def _is_registered_host(host: torch.Tensor) -> bool:
    base, nbytes = host.data_ptr(), host.numel() * host.element_size()
    with _STATE.lock:
        return any(b <= base and base + nbytes <= b + n for b, n, _ in _STATE.regions)


def _check_copy_sfa(query, query_rope, host, hot, sparse_indices, token_rows, miss, token_table) -> Tuple[int, ...]:
    """The extension's argument checks of Copy-SFA; returns ``(T, N, Dl, Dr, R, Hh, K, W)``.
    ``miss``: miss_tokens, miss_slots, miss_count (the lists ``[R, W]``, ``W`` = K or n x K)."""
    _check(query, "query", torch.bfloat16, 3)
    _check(query_rope, "query_rope", torch.bfloat16, 3)
    t, n, dl = query.shape
    dr = query_rope.shape[2]
    if tuple(query_rope.shape[:2]) != (t, n):
        raise RuntimeError("query_rope must be [T, N, Dr]")
    _check(hot, "hot", torch.bfloat16, 3)
    r, hh, d = hot.shape
    if d != dl + dr:
        raise RuntimeError("hot must be [R, Hh, Dl + Dr]")
    if host.dtype != torch.bfloat16 or host.dim() != 2 or host.shape[1] != d or not host.is_contiguous():
        raise RuntimeError(f"host must be a contiguous bf16 [S, {d}] tensor")
    _check(sparse_indices, "sparse_indices", torch.int32, 3)
    k = sparse_indices.shape[2]
    _shape(sparse_indices, "sparse_indices", (t, 1, k))
    _check(token_rows, "token_rows", torch.int32, 1)
    _shape(token_rows, "token_rows", (t,))
    w = miss[0].shape[1] if miss[0].dim() == 2 else k
    for tensor, name, shape in zip(miss, ("miss_tokens", "miss_slots", "miss_count"), ((r, w), (r, w), (r,))):
        _check(tensor, name, torch.int32, len(shape))
        _shape(tensor, name, shape)
    _check(token_table, "token_table", torch.int32, 2)
    if token_table.shape[0] != r:
        raise RuntimeError("token_table must be [R, max_ctx]")
    return t, n, dl, dr, r, hh, k, w


def _copy_sfa(
    query,
    query_rope,
    host,
    hot,
    sparse_indices,
    token_rows,
    miss_tokens,
    miss_slots,
    miss_count,
    token_table,
    scale_value,
    overflow=None,
    tokens_per_row=1,
):
    """``npu_fused_scatter_copy_sparse_flash_attention`` on the model: misses copied into
    ``hot`` (in place), attention output bf16 ``[T, N, Dl]``; ``overflow`` bf16 ``[O, D]``:
    the rows ``sparse_indices`` from ``R * Hh`` on address."""
    op = "npu_fused_scatter_copy_sparse_flash_attention"
    miss = (miss_tokens, miss_slots, miss_count)
    t, n, dl, dr, r, hh, k, w = _check_copy_sfa(
        query, query_rope, host, hot, sparse_indices, token_rows, miss, token_table
    )
    if overflow is not None:
        _check(overflow, "overflow", torch.bfloat16, 2)
        if overflow.shape[1] != dl + dr:
            raise RuntimeError(f"overflow must be [O, {dl + dr}]")
    n_pad = max(n, MIN_HEADS)
    q, qr = query, query_rope
    if n_pad != n:
        q = torch.cat([query, torch.zeros((t, n_pad - n, dl), dtype=query.dtype)], 1).contiguous()
        qr = torch.cat([query_rope, torch.zeros((t, n_pad - n, dr), dtype=query.dtype)], 1).contiguous()
    m = model()
    try:
        launch = m.tile_copy_sfa(
            tokens=t,
            heads=n_pad,
            latent_dim=dl,
            rope_dim=dr,
            rows=r,
            hot_tokens=hh,
            top_k=k,
            max_ctx=token_table.shape[1],
            scale=float(scale_value),
            miss_width=w,
            row_tokens=int(tokens_per_row),
        )
    except am.ShapeUnsupported as exc:
        raise _unsupported(op, exc) from None
    out = torch.empty((t, n_pad, dl), dtype=query.dtype)
    if t == 0:
        return out.narrow(1, 0, n)
    if not _is_registered_host(host):
        raise RuntimeError(
            "Copy-SFA: the host tensor is not in registered host memory; call "
            f"torch.ops.{NAMESPACE}.npu_fused_register_host_memory(pool) first"
        )
    m.run(am.COPY_SFA, [q, qr, host, hot, overflow, sparse_indices, token_rows, *miss, token_table, out], launch)
    return out if n_pad == n else out.narrow(1, 0, n).contiguous()


# ------------------------------------------------------------------ miss copy
def _check_copy_rows(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table) -> Tuple[int, ...]:
    """The extension's argument checks of the miss copy; returns ``(B, D, Hh, W)``."""
    _check(hot, "hot", torch.bfloat16, 3)
    _, hh, d = hot.shape
    if host.dtype != torch.bfloat16 or host.dim() != 2 or host.shape[1] != d or not host.is_contiguous():
        raise RuntimeError(f"host must be a contiguous bf16 [S, {d}] tensor")
    _check(rows, "rows", torch.int32, 1)
    b = rows.shape[0]
    _check(miss_tokens, "miss_tokens", torch.int32, 2)
    w = miss_tokens.shape[1]
    for tensor, name, shape in ((miss_tokens, "miss_tokens", (b, w)), (miss_slots, "miss_slots", (b, w))):
        _check(tensor, name, torch.int32, 2)
        _shape(tensor, name, shape)
    _check(miss_count, "miss_count", torch.int32, 1)
    _shape(miss_count, "miss_count", (b,))
    _check(token_table, "token_table", torch.int32, 2)
    return b, d, hh, w


def _copy_rows(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table) -> None:
    """``npu_fused_copy_miss_rows`` on the model: ``hot[rows[b], miss_slots[b, i]] =
    host[token_table[rows[b], miss_tokens[b, i]]]`` for ``i < miss_count[b]``, in place."""
    op = "npu_fused_copy_miss_rows"
    b, d, hh, w = _check_copy_rows(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)
    m = model()
    try:
        launch = m.tile_copy_rows(entries=b, row_dim=d, hot_tokens=hh, miss_width=w, max_ctx=token_table.shape[1])
    except am.ShapeUnsupported as exc:
        raise _unsupported(op, exc) from None
    if b == 0:
        return
    if not _is_registered_host(host):
        raise RuntimeError(
            f"{op}: the host tensor is not in registered host memory; call "
            f"torch.ops.{NAMESPACE}.npu_fused_register_host_memory(pool) first"
        )
    m.run(am.COPY_ROWS, [host, hot, rows, miss_tokens, miss_slots, miss_count, token_table], launch)


# ------------------------------------------------------------------ fake (meta) impls
# Output shapes and dtypes only, so torch.compile can trace a call of the kernels.
def _lim_outputs_like(query: torch.Tensor, rows: int, hot_tokens: int, k: int, n: int = 1):
    t, w = query.shape[0], min(n * k, hot_tokens)
    i32 = dict(dtype=torch.int32)
    return (
        query.new_empty((t, 1, k), **i32),
        query.new_empty((t, 1, k), **i32),
        query.new_empty((rows, w), dtype=torch.bool),
        query.new_empty((rows, w), **i32),
        query.new_empty((rows,), **i32),
        query.new_empty((rows, w), **i32),
        query.new_empty((rows, w), **i32),
    )


def _lim_fake(
    query,
    key,
    weights,
    cu,
    kv_len,
    block_table,
    token_rows,
    req_ids,
    stable_len,
    step,
    slot_token,
    slot_stamp,
    row_req,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=2048,
    sparse_mode=3,
    tokens_per_row=1,
):
    return _lim_outputs_like(query, *slot_token.shape, int(sparse_count), int(tokens_per_row))


def _lim_c8_fake(
    query,
    key,
    weights,
    query_scale,
    key_scale,
    cu,
    kv_len,
    block_table,
    token_rows,
    req_ids,
    stable_len,
    step,
    slot_token,
    slot_stamp,
    row_req,
    query_quant_mode=0,
    key_quant_mode=0,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=2048,
    sparse_mode=3,
    tokens_per_row=1,
):
    return _lim_outputs_like(query, *slot_token.shape, int(sparse_count), int(tokens_per_row))


def _copy_sfa_fake(
    query,
    query_rope,
    host,
    hot,
    sparse_indices,
    token_rows,
    miss_tokens,
    miss_slots,
    miss_count,
    token_table,
    scale_value,
    overflow=None,
    tokens_per_row=1,
):
    return query.new_empty(query.shape)


def _copy_rows_fake(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table) -> None:
    return None
