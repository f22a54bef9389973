"""SGLang-side startup rules of sparse decode offload (run by :mod:`..resolution`).

The rules the deployment facts decide (model, KV dtype, parallelism, SoC, hot_tokens,
speculative decoding, decode graphs ...) are ``sparse_decode.*`` / ``sglang.*`` rules in
``config.py``, so ``check-config`` gives the same verdict on the facts alone. These need
SGLang arguments the facts do not describe, the model's config or what this machine has
installed; the launch validation runs them before any process starts, and
``check-config --launch`` runs them the same way:

=========================================  =========================================================
rule                                       when
=========================================  =========================================================
``sglang.attention_backend``               an attention backend other than ``ascend_offload``
                                           (``--attention-backend`` or a per-phase one)
``sglang.fused_unavailable``               a fused operator the plan selects (the NPU default, or
                                           asked for) is not built here: every missing op, the
                                           build command
``sparse_decode.fused_copy_sfa_engine``    the fused Copy-SFA asked for (``fused_copy_sfa: true`` or
                                           ``ops: "fused"``) where it cannot serve the engine the
                                           pool builds: more than 14 verify rows per request, a top-k
                                           the kernels do not take, a host pool without a tensor view
                                           (an NPU with attention TP > 1: the MemFabric group pool)
``sglang.ops_unavailable``                 a separate operator has no usable rung here
``sglang.hisparse``                        ``--enable-hisparse`` as well (one sparse-attention offload)
``sglang.npu_sparse_kv_offload``           SGLang's in-tree NPU offload is on as well
                                           (``SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD``)
``sparse_decode.host_pool_tokens``         ``host_pool_tokens`` below SGLang's slot space
                                           (``--max-total-tokens`` + one page); without
                                           ``--max-total-tokens`` SGLang's KV-pool sizing decides the
                                           slot space and the pool applies this rule
                                           (:func:`host_pool_tokens_violation`)
``sparse_decode.indexer_int8_head_dim``    ``indexer_dtype: "int8"`` with an ``index_head_dim`` that is
                                           not a power of two (the Hadamard rotation)
=========================================  =========================================================

The operator plan checked here is the one the engine builds (``sparse_decode/engine.py``):
the same settings, the served device, the verify rows per request, the served residency
shape (``hot_tokens`` resolved as the hot-buffer plan resolves it, the model's top-k)
and the host pool's kind. So a plan the engine would refuse with
``OpSelectionError`` at its first allocation is refused here, before any scheduler starts.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

from .... import config as cfg
from ....rules import RULES, violation
from ... import compat
from ...names import BACKEND_NAME

__all__ = ["sparse_decode_violations", "host_pool_tokens_violation", "slot_space_of", "operator_plan"]


def sparse_decode_violations(
    config: cfg.OffloadConfig, view: Any, deployment: Optional[cfg.Deployment], hf_config: Any
) -> List[cfg.Violation]:
    """Every rule above that this launch breaks (``view``: SGLang's resolved arguments;
    ``deployment``: the facts read from them, ``None`` when unreadable, already reported)."""
    sd = config.sparse_decode
    if sd is None:
        return []
    out: List[cfg.Violation] = []
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
        out.append(
            violation(
                "sglang.attention_backend",
                f"attention backend(s) {sorted(backends)} cannot serve sparse decode offload",
                f"drop --attention-backend (the plugin selects {BACKEND_NAME}) or pass "
                f"--attention-backend {BACKEND_NAME}",
            )
        )
    if deployment is not None:
        out += _ops_violations(sd, deployment, hf_config)
    if compat.arg(view, "enable_hisparse"):
        out.append(
            violation(
                "sglang.hisparse",
                "--enable-hisparse is on as well",
                "use one sparse-attention offload: drop --enable-hisparse",
            )
        )
    if os.environ.get("SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD", "0") not in ("", "0", "false", "False"):
        out.append(
            violation(
                "sglang.npu_sparse_kv_offload",
                "SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD is set (SGLang's in-tree NPU offload)",
                "unset SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD",
            )
        )
    total = compat.arg(view, "max_total_tokens")
    if total and deployment is not None:
        found = host_pool_tokens_violation(sd, int(total), deployment.page_size or 1)
        out += [found] if found is not None else []
    out += _int8_head_dim(sd, hf_config)
    return out


def operator_plan(sd: cfg.SparseDecodeOffloadConfig, deployment: cfg.Deployment, hf_config: Any):
    """The :class:`~....sparse_decode.op_selection.OpPlan` the served engine builds for
    ``sd`` on ``deployment`` (what its pool hands it: the device, the verify rows per
    request, the residency shape where the model's top-k is known, the host pool's kind),
    with this machine's availability of every operator."""
    from ....sparse_decode import op_selection

    shape = cfg.residency_shape(sd, deployment) if _top_k(hf_config) is not None else {}
    return op_selection.select_for_config(
        sd,
        deployment.device,
        rows_per_request=deployment.verify_rows,
        tensor_pool=deployment.host_pool_tensor_view,
        **shape,
    )


def _top_k(hf_config: Any) -> Optional[int]:
    return getattr(hf_config, "index_topk", None)  # an HF config field: absent outside DSA models


def _ops_violations(
    sd: cfg.SparseDecodeOffloadConfig, deployment: cfg.Deployment, hf_config: Any
) -> List[cfg.Violation]:
    """The operator plan's problems (its deployment-scope ones are ``config.violations``'
    to report, on the same settings, as check-config does), then each stage's separate op
    on the rung the plan names."""
    from ....ops import registry
    from ....sparse_decode import op_selection

    out: List[cfg.Violation] = []
    registry.ensure_registered()
    plan = operator_plan(sd, deployment, hf_config)
    out += [violation(p.rule, p.problem, p.fix) for p in plan.problems if RULES[p.rule].scope != "deployment"]
    if not plan.problems:
        op_selection.log_plan(plan, "sglang-ascend-offload: sparse decode")
    for stage in plan.rungs:  # each stage's separate op on the rung the plan names (problems: above)
        try:
            if stage.problem is None:
                registry.select(stage.op, stage.rung)
        except (registry.OpUnavailableError, KeyError, ValueError) as exc:
            out.append(
                violation(
                    "sglang.ops_unavailable",
                    f"ops={sd.ops!r}: {exc}",
                    'use "ops": "auto" or install what the message names',
                )
            )
    return out


def slot_space_of(total_tokens: int, page_size: int) -> int:
    """SGLang's slot space for ``total_tokens``: its pages plus the padding page (page 0),
    the token slots the sparse decode host pool keeps."""
    return (int(total_tokens) // int(page_size) + 1) * int(page_size)


def host_pool_tokens_violation(
    sd: cfg.SparseDecodeOffloadConfig, total_tokens: int, page_size: int
) -> Optional[cfg.Violation]:
    """``sparse_decode.host_pool_tokens`` for SGLang's token capacity ``total_tokens``: the
    host pool keeps SGLang's slot space (:func:`slot_space_of`), so a configured
    ``host_pool_tokens`` below it is refused (``None``: it fits, or is unset). The launch
    applies it where ``--max-total-tokens`` gives the capacity, the pool where SGLang's
    KV-pool sizing decided it."""
    slot_space = slot_space_of(total_tokens, page_size)
    if sd.host_pool_tokens is None or sd.host_pool_tokens >= slot_space:
        return None
    return violation(
        "sparse_decode.host_pool_tokens",
        f"host_pool_tokens={sd.host_pool_tokens} is smaller than SGLang's slot space ({slot_space} = "
        f"{total_tokens} tokens in pages of {page_size} + one padding page)",
        f"set host_pool_tokens >= {slot_space} (or leave it unset) or lower --max-total-tokens",
    )


def _int8_head_dim(sd: cfg.SparseDecodeOffloadConfig, hf_config: Any) -> List[cfg.Violation]:
    dim = getattr(hf_config, "index_head_dim", None)  # an HF config field: reported missing by sglang.model_config
    if sd.indexer_dtype != "int8" or dim is None or int(dim) & (int(dim) - 1) == 0:
        return []
    return [
        violation(
            "sparse_decode.indexer_int8_head_dim",
            f"indexer_dtype 'int8' needs a power-of-two index_head_dim for the Hadamard rotation; the model has {dim}",
            'set "indexer_dtype": "bf16"',
        )
    ]
