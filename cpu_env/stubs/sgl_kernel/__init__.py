"""Import-only stand-in for sgl_kernel's CPU build in the CPU test environment.

See ../README.md. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports two
functions from the CPU build of sgl_kernel at module level; that build is not on
PyPI. This module provides them in plain torch (or raising, for the one no
tested path calls) and registers **no** ``torch.ops.sgl_kernel`` operator, so
``sglang.srt.utils.common.cpu_has_amx_support()`` is False and every layer takes
its plain-torch path. Several SGLang modules import other CPU kernels at module
level under ``is_cpu()`` (e.g. ``kernels/ops/speculative/cache_locs.py:28``); any
other public name therefore resolves to a placeholder that raises
``NotImplementedError`` naming the kernel when it is *called*, never a mock that
returns something.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+cpu-stand-in"
IS_CPU_STAND_IN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of ``req_to_token``.

    Same semantics as SGLang's Triton kernel ``assign_req_to_token_pool``
    (``srt/mem_cache/allocation.py``): for request ``i`` (in batch order),
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` receives the
    next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``.

    Shapes: ``req_pool_indices``, ``start_offset``, ``end_offset``: ``[bs]`` integer;
    ``req_to_token``: ``[pool_rows, pool_len]`` int32; ``out_cache_loc``: ``[sum(lens)]``.
    """
    del pool_len  # the row length is req_to_token.shape[1]
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


from .speculative_cpu import (  # noqa: E402, F401 - EAGLE (NextN / MTP) chain kernels in plain torch, re-exported
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)


class _MissingKernel:
    """Stands for a CPU kernel of sgl_kernel that the stand-in does not provide."""

    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} is not available: cpu_env/stubs/sgl_kernel is an "
            "import-only stand-in for the unpublished CPU build of sgl_kernel"
        )


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    return _MissingKernel(name)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """Raw-pointer KV move of the CPU build; not provided by the stand-in."""
    raise NotImplementedError(
        "sgl_kernel.copy_all_layer_kv_cache_cpu is not available in the CPU test "
        "environment's stand-in (cpu_env/stubs/sgl_kernel); the code path that "
        "needs it (KV move between slots) is not supported here."
    )


# SGLang 0.5.23's CPU graph runner (``model_executor/cpu_graph_runner.py``,
# ``register_fake_ops``; run with --enable-torch-compile on --device cpu) registers
# torch.compile fake implementations for these ``torch.ops.sgl_kernel`` operators,
# which must therefore exist. Here each is defined with a placeholder schema and a
# CPU implementation that raises NotImplementedError: the plain-torch paths this
# stand-in leaves every layer on never call them (``convert_weight_packed``, which
# ``cpu_has_amx_support()`` probes, and the names other SGLang code probes with
# ``hasattr`` are deliberately not among them).
COMPILE_FAKE_OPS = (
    "shm_allreduce",
    "bmm_cpu",
    "fused_add_rmsnorm_cpu",
    "decode_attention_cpu",
    "extend_attention_cpu",
    "gemma_fused_add_rmsnorm_cpu",
    "layernorm_cpu",
    "fused_add_layernorm_cpu",
    "multimodal_rotary_embedding_cpu",
    "apply_multidimensional_rope_cpu",
    "fused_sigmoid_mul_cpu",
    "rmsnorm_cpu",
    "l2norm_cpu",
    "fused_experts_cpu",
    "fused_rmsnorm_gated_cpu",
    "shared_expert_cpu",
    "causal_conv1d_update_cpu",
    "causal_conv1d_fwd_cpu",
    "gemma_rmsnorm_cpu",
    "gemma3_rmsnorm_cpu",
    "gemma4_rmsnorm_cpu",
    "apply_rotary_pos_emb_cpu",
    "biased_grouped_topk_cpu",
    "chunk_gated_delta_rule_cpu",
    "fp8_per_tensor_scaled_mm_cpu",
    "fp8_scaled_mm_cpu",
    "fused_dual_residual_rmsnorm_cpu",
    "fused_gdn_gating_cpu",
    "fused_input_proj_cpu",
    "fused_linear_sigmoid_mul",
    "fused_moe_router_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qk_rmsnorm_apply_from_stats_cpu",
    "fused_qk_rmsnorm_cpu",
    "fused_qk_rmsnorm_sumsq_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_qkvzba_split_reshape_cat_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "grouped_topk_cpu",
    "int4_scaled_mm_cpu",
    "int8_scaled_mm_cpu",
    "int8_scaled_mm_with_quant",
    "mxfp4_scaled_mm_cpu",
    "per_token_quant_int8_cpu",
    "qkv_proj_with_rope",
    "qkv_proj_with_rope_fused_weight",
    "rotary_embedding_cpu",
    "shm_allgather",
    "topk_sigmoid_cpu",
    "topk_softmax_cpu",
    "weight_packed_linear",
    "silu_and_mul_cpu",
    "gelu_tanh_and_mul_cpu",
    "gelu_and_mul_cpu",
)


def _define_compile_fake_ops() -> None:
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")  # noqa: TOR901 - kept alive below
    for name in COMPILE_FAKE_OPS:
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        lib.define(f"{name}(Tensor[] args) -> ()")

        def _raise(*args, _name=name, **kwargs):
            raise NotImplementedError(
                f"torch.ops.sgl_kernel.{_name} is a schema-only placeholder of the CPU "
                "test environment's sgl_kernel stand-in (cpu_env/stubs/sgl_kernel)"
            )

        lib.impl(name, _raise, "CompositeExplicitAutograd")
    globals()["_COMPILE_FAKE_LIB"] = lib


_define_compile_fake_ops()
