"""Ahead-of-time compile check: every kernel, production tile sizes, no device needed.

The interpreter accepts code that the compiler rejects (non-constexpr globals,
loop-carried values changing type, ...). This module compiles each kernel through
the real Triton frontend and backend for a given target, without launching it:

    python -m sglang_ascend_offload.triton_ops.aot_check            # CUDA sm_90 (upstream Triton)
    python -m sglang_ascend_offload.triton_ops.aot_check --arch 80

Run it with ``TRITON_INTERPRET`` unset (the kernels must be real ``JITFunction``s).
On CPU machines the CUDA backend of the upstream wheel compiles all the way to a
cubin with its bundled ``ptxas``. Tile sizes are those the launchers pick for the
production shape ``K = 2048``, ``H = 32768``, ``D = 576``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List

PROD_K = 2048
PROD_H = 32768
PROD_D = 576


@dataclass(frozen=True)
class KernelSpec:
    module: str  # inside sglang_ascend_offload.triton_ops
    name: str
    signature: Dict[str, str]
    constexprs: Dict[str, int]


def kernel_specs() -> List[KernelSpec]:
    from ._launch import next_pow2
    from .copy_rows import DEFAULT_CONFIG as COPY
    from .residency import DEFAULT_CONFIG as RES

    ptr = {"i32": "*i32", "i64": "*i64", "i8": "*i8", "i16": "*i16"}
    return [
        KernelSpec(
            "residency_kernels",
            "_lookup_kernel",
            dict(
                topk_ptr=ptr["i32"],
                req_ids_ptr=ptr["i64"],
                stable_len_ptr=ptr["i32"],
                row_req_ptr=ptr["i64"],
                slot_token_ptr=ptr["i32"],
                slot_stamp_ptr=ptr["i64"],
                hit_mask_ptr=ptr["i8"],
                slots_ptr=ptr["i32"],
                miss_count_ptr=ptr["i32"],
                miss_tokens_ptr=ptr["i32"],
                miss_slots_ptr=ptr["i32"],
                miss_entry_ptr=ptr["i32"],
                evict_min_ptr=ptr["i64"],
                K="i32",
                H="i32",
                KP="constexpr",
                BLOCK_H="constexpr",
            ),
            dict(KP=next_pow2(PROD_K), BLOCK_H=RES.lookup_block_h(PROD_K, PROD_H)),
        ),
        KernelSpec(
            "residency_kernels",
            "_victim_kernel",
            dict(
                slot_stamp_ptr=ptr["i64"],
                miss_count_ptr=ptr["i32"],
                evict_min_ptr=ptr["i64"],
                miss_slots_ptr=ptr["i32"],
                req_ids_ptr=ptr["i64"],
                row_req_ptr=ptr["i64"],
                K="i32",
                H="i32",
                BLOCK_H="constexpr",
            ),
            dict(BLOCK_H=RES.victim_block_h(PROD_H)),
        ),
        KernelSpec(
            "residency_kernels",
            "_apply_kernel",
            dict(
                slot_token_ptr=ptr["i32"],
                slot_stamp_ptr=ptr["i64"],
                hit_mask_ptr=ptr["i8"],
                slots_ptr=ptr["i32"],
                miss_count_ptr=ptr["i32"],
                miss_tokens_ptr=ptr["i32"],
                miss_slots_ptr=ptr["i32"],
                miss_entry_ptr=ptr["i32"],
                stamps_ptr=ptr["i64"],
                K="i32",
                H="i32",
                BLOCK_K="constexpr",
            ),
            dict(BLOCK_K=RES.apply_block_k(PROD_K)),
        ),
        KernelSpec(
            "copy_kernels",
            "_copy_miss_rows_kernel",
            dict(
                host_ptr=ptr["i16"],
                hot_ptr=ptr["i16"],
                miss_tokens_ptr=ptr["i32"],
                miss_slots_ptr=ptr["i32"],
                miss_count_ptr=ptr["i32"],
                token_table_ptr=ptr["i32"],
                K="i32",
                H="i32",
                D="i32",
                host_rows="i32",
                host_stride="i32",
                max_ctx="i32",
                table_stride="i32",
                BLOCK_I="constexpr",
                BLOCK_D="constexpr",
            ),
            dict(BLOCK_I=COPY.block_i, BLOCK_D=COPY.block_d_for(PROD_D)),
        ),
    ]


def compile_all(backend: str = "cuda", arch: int = 90, warp_size: int = 32) -> Dict[str, float]:
    """Compile every kernel for ``GPUTarget(backend, arch, warp_size)``; seconds per kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the AOT check needs compiled (not interpreted) kernels")
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(backend, arch, warp_size)
    seconds = {}
    for spec in kernel_specs():
        fn = getattr(importlib.import_module(f"{__package__}.{spec.module}"), spec.name)
        t0 = time.perf_counter()
        triton.compile(ASTSource(fn=fn, signature=spec.signature, constexprs=spec.constexprs), target=target)
        seconds[spec.name] = time.perf_counter() - t0
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--warp-size", type=int, default=32)
    args = parser.parse_args(argv)
    for name, sec in compile_all(args.backend, args.arch, args.warp_size).items():
        print(f"compiled {name} for {args.backend}:{args.arch} in {sec:.2f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
