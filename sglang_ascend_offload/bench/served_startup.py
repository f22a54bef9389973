"""What the served benchmarks read about a server before it answers: the error lines of
a server that did not start, and the vocabulary of the model it serves (the range of
prompt token ids)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Optional

from . import served_load

# The last lines of a server log that name an error (Python exceptions, SGLang's own
# "... failed" lines), shown as a run's ``error`` when its server does not start.
ERROR_LINE = re.compile(r"^(?:\S+: )?(?:[\w.]*(?:Error|Exception|Exit)\b.*|.*\b(?:[Ff]ailed|refus\w+)\b.*)$")


def startup_error(exc: BaseException, log_path: Optional[Path], blocks: int = 3) -> str:
    """The launcher's exception plus the last error lines of the server log (each with
    the indented lines that follow it, e.g. the numbered problems of a ``ConfigError``)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines() if log_path else []
    except OSError:
        lines = []
    found: List[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line and ERROR_LINE.match(line):
            block = [line[:600]]
            while (
                i + 1 < len(lines)
                and lines[i + 1].startswith(("  ", "\t"))
                and len(block) < 8
                and not lines[i + 1].lstrip().startswith(("File ", "^"))
            ):
                i += 1
                block.append(lines[i].strip()[:600])
            text = "\n    ".join(block)
            if text not in found[-1:]:
                found.append(text)
        i += 1
    tail = found[-blocks:]
    return f"{type(exc).__name__}: {exc}" + "".join(f"\n  {t}" for t in tail)


def model_vocab(model_path: Optional[str], trained: bool = False) -> int:
    """The vocabulary size of ``model_path`` (its ``config.json``), of the trained tiny
    fixture with ``trained``, else of the random-weight tiny fixture."""
    if model_path is None and not trained:
        return served_load.VOCAB
    if model_path is None:
        from ..testing.servers import TINY_DSA_TRAINED

        model_path = str(TINY_DSA_TRAINED)
    cfg = Path(model_path) / "config.json"
    try:
        return int(json.loads(cfg.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--model-path {model_path}: cannot read vocab_size from {cfg} ({exc})") from None
