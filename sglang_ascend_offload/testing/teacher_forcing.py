"""Held-out text through a server's *decode* path: teacher forcing with a logit processor.

A prompt's logprobs (``logprob_start_len``) come from the prefill forward, which never runs
the sparse decode engine (its hot buffers, residency, the fused Copy-SFA). To score
held-out tokens through decode, a request carries :class:`TeacherForced` (SGLang's custom
logit processor; the server needs ``--enable-custom-logit-processor``) with the held-out
continuation ``forced``: at output step ``i`` it records the model's log-probability of
``forced[i]`` and its top-2 gap from the untouched logits (one JSON line per step in the
file ``record``), then lets only ``forced[i]`` be sampled. Step 0 is scored by the
prefill forward, steps ``1..`` by decode steps over the real held-out context.

The processor runs in the server's scheduler process and is sent by reference (it lives
in this importable module), so the server must run from this source tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

try:  # the base class is SGLang's; the module also loads where SGLang is absent (docs builds)
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
except ImportError:  # pragma: no cover
    CustomLogitProcessor = object  # type: ignore[misc,assignment]

#: the server argument the processor needs
SERVER_ARGS = ["--enable-custom-logit-processor"]


class TeacherForced(CustomLogitProcessor):
    """Record ``log p(forced[i])`` and the top-2 gap at output step ``i``, then force ``forced[i]``.

    custom_params: ``forced`` (token ids), ``record`` (a file path), ``tag`` (any string,
    copied to each record). Rows without ``forced`` pass unchanged.
    """

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict]] = None) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            if not params or "forced" not in params:
                continue
            step = len(params["__req__"].output_ids)
            forced = params["forced"]
            if step >= len(forced):
                continue
            logprobs = torch.log_softmax(logits[i].float(), dim=-1)
            top = torch.topk(logprobs, 2)
            row = {
                "tag": params.get("tag", ""),
                "step": step,
                "token": int(forced[step]),
                "logprob": float(logprobs[forced[step]]),
                "argmax": int(top.indices[0]),
                "top2_gap": float(top.values[0] - top.values[1]),
            }
            with open(params["record"], "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            logits[i].fill_(float("-inf"))
            logits[i, forced[step]] = 0.0
        return logits


@dataclass(frozen=True)
class ForcedStep:
    tag: str
    step: int
    token: int
    logprob: float
    argmax: int
    top2_gap: float


def request(prompt: Sequence[int], forced: Sequence[int], record: Path, tag: str) -> dict:
    """The ``/generate`` body of one teacher-forced request (greedy, ``len(forced)`` tokens)."""
    return {
        "input_ids": list(prompt),
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": len(forced),
            "ignore_eos": True,
            "custom_params": {"forced": list(forced), "record": str(record), "tag": tag},
        },
        "custom_logit_processor": TeacherForced.to_str(),
    }


def read(record: Path) -> Dict[str, List[ForcedStep]]:
    """The recorded steps per tag, in step order."""
    out: Dict[str, List[ForcedStep]] = {}
    for line in Path(record).read_text().splitlines():
        s = ForcedStep(**json.loads(line))
        out.setdefault(s.tag, []).append(s)
    return {tag: sorted(steps, key=lambda s: s.step) for tag, steps in out.items()}


def decode_nll(steps: Dict[str, List[ForcedStep]]) -> float:
    """Mean negative log-likelihood (nats/token) of the decode-path steps (step >= 1)."""
    values = [-s.logprob for per_tag in steps.values() for s in per_tag if s.step >= 1]
    return sum(values) / len(values)


def heldout_windows(model: Path) -> List[List[int]]:
    """The held-out token windows a trained fixture was evaluated on (``heldout_eval.json``)."""
    return json.loads((Path(model) / "heldout_eval.json").read_text())["windows"]


def heldout_prompt(model: Path, tokens: int, seed: int) -> List[int]:
    """``tokens`` consecutive held-out token ids of a trained fixture (``tokens <=`` a window's
    length), from window ``seed % windows`` at an offset ``seed`` picks: real source text."""
    wins = heldout_windows(model)
    win = wins[seed % len(wins)]
    if tokens > len(win):
        raise ValueError(f"a held-out prompt of {tokens} tokens is longer than a window ({len(win)})")
    start = (seed * 97) % (len(win) - tokens + 1)
    return win[start : start + tokens]
