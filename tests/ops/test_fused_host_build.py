"""The host half of the AscendC extension, compiled and loaded on CPU (no CANN).

``ascendc_ops/tools/host_check_cpu.sh`` compiles ``host/torch_ops.cpp`` and
``host/tiling.cpp`` against CPU torch and stand-in CANN headers (launches do
nothing). Loading the module runs the ``TORCH_LIBRARY`` registrations, where torch
checks each C++ signature against its schema; the checks below then call the ops on
CPU tensors (the build registers them for CPU too) to exercise argument checks,
kernel-limit messages, head padding, output shapes and the host-memory map. The
kernels themselves are not involved. Runs in a subprocess, so this test process never
sees the real op namespace. About 20-40 s (one C++ compile): marked ``slow``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ascendc_ops" / "tools" / "host_check_cpu.sh"

CHECKS = textwrap.dedent(
    r"""
    import importlib.util, sys, torch
    spec = importlib.util.spec_from_file_location("_C_ascend", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ns = torch.ops.sglang_ascend_offload

    def raises(fn, text):
        try:
            fn()
        except RuntimeError as exc:
            assert text in str(exc), (text, str(exc)[:400])
            return
        raise AssertionError(f"expected an error containing {text!r}")

    # ---- LIM: production-like shapes run through checks, tiling and allocation
    T, R, Hh, K, Hi, Di, bs, blocks, B = 6, 8, 4096, 2048, 64, 128, 128, 40, 6
    i32 = dict(dtype=torch.int32)
    def lim_args(query_dtype=torch.bfloat16, dim=Di, hot=Hh):
        return [torch.zeros(T, Hi, dim, dtype=query_dtype), torch.zeros(blocks, bs, 1, dim, dtype=query_dtype),
                torch.zeros(T, Hi, dtype=torch.bfloat16), torch.arange(1, B + 1, **i32),
                torch.full((B,), 3000, **i32), torch.zeros(B, 32, **i32), torch.arange(T, **i32),
                torch.zeros(R, dtype=torch.int64), torch.zeros(R, **i32), torch.zeros(1, dtype=torch.int64),
                torch.full((R, hot), -1, **i32), torch.zeros(R, hot, dtype=torch.int64),
                torch.full((R,), -1, dtype=torch.int64)]
    out = ns.npu_fused_lightning_indexer_manage(*lim_args(), "TND", "PA_BSND", K, 3)
    shapes = [tuple(o.shape) for o in out]
    assert shapes == [(T, 1, K), (T, 1, K), (R, K), (R, K), (R,), (R, K), (R, K)], shapes
    assert [o.dtype for o in out] == [torch.int32, torch.int32, torch.bool] + [torch.int32] * 4
    raises(lambda: ns.npu_fused_lightning_indexer_manage(*lim_args(dim=64), "TND", "PA_BSND", K, 3),
           "index head dim must be 128")
    raises(lambda: ns.npu_fused_lightning_indexer_manage(*lim_args(hot=8192), "TND", "PA_BSND", K, 3),
           "hot_tokens must be")
    raises(lambda: ns.npu_fused_lightning_indexer_manage(*lim_args(), "TND", "PA_BSND", 100, 3),
           "sparse_count must be a multiple of 32")
    raises(lambda: ns.npu_fused_lightning_indexer_manage(*lim_args(), "BSND", "PA_BSND", K, 3), "TND / PA_BSND")
    bad_step = lim_args(); bad_step[9] = torch.zeros(1, dtype=torch.int32)
    raises(lambda: ns.npu_fused_lightning_indexer_manage(*bad_step, "TND", "PA_BSND", K, 3), "step must be Long")

    # ---- LIM-C8
    c8 = lim_args(query_dtype=torch.int8)
    c8[3:3] = [torch.zeros(T, Hi, dtype=torch.float16), torch.zeros(blocks, bs, 1, dtype=torch.float16)]
    out = ns.npu_fused_quant_lightning_indexer_manage(*c8, 0, 0, "TND", "PA_BSND", K, 3)
    assert tuple(out[0].shape) == (T, 1, K)
    raises(lambda: ns.npu_fused_quant_lightning_indexer_manage(*c8, 1, 0, "TND", "PA_BSND", K, 3), "quant mode 0")

    # ---- Copy-SFA: host map, head padding, limits
    S, D = 4096, 576
    storage = torch.zeros(S * D + 4096, dtype=torch.bfloat16)
    offset = (-storage.data_ptr() % 4096) // 2  # a 4 KiB-aligned host pool inside `storage`
    host = storage[offset: offset + S * D].view(S, D)
    def sfa_args(heads=16, k=K, host_rows=host):
        return [torch.zeros(T, heads, 512, dtype=torch.bfloat16), torch.zeros(T, heads, 64, dtype=torch.bfloat16),
                host_rows, torch.zeros(R, Hh, D, dtype=torch.bfloat16), torch.full((T, 1, k), -1, **i32),
                torch.arange(T, **i32), torch.zeros(R, k, **i32), torch.zeros(R, k, **i32), torch.zeros(R, **i32),
                torch.zeros(R, 100, **i32), 0.04]
    raises(lambda: ns.npu_fused_scatter_copy_sparse_flash_attention(*sfa_args()), "not in registered host memory")
    base = ns.npu_fused_register_host_memory(host)
    assert base == host.data_ptr()  # the stand-in aclrtHostRegister maps 1:1
    assert ns.npu_fused_register_host_memory(host[10:20]) == host.data_ptr() + 10 * D * 2  # found inside the pool
    raises(lambda: ns.npu_fused_register_host_memory(storage[1:4097]), "4 KiB-aligned")
    assert ns.npu_fused_register_host_memory(torch.zeros(8), 123456) == 123456  # a MemFabric address is recorded
    assert tuple(ns.npu_fused_scatter_copy_sparse_flash_attention(*sfa_args()).shape) == (T, 16, 512)
    assert tuple(ns.npu_fused_scatter_copy_sparse_flash_attention(*sfa_args(heads=4)).shape) == (T, 4, 512)
    raises(lambda: ns.npu_fused_scatter_copy_sparse_flash_attention(*sfa_args(heads=12)), "heads must be 8")
    raises(lambda: ns.npu_fused_scatter_copy_sparse_flash_attention(*sfa_args(k=200)), "multiple of 128")

    # ---- miss copy: host map, argument checks
    W = 16
    def copy_args(host_rows=host, rows_dtype=torch.int32, width=W):
        return [host_rows, torch.zeros(R, 64, D, dtype=torch.bfloat16), torch.arange(B, dtype=rows_dtype),
                torch.zeros(B, width, **i32), torch.zeros(B, W, **i32), torch.zeros(B, **i32),
                torch.zeros(R, 100, **i32)]
    raises(lambda: ns.npu_fused_copy_miss_rows(*copy_args(torch.zeros(S, D, dtype=torch.bfloat16))),
           "npu_fused_copy_miss_rows: the host tensor is not in registered host memory")
    ns.npu_fused_copy_miss_rows(*copy_args())
    raises(lambda: ns.npu_fused_copy_miss_rows(*copy_args(rows_dtype=torch.int64)), "rows must be Int")
    raises(lambda: ns.npu_fused_copy_miss_rows(*copy_args(width=8)), "miss_slots must have shape")
    print("host checks passed")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile the host code")
def test_host_code_compiles_registers_and_checks_on_cpu(tmp_path):
    build = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), sys.executable], capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stderr[-4000:]
    check = tmp_path / "checks.py"
    check.write_text(CHECKS)
    run = subprocess.run(
        [sys.executable, str(check), str(tmp_path / "_C_ascend.so")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "host checks passed" in run.stdout
