"""The SoC and CANN version of the *installed* CANN build, read from its own files.

Sparse decode offload refuses Ascend 950PR/950DT nodes, and the check has to run before
any offload allocation without initialising the NPU or asking the runtime for the SoC.
This module answers from the files the CANN installers leave on disk; it never imports
``torch_npu`` or ``acl`` and never opens a device.

Files read (``<cann>`` is ``$ASCEND_HOME_PATH``, else ``$ASCEND_TOOLKIT_HOME``, else the
first of ``/usr/local/Ascend/cann``, ``/usr/local/Ascend/ascend-toolkit/latest`` that
exists; ``<opp>`` is ``$ASCEND_OPP_PATH``, else ``<cann>/opp``):

* CANN version: ``<cann>/<arch>-linux/ascend_toolkit_install.info`` (then
  ``<cann>/ascend_toolkit_install.info``), ``key=value`` lines, the ``version=`` line
  (e.g. ``version=8.5.0``). Documented in the CANN 8.5.0 installation guide, "File
  Paths" (hiascend.com, softwareinst/instg/instg_0044: "Path for recording information
  such as the software package version, CPU architecture, and installation path").
  Fallback: ``<cann>/version.info`` or ``<cann>/toolkit/version.info`` (``Version=...``
  lines, the format the AscendC build scripts of asc-devkit 8.5.0 read with
  ``grep Version -w .../toolkit/version.info``).
* SoC: the per-SoC operator kernel directories the CANN operator package (the
  ``ops`` / ``kernels`` package of one SoC, installed on top of the toolkit) fills,
  ``<opp>/built-in/op_impl/ai_core/tbe/kernel/<short soc>/``. The short names are
  CANN's own (asc-devkit 8.5.0 ``cmake/asc/fwk_modules/util/opdesc_parser.py``,
  ``SOC_TO_SHORT_SOC_MAP``): ``ascend910b`` (Atlas A2, Ascend910B1..B4),
  ``ascend910_93`` (Atlas A3, Ascend910_93xx), ``ascend910_95`` (the Ascend 950PR/950DT
  series, Ascend910_95xx; ``platform_ascendc.h`` ``SocVersion::ASCEND910_95``).
  A directory counts as installed when it holds an operator directory with at least
  one file; the toolkit alone leaves only its ``ops_oam`` helper there, which is
  ignored.

Decision (:func:`detect`): exactly one installed family -> that SoC; the 950 series
among several -> 950 (a build carrying 950 kernels may be serving a 950, so the
refusal holds; install only the A2/A3 operator package to lift it); several A2/A3
families, or none, or an unreadable tree -> undecided, with the reason. An undecided
answer never passes: the deployment records it and ``sparse_decode.soc_unknown``
refuses (``config.py``).
"""

from __future__ import annotations

import os
import platform as _py_platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

#: short SoC directory name (CANN's) -> (SoC name for the deployment, family)
KERNEL_DIRS: Tuple[Tuple[str, str, str], ...] = (
    ("ascend910_95", "Ascend910_95", "950"),
    ("ascend950", "Ascend950", "950"),
    ("ascend910_93", "Ascend910_93", "A3"),
    ("ascend910b", "Ascend910B", "A2"),
)
#: entries of a kernel directory that the toolkit installs without any operator package
TOOLKIT_ONLY_ENTRIES = frozenset({"ops_oam", "config"})
DEFAULT_ROOTS = ("/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest")
KERNEL_SUBDIR = Path("built-in/op_impl/ai_core/tbe/kernel")
SET_ENV_HINT = (
    "source the CANN environment first: source /usr/local/Ascend/ascend-toolkit/set_env.sh "
    "(or <install>/cann/set_env.sh), which sets ASCEND_HOME_PATH"
)


@dataclass(frozen=True)
class CannInstall:
    """What the installed CANN build says about itself.

    root: the CANN install directory used (``None`` = none found). version: the
    toolkit version (``None`` = unreadable). version_file: the file it came from.
    soc: SoC name for :class:`config.Deployment` (``Ascend910B``, ``Ascend910_93``,
    ``Ascend910_95``) or ``None`` when undecided; family: its family (``A2``, ``A3``,
    ``950``). installed_families: every family whose operator kernels are installed.
    reason: why the SoC is undecided (``None`` when ``soc`` is set). notes: any other
    facts worth printing (e.g. a 950 build that also carries A3 kernels).
    """

    root: Optional[str]
    version: Optional[str]
    version_file: Optional[str]
    soc: Optional[str]
    family: Optional[str]
    installed_families: Tuple[str, ...] = ()
    reason: Optional[str] = None
    notes: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def decided(self) -> bool:
        return self.soc is not None


def cann_root(env: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """The CANN install directory: ``$ASCEND_HOME_PATH``, ``$ASCEND_TOOLKIT_HOME``, then
    the default install locations; ``None`` if none exists."""
    env = os.environ if env is None else env
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        value = env.get(var)
        if value:
            return Path(value)
    for candidate in DEFAULT_ROOTS:
        if Path(candidate).is_dir():
            return Path(candidate)
    return None


def read_key_values(path: Path) -> Dict[str, str]:
    """``key=value`` lines of an install-info file (keys lower-cased, quotes stripped);
    raises ``OSError`` when the file cannot be read."""
    out: Dict[str, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        text = line.strip()
        if not text or text.startswith("#") or "=" not in text:
            continue
        key, _, value = text.partition("=")
        out[key.strip().lower()] = value.strip().strip('"').strip("'")
    return out


def _version(root: Path, arch: str) -> Tuple[Optional[str], Optional[str], Tuple[str, ...]]:
    candidates = (
        root / f"{arch}-linux" / "ascend_toolkit_install.info",
        root / "ascend_toolkit_install.info",
        root / "version.info",
        root / "toolkit" / "version.info",
    )
    problems = []
    for path in candidates:
        if not path.is_file():
            continue
        try:
            values = read_key_values(path)
        except OSError as exc:
            problems.append(f"{path}: unreadable ({exc.strerror or exc})")
            continue
        if values.get("version"):
            return values["version"], str(path), tuple(problems)
        problems.append(f"{path}: no version= line")
    return None, None, tuple(problems)


def _installed_kernel_dirs(kernel_root: Path) -> Tuple[Tuple[str, ...], Optional[str]]:
    """Short SoC names whose kernel directory holds operator kernels, or a reason."""
    try:
        entries = sorted(p.name for p in kernel_root.iterdir() if p.is_dir())
    except OSError as exc:
        return (), f"{kernel_root} is unreadable ({exc.strerror or exc})"
    found = []
    for name in entries:
        soc_dir = kernel_root / name
        try:
            ops = [p for p in soc_dir.iterdir() if p.is_dir() and p.name not in TOOLKIT_ONLY_ENTRIES]
            if any(any(f.is_file() for f in op.iterdir()) for op in ops):
                found.append(name)
        except OSError:
            continue
    return tuple(found), None


def _family_of_dir(name: str) -> Optional[Tuple[str, str]]:
    for prefix, soc, family in KERNEL_DIRS:
        if name == prefix or name.startswith(prefix):
            return soc, family
    return None


def detect(env: Optional[Mapping[str, str]] = None, arch: Optional[str] = None) -> CannInstall:
    """Read the installed CANN build (see the module docstring). Never raises for a
    missing or broken install: the answer says what could not be read."""
    env = os.environ if env is None else env
    arch = arch or _py_platform.machine() or "x86_64"
    root = cann_root(env)
    if root is None:
        return CannInstall(
            None,
            None,
            None,
            None,
            None,
            reason=f"no CANN install found (ASCEND_HOME_PATH unset, none of {', '.join(DEFAULT_ROOTS)}); "
            + SET_ENV_HINT,
        )
    if not root.is_dir():
        return CannInstall(
            str(root),
            None,
            None,
            None,
            None,
            reason=f"the CANN install directory {root} does not exist; " + SET_ENV_HINT,
        )
    version, version_file, version_notes = _version(root, arch)
    opp = Path(env.get("ASCEND_OPP_PATH") or root / "opp")
    kernel_root = opp / KERNEL_SUBDIR
    base = dict(root=str(root), version=version, version_file=version_file)
    if not kernel_root.is_dir():
        return CannInstall(
            **base,
            soc=None,
            family=None,
            notes=version_notes,
            reason=f"{kernel_root} does not exist: no CANN operator package is installed, so the "
            "build does not say which SoC it serves; install the A2 / A3 operator package",
        )
    dirs, problem = _installed_kernel_dirs(kernel_root)
    if problem:
        return CannInstall(**base, soc=None, family=None, notes=version_notes, reason=problem)
    known: Dict[str, str] = {}
    unknown = []
    for name in dirs:
        hit = _family_of_dir(name)
        if hit is None:
            unknown.append(name)
        else:
            known.setdefault(hit[1], hit[0])
    families = tuple(sorted(known))
    notes = version_notes + ((f"kernel directories of other SoCs: {', '.join(unknown)}",) if unknown else ())
    if "950" in known:
        extra = tuple(f for f in families if f != "950")
        if extra:
            notes += (
                f"the build also carries {', '.join(extra)} kernels; a build with Ascend 950 kernels is "
                "treated as a 950 node",
            )
        return CannInstall(**base, soc=known["950"], family="950", installed_families=families, notes=notes)
    if len(known) == 1:
        ((family, soc),) = known.items()
        return CannInstall(**base, soc=soc, family=family, installed_families=families, notes=notes)
    if not known:
        reason = (
            f"no operator kernels of a known SoC under {kernel_root} (found: {', '.join(dirs) or 'none'}); "
            "install the CANN operator package of this node's SoC (A2 or A3)"
        )
    else:
        reason = (
            f"the build carries kernels of several SoC families ({', '.join(families)}) under {kernel_root}, "
            "so it does not say which one this node is"
        )
    return CannInstall(**base, soc=None, family=None, installed_families=families, notes=notes, reason=reason)


def deployment_soc(
    runtime_soc: Optional[str] = None, env: Optional[Mapping[str, str]] = None
) -> Tuple[Optional[str], Optional[str]]:
    """``(soc, soc_unknown)`` for an NPU deployment: the installed build's SoC, or
    ``None`` and the reason it is undecided.

    ``runtime_soc`` (the device's own name, where the caller already has it) is a
    cross-check only: it decides between several installed A2/A3 families, and a
    family that contradicts the installed build makes the answer undecided.
    """
    from .soc import soc_family

    info = detect(env)
    runtime_family = soc_family(runtime_soc) if runtime_soc else None
    if info.decided:
        if runtime_family and info.family != "950" and runtime_family != info.family:
            return None, (
                f"the installed CANN build serves {info.family} ({info.soc}) but the device reports "
                f"{runtime_soc!r} ({runtime_family}); install the operator package of this SoC"
            )
        return info.soc, None
    if runtime_family and runtime_family in info.installed_families and runtime_family != "950":
        return runtime_soc, None
    return None, info.reason
