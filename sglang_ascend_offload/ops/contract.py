"""The operator contract: the types every rung exchanges and one signature per op.

This module is the single home of

* the rung names (:data:`RUNGS`, :data:`CHOICES`);
* the residency types shared by every residency rung and by the decode engine
  (:class:`ResidencyTable`, :class:`ResidencyStep`, :class:`Lookup`) and the result
  of the fused indexer+manage ops (:class:`IndexerManageResult`); the semantics are
  written down in ``docs/residency_contract.md``;
* one signature per op (:data:`OP_SIGNATURES`): parameter names, kinds and defaults
  that the ``reference``, ``triton``, ``npu`` and ``fused`` implementations all take;
* the :func:`implements` marker that an implementation module puts on each rung.

It imports nothing of this package, so ``ops/reference.py``, ``ops/residency.py``,
``ops/triton_impls.py``, ``ops/npu_impls.py``, ``ops/fused.py``,
``sparse_decode/`` and ``triton_ops/`` all depend on it and it on none of them.

Registration has no import side effects: :func:`implements` only checks the
function against the op's signature (a :class:`TypeError` naming the difference)
and attaches an :class:`OpImpl` to it. The registry (``ops/registry.py``) collects
the marked functions of a fixed list of modules in
:func:`~sglang_ascend_offload.ops.registry.ensure_registered`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

import torch

__all__ = [
    "RUNGS",
    "CHOICES",
    "INT64_MAX",
    "Step",
    "ResidencyTable",
    "ResidencyStep",
    "Lookup",
    "IndexerManageResult",
    "OpImpl",
    "OP_SIGNATURES",
    "signature_mismatch",
    "implements",
    "IMPL_ATTR",
]

#: Implementation rungs, in the order the docs list them (``auto`` picks per device).
RUNGS = ("reference", "triton", "npu", "fused")
#: Values of the ``ops`` setting.
CHOICES = ("auto",) + RUNGS

INT64_MAX = torch.iinfo(torch.int64).max

#: A decode step counter: a Python int, or a 0-d int64 device tensor (graph form).
Step = Union[int, torch.Tensor]


# ----------------------------------------------------------------- residency types
@dataclass
class ResidencyTable:
    """Residency state of one layer; the tensors are mutated in place by every step.

    slot_token: int32 ``[R, H]`` logical position held by each slot, ``-1`` = empty.
    slot_stamp: int64 ``[R, H]`` recency, larger = more recent, ``0`` for empty.
    row_req:    int64 ``[R]`` request owning the row's content, ``-1`` = none.
    """

    slot_token: torch.Tensor  # int32 [R, H]
    slot_stamp: torch.Tensor  # int64 [R, H]
    row_req: torch.Tensor  # int64 [R]

    @classmethod
    def empty(cls, rows: int, hot_tokens: int, device=None) -> "ResidencyTable":
        """All rows unowned, all slots empty."""
        return cls(
            slot_token=torch.full((rows, hot_tokens), -1, dtype=torch.int32, device=device),
            slot_stamp=torch.zeros((rows, hot_tokens), dtype=torch.int64, device=device),
            row_req=torch.full((rows,), -1, dtype=torch.int64, device=device),
        )

    @property
    def rows(self) -> int:
        return self.slot_token.shape[0]

    @property
    def hot_tokens(self) -> int:
        return self.slot_token.shape[1]

    def clone(self) -> "ResidencyTable":
        return ResidencyTable(self.slot_token.clone(), self.slot_stamp.clone(), self.row_req.clone())


@dataclass
class ResidencyStep:
    """Outputs of one step of one layer (all ``[R, K]`` tensors follow top-k order).

    hit_mask: bool ``[R,K]``, entry ``j`` was a hit (False for padding).
    slots: int32 ``[R,K]``, hot-buffer slot of entry ``j`` after the step, ``-1`` for
        padding: the remapped top-k.
    miss_count: int32 ``[R]``.
    miss_tokens: int32 ``[R,K]``, logical positions of the misses in top-k order,
        compacted left, ``-1`` after ``miss_count``.
    miss_slots: int32 ``[R,K]``, their victim slots, same layout.
    """

    hit_mask: torch.Tensor
    slots: torch.Tensor
    miss_count: torch.Tensor
    miss_tokens: torch.Tensor
    miss_slots: torch.Tensor


@dataclass
class Lookup:
    """Intermediate result of the residency lookup (int64 indices for gather/scatter).

    valid: bool ``[R,K]``, a real entry (not padding, row not idle).
    hit: bool ``[R,K]``.
    hit_slot: int64 ``[R,K]``, slot of a hit, ``0`` where not a hit (mask with ``hit``).
    slot_hit: bool ``[R,H]``, the slot is hit in this step (never a victim).
    """

    valid: torch.Tensor
    hit: torch.Tensor
    hit_slot: torch.Tensor
    slot_hit: torch.Tensor

    @property
    def miss(self) -> torch.Tensor:
        return self.valid & ~self.hit


@dataclass
class IndexerManageResult:
    """Outputs of LIM / LIM-C8 for one layer and step.

    topk_indices:   int32 ``[T, 1, K]`` logical top-k positions of each query token
                    (the indexer's output; ``-1`` padding).
    sparse_indices: int32 ``[T, 1, K]`` rows of the flat hot buffer ``[R*H, D]``
                    holding those positions after the step, same order
                    (``token_rows[t] * H + slot``; ``-1`` for padding and for tokens
                    with ``token_rows[t] == -1``): what Copy-SFA attends over.
    residency:      the per-row :class:`ResidencyStep` (``hit_mask``, ``slots``,
                    ``miss_count``, ``miss_tokens``, ``miss_slots``; all ``[R, ...]``):
                    what Copy-SFA copies.
    """

    topk_indices: torch.Tensor
    sparse_indices: torch.Tensor
    residency: ResidencyStep


# ------------------------------------------------------------------ op signatures
# One stub per op: the parameters every rung takes (names, positional/keyword kind,
# defaults). Shapes, dtypes and semantics are documented on the reference rung
# (``ops/reference.py``, ``ops/residency.py``, ``ops/fused.py``) and in
# ``docs/operators.md``; annotations are not compared (rungs may spell them differently).
_T = torch.Tensor
_OT = Optional[torch.Tensor]


def _lightning_indexer(
    query: _T,
    key: _T,
    weights: _T,
    *,
    actual_seq_lengths_query: _T,
    actual_seq_lengths_key: _T,
    block_table: _T,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
) -> _T:
    """int32 ``[T, 1, K]`` logical top-k positions per query token (``-1`` padding)."""


def _quant_lightning_indexer(
    query: _T,
    key: _T,
    weights: _T,
    query_dequant_scale: _T,
    key_dequant_scale: _T,
    *,
    actual_seq_lengths_query: _T,
    actual_seq_lengths_key: _T,
    block_table: _T,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
) -> _T:
    """As ``lightning_indexer`` over int8 Hadamard-rotated query/key with fp16 scales."""


def _sparse_mla_attention(
    query: _T,
    key: _T,
    value: _OT,
    sparse_indices: _T,
    scale_value: float,
    *,
    block_table: _OT = None,
    actual_seq_lengths_query: _OT = None,
    actual_seq_lengths_kv: _OT = None,
    query_rope: _OT = None,
    key_rope: _OT = None,
    sparse_block_size: int = 1,
    layout_query: str = "TND",
    layout_kv: str = "PA_BSND",
    sparse_mode: int = 3,
    attention_mode: int = 2,
) -> _T:
    """Absorbed-MLA attention over the selected latent rows; ``[T, N, D_latent]``."""


def _gather_rows(src: _T, index: _T) -> _T:
    """``src[index]`` (bit-exact)."""


def _scatter_rows(dst: _T, index: _T, rows: _T) -> _T:
    """``dst[index] = rows`` in place, returns ``dst`` (bit-exact; unique indices)."""


def _residency_manage(
    slot_token: _T, slot_stamp: _T, row_req: _T, topk: _T, req_ids: _T, stable_len: _T, step
) -> ResidencyStep:
    """One exact-LRU step of one layer; mutates the three state tensors in place."""


def _copy_miss_rows(host: _T, hot: _T, miss_tokens: _T, miss_slots: _T, miss_count: _T, token_table: _T) -> None:
    """Copy the miss rows of one layer host -> hot buffer (bit-exact)."""


def _lightning_indexer_manage(
    query: _T,
    key: _T,
    weights: _T,
    *,
    actual_seq_lengths_query: _T,
    actual_seq_lengths_key: _T,
    block_table: _T,
    token_rows: _T,
    req_ids: _T,
    stable_len: _T,
    step: Step,
    slot_token: _T,
    slot_stamp: _T,
    row_req: _T,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    tokens_per_row: int = 1,
) -> IndexerManageResult:
    """LIM: ``lightning_indexer`` then ``residency_manage`` per row."""


def _quant_lightning_indexer_manage(
    query: _T,
    key: _T,
    weights: _T,
    query_dequant_scale: _T,
    key_dequant_scale: _T,
    *,
    actual_seq_lengths_query: _T,
    actual_seq_lengths_key: _T,
    block_table: _T,
    token_rows: _T,
    req_ids: _T,
    stable_len: _T,
    step: Step,
    slot_token: _T,
    slot_stamp: _T,
    row_req: _T,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    layout_query: str = "TND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    tokens_per_row: int = 1,
) -> IndexerManageResult:
    """LIM-C8: ``quant_lightning_indexer`` then ``residency_manage`` per row."""


def _copy_sparse_flash_attention(
    query: _T,
    host: _T,
    hot: _T,
    sparse_indices: _T,
    scale_value: float,
    *,
    query_rope: _T,
    token_rows: _T,
    miss_tokens: _T,
    miss_slots: _T,
    miss_count: _T,
    token_table: _T,
    layout_query: str = "TND",
    attention_mode: int = 2,
    overflow: Optional[_T] = None,
    tokens_per_row: Optional[int] = None,
) -> _T:
    """Copy-SFA: ``copy_miss_rows`` then ``sparse_mla_attention`` over the flat hot buffer
    (and the overflow area's rows after it, where given)."""


#: op name -> the signature every rung of it takes.
OP_SIGNATURES: Dict[str, inspect.Signature] = {
    fn.__name__[1:]: inspect.signature(fn)
    for fn in (
        _lightning_indexer,
        _quant_lightning_indexer,
        _sparse_mla_attention,
        _gather_rows,
        _scatter_rows,
        _residency_manage,
        _copy_miss_rows,
        _lightning_indexer_manage,
        _quant_lightning_indexer_manage,
        _copy_sparse_flash_attention,
    )
}


def _shape(sig: inspect.Signature):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def signature_mismatch(op: str, fn: Callable) -> Optional[str]:
    """``None`` if ``fn`` takes exactly ``op``'s parameters (names, kinds, defaults), else
    a sentence naming the first difference."""
    if op not in OP_SIGNATURES:
        return f"unknown op {op!r}; the contract defines {', '.join(sorted(OP_SIGNATURES))}"
    want = _shape(OP_SIGNATURES[op])
    got = _shape(inspect.signature(fn))
    for i in range(max(len(want), len(got))):
        w = want[i] if i < len(want) else None
        g = got[i] if i < len(got) else None
        if w != g:

            def fmt(p):
                if p is None:
                    return "nothing"
                default = "" if p[2] is inspect.Parameter.empty else f"={p[2]!r}"
                return f"{p[0]}{default} ({p[1].description})"

            return f"parameter {i}: contract has {fmt(w)}, implementation has {fmt(g)}"
    return None


# ------------------------------------------------------------------ implementations
def _always_available() -> Optional[str]:
    return None


@dataclass(frozen=True)
class OpImpl:
    """One implementation of one op.

    ``unavailable`` returns ``None`` when the implementation can run here, else a
    sentence saying what is missing and how to get it. ``rows_form``: the same op over a
    batch of engine rows, where the rung has one (``copy_miss_rows``: ``(host, hot, rows,
    miss_tokens, miss_slots, miss_count, token_table)`` with ``[B, K]`` miss lists of the
    rows ``rows`` int64 ``[B]``, static shapes); ``None``: callers pass every row's lists.
    """

    op: str
    rung: str
    fn: Callable
    unavailable: Callable[[], Optional[str]]
    rows_form: Optional[Callable] = None

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


#: Attribute :func:`implements` sets on a function (the registry collects it).
IMPL_ATTR = "__op_impl__"


def implements(
    op: str,
    rung: str,
    unavailable: Callable[[], Optional[str]] = _always_available,
    rows_form: Optional[Callable] = None,
):
    """Mark ``fn`` as the ``rung`` implementation of ``op`` (no global state changes);
    ``rows_form``: its form over a batch of rows (:class:`OpImpl`).

    Raises :class:`ValueError` for an unknown rung and :class:`TypeError` when ``fn``'s
    parameters differ from ``op``'s contract signature.
    """
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; expected one of {RUNGS}")

    def deco(fn: Callable) -> Callable:
        problem = signature_mismatch(op, fn)
        if problem is not None:
            raise TypeError(f"op {op!r}, rung {rung!r} ({fn.__module__}.{fn.__qualname__}): {problem}")
        setattr(fn, IMPL_ATTR, OpImpl(op=op, rung=rung, fn=fn, unavailable=unavailable, rows_form=rows_form))
        return fn

    return deco
