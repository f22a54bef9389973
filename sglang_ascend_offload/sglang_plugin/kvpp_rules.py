"""SGLang-side startup rules of KVPP (run by :mod:`.resolution`).

The engine-agnostic limits of KVPP (no DCP, off on decode-only nodes, eager or
piecewise graphs, non-hybrid MLA/DSA models, speculative decoding only MTP / DSpark
with a fixed token count, a TP x PCP group > 1) are ``kvpp.*`` rules in ``config.py``.
These are about what the SGLang pool (:mod:`.kvpp_pool`) can serve:

===============================  ===============================================================
rule                             when / why
===============================  ===============================================================
``sglang.kvpp_backend``          an attention backend other than ``ascend_offload``: the pool is
                                 built only for it and reads its forward metadata
``sglang.kvpp_layerwise``        layerwise prefill offload on as well: both replace the KV pool
                                 with their own layer placement (shared device buffers saved to a
                                 host store vs. owner ranks + scratch); no combined pool exists
``sglang.kvpp_pd_prefill``       ``--disaggregation-mode prefill``: the P/D transfer backends send
                                 every layer from the prefill rank paired with a decode rank; under
                                 KVPP a rank keeps only its owned layers (the others live in a
                                 scratch buffer the next layer overwrites), so a sender would need
                                 the owner of each layer -- not built
``sglang.kvpp_dp_attention``     DP attention: the replicated domain is the attention-TP group,
                                 and DP ranks run different batches (padding, idle forwards)
``sglang.kvpp_tbo``              two-batch overlap / PD-multiplexing: interleaved forwards break the
                                 one-layer-ahead broadcast order (a collective on every rank)
``sglang.kvpp_hicache``          ``--enable-hierarchical-cache`` (it drives the layer counter)
``sglang.kvpp_pp``               pipeline parallelism: per-stage groups are not wired / tested
===============================  ===============================================================
"""

from __future__ import annotations

from typing import Any, List

from .. import config as cfg
from . import compat
from .deployment import attention_parallel
from .names import BACKEND_NAME

__all__ = ["kvpp_violations", "RULES"]

RULES = ("sglang.kvpp_backend", "sglang.kvpp_layerwise", "sglang.kvpp_pd_prefill", "sglang.kvpp_dp_attention",
         "sglang.kvpp_tbo", "sglang.kvpp_hicache", "sglang.kvpp_pp")


def kvpp_violations(config: cfg.OffloadConfig, view: Any) -> List[cfg.Violation]:
    """Every rule above that ``view`` (the resolved server arguments) breaks."""
    if config.kvpp is None:
        return []
    out: List[cfg.Violation] = []

    def add(rule: str, problem: str, fix: str) -> None:
        assert rule in RULES, rule
        out.append(cfg.Violation(rule, problem, fix))

    backends = {b for b in (compat.arg_or(view, "attention_backend", None),
                            compat.arg_or(view, "prefill_attention_backend", None),
                            compat.arg_or(view, "decode_attention_backend", None)) if b}
    if backends - {BACKEND_NAME}:
        add("sglang.kvpp_backend", f"attention backend(s) {sorted(backends)} cannot serve KVPP",
            f"drop --attention-backend (the plugin selects {BACKEND_NAME}) or pass --attention-backend "
            f"{BACKEND_NAME}")
    if config.layerwise_prefill is not None:
        add("sglang.kvpp_layerwise", "KVPP and layerwise prefill offload are both on: each replaces the KV pool "
            "with its own layer placement and no combined pool exists",
            "enable one of them (layerwise prefill offload on a P/D prefill node, KVPP on a colocated server)")
    if str(compat.arg_or(view, "disaggregation_mode", "null") or "null") == "prefill":
        add("sglang.kvpp_pd_prefill", "--disaggregation-mode prefill with KVPP: the P/D transfer backends send "
            "every layer from the paired prefill rank, which under KVPP keeps only its owned layers",
            "run KVPP on a colocated server, or drop --enable-kvpp on the prefill node")
    get = lambda name, default=None: compat.arg_or(view, name, default)  # noqa: E731
    attn_dp, _ = attention_parallel(get)
    if attn_dp > 1 and (get("enable_dp_attention", False) or int(get("attn_dp_size", 1) or 1) > 1):
        add("sglang.kvpp_dp_attention", f"DP attention with {attn_dp} attention-DP groups",
            "drop --enable-dp-attention / --attn-dp-size with KVPP")
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        if get(flag, False):
            add("sglang.kvpp_tbo", f"--{flag.replace('_', '-')} interleaves forwards layer by layer",
                f"drop --{flag.replace('_', '-')}")
    if get("enable_hierarchical_cache", False):
        add("sglang.kvpp_hicache", "--enable-hierarchical-cache is on (HiCache drives the pool's layer counter)",
            "drop --enable-hierarchical-cache")
    if int(get("pp_size", 1) or 1) > 1:
        add("sglang.kvpp_pp", f"pp_size={view.pp_size}: per-stage KVPP groups are not wired in the SGLang plugin",
            "set --pp-size 1 with KVPP")
    return out
