"""The one hook on SGLang's per-token KV bytes (``DefaultPoolConfigurator._compute_cell_size``).

SGLang sizes its KV pool as budget / cell bytes. Each feature that changes what a token
costs on the device says so through its ``cell_size_after(cell, configurator, kvc,
num_layers)``: the new per-token bytes, or ``None`` when it does not serve this pool.
The startup rules allow one pool-replacing feature per server, so at most the one
active feature answers; the ``--device-kv-budget`` accounting of a CPU server is part
of sparse decode's answer (with or without offload).
"""

from __future__ import annotations

from typing import Optional

from . import kvpp, layerwise_prefill, sparse_decode

__all__ = ["cell_size_after", "FEATURE_CELL_SIZES"]

#: Each feature's answer, asked in this order (each sees the previous answer).
FEATURE_CELL_SIZES = (layerwise_prefill.cell_size_after, kvpp.cell_size_after, sparse_decode.cell_size_after)


def cell_size_after(cell: int, self, kvc, num_layers: int) -> Optional[int]:
    """HookRegistry AFTER hook: SGLang's ``cell`` as the active feature counts it, or
    ``None`` (SGLang's own figure) when no feature serves this pool."""
    changed = False
    for feature_cell_size in FEATURE_CELL_SIZES:
        answer = feature_cell_size(cell, self, kvc, num_layers)
        if answer is not None:
            cell, changed = answer, True
    return cell if changed else None
