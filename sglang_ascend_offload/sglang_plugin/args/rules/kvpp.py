"""SGLang-side startup rules of KVPP (run by :mod:`..resolution`).

The engine-agnostic limits of KVPP (no DCP, off on decode-only and P/D prefill nodes,
not with layerwise prefill offload, eager or piecewise graphs, non-hybrid MLA/DSA
models, speculative decoding only MTP / DSpark with a fixed token count, a TP x PCP
group > 1) are ``kvpp.*`` rules in ``config.py`` (so ``check-config`` gives the same
verdict).
So are DP attention (``sglang.kvpp_dp_attention``) and pipeline parallelism
(``sglang.kvpp_pp``), which the deployment facts describe. These are about SGLang
arguments the facts do not describe, which the SGLang pool
(:mod:`...mem_cache.pool.kvpp`) cannot serve:

===============================  ===============================================================
rule                             when / why
===============================  ===============================================================
``sglang.kvpp_backend``          an attention backend other than ``ascend_offload``: the pool is
                                 built only for it and reads its forward metadata
``sglang.kvpp_tbo``              two-batch overlap / PD-multiplexing: interleaved forwards break the
                                 one-layer-ahead broadcast order (a collective on every rank)
``sglang.kvpp_hicache``          ``--enable-hierarchical-cache`` (it drives the layer counter)
===============================  ===============================================================
"""

from __future__ import annotations

from typing import Any, List

from .... import config as cfg
from ....rules import violation
from ... import compat
from ...names import BACKEND_NAME

__all__ = ["kvpp_violations"]


def kvpp_violations(config: cfg.OffloadConfig, view: Any) -> List[cfg.Violation]:
    """Every rule above that ``view`` (the resolved server arguments) breaks."""
    if config.kvpp is None:
        return []
    out: List[cfg.Violation] = []

    def add(rule: str, problem: str, fix: str) -> None:
        out.append(violation(rule, problem, fix))

    backends = {
        b
        for b in (
            compat.arg_or(view, "attention_backend", None),
            compat.arg_or(view, "prefill_attention_backend", None),
            compat.arg_or(view, "decode_attention_backend", None),
        )
        if b
    }
    if backends - {BACKEND_NAME}:
        add(
            "sglang.kvpp_backend",
            f"attention backend(s) {sorted(backends)} cannot serve KVPP",
            f"drop --attention-backend (the plugin selects {BACKEND_NAME}) or pass --attention-backend {BACKEND_NAME}",
        )
    get = lambda name, default=None: compat.arg_or(view, name, default)  # noqa: E731
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        if get(flag, False):
            add(
                "sglang.kvpp_tbo",
                f"--{flag.replace('_', '-')} interleaves forwards layer by layer",
                f"drop --{flag.replace('_', '-')}",
            )
    if get("enable_hierarchical_cache", False):
        add(
            "sglang.kvpp_hicache",
            "--enable-hierarchical-cache is on (HiCache drives the pool's layer counter)",
            "drop --enable-hierarchical-cache",
        )
    return out
