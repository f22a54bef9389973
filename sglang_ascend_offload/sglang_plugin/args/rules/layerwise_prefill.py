"""SGLang-side startup rules of layerwise prefill offload (run by :mod:`..resolution`).

The engine-agnostic rules (eager mode with reuse, Memcache off CPU, decode-only node,
independent layers, prefetch depth, ...) live in ``config.py``; these are about what
the SGLang pool (:mod:`...mem_cache.pool.layerwise_prefill`) can serve:

================================  ==============================================================
rule                              when
================================  ==============================================================
``sglang.layerwise_backend``      an attention backend other than ``ascend_offload`` (the pool
                                  is built only for it and reads its forward metadata)
``sglang.layerwise_sparse_decode``  sparse decode offload on as well (both replace the KV pool)
``sglang.layerwise_speculative``  speculation other than the NextN / MTP chain (``EAGLE`` / ``NEXTN``
                                  with ``--speculative-eagle-topk 1``, the served and tested form;
                                  its draft layer is an independent layer of the plan)
``sglang.layerwise_tbo``          two-batch overlap or PD-multiplexing (interleaved forwards)
``sglang.layerwise_hicache``      ``--enable-hierarchical-cache`` (owns the layer counter)
``sglang.layerwise_pp``           pipeline parallelism (per-stage plans are not wired / tested)
``sglang.layerwise_block_tokens`` ``store_block_tokens`` set to something other than the page size
``sglang.layerwise_store``        ``store_backend`` memcache with buffer reuse and memcache-hybrid
                                  missing
================================  ==============================================================
"""

from __future__ import annotations

import importlib.util
from typing import Any, List

from .... import config as cfg
from ... import compat
from ...names import BACKEND_NAME

__all__ = ["layerwise_violations", "RULES"]

RULES = ("sglang.layerwise_backend", "sglang.layerwise_sparse_decode", "sglang.layerwise_speculative",
         "sglang.layerwise_tbo", "sglang.layerwise_hicache", "sglang.layerwise_block_tokens",
         "sglang.layerwise_store", "sglang.layerwise_pp")


def layerwise_violations(config: cfg.OffloadConfig, view: Any) -> List[cfg.Violation]:
    """Every rule above that ``view`` (the resolved server arguments) breaks."""
    lw = config.layerwise_prefill
    if lw is None:
        return []
    out: List[cfg.Violation] = []

    def add(rule: str, problem: str, fix: str) -> None:
        out.append(cfg.Violation(rule, problem, fix))

    backends = {b for b in (compat.arg(view, "attention_backend"),
                            compat.arg(view, "prefill_attention_backend"),
                            compat.arg(view, "decode_attention_backend")) if b}
    if backends - {BACKEND_NAME}:
        add("sglang.layerwise_backend", f"attention backend(s) {sorted(backends)} cannot serve layerwise "
            "prefill offload", f"drop --attention-backend (the plugin selects {BACKEND_NAME}) or pass "
            f"--attention-backend {BACKEND_NAME}")
    if config.sparse_decode is not None:
        add("sglang.layerwise_sparse_decode", "sparse decode offload and layerwise prefill offload are both on "
            "in one server", "enable layerwise prefill offload on the prefill node and sparse decode offload "
            "on the decode node")
    algo = compat.arg(view, "speculative_algorithm")
    if algo:
        eagle_topk = compat.arg(view, "speculative_eagle_topk")
        if str(algo).upper() not in ("EAGLE", "NEXTN"):
            add("sglang.layerwise_speculative", f"speculative algorithm {algo!r} with layerwise prefill offload: "
                "only the NextN / MTP draft (EAGLE / NEXTN) is wired (its layer gets a dedicated buffer)",
                "use --speculative-algorithm NEXTN, or drop the speculative decoding flags")
        if eagle_topk is not None and int(eagle_topk) != 1:
            add("sglang.layerwise_speculative", f"--speculative-eagle-topk {eagle_topk}: a draft tree; layerwise "
                "prefill offload is served and tested with draft chains", "use --speculative-eagle-topk 1")
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        if compat.arg(view, flag):
            add("sglang.layerwise_tbo", f"--{flag.replace('_', '-')} interleaves forwards layer by layer",
                f"drop --{flag.replace('_', '-')}")
    if compat.arg(view, "enable_hierarchical_cache"):
        add("sglang.layerwise_hicache", "--enable-hierarchical-cache is on (HiCache drives the pool's layer "
            "counter)", "drop --enable-hierarchical-cache")
    if (compat.arg(view, "pp_size") or 1) > 1:
        add("sglang.layerwise_pp", f"pp_size={view.pp_size}: the layer buffers are planned per model, not per "
            "pipeline stage", "set --pp-size 1 with layerwise prefill offload")
    page = compat.arg(view, "page_size")
    if lw.store_block_tokens is not None and page is not None and lw.store_block_tokens != page:
        add("sglang.layerwise_block_tokens", f"store_block_tokens={lw.store_block_tokens} but the KV page "
            f"size is {page} (the SGLang pool stores one object per page)", "drop store_block_tokens")
    store = lw.effective_store_backend(str(compat.arg(view, "device") or "cpu"))
    if (lw.shared_buffers is not None and store == "memcache"
            and importlib.util.find_spec("memcache_hybrid") is None):
        how = "" if lw.store_backend else " (the default on an Ascend NPU)"
        add("sglang.layerwise_store", f"store_backend 'memcache'{how} but memcache-hybrid is not installed",
            "pip install memcache-hybrid memfabric-hybrid on the Ascend node, or use \"store_backend\": "
            "\"local\" on a CPU")
    return out
