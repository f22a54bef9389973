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
``memory.insufficient``          one request's hot buffers and the host pool do not fit in the
                                 memory available now (:mod:`...memory_budget`); how many
                                 requests get hot buffers is decided when SGLang sizes its KV
                                 pool, from the same budget (:mod:`..mem_cache.sizing.sparse_decode`)
===============================  ==============================================================

Speculative decoding with sparse decode offload (the NextN / MTP chain of ``steps + 1``
verify rows, eager decode off the CPU, no overlap scheduling) is decided by the deployment
facts: rule ``sglang.sparse_decode_speculative`` in ``config.violations``.

Defaults resolved here, so the published config (what every process runs) states
them and the log shows them once: ``hot_tokens`` (2 x top-k rounded up to the page
size), ``layerwise_prefill.store_backend`` (``memcache`` on an Ascend NPU, ``local``
elsewhere).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, List, Optional, Tuple

from ... import config as cfg
from ... import memory_budget
from ...rules import violation
from .. import compat

logger = logging.getLogger(__name__)

__all__ = ["resolve_defaults", "launch_violations", "sparse_decode_allocations", "MIN_HOT_ROWS"]

# Hot-buffer rows of the smallest server: one request and SGLang's padding request row.
MIN_HOT_ROWS = 2

# HF config fields each feature's pool reads.
_DSA_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "num_hidden_layers")


def resolve_defaults(config: cfg.OffloadConfig, deployment: cfg.Deployment) -> Tuple[cfg.OffloadConfig, List[str]]:
    """``(config with its defaults made explicit, one line per default applied)``."""
    notes: List[str] = []
    sd = config.sparse_decode
    if sd is not None and sd.hot_tokens is None and deployment.index_topk is not None:
        rows = deployment.speculative_rows if deployment.speculative_method and deployment.speculative_rows else 1
        hot = cfg.default_hot_tokens(deployment.index_topk, deployment.page_size, rows_per_request=rows)
        factor = "2" if rows <= 2 else f"{rows} verify rows"
        notes.append(
            f"sparse_decode.hot_tokens = {hot} ({factor} x top-k {deployment.index_topk}, rounded up to "
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


def sparse_decode_allocations(
    hf_config: Any,
    sd: cfg.SparseDecodeOffloadConfig,
    *,
    hot_tokens: int,
    rows: int,
    rows_source: str,
    host_tokens: Optional[int],
    host_tokens_source: str,
    device: str,
) -> List[memory_budget.Allocation]:
    """The hot buffers (device) and the host pool (host) of sparse decode offload."""
    layers = int(hf_config.num_hidden_layers)
    row_bytes = (int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)) * 2  # bf16
    items = [
        memory_budget.Allocation(
            "hot buffers",
            "device",
            layers * rows * hot_tokens * row_bytes,
            f"{layers} layers x {rows} rows ({rows_source}) x {hot_tokens} hot_tokens x {row_bytes} B",
            "hot_tokens or --max-running-requests",
        )
    ]
    if host_tokens is not None:
        items.append(
            memory_budget.Allocation(
                "host pool",
                "host",
                layers * host_tokens * row_bytes,
                f"{layers} layers x {host_tokens} tokens ({host_tokens_source}) x {row_bytes} B",
                "host_pool_tokens or --max-total-tokens",
            )
        )
    return items


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


def _sparse_decode_memory(
    sd: cfg.SparseDecodeOffloadConfig, view: Any, hf_config: Any, deployment: cfg.Deployment
) -> List[cfg.Violation]:
    spec_tokens = (
        compat.arg(view, "speculative_num_draft_tokens") if compat.arg(view, "speculative_algorithm") else None
    )
    verify_rows = int(spec_tokens) if spec_tokens else 1
    hot = sd.hot_tokens or cfg.default_hot_tokens(
        int(hf_config.index_topk), deployment.page_size, rows_per_request=verify_rows
    )
    if hot < 1:
        return []  # reported by the range rule
    # The pool sizing caps the running requests to the hot buffers that fit SGLang's KV
    # budget (offload_sizing.py); what must fit here is the smallest server: one request.
    rows = MIN_HOT_ROWS
    rows_source = "one request + its padding row: more requests get hot buffers as SGLang's KV budget allows"
    total = compat.arg(view, "max_total_tokens")
    if sd.host_pool_tokens is not None:
        host_tokens, host_source = sd.host_pool_tokens, "host_pool_tokens"
    elif total:
        host_tokens, host_source = int(total), "--max-total-tokens"
    else:
        host_tokens, host_source = None, ""
    items = sparse_decode_allocations(
        hf_config,
        sd,
        hot_tokens=hot,
        rows=rows,
        rows_source=rows_source,
        host_tokens=host_tokens,
        host_tokens_source=host_source,
        device=deployment.device,
    )
    found = memory_budget.check(items, deployment.device)
    if not found:
        logger.info(
            "sglang-ascend-offload: sparse decode offload plans %s",
            "; ".join(f"{i.name} {memory_budget.format_bytes(i.nbytes)} ({i.where})" for i in items),
        )
    return found
