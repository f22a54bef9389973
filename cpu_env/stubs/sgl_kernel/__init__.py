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


from .speculative_cpu import (  # noqa: E402 - EAGLE (NextN / MTP) chain kernels in plain torch
    assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu, build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu, verify_tree_greedy_cpu)


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
