"""Entry point of the SGLang plugin (group ``sglang.srt.plugins``, name ``ascend_offload``).

SGLang 0.5.23 calls :func:`register` from ``load_plugins()`` in every one of its
processes: the launcher (before it parses the command line), ``Engine.__init__``,
each scheduler, the detokenizer and the DP controller. It is idempotent per process.

Version policy. Only SGLang 0.5.23 is supported: the plugin leans on that
release's internal names (resolution step names, class paths). ``load_plugins()``
catches and logs anything a plugin raises and carries on, so raising here would
not stop a server; instead, on another SGLang version the plugin logs an error
once, registers its flags only (so ``--help`` still documents them), and refuses
any use of them with :class:`~.args.flags.UnsupportedSGLangVersion` at argument
parsing. SGLang itself then runs exactly as without the plugin.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from .. import SUPPORTED_SGLANG_VERSION as SUPPORTED_SGLANG  # the one version constant
from .compat import installed_sglang_version

logger = logging.getLogger("sglang_ascend_offload")

_registered = False


def version_problem(found: Optional[str]) -> str:
    """Empty when ``found`` is supported, else a sentence saying what is wrong."""
    if found is None:
        return "SGLang is not installed (no 'sglang' distribution found)"
    if found != SUPPORTED_SGLANG:
        return f"SGLang {found} is installed and sglang-ascend-offload supports SGLang {SUPPORTED_SGLANG} only"
    return ""


def register() -> None:
    """Register the plugin with SGLang (see the module docstring). Returns ``None``."""
    global _registered
    if _registered:
        return
    _registered = True
    from . import install

    problem = version_problem(installed_sglang_version())
    if problem:
        logger.error("sglang-ascend-offload is inactive: %s.", problem)
        install.install_flags(refuse_reason=problem)
        return
    install.install_flags()
    install.install_runtime()
    logger.info(
        "sglang-ascend-offload %s active in process %d (SGLang %s)", _package_version(), os.getpid(), SUPPORTED_SGLANG
    )


def is_registered() -> bool:
    return _registered


def _package_version() -> str:
    from ..versions import installed_version

    return installed_version("sglang-ascend-offload") or "(unknown version)"
