"""Where the AscendC headers are, and the generated pieces a compile against them needs.

Two layouts are understood:

* ``devkit``: the open-source asc-devkit tree (``include/``, ``impl/``, ``cmake/``), as in
  ``../shared/third_party/asc-devkit-8.5.0`` next to the repository. The toolkit's build
  generates ``kernel_tiling/kernel_tiling.h`` (``impl/adv_api/cmake/scripts/
  gen_kernel_tiling_data_def.py``) and installs header links (``tikcfw/lib`` -> the
  high-level API folder, whose ``matmul_intf.h`` links to ``matmul/matmul_intf.h``); both
  are recreated here in a build folder of this project, never in the devkit tree.
* ``toolkit``: an installed CANN toolkit (``$ASCEND_HOME_PATH``) with
  ``compiler/tikcpp/tikcfw`` (or ``tools/tikcpp/tikcfw``), where those pieces already exist.

Lookup order: ``$SAO_ASCENDC_HEADERS`` (either layout), then ``$ASCEND_HOME_PATH``, then
``<repo>/../shared/third_party/asc-devkit-8.5.0``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
ASCENDC_OPS = REPO / "ascendc_ops"
BUILD = ASCENDC_OPS / "build" / "kernel_check"
DEFAULT_DEVKIT = REPO.parent / "shared" / "third_party" / "asc-devkit-8.5.0"
ENV_VAR = "SAO_ASCENDC_HEADERS"


class HeadersNotFound(RuntimeError):
    """No AscendC headers where they were looked for (the message says what to set)."""


@dataclass(frozen=True)
class AscendcHeaders:
    """A located header tree.

    root:     the tree's root folder;
    layout:   ``"devkit"`` or ``"toolkit"``;
    version:  what ``version.info`` (or the toolkit's version file) says, e.g. ``8.5.0-beta.1``;
    include_dirs: ``-I`` folders in order (generated folder first);
    source:   how it was found (``"$SAO_ASCENDC_HEADERS"``, ``"$ASCEND_HOME_PATH"``, ``"default"``).
    """

    root: Path
    layout: str
    version: str
    include_dirs: List[Path] = field(default_factory=list)
    source: str = "default"


def _version(root: Path) -> str:
    for name in ("version.info", "compiler/version.info", "version.cfg"):
        f = root / name
        if f.is_file():
            m = re.search(r"^Version=(\S+)", f.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
    return "unknown"


def _is_devkit(p: Path) -> bool:
    return (p / "include" / "kernel_operator.h").is_file() and (p / "impl" / "basic_api").is_dir()


def _tikcfw(p: Path) -> Optional[Path]:
    for sub in ("compiler/tikcpp/tikcfw", "tools/tikcpp/tikcfw", "tikcpp/tikcfw"):
        if (p / sub / "kernel_operator.h").is_file():
            return p / sub
    return None


def locate() -> AscendcHeaders:
    """Find the headers (see the module docstring); raise :class:`HeadersNotFound` if none."""
    tried = []
    candidates = []
    if os.environ.get(ENV_VAR):
        candidates.append((Path(os.environ[ENV_VAR]), f"${ENV_VAR}"))
    elif os.environ.get("ASCEND_HOME_PATH"):
        candidates.append((Path(os.environ["ASCEND_HOME_PATH"]), "$ASCEND_HOME_PATH"))
    candidates.append((DEFAULT_DEVKIT, "default"))
    for path, source in candidates:
        tried.append(f"{source}={path}")
        if _is_devkit(path):
            return AscendcHeaders(path.resolve(), "devkit", _version(path), _devkit_dirs(path.resolve()), source)
        tik = _tikcfw(path)
        if tik is not None:
            dirs = [tik, tik / "impl", tik / "interface", tik / "kernel_tiling", tik / "lib"]
            return AscendcHeaders(path.resolve(), "toolkit", _version(path), [d for d in dirs if d.is_dir()], source)
        if source != "default":
            break  # an explicit setting that does not hold headers is an error, not a fallback
    raise HeadersNotFound(
        "AscendC headers not found (tried " + ", ".join(tried) + "). Set "
        f"{ENV_VAR} to an asc-devkit tree (include/, impl/) or to a CANN toolkit root, or "
        "put the asc-devkit 8.5.0 headers at ../shared/third_party/asc-devkit-8.5.0."
    )


def _devkit_dirs(root: Path) -> List[Path]:
    gen = generated_dir(root)
    return [
        gen,
        root,
        root / "include",
        root / "include" / "basic_api",
        root / "include" / "adv_api",
        root / "impl",
        root / "impl" / "basic_api",
        root / "impl" / "micro_api",
        root / "impl" / "micro_api_inc",
    ]


def generated_dir(root: Path) -> Path:
    return BUILD / f"gen-{_version(root)}"


def prepare(headers: AscendcHeaders) -> None:
    """Create the generated headers / links of a devkit tree (idempotent, in BUILD only)."""
    if headers.layout != "devkit":
        return
    gen = generated_dir(headers.root)
    tiling = gen / "kernel_tiling" / "kernel_tiling.h"
    if not tiling.is_file():
        tiling.parent.mkdir(parents=True, exist_ok=True)
        script = headers.root / "impl" / "adv_api" / "cmake" / "scripts" / "gen_kernel_tiling_data_def.py"
        tmp = tiling.with_suffix(".tmp")
        subprocess.run(
            [sys.executable, str(script), str(headers.root / "include" / "adv_api"), str(tmp)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        tmp.replace(tiling)
    # tikcfw/lib -> the high-level API folder; lib/matmul_intf.h -> matmul/matmul_intf.h
    # (impl/adv_api/cmake/kernel_directory.cmake and kernel_headers.cmake). A forwarding
    # header instead of a link keeps the devkit's own relative includes resolving.
    lib = gen / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    target = headers.root / "include" / "adv_api" / "matmul" / "matmul_intf.h"
    fwd = lib / "matmul_intf.h"
    text = f'// generated: the toolkit installs lib/matmul_intf.h as a link to this file\n#include "{target}"\n'
    if not fwd.is_file() or fwd.read_text() != text:
        fwd.write_text(text)
