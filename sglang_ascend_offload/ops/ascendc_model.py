"""Build and call the functional model of the AscendC kernels (CPU, ctypes).

``ascendc_ops/tools/ascendc_model/`` holds a model of the AscendC API the kernels use
(``kernel_operator.h``, ``lib/matmul_intf.h``), stand-ins for the host tiling's platform
and Matmul-tiling headers, and a driver. The kernels (``ascendc_ops/kernels/*.cpp``)
and the host tiling (``ascendc_ops/host/tiling.cpp``) are compiled *unchanged* against
them into one shared library (cached in ``ascendc_ops/build/kernel_check/model/`` by a
hash of the command line and every source), which this module loads. Only g++ is
needed: the model does not use the AscendC headers.

:class:`KernelModel` takes torch CPU tensors, runs the host tiling for the shape (so the
kernel reads the same tiling buffer the real launch would upload), allocates the
workspace, and runs one launch on simulated cores (cube cores first, then the vector
cores in a given order). Faults the model detects (UB / GM bounds, alignment,
unbalanced flags, queue misuse) raise :class:`ModelFault`.

Two users: ``kernel_check`` (``check-kernels``: the kernels against the reference
compositions) and ``ops/ascendc_cpu_ops.py`` (the fused rung's torch ops on CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
ASCENDC_OPS = REPO / "ascendc_ops"
MODEL_DIR = ASCENDC_OPS / "tools" / "ascendc_model"
OUT_DIR = ASCENDC_OPS / "build" / "kernel_check" / "model"
KERNELS = ASCENDC_OPS / "kernels"

LIM, LIM_C8, COPY_SFA, COPY_ROWS = 0, 1, 2, 3
TASK_RATION = 2  # vector cores per cube core (MIX AIC:AIV 1:2)


class ModelFault(RuntimeError):
    """The model caught the kernel doing something the hardware does not allow."""


class ShapeUnsupported(ValueError):
    """The host tiling refused the shape (the message is the kernel limit it violates)."""


class ModelBuildError(RuntimeError):
    """The model library cannot be built here (no compiler, missing sources, compile error)."""


def compiler() -> str:
    """Path of the C++ compiler (``$CXX``, default ``g++``); :class:`ModelBuildError` if absent."""
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise ModelBuildError(
            f"C++ compiler {cxx!r} not found: install g++ >= 10 (scripts/setup_cpu_env.sh "
            "does: apt-get install g++) or set CXX"
        )
    return path


def _sources(kernels: Path) -> List[Path]:
    return [
        MODEL_DIR / "model_driver.cpp",
        kernels / "lightning_indexer_manage.cpp",
        kernels / "scatter_copy_sparse_flash_attention.cpp",
        kernels / "copy_miss_rows.cpp",
        ASCENDC_OPS / "host" / "tiling.cpp",
    ]


def _all_sources(kernels: Path) -> List[Path]:
    files = _sources(kernels)
    for folder, pattern in (
        (MODEL_DIR, "**/*.h"),
        (kernels, "*.h"),
        (ASCENDC_OPS / "include", "*.h"),
        (ASCENDC_OPS / "host", "*.h"),
    ):
        files += sorted(folder.glob(pattern))
    return files


def _command(cxx: str, out: Path, kernels: Path) -> List[str]:
    return [
        cxx,
        "-std=c++17",
        "-O2",
        "-shared",
        "-fPIC",
        "-Wall",
        "-Werror=return-type",
        "-I",
        str(MODEL_DIR),
        "-I",
        str(MODEL_DIR / "host"),
        "-I",
        str(ASCENDC_OPS / "include"),
        "-I",
        str(kernels),
        "-I",
        str(ASCENDC_OPS / "host"),
        *[str(s) for s in _sources(kernels)],
        "-o",
        str(out),
    ]


def library_path(kernels: Path = KERNELS) -> Path:
    """Where the library built from ``kernels`` is cached (it may not exist yet): the name
    carries a hash of the compile command and of every source file."""
    missing = [str(f) for f in _sources(kernels) if not f.is_file()]
    if missing:
        raise ModelBuildError(
            f"functional model sources missing: {', '.join(missing)} (the AscendC model is "
            "built from the repository's ascendc_ops/ tree)"
        )
    h = hashlib.sha256()
    h.update(" ".join(_command(compiler(), Path("x"), kernels)).encode())
    for f in _all_sources(kernels):
        h.update(str(f).encode())
        h.update(f.read_bytes())
    return OUT_DIR / f"libsao_model-{h.hexdigest()[:16]}.so"


def build(use_cache: bool = True, kernels: Path = KERNELS) -> Path:
    """Compile the model library from the kernels in ``kernels`` (default
    ``ascendc_ops/kernels``), or reuse the cached one with the same source hash.
    A compile is logged (it takes ~10-30 s); errors are :class:`ModelBuildError`
    (a ``RuntimeError``) with the compiler's message."""
    out = library_path(kernels)
    if use_cache and out.is_file():
        return out
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    logger.info("building the AscendC functional model library from %s (g++, ~10-30 s): %s", kernels, out)
    res = subprocess.run(_command(compiler(), tmp, kernels), capture_output=True, text=True)
    if res.returncode != 0:
        raise ModelBuildError("building the functional model failed:\n" + res.stderr[:6000])
    tmp.replace(out)
    return out


@dataclass(frozen=True)
class Launch:
    """What the host tiling produced: uint8 tiling buffer, workspace bytes, cube cores."""

    tiling: torch.Tensor
    workspace_bytes: int
    block_dim: int


class KernelModel:
    """The loaded model library. ``aic_cores`` is the SoC's cube-core count the host
    tiling sees (vector cores = 2x); small values make cores take several tokens/rows."""

    def __init__(self, path: Optional[Path] = None, aic_cores: int = 24):
        self.path = path or build()
        self.lib = ctypes.CDLL(str(self.path))
        self.aic = aic_cores
        u32p, u8p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint8)
        self.lib.sao_model_tiling_bytes.restype = ctypes.c_uint32
        u32 = ctypes.c_uint32
        tiling_out = [u8p, ctypes.POINTER(ctypes.c_uint64), u32p, ctypes.c_char_p, ctypes.c_int]  # every tiler's tail
        self.lib.sao_model_tile_lim.argtypes = [u32p, u32, u32, *tiling_out]
        self.lib.sao_model_tile_copy_sfa.argtypes = [u32p, ctypes.c_float, u32, u32, *tiling_out]
        self.lib.sao_model_tile_copy_rows.argtypes = [u32p, u32, u32, *tiling_out]
        self.lib.sao_model_run.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_uint32,
            u32p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        self.tiling_bytes = int(self.lib.sao_model_tiling_bytes())

    # ------------------------------------------------------------------ tiling
    def _tile(self, fn, shape: Sequence[int], *extra) -> Launch:
        arr = (ctypes.c_uint32 * len(shape))(*shape)
        tiling = torch.zeros(self.tiling_bytes, dtype=torch.uint8)
        ws = ctypes.c_uint64(0)
        bd = ctypes.c_uint32(0)
        err = ctypes.create_string_buffer(1024)
        rc = fn(
            arr,
            *extra,
            self.aic,
            self.aic * TASK_RATION,
            ctypes.cast(tiling.data_ptr(), ctypes.POINTER(ctypes.c_uint8)),
            ctypes.byref(ws),
            ctypes.byref(bd),
            err,
            len(err),
        )
        if rc == 1:
            raise ShapeUnsupported(err.value.decode())
        if rc != 0:
            raise RuntimeError("host tiling failed: " + err.value.decode())
        return Launch(tiling, int(ws.value), int(bd.value))

    def tile_lim(
        self,
        *,
        tokens,
        requests,
        index_heads,
        index_dim,
        block_size,
        max_blocks,
        rows,
        hot_tokens,
        top_k,
        sparse_mode,
        quantized,
        tokens_per_row=1,
    ) -> Launch:
        """Host tiling of LIM / LIM-C8 for this shape (:class:`ShapeUnsupported` outside the limits)."""
        return self._tile(
            self.lib.sao_model_tile_lim,
            [
                tokens,
                requests,
                index_heads,
                index_dim,
                block_size,
                max_blocks,
                rows,
                hot_tokens,
                top_k,
                sparse_mode,
                int(quantized),
                int(tokens_per_row),
            ],
        )

    def tile_copy_sfa(
        self,
        *,
        tokens,
        heads,
        latent_dim,
        rope_dim,
        rows,
        hot_tokens,
        top_k,
        max_ctx,
        scale,
        miss_width=0,
        row_tokens=1,
    ) -> Launch:
        """Host tiling of Copy-SFA for this shape (``heads`` already padded to >= 8; ``miss_width``:
        columns of the miss lists, ``0`` = ``top_k``; ``row_tokens``: tokens a row may serve)."""
        shape = [tokens, heads, latent_dim, rope_dim, rows, hot_tokens, top_k, max_ctx, miss_width, row_tokens]
        return self._tile(self.lib.sao_model_tile_copy_sfa, shape, ctypes.c_float(scale))

    def tile_copy_rows(self, *, entries, row_dim, hot_tokens, miss_width, max_ctx) -> Launch:
        """Host tiling of the miss copy (rows form) for this shape."""
        shape = [entries, row_dim, hot_tokens, miss_width, max_ctx]
        return self._tile(self.lib.sao_model_tile_copy_rows, shape)

    # --------------------------------------------------------------------- run
    def run(
        self,
        kernel: int,
        args: Sequence[Optional[torch.Tensor]],
        launch: Launch,
        core_order: Optional[Sequence[int]] = None,
    ) -> None:
        """One launch: ``args`` are the kernel's GM arguments in order (``None`` = nullptr),
        the workspace and tiling are appended here. Every tensor must be contiguous."""
        workspace = torch.empty(launch.workspace_bytes, dtype=torch.uint8)
        tensors = list(args) + [workspace, launch.tiling]
        ptrs = (ctypes.c_void_p * len(tensors))()
        ranges = []
        for i, t in enumerate(tensors):
            if t is None:
                ptrs[i] = None
                continue
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"kernel argument {i} must be a contiguous CPU tensor")
            ptrs[i] = t.data_ptr()
            if t.numel():
                ranges += [t.data_ptr(), t.numel() * t.element_size()]
        cores = launch.block_dim * TASK_RATION
        order = list(range(cores)) if core_order is None else list(core_order)
        if sorted(order) != list(range(cores)):
            raise ValueError(f"core_order must be a permutation of 0..{cores - 1}")
        order_arr = (ctypes.c_uint32 * cores)(*order)
        range_arr = (ctypes.c_uint64 * len(ranges))(*ranges)
        err = ctypes.create_string_buffer(2048)
        rc = self.lib.sao_model_run(
            kernel,
            ptrs,
            len(tensors),
            launch.block_dim,
            TASK_RATION,
            order_arr,
            cores,
            range_arr,
            len(ranges) // 2,
            err,
            len(err),
        )
        if rc != 0:
            raise ModelFault(err.value.decode())


def main(argv=None) -> int:
    """``python -m sglang_ascend_offload.ops.ascendc_model --build``: build the library if
    its sources changed (cached by hash, so a no-op otherwise) and print its path."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--build", action="store_true", help="build (or find the cached) model library")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
