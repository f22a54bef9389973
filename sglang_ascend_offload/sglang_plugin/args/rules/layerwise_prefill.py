"""SGLang-side startup rules of layerwise prefill offload (run by :mod:`..resolution`).

The engine-agnostic rules (eager mode with reuse, Memcache off CPU, decode-only node,
independent layers, prefetch depth, not with sparse decode offload, speculation only as
the NextN / MTP chain, no PP, ``store_block_tokens`` = the page size, ...) live in
``config.py``; these are about SGLang arguments and packages the deployment facts do not
describe, which the SGLang pool (:mod:`...mem_cache.pool.layerwise_prefill`) needs:

================================  ==============================================================
rule                              when
================================  ==============================================================
``sglang.layerwise_backend``      an attention backend other than ``ascend_offload`` (the pool
                                  is built only for it and reads its forward metadata)
``sglang.layerwise_tbo``          two-batch overlap or PD-multiplexing (interleaved forwards)
``sglang.layerwise_hicache``      ``--enable-hierarchical-cache`` (owns the layer counter)
``sglang.layerwise_store``        ``store_backend`` memcache with buffer reuse and memcache-hybrid
                                  missing
================================  ==============================================================
"""

from __future__ import annotations

import importlib.util
from typing import Any, List

from .... import config as cfg
from ....rules import violation
from ... import compat
from ...names import BACKEND_NAME

__all__ = ["layerwise_violations"]


def layerwise_violations(config: cfg.OffloadConfig, view: Any) -> List[cfg.Violation]:
    """Every rule above that ``view`` (the resolved server arguments) breaks."""
    lw = config.layerwise_prefill
    if lw is None:
        return []
    out: List[cfg.Violation] = []

    def add(rule: str, problem: str, fix: str) -> None:
        out.append(violation(rule, problem, fix))

    backends = {
        b
        for b in (
            compat.arg(view, "attention_backend"),
            compat.arg(view, "prefill_attention_backend"),
            compat.arg(view, "decode_attention_backend"),
        )
        if b
    }
    if backends - {BACKEND_NAME}:
        add(
            "sglang.layerwise_backend",
            f"attention backend(s) {sorted(backends)} cannot serve layerwise prefill offload",
            f"drop --attention-backend (the plugin selects {BACKEND_NAME}) or pass --attention-backend {BACKEND_NAME}",
        )
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        if compat.arg(view, flag):
            add(
                "sglang.layerwise_tbo",
                f"--{flag.replace('_', '-')} interleaves forwards layer by layer",
                f"drop --{flag.replace('_', '-')}",
            )
    if compat.arg(view, "enable_hierarchical_cache"):
        add(
            "sglang.layerwise_hicache",
            "--enable-hierarchical-cache is on (HiCache drives the pool's layer counter)",
            "drop --enable-hierarchical-cache",
        )
    store = lw.effective_store_backend(str(compat.arg(view, "device") or "cpu"))
    if lw.shared_buffers is not None and store == "memcache" and importlib.util.find_spec("memcache_hybrid") is None:
        how = "" if lw.store_backend else " (the default on an Ascend NPU)"
        add(
            "sglang.layerwise_store",
            f"store_backend 'memcache'{how} but memcache-hybrid is not installed",
            'pip install memcache-hybrid memfabric-hybrid on the Ascend node, or use "store_backend": "local" on a CPU',
        )
    return out
