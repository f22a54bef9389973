"""Syntax-only compile of the AscendC kernels against the AscendC headers (no CANN needed).

Every kernel translation unit of ``ascendc_ops/kernels/`` is compiled with
``g++ -std=c++17 -fsyntax-only -D__NPU_ARCH__=2201`` once per ``__DAV_*`` variant the
toolkit build compiles a MIX (AIC:AIV 1:2) kernel for on A2/A3: ``__DAV_C220_VEC__``
(vector cores) and ``__DAV_C220_CUBE__`` (cube cores). This is the headers' NPU path
(``ASCENDC_CPU_DEBUG`` unset, ``ASCEND_IS_AIC`` an ``if constexpr``), the one bisheng
compiles; the CPU-debug path (``-DASCENDC_CPU_DEBUG=1``) compiles both core types in one
unit and does not see the per-variant code (with ``__DAV_C220_CUBE__`` it does not even
compile: its ``REGIST_MATMUL_OBJ`` names a vector-only global). The headers come from
:mod:`.headers`; what bisheng / tikicpulib declare comes from
``ascendc_ops/tools/ascendc_cpu_stubs/`` (force-included ``stub_def.h``, with the
generated ``stub_generated.h``). g++ then checks every AscendC API call of the kernels
(names, template arguments, argument lists, const-ness) against the real declarations.

A *negative control* compiles a copy of a kernel with one AscendC call mutated to a wrong
argument list; the check is only trusted when that copy fails.

Results are cached in ``ascendc_ops/build/kernel_check/cache/`` keyed by a SHA-256 over
the command line and the content of every file the preprocessor reads (listed by the
compile itself, ``-MD -MF``), so an unchanged kernel is not recompiled. At most two
compiles run at once (each needs ~350 MB and one core for ~16 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import headers as hdr

KERNELS_DIR = hdr.ASCENDC_OPS / "kernels"
STUB_DIR = hdr.ASCENDC_OPS / "tools" / "ascendc_cpu_stubs"
CACHE_DIR = hdr.BUILD / "cache"
MAX_JOBS = 2

# (name in reports, translation unit, kernel entry points it defines)
KERNEL_UNITS = (
    (
        "lightning_indexer_manage",
        "lightning_indexer_manage.cpp",
        ("sao_lightning_indexer_manage", "sao_quant_lightning_indexer_manage"),
    ),
    (
        "scatter_copy_sparse_flash_attention",
        "scatter_copy_sparse_flash_attention.cpp",
        ("sao_scatter_copy_sparse_flash_attention",),
    ),
    ("copy_miss_rows", "copy_miss_rows.cpp", ("sao_copy_miss_rows",)),
)
# variant name -> extra defines (what the toolkit's MIX build defines per core type on A2/A3)
VARIANTS = {"vec": ["-D__DAV_C220_VEC__"], "cube": ["-D__DAV_C220_CUBE__"]}

# The negative control: this call of sao_kernel_common.h is given a wrong argument list.
NEGATIVE_FILE = "sao_kernel_common.h"
NEGATIVE_UNIT = "lightning_indexer_manage.cpp"
NEGATIVE_FROM = "AscendC::DataCopyPad(dst, src, params, pad);"
NEGATIVE_TO = "AscendC::DataCopyPad(dst, src, params, pad, 7, 1.5f);"


class CompilerNotFound(RuntimeError):
    pass


@dataclass
class CompileResult:
    """One (unit, variant) compile.

    ok: g++ exited 0; errors: number of ``error:`` lines; seconds: wall time of this run
    (0 when cached); cached: taken from the cache; log: the first 4000 characters of stderr.
    """

    unit: str
    variant: str
    ok: bool
    errors: int
    seconds: float
    cached: bool
    log: str = ""


def compiler() -> str:
    """The runtime's compiler lookup (``ops.ascendc_model.compiler``), failing as :class:`CompilerNotFound`."""
    from ..ops.ascendc_model import ModelBuildError
    from ..ops.ascendc_model import compiler as find_compiler

    try:
        return find_compiler()
    except ModelBuildError as exc:
        raise CompilerNotFound(str(exc)) from None


def compile_command(
    headers: hdr.AscendcHeaders, source: Path, variant: str, include_dirs: Sequence[Path] = ()
) -> List[str]:
    cmd = [
        compiler(),
        "-std=c++17",
        "-fsyntax-only",
        "-w",
        "-D__NPU_ARCH__=2201",
        "-DASCENDC_DUMP=0",
        *VARIANTS[variant],
        "-include",
        str(STUB_DIR / "stub_def.h"),
        "-I",
        str(STUB_DIR),
    ]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    for d in headers.include_dirs:
        cmd += ["-I", str(d)]
    cmd.append(str(source))
    return cmd


def _kernel_includes() -> List[Path]:
    return [hdr.ASCENDC_OPS / "include", KERNELS_DIR]


def _read_deps(dep_file: Path) -> List[str]:
    """Files the preprocessor read (the ``-MD -MF`` output of the compile itself)."""
    try:
        text = dep_file.read_text().replace("\\\n", " ")
    except OSError:
        return []
    files = text.split(":", 1)[1].split() if ":" in text else []
    return sorted(set(files))


def _key(cmd: List[str], files: List[str]) -> str:
    h = hashlib.sha256()
    h.update("\0".join(cmd).encode())
    for f in files:
        h.update(f.encode())
        try:
            h.update(hashlib.sha256(Path(f).read_bytes()).digest())
        except OSError:
            h.update(b"missing")
    return h.hexdigest()


def _cached_deps(cmd: List[str]) -> Optional[List[str]]:
    """Dependency list recorded for this exact command (refreshed on every real compile)."""
    f = CACHE_DIR / ("deps-" + hashlib.sha256("\0".join(cmd).encode()).hexdigest()[:32] + ".json")
    if f.is_file():
        try:
            return json.loads(f.read_text())
        except ValueError:
            return None
    return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _store_deps(cmd: List[str], deps: List[str]) -> None:
    f = CACHE_DIR / ("deps-" + hashlib.sha256("\0".join(cmd).encode()).hexdigest()[:32] + ".json")
    _write_atomic(f, json.dumps(deps))


def compile_one(
    headers: hdr.AscendcHeaders, source: Path, variant: str, unit: str, use_cache: bool = True
) -> CompileResult:
    cmd = compile_command(headers, source, variant, _kernel_includes())
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    deps = _cached_deps(cmd) if use_cache else None
    if deps:
        key = _key(cmd, deps)
        hit = CACHE_DIR / f"{key}.json"
        if hit.is_file():
            d = json.loads(hit.read_text())
            return CompileResult(unit, variant, d["ok"], d["errors"], 0.0, True, d["log"])
    t0 = time.monotonic()
    dep_file = CACHE_DIR / f"deps-{os.getpid()}-{threading.get_ident()}.d"
    res = subprocess.run(cmd + ["-MD", "-MF", str(dep_file)], capture_output=True, text=True)
    seconds = time.monotonic() - t0
    errors = len(re.findall(r"\berror:", res.stderr))
    result = CompileResult(unit, variant, res.returncode == 0, errors, seconds, False, res.stderr[:4000])
    deps = _read_deps(dep_file)
    dep_file.unlink(missing_ok=True)
    if use_cache:
        if deps:
            _store_deps(cmd, deps)
            key = _key(cmd, deps)
            _write_atomic(CACHE_DIR / f"{key}.json", json.dumps({"ok": result.ok, "errors": errors, "log": result.log}))
    return result


def negative_control_source() -> Path:
    """A copy of the kernels folder with one AscendC call given a wrong argument list.

    The folder is named by a hash of the kernels' content (so the compile cache applies
    and concurrent runs never rewrite a folder another run is compiling)."""
    h = hashlib.sha256()
    for f in sorted(KERNELS_DIR.iterdir()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    neg = hdr.BUILD / f"negative_control-{h.hexdigest()[:16]}"
    if not (neg / NEGATIVE_UNIT).is_file():
        tmp = hdr.BUILD / f"negative_control.{os.getpid()}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(KERNELS_DIR, tmp)
        common = tmp / NEGATIVE_FILE
        text = common.read_text()
        if NEGATIVE_FROM not in text:
            shutil.rmtree(tmp)
            raise RuntimeError(
                f"negative control: {NEGATIVE_FROM!r} not found in kernels/{NEGATIVE_FILE}; "
                "update NEGATIVE_FROM in kernel_check/compile_check.py"
            )
        common.write_text(text.replace(NEGATIVE_FROM, NEGATIVE_TO, 1))
        try:
            tmp.rename(neg)
        except OSError:  # another run made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return neg / NEGATIVE_UNIT


def shadowed_headers(headers: hdr.AscendcHeaders, folders: Sequence[Path] = ()) -> List[str]:
    """Our kernel-side headers whose file name is also an AscendC header's.

    The AscendC headers include each other by quoted bare names (``#include
    "kernel_common.h"``); with ``ascendc_ops/kernels`` or ``ascendc_ops/include`` on the
    include path, a file of ours with such a name would be picked up in place of the
    toolkit's, whichever compiler builds it."""
    folders = list(folders) or _kernel_includes()
    theirs: Dict[str, Path] = {}
    gen = hdr.generated_dir(headers.root) if headers.layout == "devkit" else None
    for d in headers.include_dirs:
        if d == gen or not d.is_dir():
            continue
        for f in d.rglob("*.h"):
            theirs.setdefault(f.name, f)
    found = []
    for folder in folders:
        for f in sorted(folder.glob("*.h")):
            if f.name in theirs:
                found.append(
                    f"{f.relative_to(folder.parent)} has the name of the AscendC header {theirs[f.name]}: "
                    "rename it (the headers' quoted includes would find ours instead)"
                )
    return found


@dataclass
class CompileReport:
    """All compiles of one check: ``results`` per (unit, variant), the negative control,
    the headers used and the total wall time."""

    headers: hdr.AscendcHeaders
    results: List[CompileResult] = field(default_factory=list)
    negative: Optional[CompileResult] = None
    seconds: float = 0.0
    shadowing: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            all(r.ok for r in self.results)
            and self.negative is not None
            and not self.negative.ok
            and not self.shadowing
        )


def run(
    jobs: int = MAX_JOBS, use_cache: bool = True, negative: bool = True, headers: Optional[hdr.AscendcHeaders] = None
) -> CompileReport:
    """Compile every (kernel unit, variant), plus the negative control; at most ``jobs`` at once."""
    t0 = time.monotonic()
    headers = headers or hdr.locate()
    hdr.prepare(headers)
    tasks = [(KERNELS_DIR / src, variant, name) for name, src, _ in KERNEL_UNITS for variant in VARIANTS]
    neg_task = None
    if negative:
        neg_task = (negative_control_source(), "vec", "negative_control")
    jobs = max(1, min(jobs, MAX_JOBS))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compile_one, headers, s, v, n, use_cache) for s, v, n in tasks]
        neg_future = pool.submit(compile_one, headers, *neg_task, use_cache) if neg_task else None
        results = [f.result() for f in futures]
        neg = neg_future.result() if neg_future else None
    return CompileReport(headers, results, neg, time.monotonic() - t0, shadowed_headers(headers))
