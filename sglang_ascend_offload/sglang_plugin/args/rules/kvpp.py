"""SGLang-side startup rules of KVPP (run by :mod:`..resolution`).

The engine-agnostic limits of KVPP (no DCP, off on decode-only and P/D prefill nodes,
not with layerwise prefill offload, eager or piecewise graphs, non-hybrid MLA/DSA
models, speculative decoding only MTP / DSpark with a fixed token count, a TP x PCP
group > 1) are ``kvpp.*`` rules in ``config.py`` (so ``check-config`` gives the same
verdict).
These are about what the SGLang pool (:mod:`...mem_cache.pool.kvpp`) can serve:

===============================  ===============================================================
rule                             when / why
===============================  ===============================================================
``sglang.kvpp_backend``          an attention backend other than ``ascend_offload``: the pool is
                                 built only for it and reads its forward metadata
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

from .... import config as cfg
from ... import compat
from ..deployment import attention_parallel
from ...names import BACKEND_NAME

__all__ = ["kvpp_violations", "RULES"]

RULES = ("sglang.kvpp_backend", "sglang.kvpp_dp_attention", "sglang.kvpp_tbo", "sglang.kvpp_hicache",
         "sglang.kvpp_pp")


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
