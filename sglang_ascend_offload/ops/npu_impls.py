"""The ``npu`` rung: thin wrappers over torch_npu's built-in operators.

The residency step and the miss copy have no torch_npu operator of their own: their
``npu`` rung is the static-shape torch composition of ``ops/residency.py`` run on the NPU
(torch_npu's aten kernels: sort, gather, scatter, index_copy), registered as a rung of
its own so that an operator plan on an NPU names it (never the reference rung, which
runs there only with ``ops: "reference"``) and it is usable only where an NPU is.

The npu miss copy gathers from the host pool on the host: torch_npu has no device-side
indexed read of host memory (its aten ops take device tensors only, and an
``aclrtHostRegister`` mapping is usable by kernels, not by torch tensors), so the miss
rows' host slots are read back first -- one device->host read per layer step, which a
graph capture refuses. The sync-free, capturable miss copy is the ``fused`` rung's
(``ops/fused.py``: this project's AscendC kernel reading registered host memory), which
``ops: auto`` picks first on an NPU with the extension built.

``torch_npu`` is imported lazily inside the wrappers and the availability checks, so
importing this module (which the registry does everywhere) never touches it. Every
wrapper takes exactly the reference op's arguments (see ``reference.py``) and
returns the reference op's result type; torch_npu's extra outputs (indexer values,
softmax statistics) are dropped.

This module also holds the availability check for the ``fused`` rung (this
project's AscendC operators LIM, LIM-C8 and Copy-SFA, built from ``ascendc_ops/``).
The fused ops and their reference compositions live in ``ops/fused.py`` (which
imports this module, never the other way round); they are marked with::

    @implements("lightning_indexer_manage", "fused",
              unavailable=lambda: fused_op_unavailable("npu_fused_lightning_indexer_manage"))
    def lim_fused(...):
        return fused_op("npu_fused_lightning_indexer_manage")(...)

Every reason the fused rung gives ends with how to build the extension
(:data:`FUSED_BUILD_HINT`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Callable, Optional

import torch

from .. import platform
from .contract import ResidencyStep, implements
from .residency import copy_miss_rows_rows as _copy_rows_composition
from .residency import residency_manage as _lru_composition

INSTALL_HINT = "install the [npu] extra on an Ascend node with CANN"


# ------------------------------------------------------------------ availability
@functools.lru_cache(maxsize=1)
def torch_npu_unavailable() -> Optional[str]:
    """``None`` if torch_npu imports and an NPU is visible, else what is missing."""
    if importlib.util.find_spec("torch_npu") is None:
        return f"torch_npu is not importable: {INSTALL_HINT}"
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - a broken CANN install is a reason, not a crash
        return f"torch_npu is installed but fails to import ({exc!r}): check the CANN environment (set_env.sh)"
    if platform.device_kind() != "npu":
        return f"no NPU device (device kind is {platform.device_kind()!r})"
    return None


def _torch_npu_op_unavailable(name: str) -> Optional[str]:
    reason = torch_npu_unavailable()
    if reason is not None:
        return reason
    torch_npu = importlib.import_module("torch_npu")
    if not hasattr(torch_npu, name):
        version = getattr(torch_npu, "__version__", "?")
        return f"torch_npu {version} has no {name}: upgrade torch_npu/CANN to a release that ships it"
    return None


def _torch_npu_op(name: str) -> Callable:
    return getattr(importlib.import_module("torch_npu"), name)


# ------------------------------------------------------------ fused (AscendC) ops
# The compiled extension that registers this project's AscendC operators, and the
# torch.ops namespace they are registered under (ascendc_ops/ builds both).
FUSED_EXTENSION_MODULE = "sglang_ascend_offload._C_ascend"
FUSED_OP_NAMESPACE = "sglang_ascend_offload"
FUSED_KERNELS = (
    "npu_fused_lightning_indexer_manage",  # LIM
    "npu_fused_quant_lightning_indexer_manage",  # LIM-C8
    "npu_fused_scatter_copy_sparse_flash_attention",  # Copy-SFA
    "npu_fused_copy_miss_rows",  # the miss copy on its own (copy_miss_rows, fused rung)
    "npu_fused_register_host_memory",  # host pool -> device address for Copy-SFA and the miss copy
)
FUSED_BUILD_HINT = (
    "build ascendc_ops with CANN: bash ascendc_ops/build.sh --install "
    "(on an Ascend node with CANN set_env.sh sourced and torch_npu installed; see ascendc_ops/README.md)"
)


def _fused_extension_unavailable() -> Optional[str]:
    """``None`` if the fused ops' provider is usable: on CPU the functional-model ops
    (``ops/ascendc_cpu_ops.py``) once registered, else the built AscendC extension."""
    from . import ascendc_cpu_ops

    if ascendc_cpu_ops.registered():
        return None
    reason = _npu_extension_unavailable()
    if reason is not None and platform.device_kind() == "cpu":
        reason += (
            " (on CPU, ops=fused runs the AscendC kernels on the functional model instead: selecting "
            "ops=fused, or ops.ascendc_cpu_ops.register(), builds and registers them)"
        )
    return reason


@functools.lru_cache(maxsize=1)
def _npu_extension_unavailable() -> Optional[str]:
    reason = torch_npu_unavailable()
    if reason is not None:
        return reason
    if importlib.util.find_spec(FUSED_EXTENSION_MODULE) is None:
        return f"the AscendC extension {FUSED_EXTENSION_MODULE} is not built"
    try:
        importlib.import_module(FUSED_EXTENSION_MODULE)
    except Exception as exc:  # noqa: BLE001
        return f"the AscendC extension {FUSED_EXTENSION_MODULE} fails to load: {exc!r}"
    return None


def fused_op_unavailable(kernel: str) -> Optional[str]:
    """Availability check for one fused kernel (for ``implements(..., unavailable=)``).

    The reason names the kernel, what is missing, and ends with :data:`FUSED_BUILD_HINT`.
    """
    reason = _fused_extension_unavailable()
    if reason is None:
        namespace = getattr(torch.ops, FUSED_OP_NAMESPACE)
        if not hasattr(namespace, kernel):
            reason = (
                f"the AscendC extension {FUSED_EXTENSION_MODULE} does not provide {kernel} "
                "(built from an older source tree)"
            )
    if reason is None:
        return None
    return f"fused kernel {kernel}: {reason}; {FUSED_BUILD_HINT}"


def fused_op(kernel: str) -> Callable:
    """The ``torch.ops`` callable of a fused kernel (call its check first)."""
    return getattr(getattr(torch.ops, FUSED_OP_NAMESPACE), kernel)


# --------------------------------------------------------------------- indexers
@implements(
    "lightning_indexer",
    "npu",
    unavailable=lambda: _torch_npu_op_unavailable("npu_lightning_indexer"),
)
def lightning_indexer_npu(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    block_table: torch.Tensor,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
) -> torch.Tensor:
    """``torch_npu.npu_lightning_indexer``; returns its indices ``[T, 1, K]`` int32."""
    result = _torch_npu_op("npu_lightning_indexer")(
        query=query,
        key=key,
        weights=weights,
        actual_seq_lengths_query=actual_seq_lengths_query.to(device=query.device, dtype=torch.int32),
        actual_seq_lengths_key=actual_seq_lengths_key.to(device=query.device, dtype=torch.int32),
        block_table=block_table.to(device=query.device, dtype=torch.int32),
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=sparse_count,
        sparse_mode=sparse_mode,
    )
    return result[0] if isinstance(result, (tuple, list)) else result


@implements(
    "quant_lightning_indexer",
    "npu",
    unavailable=lambda: _torch_npu_op_unavailable("npu_quant_lightning_indexer"),
)
def quant_lightning_indexer_npu(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    query_dequant_scale: torch.Tensor,
    key_dequant_scale: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor,
    block_table: torch.Tensor,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
) -> torch.Tensor:
    """``torch_npu.npu_quant_lightning_indexer``; returns ``[T, 1, K]`` int32.

    torch_npu takes ``float16`` weights and dequantisation scales for int8 query / key
    (``docs/context/torch_npu-npu_quant_lightning_indexer.md`` of Ascend/op-plugin, Atlas
    A2 and A3): ``weights`` ``[T, H]`` arrive in the model's dtype (bf16, as the fused
    LIM-C8 takes them) and are converted here, exactly for every bf16 value of magnitude
    ``>= 2**-17`` up to fp16's maximum 65504 (the op requires ``weights * query scale``
    within fp16's range: DeepSeek-V3.2's indexer weights are far inside it). Scales in
    another dtype are converted the same way. A ``[blocks, block_size, 1, 1]`` key scale
    is reshaped to the ``[blocks, block_size, 1]`` the kernel documents.
    """
    if key_dequant_scale.dim() == 4:
        key_dequant_scale = key_dequant_scale.reshape(key_dequant_scale.shape[:3])
    fp16 = torch.float16
    result = _torch_npu_op("npu_quant_lightning_indexer")(
        query=query,
        key=key,
        weights=weights.to(fp16).contiguous(),
        query_dequant_scale=query_dequant_scale.to(fp16).contiguous(),
        key_dequant_scale=key_dequant_scale.to(fp16).contiguous(),
        actual_seq_lengths_query=actual_seq_lengths_query.to(device=query.device, dtype=torch.int32),
        actual_seq_lengths_key=actual_seq_lengths_key.to(device=query.device, dtype=torch.int32),
        block_table=block_table.to(device=query.device, dtype=torch.int32),
        query_quant_mode=query_quant_mode,
        key_quant_mode=key_quant_mode,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=sparse_count,
        sparse_mode=sparse_mode,
    )
    return result[0] if isinstance(result, (tuple, list)) else result


# ---------------------------------------------------------------------- attention
# Block sizes tried, largest first, for the gathered rows of a "flat" buffer presented to
# the paged kernel (a token's selection rounded up to a multiple of the smallest).
_FLAT_BLOCK_SIZES = (128, 64, 32, 16)
#: a token's gathered selection is padded to a multiple of this many rows
FLAT_ROWS_MULTIPLE = _FLAT_BLOCK_SIZES[-1]


def _flat_as_paged(key: torch.Tensor, key_rope: torch.Tensor, indices: torch.Tensor):
    """A flat ``[S, D]`` buffer's selected rows as PA_BSND for the paged kernel.

    Token ``t``'s ``K`` selected rows (``indices`` ``[T, K]`` row numbers, ``-1`` none) are
    gathered, in order, into contiguous latent / rope planes ``[T*K', ...]`` (``K'`` = ``K``
    rounded up to :data:`FLAT_ROWS_MULTIPLE`; torch_npu takes contiguous caches only, and a
    hot buffer's latent and rope columns are two strided views of one ``[S, 576]`` buffer),
    each token its own single-token request over its ``K'`` rows (``sparse_mode`` 0), its
    indices renumbered ``0..K-1`` (``-1`` kept). The same rows in the same order as ``flat``
    reads them; static shapes, ``O(T*K)`` rows copied (not the buffer)."""
    num_tokens, k = indices.shape
    padded = -(-k // FLAT_ROWS_MULTIPLE) * FLAT_ROWS_MULTIPLE
    block = next(b for b in _FLAT_BLOCK_SIZES if padded % b == 0)
    device = key.device
    latent = key.reshape(-1, key.shape[-1])
    rope = key_rope.reshape(-1, key_rope.shape[-1])
    rows = torch.nn.functional.pad(indices, (0, padded - k), value=-1).clamp(min=0).reshape(-1).to(torch.int64)
    blocks = num_tokens * padded // block
    paged_latent = latent.index_select(0, rows).reshape(blocks, block, 1, latent.shape[-1])
    paged_rope = rope.index_select(0, rows).reshape(blocks, block, 1, rope.shape[-1])
    block_table = torch.arange(blocks, dtype=torch.int32, device=device).reshape(num_tokens, padded // block)
    local = torch.arange(k, dtype=torch.int32, device=device).expand(num_tokens, k)
    local = torch.where(indices >= 0, local, torch.full_like(local, -1)).reshape(num_tokens, 1, k).contiguous()
    cu_q = torch.arange(1, num_tokens + 1, dtype=torch.int32, device=device)
    kv_len = torch.full((num_tokens,), padded, dtype=torch.int32, device=device)
    return paged_latent, paged_rope, block_table, cu_q, kv_len, local


@implements(
    "sparse_mla_attention",
    "npu",
    unavailable=lambda: _torch_npu_op_unavailable("npu_sparse_flash_attention"),
)
def sparse_mla_attention_npu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: Optional[torch.Tensor],
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    block_table: Optional[torch.Tensor] = None,
    actual_seq_lengths_query: Optional[torch.Tensor] = None,
    actual_seq_lengths_kv: Optional[torch.Tensor] = None,
    query_rope: Optional[torch.Tensor] = None,
    key_rope: Optional[torch.Tensor] = None,
    sparse_block_size: int = 1,
    layout_query: str = "TND",
    layout_kv: str = "PA_BSND",
    sparse_mode: int = 3,
    attention_mode: int = 2,
) -> torch.Tensor:
    """``torch_npu.npu_sparse_flash_attention`` (MLA absorb, attention_mode=2).

    PA_BSND is passed through as SGLang's Ascend backend does. ``flat`` is mapped to
    PA_BSND over each token's gathered selection (:func:`_flat_as_paged`: one single-token
    request per query token, indices renumbered into its rows).
    """
    num_tokens = query.shape[0]
    # torch_npu takes contiguous queries only (SGLang's q_nope / q_pe are views of one q)
    query = query.contiguous()
    query_rope = query_rope.contiguous() if query_rope is not None else None
    indices = sparse_indices.reshape(num_tokens, 1, -1).to(device=query.device, dtype=torch.int32)
    if layout_kv == "flat":
        key, key_rope, block_table, actual_seq_lengths_query, actual_seq_lengths_kv, indices = _flat_as_paged(
            key, key_rope, indices.reshape(num_tokens, -1)
        )
        sparse_mode = 0
    elif layout_kv != "PA_BSND":
        raise ValueError(f"layout_kv={layout_kv!r}: expected 'PA_BSND' or 'flat'")
    result = _torch_npu_op("npu_sparse_flash_attention")(
        query=query,
        key=key,
        value=key,
        sparse_indices=indices,
        scale_value=float(scale_value),
        block_table=block_table.to(device=query.device, dtype=torch.int32),
        actual_seq_lengths_query=actual_seq_lengths_query.to(device=query.device, dtype=torch.int32),
        actual_seq_lengths_kv=actual_seq_lengths_kv.to(device=query.device, dtype=torch.int32),
        query_rope=query_rope,
        key_rope=key_rope,
        sparse_block_size=sparse_block_size,
        layout_query=layout_query,
        layout_kv="PA_BSND",
        sparse_mode=sparse_mode,
        attention_mode=attention_mode,
        return_softmax_lse=False,
    )
    return result[0] if isinstance(result, (tuple, list)) else result


# ------------------------------------------------------------------- row copies
@implements("gather_rows", "npu", unavailable=torch_npu_unavailable)
def gather_rows_npu(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``index_select`` on ``src``'s device (bit-exact)."""
    return torch.index_select(src, 0, index.to(device=src.device, dtype=torch.int64))


@implements("scatter_rows", "npu", unavailable=torch_npu_unavailable)
def scatter_rows_npu(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``index_copy_`` on ``dst``'s device (bit-exact; unique indices)."""
    if rows.dtype != dst.dtype:
        raise ValueError(f"scatter_rows: rows dtype {rows.dtype} != dst dtype {dst.dtype}")
    return dst.index_copy_(0, index.to(device=dst.device, dtype=torch.int64), rows.to(dst.device))


# ---------------------------------------------------------------- residency and copy
@implements("residency_manage", "npu", unavailable=torch_npu_unavailable)
def residency_manage_npu(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step,
) -> ResidencyStep:
    """The exact-LRU step of ``ops/residency.py`` on the NPU's tensors (static shapes, no
    host read); bit-exact with the reference."""
    return _lru_composition(slot_token, slot_stamp, row_req, topk, req_ids, stable_len, step)


def copy_miss_rows_rows_npu(
    host: torch.Tensor,
    hot: torch.Tensor,
    rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """The rows form of the ``npu`` miss copy: ``residency.copy_miss_rows_rows`` on the NPU
    (static shapes, no host read, graph-capturable)."""
    _copy_rows_composition(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)


@implements("copy_miss_rows", "npu", unavailable=torch_npu_unavailable, rows_form=copy_miss_rows_rows_npu)
def copy_miss_rows_npu(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """Every row's miss copy on the NPU: the rows form over all rows ``0..R-1`` (static
    shapes; a caller with a batch of rows calls :func:`copy_miss_rows_rows_npu`)."""
    rows = torch.arange(hot.shape[0], dtype=torch.int64, device=miss_count.device)
    copy_miss_rows_rows_npu(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)
