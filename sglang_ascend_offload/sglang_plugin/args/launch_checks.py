"""Startup checks that need SGLang's resolved arguments and the model, and the
defaults they resolve (run by :mod:`.resolution` before any process starts).

Every launch that would fail later for a reason known at startup is refused here,
with every problem listed:

===============================  ==============================================================
rule                             when
===============================  ==============================================================
``sglang.model_config``          a feature needs model facts the HF config lacks (a DSA
                                 architecture without its indexer fields, an MLA model without
                                 ``kv_lora_rank`` ...): the pools would fail after the weights load
``memory.insufficient``          the smallest server's hot buffers (the hot-buffer plan for one
                                 request: its hot row, the padding slot, the sink row, a P/D
                                 decode's pre-allocation slots, with their residency tables)
                                 and the host pool do not fit in the memory available now
                                 (:mod:`...memory_budget`); how many requests get hot buffers
                                 is decided when SGLang sizes its KV pool, from the same plan
                                 (:mod:`..mem_cache.sizing.sparse_decode`)
===============================  ==============================================================

Speculative decoding with sparse decode offload (the NextN / MTP chain of ``steps + 1``
verify rows, eager decode off the CPU, no overlap scheduling) is decided by the deployment
facts: rule ``sglang.sparse_decode_speculative`` in ``config.violations``.

Defaults resolved here, so the published config (what every process runs) states
them and the log shows them once: ``hot_tokens`` (the hot-buffer plan's default,
``sparse_decode.sizing.default_hot_tokens``), ``layerwise_prefill.store_backend``
(``memcache`` on an Ascend NPU, ``local`` elsewhere).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, List, Optional, Tuple

from ... import config as cfg
from ... import memory_budget
from ...rules import violation
from ...sparse_decode import sizing as hot_sizing
from ...sparse_decode.sizing import HotBufferPlan, pre_alloc_slots
from .. import compat
from ..mem_cache.sizing.sparse_decode import memory_allocations

logger = logging.getLogger(__name__)

__all__ = ["resolve_defaults", "launch_violations", "smallest_hot_plan"]

# HF config fields each feature's pool reads.
_DSA_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "num_hidden_layers")


def resolve_defaults(config: cfg.OffloadConfig, deployment: cfg.Deployment) -> Tuple[cfg.OffloadConfig, List[str]]:
    """``(config with its defaults made explicit, one line per default applied)``."""
    notes: List[str] = []
    sd = config.sparse_decode
    if sd is not None and sd.hot_tokens is None and deployment.index_topk is not None:
        hot = hot_sizing.resolve_hot_tokens(None, deployment.index_topk, deployment.page_size)
        notes.append(
            f"sparse_decode.hot_tokens = {hot} (2 x top-k {deployment.index_topk}, rounded up to "
            f"the page size {deployment.page_size or 1})"
        )
        config = dataclasses.replace(config, sparse_decode=dataclasses.replace(sd, hot_tokens=hot))
    lw = config.layerwise_prefill
    if lw is not None and lw.store_backend is None:
        store = lw.effective_store_backend(deployment.device)
        notes.append(f"layerwise_prefill.store_backend = {store!r} (the default on a {deployment.device} device)")
        config = dataclasses.replace(config, layerwise_prefill=dataclasses.replace(lw, store_backend=store))
    return config, notes


def _missing(hf_config: Any, names) -> List[str]:
    # HF config fields are optional by nature: absence is exactly what this reports.
    return [n for n in names if getattr(hf_config, n, None) is None]


def launch_violations(
    config: cfg.OffloadConfig, view: Any, hf_config: Any, deployment: Optional[cfg.Deployment]
) -> List[cfg.Violation]:
    """Every rule of the module docstring that this launch breaks."""
    out: List[cfg.Violation] = []
    features = [name for name in ("sparse_decode", "layerwise_prefill", "kvpp") if getattr(config, name) is not None]
    if not features or hf_config is None:
        return out
    missing = _missing(hf_config, _MLA_FIELDS)
    if config.sparse_decode is not None:
        missing += _missing(hf_config, _DSA_FIELDS)
    if missing:
        archs = ", ".join(getattr(hf_config, "architectures", None) or ["?"])
        out.append(
            violation(
                "sglang.model_config",
                f"{', '.join(features)} need(s) the model config fields {', '.join(missing)}, which the model "
                f"({archs}) does not define",
                "serve a complete DeepSeek-V3.2-style (MLA + lightning indexer) config.json, or disable the feature",
            )
        )
    sd = config.sparse_decode
    if sd is not None and not missing and deployment is not None:
        out += _sparse_decode_memory(sd, view, hf_config, deployment)
    return out


def smallest_hot_plan(
    sd: cfg.SparseDecodeOffloadConfig, view: Any, hf_config: Any, deployment: cfg.Deployment
) -> HotBufferPlan:
    """The hot-buffer plan of the smallest server this launch can be: one running request
    (the device-budget split decides how many more fit), with this launch's hot_tokens,
    verify rows, page size and P/D pre-allocation slots."""
    return HotBufferPlan.build(
        configured_hot_tokens=sd.hot_tokens,
        top_k=int(hf_config.index_topk),
        page_size=deployment.page_size,
        verify_rows=deployment.verify_rows,
        layers=int(hf_config.num_hidden_layers),
        row_dim=int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim),
        running_requests=1,
        pre_alloc_slots=pre_alloc_slots(
            compat.arg(view, "disaggregation_mode"), compat.arg(view, "disaggregation_decode_extra_slots")
        ),
    )


def _sparse_decode_memory(
    sd: cfg.SparseDecodeOffloadConfig, view: Any, hf_config: Any, deployment: cfg.Deployment
) -> List[cfg.Violation]:
    if sd.hot_tokens is not None and sd.hot_tokens < 1:
        return []  # reported by the range rule
    hot_plan = smallest_hot_plan(sd, view, hf_config, deployment)
    total = compat.arg(view, "max_total_tokens")
    if sd.host_pool_tokens is not None:
        host_tokens, host_source = sd.host_pool_tokens, "host_pool_tokens"
    elif total:
        host_tokens, host_source = int(total), "--max-total-tokens"
    else:
        host_tokens, host_source = None, ""
    items = memory_allocations(hot_plan, host_tokens, host_source)
    found = memory_budget.check(items, deployment.device)
    if not found:
        logger.info(
            "sglang-ascend-offload: sparse decode offload plans %s",
            "; ".join(f"{i.name} {memory_budget.format_bytes(i.nbytes)} ({i.where})" for i in items),
        )
    return found
