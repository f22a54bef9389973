"""Facts of an SGLang deployment, as :class:`sglang_ascend_offload.config.Deployment`.

:func:`build_deployment` reads attributes of anything shaped like SGLang's resolved
server arguments (the resolving view during resolution, a ``ServerArgs`` record, or
a ``SimpleNamespace`` in tests) plus the HuggingFace config of the model; it does
not import SGLang. :func:`deployment_from_server_args` is the SGLang-side entry.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ... import config as cfg
from ... import platform
from .. import compat

DSA_ARCHITECTURES = frozenset({"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"})
_BF16 = {"bf16", "bfloat16"}
# SGLang speculative algorithm names -> the method names the config rules check
# (``Deployment.speculative_method``).
_SPEC_METHODS = {"nextn": "mtp", "eagle": "mtp", "mtp": "mtp", "dspark": "dspark"}


def model_kind(hf_config: Any) -> str:
    """``dsa`` (index_topk or a DSA architecture), ``mla`` (kv_lora_rank), else ``other``.

    HF config fields are optional by nature (a model defines the ones it has), so they
    are read with defaults throughout this module; server arguments go through
    :func:`..compat.arg`.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(hf_config, "index_topk", None) is not None or DSA_ARCHITECTURES & set(archs):
        return "dsa"
    if getattr(hf_config, "kv_lora_rank", None):
        return "mla"
    return "other"


def main_kv_dtype(kv_cache_dtype: Optional[str], hf_config: Any) -> str:
    """The main KV dtype name; ``auto`` means the model's own dtype."""
    name = (kv_cache_dtype or "auto").lower()
    if name == "auto":
        model_dtype = str(
            getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or "bfloat16"
        ).replace("torch.", "")
        name = model_dtype.lower()
    return "bf16" if name in _BF16 else name


def graph_mode(cuda_graph_config: Any, disable_cuda_graph: bool, pd_role: str) -> str:
    """``eager`` / ``piecewise`` / ``full`` for the phase(s) this server runs."""
    if disable_cuda_graph or cuda_graph_config is None:
        return "eager"
    phases = {"prefill": ("prefill",), "decode": ("decode",)}.get(pd_role, ("prefill", "decode"))
    modes = set()
    for phase in phases:
        backend = str(getattr(getattr(cuda_graph_config, phase, None), "backend", "disabled"))
        modes.add({"disabled": "eager", "full": "full"}.get(backend, "piecewise"))
    for mode in ("full", "piecewise"):
        if mode in modes:
            return mode
    return "eager"


_HYBRID_LAYER_KINDS = {"sliding_attention", "linear_attention", "mamba"}


def attention_parallel(get) -> Tuple[int, int]:
    """``(attention DP groups, attention TP size)`` of resolved server arguments.

    SGLang 0.5.23 resolves the deprecated ``--dp N --enable-dp-attention`` to
    ``attn_dp_size = N``, ``dp_size = 1``, ``enable_dp_attention = False``
    (``arg_groups/parallel_hook.py``); the attention TP group is ``tp_size //
    (attn_dp_size x attn_cp_size)``. Unresolved arguments with the old spelling are
    read the same way.
    """
    tp = int(get("tp_size", 1) or 1)
    dp_size = int(get("dp_size", 1) or 1)
    attn_dp = int(get("attn_dp_size", 1) or 1)
    if get("enable_dp_attention", False) and attn_dp == 1:
        attn_dp, dp_size = dp_size, 1
    attn_cp = int(get("attn_cp_size", 1) or 1)
    dp = max(dp_size, attn_dp)
    return dp, max(1, tp // (attn_dp * attn_cp))


def build_deployment(
    args: Any,
    hf_config: Any,
    soc: Optional[str] = None,
    hybrid_kv: Optional[bool] = None,
    soc_unknown: Optional[str] = None,
) -> cfg.Deployment:
    """Deployment facts from resolved server arguments and the model's HF config.

    hybrid_kv: SGLang's own verdict where known (``ModelConfig.is_hybrid_swa`` or a
    Mamba-like config); otherwise inferred from ``hf_config.layer_types``.
    """

    def get(name: str, default: Any = None) -> Any:
        value = compat.arg(args, name)  # strict: a renamed SGLang field stops startup
        return default if value is None else value

    device = get("device") or platform.device_kind()
    if device not in ("npu", "cuda", "cpu"):
        device = "cuda" if device in ("gpu", "rocm", "hip") else device
    pd_role = {"prefill": "prefill", "decode": "decode"}.get(str(get("disaggregation_mode", "null")), "colocated")
    attn_cp = int(get("attn_cp_size", 1) or 1)
    prefill_cp = bool(get("enable_prefill_cp", False))
    spec = get("speculative_algorithm")
    spec_method = _SPEC_METHODS.get(str(spec).lower(), str(spec).lower()) if spec else None
    if hybrid_kv is None:
        hybrid_kv = bool(_HYBRID_LAYER_KINDS & set(getattr(hf_config, "layer_types", None) or ()))
    kind = model_kind(hf_config)
    dp, attn_tp = attention_parallel(get)
    graphs = (get("cuda_graph_config"), bool(get("disable_cuda_graph", False)))
    decode_graphs = graph_mode(*graphs, "decode")
    if device == "cpu" and not get("enable_torch_compile", False):
        decode_graphs = "eager"  # SGLang's CPU engine captures decode graphs only with torch.compile
    return cfg.Deployment(
        device=device,
        soc=soc,
        soc_unknown=soc_unknown if device == "npu" else None,
        model_kind=kind,
        hybrid_kv=bool(hybrid_kv),
        main_kv_dtype=main_kv_dtype(get("kv_cache_dtype"), hf_config),
        main_kv_packing="none",
        num_layers=getattr(hf_config, "num_hidden_layers", None),
        index_topk=getattr(hf_config, "index_topk", None) if kind == "dsa" else None,
        page_size=get("page_size"),
        dp=dp,
        tp=int(get("tp_size", 1) or 1),
        attn_tp=attn_tp,
        cp=1 if prefill_cp else attn_cp,
        pp=int(get("pp_size", 1) or 1),
        pcp=attn_cp if prefill_cp else 1,
        dcp=int(get("dcp_size", 1) or 1),
        pd_role=pd_role,
        disaggregation_transfer_backend=get("disaggregation_transfer_backend") if pd_role != "colocated" else None,
        graph_mode=graph_mode(*graphs, pd_role),
        decode_graph_mode=decode_graphs,
        speculative_method=spec_method,
        speculative_fixed=not bool(get("speculative_adaptive", False)),
        speculative_rows=_spec_int(get, spec, "speculative_num_draft_tokens"),
        speculative_steps=_spec_int(get, spec, "speculative_num_steps"),
        speculative_topk=_spec_int(get, spec, "speculative_eagle_topk"),
        overlap_schedule=not bool(get("disable_overlap_schedule", False)),
        dp_attention=bool(get("enable_dp_attention", False) or int(get("attn_dp_size", 1) or 1) > 1),
    )


def _spec_int(get, algorithm: Any, name: str) -> Optional[int]:
    """A speculative-decoding count where speculation is on and SGLang has it, else ``None``."""
    value = get(name) if algorithm else None
    return int(value) if value else None


def deployment_from_server_args(server_args: Any) -> cfg.Deployment:
    """:func:`build_deployment` over SGLang's resolving view of ``server_args``."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view

    view = resolving_view(server_args)
    model_config = model_config_of(server_args)
    # NPU: the SoC the installed CANN build declares (undecided -> soc_unknown refuses)
    soc, soc_unknown = platform.installed_soc() if (view.device or platform.device_kind()) == "npu" else (None, None)
    hybrid = bool(getattr(model_config, "is_hybrid_swa", False)) or bool(
        getattr(model_config, "mambaish_config", None) or getattr(model_config, "hybrid_gdn_config", None)
    )
    return build_deployment(view, model_config.hf_config, soc, hybrid_kv=hybrid, soc_unknown=soc_unknown)
