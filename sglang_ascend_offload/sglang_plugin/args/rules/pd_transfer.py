"""Startup rules of the ``ascend_offload`` P/D backend and the runtime pair check.

Startup (the plugin's validation step, before any process is spawned):
:func:`pd_violations` adds the SGLang-side rules below to ``config.violations``,
and :func:`with_pd_facts` gives ``config.violations`` the P/D facts of this server
(the transfer backend the user chose, the peer's TP size where configured).

======================================  ============================================================
rule                                    when
======================================  ============================================================
``sglang.pd_backend``                   ``--enable-pd-transfer`` with another transfer backend, or
                                        ``--disaggregation-transfer-backend ascend_offload`` without it
``sglang.pd_attention_backend``         an attention backend other than ``ascend_offload`` (the
                                        backend moves that backend's DSA pools)
``sglang.pd_engine_unavailable``        ``engine=mooncake`` without the Mooncake transfer engine
``sglang.pd_unsupported``               a P/D feature the backend does not provide: decode radix
                                        cache, decode host receive, HiSparse, ``prefill_complete``
                                        allocation, staging buffers, role switch, optimistic prefill
                                        with layerwise prefill offload
``sglang.pd_cpu_retraction_backup``     a CPU decode server without
                                        ``--disaggregation-decode-retraction-backup cpu_tensor``
                                        (SGLang's default backup registers CUDA host memory,
                                        ``mem_cache/pool_host/common.py``)
======================================  ============================================================

What the deployment facts decide is ``config.violations``'s (so ``check-config`` gives the
same verdict): decode attention TP > 1 (``pd_transfer.decode_tp``: served with sparse
decode offload, whose host pool the decode TP ranks share; refused without it, the
device main KV is per rank), MemFabric off an NPU (``sglang.pd_engine_device``), PP / CP /
DCP (``sglang.pd_parallel``) and speculative decoding on a layerwise prefill or on a
decode with attention TP > 1 (``sglang.pd_speculative``: the draft layer is per-rank
device KV, while each rank pulls only its range of the main KV).

At run time the pair is checked when the two sides meet (:func:`pair_problems`): the
decode manager runs it on the prefill's parallel info (SGLang's ``/route`` answer)
and fails every request to an invalid prefill with all reasons; the protocol's
handshake repeats the layout / engine / protocol / topology checks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional

from .... import config as cfg
from ....rules import violation
from ... import compat

BACKEND_NAME = "ascend_offload"
#: What ``--disaggregation-transfer-backend ascend_offload`` resolves to inside SGLang
#: (``TransferBackend`` is a closed Enum; see :mod:`...disaggregation.ascend_offload.install`).
SGLANG_BACKEND = "ascend"


def raw_transfer_backend(server_args: Any) -> Optional[str]:
    """The ``--disaggregation-transfer-backend`` the user gave (before our rewrite)."""
    raw = getattr(server_args, "_raw_input", None) or {}
    if "disaggregation_transfer_backend" in raw:
        return raw["disaggregation_transfer_backend"]
    return getattr(server_args, "disaggregation_transfer_backend", None)


def chose_backend(server_args: Any) -> bool:
    return raw_transfer_backend(server_args) == BACKEND_NAME


def with_pd_facts(deployment: cfg.Deployment, config: cfg.OffloadConfig, server_args: Any) -> cfg.Deployment:
    """``deployment`` with the P/D facts ``config.violations`` needs.

    The transfer backend is the one the user chose (``ascend_offload``, not SGLang's
    internal ``ascend``); ``peer_tp`` / ``peer_protocol`` come from the P/D config when
    it names them (fields ``peer_tp`` / ``peer_protocol``, where the config has them).
    """
    changes = {}
    if deployment.pd_role != "colocated" and chose_backend(server_args):
        changes["disaggregation_transfer_backend"] = BACKEND_NAME
    pd = config.pd_transfer
    if pd is not None:
        for name in ("peer_tp", "peer_protocol"):
            value = getattr(pd, name, None)
            if value is not None:
                changes[name] = value
    return dataclasses.replace(deployment, **changes) if changes else deployment


def _violation(rule: str, problem: str, fix: str) -> cfg.Violation:
    return violation(rule, problem, fix)


def missing_config_violation() -> cfg.Violation:
    return _violation(
        "sglang.pd_backend",
        "--disaggregation-transfer-backend ascend_offload without --enable-pd-transfer",
        "add --enable-pd-transfer (settings: --pd-transfer-config)",
    )


def mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401, PLC0415 - availability probe
    except ImportError:
        return False
    return True


def pd_violations(config: cfg.OffloadConfig, server_args: Any, view: Any = None) -> List[cfg.Violation]:
    """The SGLang-side P/D rules (module table) for ``server_args``; ``view``: their
    resolved values (SGLang's resolving view; looked up when not given)."""
    if view is None:
        from sglang.srt.arg_groups.model_override_base import resolving_view

        view = resolving_view(server_args)
    out: List[cfg.Violation] = []
    pd = config.pd_transfer
    role = str(compat.arg_or(view, "disaggregation_mode", "null"))
    if pd is None:
        if role in ("prefill", "decode") and chose_backend(server_args):
            out.append(missing_config_violation())
        return out
    backend = raw_transfer_backend(server_args)
    if role in ("prefill", "decode") and backend != BACKEND_NAME:
        out.append(
            _violation(
                "sglang.pd_backend",
                f"--enable-pd-transfer with --disaggregation-transfer-backend {backend!r}",
                f"pass --disaggregation-transfer-backend {BACKEND_NAME}",
            )
        )
    backends = {
        b
        for b in (
            view.attention_backend,
            compat.arg_or(view, "prefill_attention_backend", None),
            compat.arg_or(view, "decode_attention_backend", None),
        )
        if b
    }
    if backends != {BACKEND_NAME}:
        out.append(
            _violation(
                "sglang.pd_attention_backend",
                f"attention backend(s) {sorted(backends)}",
                f"drop --attention-backend (DSA models get {BACKEND_NAME}) or pass --attention-backend {BACKEND_NAME}",
            )
        )
    device = str(compat.arg_or(view, "device", None) or "")
    if pd.engine == "mooncake" and not mooncake_available():
        out.append(
            _violation(
                "sglang.pd_engine_unavailable",
                "the mooncake package is not importable",
                "pip install mooncake-transfer-engine-non-cuda (CPU/TCP) or "
                "mooncake-transfer-engine; on Debian apt-get install libibverbs1 librdmacm1",
            )
        )
    unsupported = []
    if role == "decode" and compat.arg_or(view, "disaggregation_decode_enable_radix_cache", False):
        unsupported.append("--disaggregation-decode-enable-radix-cache")
    if float(compat.arg_or(view, "disaggregation_decode_host_receive_threshold", 1.0) or 1.0) < 1:
        unsupported.append("--disaggregation-decode-host-receive-threshold < 1")
    if compat.arg_or(view, "enable_hisparse", False):
        unsupported.append("--enable-hisparse")
    if compat.arg_or(view, "disaggregation_decode_allocation_policy", "early") != "early":
        unsupported.append(f"--disaggregation-decode-allocation-policy {view.disaggregation_decode_allocation_policy}")
    if compat.arg_or(view, "enable_pd_role_switch", False):
        unsupported.append("--enable-pd-role-switch")
    if os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").lower() in ("1", "true", "yes"):
        unsupported.append("SGLANG_DISAGG_STAGING_BUFFER")
    if (
        config.layerwise_prefill is not None
        and role == "prefill"
        and int(compat.arg_or(view, "optimistic_prefill_attempts", 0) or 0) > 0
    ):
        unsupported.append(
            f"--optimistic-prefill-attempts {view.optimistic_prefill_attempts} with layerwise "
            "prefill offload (a request computed before its decode bootstrapped is sent after "
            "the forward, when its shared layer buffers hold other layers)"
        )
    if unsupported:
        out.append(
            _violation(
                "sglang.pd_unsupported",
                "not supported with the ascend_offload P/D backend: " + "; ".join(unsupported),
                "drop these settings",
            )
        )
    if (
        role == "decode"
        and device == "cpu"
        and compat.arg_or(view, "disaggregation_decode_retraction_backup", None) != "cpu_tensor"
    ):
        out.append(
            _violation(
                "sglang.pd_cpu_retraction_backup",
                f"retraction backup {compat.arg(view, 'disaggregation_decode_retraction_backup')!r} "
                "on a CPU decode server",
                "pass --disaggregation-decode-retraction-backup cpu_tensor",
            )
        )
    return out


def pair_problems(
    pd: cfg.PDTransferConfig,
    *,
    role: str,
    own_tp: int,
    peer_tp: int,
    device: str,
    dp: int = 1,
    soc: Optional[str] = None,
    peer_cp: int = 1,
    peer_pp: int = 1,
) -> List[str]:
    """Every reason why this server cannot pair with a peer of ``peer_tp`` (empty = fine).

    Runs ``config.violations``'s ``pd_transfer`` rules with the peer's facts, plus
    the peer's PP / CP, which the backend does not support.
    """
    deployment = cfg.Deployment(
        device=device if device in ("npu", "cuda", "cpu") else "cpu",
        soc=soc,
        tp=own_tp,
        dp=dp,
        pd_role=role,
        peer_tp=peer_tp,
    )
    # pd_transfer.decode_tp is this server's own startup rule (it needs its sparse decode
    # config, which the pair check does not have), not a property of the pair
    found = [
        v
        for v in cfg.violations(cfg.OffloadConfig(pd_transfer=pd), deployment)
        if v.rule.startswith("pd_transfer.") and v.rule != "pd_transfer.decode_tp"
    ]
    out = [f"[{v.rule}] {v.problem} -> {v.fix}" for v in found]
    if peer_cp > 1 or peer_pp > 1:
        out.append(f"[sglang.pd_parallel] peer has attention CP {peer_cp}, PP {peer_pp} -> use TP only")
    return out
