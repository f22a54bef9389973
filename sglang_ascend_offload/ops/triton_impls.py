"""The ``triton`` rung: Triton kernels of ``residency_manage`` and ``copy_miss_rows``.

Importing this module never imports triton (the registry imports it everywhere);
the kernels live in :mod:`sglang_ascend_offload.triton_ops` and are imported on the
first call. Each wrapper takes exactly the reference op's arguments and returns the
reference op's result type, so ``ops="triton"`` swaps rungs without changing callers.

Availability (:func:`triton_unavailable`): triton must import; on a machine without
a GPU/NPU the kernels run only through the Triton interpreter, which has to be
switched on with ``TRITON_INTERPRET=1`` before the kernels are first imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Optional

import torch

from .. import platform
from .contract import implements

INTERPRET_HINT = "set TRITON_INTERPRET=1 to run Triton kernels on CPU through the interpreter (slow; correctness only)"


def triton_unavailable() -> Optional[str]:
    """``None`` if the Triton kernels can run here, else what is missing and what to do."""
    if importlib.util.find_spec("triton") is None:
        return (
            "triton is not importable: install triton-ascend on Ascend NPU nodes (the [npu] extra) "
            "or triton on CUDA/CPU machines"
        )
    # Checked before importing triton: triton's own @jit library functions (tl.cumsum,
    # tl.max, ...) are built in the mode in force at its first import, so importing it
    # here without the interpreter would break every later interpreted launch.
    if platform.device_kind() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return INTERPRET_HINT
    try:
        importlib.import_module("triton")
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"triton is installed but fails to import ({exc!r})"
    return None


@implements("residency_manage", "triton", unavailable=triton_unavailable)
def residency_manage(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step: int,
):
    """Exact-LRU residency step on Triton kernels; see ``triton_ops/residency.py``.

    Same arguments, in-place state update and ``ResidencyStep`` result as the reference.
    """
    from ..triton_ops.residency import residency_manage as impl

    return impl(slot_token, slot_stamp, row_req, topk, req_ids, stable_len, step)


@implements("copy_miss_rows", "triton", unavailable=triton_unavailable)
def copy_miss_rows(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """Fused gather (host) + scatter (hot slots) of the miss rows; see ``triton_ops/copy_rows.py``."""
    from ..triton_ops.copy_rows import copy_miss_rows as impl

    impl(host, hot, miss_tokens, miss_slots, miss_count, token_table)
