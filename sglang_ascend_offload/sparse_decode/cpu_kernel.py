"""The CPU kernel of the residency contract (exact LRU) and of the miss copy, rows form.

``csrc/lru_cpu.cpp`` is compiled with the system C++ compiler into a small shared
library (no torch headers: a build takes about a second) and called through ctypes
behind two torch custom ops, so ``torch.compile(fullgraph=True)`` sees each as one
opaque op:

* ``sglang_ascend_offload::lru_manage_rows`` -- one exact-LRU step of the batch's rows
  (``docs/residency_contract.md``, "Rows form"), in place on the contract's state plus
  the kernel's derived state (:class:`KernelLRUState`: eviction order, hash map
  position -> slot, per-row position bound), returning the five
  :class:`~.residency.ResidencyStep` tensors;
* ``sglang_ascend_offload::copy_miss_rows_rows`` -- the miss copy host -> hot buffer
  of the same rows (only the ``miss_count`` rows of each batch entry are touched).

The torch reference (``residency.residency_manage``) is the specification; the
kernel is tested against it bit for bit (state and outputs). It is not a policy of its
own but the ``impl="kernel"`` implementation of the ``lru`` policy
(:class:`~sglang_ascend_offload.sparse_decode.policies.lru.LRUManager`; the engine's
``manage_impl`` chooses it). Build: ``python -m
sglang_ascend_offload.sparse_decode.cpu_kernel --build`` (``scripts/setup_cpu_env.sh``
runs it; idempotent: the library's file name carries a hash of the source and the
flags). :func:`library` builds on first use when the file is missing, and raises
:class:`CPUKernelUnavailable` naming the fix when no compiler works.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CPUKernelUnavailable",
    "KernelLRUState",
    "library",
    "library_path",
    "build",
    "lru_manage_rows",
    "copy_miss_rows_rows",
    "set_simd",
]

_SRC = Path(__file__).with_name("csrc") / "lru_cpu.cpp"
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-exceptions"]
_LIB: Optional[ctypes.CDLL] = None


class CPUKernelUnavailable(RuntimeError):
    """The CPU residency kernel cannot be built or loaded here (message says how to fix it)."""


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_path() -> Path:
    """Where the library for the current source and flags lives (it may not exist yet).

    ``SGLANG_ASCEND_OFFLOAD_KERNEL_DIR`` overrides the directory (default: ``build``
    next to this module, ignored by git).
    """
    digest = hashlib.sha256(_SRC.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    root = Path(os.environ.get("SGLANG_ASCEND_OFFLOAD_KERNEL_DIR", Path(__file__).with_name("build")))
    return root / f"libsao_lru_cpu_{digest}.so"


def build(force: bool = False) -> Path:
    """Compile the kernel if its library is missing (or ``force``); returns its path."""
    out = library_path()
    if out.exists() and not force:
        return out
    cxx = _compiler()
    if cxx is None:
        raise CPUKernelUnavailable(
            "the CPU residency kernel needs a C++ compiler (g++/clang++; set CXX to choose one): install one "
            "(apt-get install g++) and run `python -m sglang_ascend_offload.sparse_decode.cpu_kernel --build` "
            "(scripts/setup_cpu_env.sh does it), or run the engine with manage_impl='torch'"
        )
    return compile_library(cxx, _SRC, out, "the CPU residency kernel", CPUKernelUnavailable)


def compile_library(cxx: str, src: Path, out: Path, what: str, error: type) -> Path:
    """Compile ``src`` with ``_FLAGS`` into the shared library ``out``; ``error(...)`` on failure.

    Written to a temporary file and renamed, so concurrent builders never load a
    half-written library. Shared by every CPU kernel loader of this package.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, str(src), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise error(f"building {what} failed ({' '.join(cmd)}):\n{proc.stderr}")
    os.replace(tmp, out)
    logger.info("built %s: %s", what, out)
    return out


def library() -> ctypes.CDLL:
    """The loaded kernel library (built on first use if missing)."""
    global _LIB
    if _LIB is None:
        path = build()
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.sao_lru_manage_rows.argtypes = [p] * 7 + [i64] * 3 + [p] * 4 + [i64] * 3 + [p] * 5 + [i64]
        lib.sao_lru_manage_rows.restype = ctypes.c_int
        lib.sao_copy_miss_rows.argtypes = [p, i64, p, i64, i64, i64, p, i64, i64, p, p, p, p, i64, i64]
        lib.sao_copy_miss_rows.restype = ctypes.c_int
        lib.sao_lru_set_simd.argtypes = [ctypes.c_int]
        lib.sao_lru_set_simd.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def set_simd(on: bool) -> bool:
    """Choose the lookup of the int16 dense map: ``on`` (the default) the AVX-512 loop
    where the CPU has AVX-512 F/BW/VL, else the scalar loop everywhere (same results;
    tests run both). Returns whether this CPU has the AVX-512 loop."""
    return bool(library().sao_lru_set_simd(1 if on else 0))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _need(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    if t.dtype != dtype or t.dim() != dim or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a contiguous {dim}-D {dtype} CPU tensor, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
        )


# ------------------------------------------------------------------ state
def _hash_capacity(hot_tokens: int) -> int:
    cap = 2
    while cap < 2 * hot_tokens:
        cap *= 2
    return cap


#: Largest dense position map (elements, per layer) :class:`KernelLRUState` allocates;
#: beyond it (many rows x long contexts) the map is a hash table of ``2H..4H`` entries
#: per row. Same bound as the reference's transient map (``residency.DENSE_MAP_LIMIT``).
DENSE_MAP_LIMIT = 1 << 24
_INT16_MAX = 32767


@dataclass
class KernelLRUState:
    """The contract's state of one layer plus the kernel's derived state (all CPU).

    slot_token int32 ``[R,H]``, slot_stamp int64 ``[R,H]``, row_req int64 ``[R]``: the
    contract's (``docs/residency_contract.md``). order int32 ``[R,H]``: each row's slots
    by ``(slot_stamp, slot)``. Position map, persistent: ``map_kind == 0`` dense,
    hkeys = slot_of ``[R,P]`` (``P`` = the token table's width; ``R*P <=
    DENSE_MAP_LIMIT``; int16 when ``H <= 32767``, else int32: the map is the cold
    memory a step's lookups touch, so the narrower type halves its cache lines), written only at fills and never
    cleared (an entry counts only
    if ``slot_token[r, slot_of[r, p]] == p``); ``map_kind == 1`` hash, hkeys / hvals
    int32 ``[R,C]``, ``C`` the power of two ``>= 2H``, updated at fills, evictions and
    resets (memory bounded by ``H`` whatever the context). maxpos int32 ``[R]``: an upper bound of the
    held positions. Only the kernel may update it (the derived parts follow the
    contract's parts only through it).
    """

    slot_token: torch.Tensor
    slot_stamp: torch.Tensor
    row_req: torch.Tensor
    order: torch.Tensor
    hkeys: torch.Tensor
    hvals: torch.Tensor
    maxpos: torch.Tensor
    map_kind: int = 1

    @classmethod
    def empty(
        cls, rows: int, hot_tokens: int, max_positions: Optional[int] = None, dense_dtype: Optional[torch.dtype] = None
    ) -> "KernelLRUState":
        """Empty state; a dense map when ``max_positions`` (every position is below it)
        is given and ``rows * max_positions <= DENSE_MAP_LIMIT``, else a hash map.
        ``dense_dtype`` (int16 / int32) overrides the dense map's slot type (default:
        int16 when ``hot_tokens <= 32767``)."""
        if dense_dtype is None:
            dense_dtype = torch.int16 if hot_tokens <= _INT16_MAX else torch.int32
        if dense_dtype not in (torch.int16, torch.int32) or (dense_dtype == torch.int16 and hot_tokens > _INT16_MAX):
            raise ValueError(f"dense_dtype {dense_dtype} cannot hold slots of hot_tokens {hot_tokens}")
        if max_positions is not None and rows * max(1, max_positions) <= DENSE_MAP_LIMIT:
            kind, hkeys, hvals = (
                0,
                torch.full((rows, max(1, max_positions)), -1, dtype=dense_dtype),
                torch.zeros((1,), dtype=torch.int32),
            )
        else:
            cap = _hash_capacity(hot_tokens)
            kind, hkeys, hvals = (
                1,
                torch.full((rows, cap), -1, dtype=torch.int32),
                torch.zeros((rows, cap), dtype=torch.int32),
            )
        return cls(
            slot_token=torch.full((rows, hot_tokens), -1, dtype=torch.int32),
            slot_stamp=torch.zeros((rows, hot_tokens), dtype=torch.int64),
            row_req=torch.full((rows,), -1, dtype=torch.int64),
            order=torch.arange(hot_tokens, dtype=torch.int32).repeat(rows, 1),
            hkeys=hkeys,
            hvals=hvals,
            maxpos=torch.full((rows,), -1, dtype=torch.int32),
            map_kind=kind,
        )

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return (self.slot_token, self.slot_stamp, self.row_req, self.order, self.hkeys, self.hvals, self.maxpos)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


# ------------------------------------------------------------------ custom ops
@torch.library.custom_op(
    "sglang_ascend_offload::lru_manage_rows",
    mutates_args=("slot_token", "slot_stamp", "row_req", "order", "hkeys", "hvals", "maxpos"),
    device_types="cpu",
)
def _lru_manage_rows_op(
    slot_token: torch.Tensor,
    slot_stamp: torch.Tensor,
    row_req: torch.Tensor,
    order: torch.Tensor,
    hkeys: torch.Tensor,
    hvals: torch.Tensor,
    maxpos: torch.Tensor,
    rows: torch.Tensor,
    topk: torch.Tensor,
    req_ids: torch.Tensor,
    stable_len: torch.Tensor,
    step: torch.Tensor,
    map_kind: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _lru_manage_rows_raw(
        slot_token,
        slot_stamp,
        row_req,
        order,
        hkeys,
        hvals,
        maxpos,
        rows,
        topk,
        req_ids,
        stable_len,
        int(step),
        map_kind,
    )


def _lru_manage_rows_raw(
    slot_token,
    slot_stamp,
    row_req,
    order,
    hkeys,
    hvals,
    maxpos,
    rows,
    topk,
    req_ids,
    stable_len,
    step: int,
    map_kind: int,
):
    r, h = slot_token.shape
    b, k = topk.shape
    hit_mask = torch.empty((b, k), dtype=torch.bool)
    slots = torch.empty((b, k), dtype=torch.int32)
    miss_count = torch.empty((b,), dtype=torch.int32)
    miss_tokens = torch.empty((b, k), dtype=torch.int32)
    miss_slots = torch.empty((b, k), dtype=torch.int32)
    kind = 2 if map_kind == 0 and hkeys.dtype == torch.int16 else map_kind  # the kernel's dense int16 map
    rc = library().sao_lru_manage_rows(
        _ptr(slot_token),
        _ptr(slot_stamp),
        _ptr(row_req),
        _ptr(order),
        _ptr(hkeys),
        _ptr(hvals),
        _ptr(maxpos),
        r,
        h,
        hkeys.shape[1],
        _ptr(rows),
        _ptr(topk),
        _ptr(req_ids),
        _ptr(stable_len),
        b,
        k,
        step,
        _ptr(hit_mask),
        _ptr(slots),
        _ptr(miss_count),
        _ptr(miss_tokens),
        _ptr(miss_slots),
        kind,
    )
    if rc == 1:
        raise IndexError(f"lru_manage_rows: a batch row is outside the {r} state rows")
    if rc == 2:
        raise RuntimeError(
            "lru_manage_rows: the kernel's position map disagrees with slot_token "
            "(the state was changed outside the kernel)"
        )
    if rc == 3:
        raise IndexError(
            f"lru_manage_rows: a top-k position is >= the dense map's width {hkeys.shape[1]} "
            "(positions index the token table, whose width sized the map)"
        )
    if rc == 4:
        raise ValueError(f"lru_manage_rows: an int16 dense map needs hot_tokens <= 32767, got {h}")
    return hit_mask, slots, miss_count, miss_tokens, miss_slots


@_lru_manage_rows_op.register_fake
def _(slot_token, slot_stamp, row_req, order, hkeys, hvals, maxpos, rows, topk, req_ids, stable_len, step, map_kind):
    b, k = topk.shape
    return (
        topk.new_empty((b, k), dtype=torch.bool),
        topk.new_empty((b, k), dtype=torch.int32),
        topk.new_empty((b,), dtype=torch.int32),
        topk.new_empty((b, k), dtype=torch.int32),
        topk.new_empty((b, k), dtype=torch.int32),
    )


@torch.library.custom_op("sglang_ascend_offload::copy_miss_rows_rows", mutates_args=("hot",), device_types="cpu")
def _copy_miss_rows_op(
    host: torch.Tensor,
    hot: torch.Tensor,
    rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    _copy_miss_rows_raw(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)


def _copy_miss_rows_raw(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table) -> None:
    r, h, d = hot.shape
    b, k = miss_tokens.shape
    rc = library().sao_copy_miss_rows(
        _ptr(host),
        host.shape[0],
        _ptr(hot),
        r,
        h,
        d * hot.element_size(),
        _ptr(token_table),
        token_table.shape[0],
        token_table.shape[1],
        _ptr(rows),
        _ptr(miss_tokens),
        _ptr(miss_slots),
        _ptr(miss_count),
        b,
        k,
    )
    if rc != 0:
        raise IndexError("copy_miss_rows_rows: a row, miss position, slot or host slot is out of range")


@_copy_miss_rows_op.register_fake
def _(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table):
    return None


# ------------------------------------------------------------------ python entry points
def lru_manage_rows(
    state: KernelLRUState, rows: torch.Tensor, topk: torch.Tensor, req_ids: torch.Tensor, stable_len: torch.Tensor, step
) -> Tuple[torch.Tensor, ...]:
    """One exact-LRU step of the batch rows (rows form of the contract).

    rows int64 ``[B]`` (state rows; real rows distinct, padding rows idle),
    topk int32 ``[B,K]``, req_ids int64 ``[B]``, stable_len int32 ``[B]``, step an
    int or a 0-d int64 tensor (strictly increasing per row). Returns
    ``(hit_mask, slots, miss_count, miss_tokens, miss_slots)`` ``[B,...]``.
    """
    if not torch.compiler.is_compiling():
        for name, t, dtype, dim in (
            ("rows", rows, torch.int64, 1),
            ("topk", topk, torch.int32, 2),
            ("req_ids", req_ids, torch.int64, 1),
            ("stable_len", stable_len, torch.int32, 1),
        ):
            _need(name, t, dtype, dim)
        if state.slot_token.shape[1] < topk.shape[1]:
            raise ValueError(f"hot_tokens {state.slot_token.shape[1]} < top_k {topk.shape[1]}")
        # eager: straight to the kernel (dispatching the custom op costs ~0.2 ms a call)
        return _lru_manage_rows_raw(*state.tensors(), rows, topk, req_ids, stable_len, int(step), state.map_kind)
    if not isinstance(step, torch.Tensor):
        step = torch.tensor(int(step), dtype=torch.int64)
    return _lru_manage_rows_op(*state.tensors(), rows, topk, req_ids, stable_len, step, state.map_kind)


def copy_miss_rows_rows(
    host: torch.Tensor,
    hot: torch.Tensor,
    rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    token_table: torch.Tensor,
) -> None:
    """hot ``[R,H,D]``: ``hot[rows[b], miss_slots[b,i]] = host[token_table[rows[b], miss_tokens[b,i]]]``
    for ``i < miss_count[b]`` (host ``[S,D]``, same dtype; token_table int32 ``[>R_real, max_ctx]``)."""
    if not torch.compiler.is_compiling():
        if host.dtype != hot.dtype or host.shape[-1] != hot.shape[-1]:
            raise ValueError(f"host {host.dtype} {tuple(host.shape)} and hot {hot.dtype} {tuple(hot.shape)} differ")
        for name, t in (("host", host), ("hot", hot), ("token_table", token_table)):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU tensor")
        if token_table.dtype != torch.int32:
            raise ValueError("token_table must be int32")
        _copy_miss_rows_raw(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)
        return
    _copy_miss_rows_op(host, hot, rows, miss_tokens, miss_slots, miss_count, token_table)


def build_cli(name: str, build_fn, library_fn, argv=None) -> int:
    """``python -m <kernel module> --build [--force]``: compile if needed, load, print the path.

    Shared by the LRU kernel (this module) and the score-aware kernel
    (``score_kernel.py``); ``scripts/setup_cpu_env.sh`` runs both. Exit 1 with the
    reason on stderr when the kernel cannot be built or loaded here.
    """
    parser = argparse.ArgumentParser(description=f"build the {name} CPU kernel")
    parser.add_argument("--build", action="store_true", help="compile the kernel if needed and print its path")
    parser.add_argument("--force", action="store_true", help="recompile even if the library exists")
    args = parser.parse_args(argv)
    try:
        path = build_fn(force=args.force)
        library_fn()
    except CPUKernelUnavailable as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv=None) -> int:
    return build_cli("cpu_kernel", build, library, argv)


if __name__ == "__main__":
    raise SystemExit(main())
