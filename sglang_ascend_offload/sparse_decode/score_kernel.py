"""The CPU kernel of the score-aware residency policies (``score_rank``, ``score_rank_guarded``).

``csrc/score_rank_cpu.cpp`` is compiled with the system C++ compiler (same compiler and
flags as the LRU kernel of :mod:`.cpu_kernel`) into its own small shared library, named by
a hash of its source and flags, and called through ctypes. Rows form: one step of the
batch's state rows, in place on the torch managers' own state tensors (the contract's
table; for the guarded policy also the ghost LRU table and the two miss counters), so a
kernel manager's :meth:`state` is the torch manager's, bit for bit (tested in
``tests/sparse_decode/test_score_rank_kernel.py``). No derived state: the position map is
rebuilt per row in per-thread scratch.

Build: ``python -m sglang_ascend_offload.sparse_decode.score_kernel --build``
(``scripts/setup_cpu_env.sh`` runs it; idempotent). Unlike the LRU kernel, :func:`library`
never builds: when the library for the current source is missing it raises
:class:`ScoreKernelUnavailable` saying to run the setup script (choose
``manage_impl='torch'`` to run the torch policy instead). Eager only (the score-aware
policies are served eager-only, ``rank_depth``): under ``torch.compile`` it is an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from .cpu_kernel import _FLAGS, CPUKernelUnavailable, _compiler, build_cli, compile_library

logger = logging.getLogger(__name__)

__all__ = ["ScoreKernelUnavailable", "library", "library_path", "build", "score_rank_manage_rows", "MAX_STEP"]

_SRC = Path(__file__).with_name("csrc") / "score_rank_cpu.cpp"
_LIB: Optional[ctypes.CDLL] = None
#: largest step (stamps ``2*step+2`` stay below ``2**32``, as in the torch policies)
MAX_STEP = (1 << 31) - 2


class ScoreKernelUnavailable(CPUKernelUnavailable):
    """The score-aware CPU kernel is not built (or cannot be): the message says how to fix it."""


def library_path() -> Path:
    """Where the library for the current source and flags lives (it may not exist yet);
    ``SGLANG_ASCEND_OFFLOAD_KERNEL_DIR`` overrides the directory, as for the LRU kernel."""
    digest = hashlib.sha256(_SRC.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    root = Path(os.environ.get("SGLANG_ASCEND_OFFLOAD_KERNEL_DIR", Path(__file__).with_name("build")))
    return root / f"libsao_score_rank_cpu_{digest}.so"


_HOW = (
    "run `bash scripts/setup_cpu_env.sh` (or `python -m sglang_ascend_offload.sparse_decode.score_kernel "
    "--build`), or choose manage_impl='torch' for the torch policy"
)


def build(force: bool = False) -> Path:
    """Compile the kernel if its library is missing (or ``force``); returns its path."""
    out = library_path()
    if out.exists() and not force:
        return out
    cxx = _compiler()
    if cxx is None:
        raise ScoreKernelUnavailable(
            "the score-aware CPU kernel needs a C++ compiler (g++/clang++; set CXX): apt-get install g++, then " + _HOW
        )
    return compile_library(cxx, _SRC, out, "the score-aware CPU kernel", ScoreKernelUnavailable)


def library() -> ctypes.CDLL:
    """The loaded kernel library; :class:`ScoreKernelUnavailable` when it is not built."""
    global _LIB
    if _LIB is None:
        path = library_path()
        if not path.exists():
            raise ScoreKernelUnavailable(
                f"the score-aware CPU kernel is not built ({path.name} is missing for the "
                f"current source {_SRC.name}): {_HOW}"
            )
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.sao_score_rank_rows.argtypes = [p, p, p, i64, i64] + [p] * 5 + [i64] * 4 + [p] * 5 + [p] * 5 + [i64] * 2
        lib.sao_score_rank_rows.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def _need(name: str, t: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
        )


def score_rank_manage_rows(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    rows: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    ranked: torch.Tensor,
    step: int,
    guard: Optional[Tuple[torch.Tensor, ...]] = None,
    seed: int = 0,
    slack_shift: Optional[int] = None,
) -> Tuple[torch.Tensor, ...]:
    """One ``score_rank`` step (``guard is None``) or ``score_rank_guarded`` step of the batch rows.

    State, mutated in place: slot_token int32 ``[R,H]``, slot_stamp int64 ``[R,H]``,
    row_req int64 ``[R]``; ``guard`` = (ghost slot_token int32 ``[R,H]``, ghost slot_stamp
    int64 ``[R,H]``, ghost row_req int64 ``[R]``, ghost_misses int64 ``[R]``, own_misses
    int64 ``[R]``) with the guard's ``seed`` and ``slack_shift`` (``None`` = off).
    Inputs: rows int64 ``[B]`` (real rows distinct), topk int32 ``[B,K]`` (``K <= H``),
    req_ids int64 ``[B]``, stable_len int32 ``[B]``, ranked int32 ``[B,D]`` (``D >= K``;
    unique positions per row, ``-1`` padding), step an int in ``0..MAX_STEP``. Returns
    ``(hit_mask bool, slots int32, miss_count int32 [B], miss_tokens int32, miss_slots int32)``.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "the score-aware CPU kernel is eager-only (the score policies are served eager); "
            "use manage_impl='torch' under torch.compile"
        )
    r, h = slot_token.shape
    b, k = topk.shape
    d = ranked.shape[1] if ranked.dim() == 2 else -1
    _need("slot_token", slot_token, torch.int32, (r, h))
    _need("slot_stamp", slot_stamp, torch.int64, (r, h))
    _need("row_req", row_req, torch.int64, (r,))
    _need("rows", rows, torch.int64, (b,))
    _need("topk", topk, torch.int32, (b, k))
    _need("req_ids", req_ids, torch.int64, (b,))
    _need("stable_len", stable_len, torch.int32, (b,))
    _need("ranked", ranked, torch.int32, (b, d))
    if h < k:
        raise ValueError(f"hot_tokens {h} < top_k {k}")
    if d < k:
        raise ValueError(f"ranked depth {d} < top_k {k}")
    step = int(step)
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step} out of range 0..{MAX_STEP}")
    hit_mask = torch.empty((b, k), dtype=torch.bool)
    slots = torch.empty((b, k), dtype=torch.int32)
    miss_count = torch.empty((b,), dtype=torch.int32)
    miss_tokens = torch.empty((b, k), dtype=torch.int32)
    miss_slots = torch.empty((b, k), dtype=torch.int32)
    if guard is None:
        gp = [None] * 5
    else:
        g_tok, g_stamp, g_req, g_misses, o_misses = guard
        _need("ghost slot_token", g_tok, torch.int32, (r, h))
        _need("ghost slot_stamp", g_stamp, torch.int64, (r, h))
        for name, t in (("ghost row_req", g_req), ("ghost_misses", g_misses), ("own_misses", o_misses)):
            _need(name, t, torch.int64, (r,))
        gp = [t.data_ptr() for t in guard]
    rc = library().sao_score_rank_rows(
        slot_token.data_ptr(),
        slot_stamp.data_ptr(),
        row_req.data_ptr(),
        r,
        h,
        rows.data_ptr(),
        topk.data_ptr(),
        req_ids.data_ptr(),
        stable_len.data_ptr(),
        ranked.data_ptr(),
        b,
        k,
        d,
        step,
        hit_mask.data_ptr(),
        slots.data_ptr(),
        miss_count.data_ptr(),
        miss_tokens.data_ptr(),
        miss_slots.data_ptr(),
        *gp,
        int(seed),
        -1 if slack_shift is None else int(slack_shift),
    )
    if rc == 1:
        raise IndexError(f"score_rank_manage_rows: a batch row is outside the {r} state rows")
    if rc != 0:
        raise RuntimeError(f"score_rank_manage_rows: kernel error {rc} (fewer evictable slots than misses)")
    return hit_mask, slots, miss_count, miss_tokens, miss_slots


def main(argv=None) -> int:
    return build_cli("score_kernel", build, library, argv)


if __name__ == "__main__":
    raise SystemExit(main())
