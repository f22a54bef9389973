"""``python -m sglang_ascend_offload capacity``: flags, input checking, table and JSON.

Every flag value is read as text and converted here, so that every problem (a
non-number, a size <= 0, hot tokens below top-k, a model config missing keys...)
is reported in one message, exit status 2. The computation is :mod:`.capacity`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional

from .capacity import GIB, MIB, CapacityInputs, CapacityReport, input_problems, plan
from .errors import ConfigError, Violation
from .model_specs import INDEXER_DTYPES, PRESETS, ModelShape, load_hf_config, preset

DEFAULT_MODEL = "deepseek-v3.2"

# dest -> kind: "gib" float GiB, "int", "tokens" (int, k/m suffix = 2^10 / 2^20)
_NUMBERS: Dict[str, str] = {
    "hbm_gb": "gib",
    "host_gb": "gib",
    "weights_gb": "gib",
    "tp": "int",
    "dp": "int",
    "pcp": "int",
    "context": "tokens",
    "page_size": "int",
    "hot_tokens": "tokens",
    "rows": "int",
    "rows_per_request": "int",
    "decode_extra_slots": "int",
    "shared_buffers": "int",
    "independent_layers": "int",
    "prefill_tokens": "tokens",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", help=f"preset: {', '.join(sorted(PRESETS))} (default {DEFAULT_MODEL})")
    model.add_argument(
        "--model-config", metavar="PATH", help="HuggingFace config.json (or its directory) instead of a preset"
    )
    model.add_argument(
        "--indexer-dtype",
        choices=INDEXER_DTYPES,
        help="indexer key dtype: bf16 (default for the presets) or int8 (LIM-C8)",
    )
    model.add_argument(
        "--mtp", action="store_true", help="speculative decoding with the model's MTP layers (their KV is counted)"
    )
    machine = parser.add_argument_group("machine")
    machine.add_argument(
        "--hbm-gb", metavar="GIB", help="HBM per device (GiB) available to KV: after weights, activations, workspace"
    )
    machine.add_argument(
        "--weights-gb",
        metavar="GIB",
        default="0",
        help="subtracted from --hbm-gb first (pass the whole HBM plus the weights share)",
    )
    machine.add_argument("--host-gb", metavar="GIB", help="host memory of the node (GiB) for host KV pools")
    machine.add_argument("--tp", default="1", help="attention TP size per DP rank (MLA KV replicated over it)")
    machine.add_argument("--dp", default="1", help="DP ranks (each its own KV pools and host pool)")
    machine.add_argument("--pcp", default="1", help="prefill context parallel size (KVPP group = tp * pcp)")
    work = parser.add_argument_group("workload and knobs")
    work.add_argument("--context", default="131072", help="tokens per request (k/m suffix: x1024 / x1048576)")
    work.add_argument("--page-size", default="128", help="KV page size in tokens")
    work.add_argument(
        "--hot-tokens",
        help="sparse decode hot slots per layer and request, shared by its verify rows (default "
        "2 x top-k rounded up to the page size, as the server resolves it); at least top-k (verify rounds "
        "whose union exceeds it use the overflow area, counted per request)",
    )
    work.add_argument(
        "--rows",
        help="fixed requests with a hot row (default: one per request); the engine adds its "
        "padding slot and sink row either way",
    )
    work.add_argument(
        "--rows-per-request",
        help="decode (verify) rows per request (default 1, 1 + MTP layers with "
        "--mtp; e.g. 4 for MTP with 3 draft tokens)",
    )
    work.add_argument(
        "--decode-extra-slots",
        help="a P/D decode's --disaggregation-decode-extra-slots: request slots with a hot row each (default 0)",
    )
    work.add_argument("--shared-buffers", default="4", help="layerwise prefill shared buffers B")
    work.add_argument("--independent-layers", default="1", help="layerwise prefill independent layers I")
    work.add_argument(
        "--prefill-tokens", help="tokens in the layerwise buffers of the colocated mode (default --context)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"modes": [{"name", "device_bytes_per_token", "host_bytes_per_token", '
        '"tokens", "requests", "limited_by", ...}], ...}',
    )


def _number(flag: str, kind: str, text: str, problems: List[Violation]) -> Optional[float]:
    t = text.strip().lower()
    try:
        if kind == "gib":
            return float(t)
        scale = 1
        if kind == "tokens" and t[-1:] in ("k", "m"):
            scale, t = (1024 if t[-1] == "k" else 1024 * 1024), t[:-1]
        return int(t) * scale
    except ValueError:
        want = (
            "a number of GiB" if kind == "gib" else "an integer" + (" (k/m suffix allowed)" if kind == "tokens" else "")
        )
        problems.append(Violation("capacity.parse", f"{flag} {text!r} is not {want}", f"pass {want}"))
        return None


def inputs_from_args(args: argparse.Namespace):
    """``(model, inputs)`` from parsed flags; ConfigError listing every problem."""
    problems: List[Violation] = []
    values: Dict[str, Any] = {}
    for dest, kind in _NUMBERS.items():
        text = getattr(args, dest, None)
        flag = "--" + dest.replace("_", "-")
        if text is None:
            if dest in ("hbm_gb", "host_gb"):
                problems.append(Violation("capacity.missing", f"{flag} is missing", f"pass {flag} (GiB)"))
            continue
        value = _number(flag, kind, str(text), problems)
        if value is not None:
            values[dest] = value
    model: Optional[ModelShape] = None
    try:
        if args.model and args.model_config:
            raise ConfigError(
                [Violation("capacity.model", "both --model and --model-config given", "pass one of them")]
            )
        if args.model_config:
            model = load_hf_config(args.model_config)
        else:
            model = preset(args.model or DEFAULT_MODEL)
    except ConfigError as exc:
        problems += exc.violations
    if args.indexer_dtype and model is not None:
        model = model.with_indexer_dtype(args.indexer_dtype)
    gib = {k: int(round(values[k] * GIB)) for k in ("hbm_gb", "host_gb", "weights_gb") if k in values}
    inputs = CapacityInputs(
        hbm_bytes=gib.get("hbm_gb", 0),
        host_bytes=gib.get("host_gb", 0),
        weights_bytes=gib.get("weights_gb", 0),
        indexer_dtype=model.indexer_dtype if model is not None else (args.indexer_dtype or "bf16"),
        mtp=bool(args.mtp),
        **{k: int(v) for k, v in values.items() if not k.endswith("_gb")},
    )
    # Ranges that failed to parse are already reported; do not report them twice.
    reported = {v.problem.split()[0] for v in problems}
    for v in input_problems(inputs, model):
        key = v.rule.split(".", 1)[1]
        if key in ("hbm", "host") and f"--{key}-gb" in reported:
            continue
        problems.append(v)
    if problems:
        raise ConfigError(problems, "capacity inputs")
    assert model is not None
    return model, inputs


# ------------------------------------------------------------------ output
def report_to_json(report: CapacityReport) -> Dict[str, Any]:
    """``{"model", "inputs", "modes": [...], "skipped": [...], "hot_buffer": {...}}`` with the mode keys of
    the CLI contract; ``hot_buffer``: the sparse decode hot buffer of one request (shared by its
    verify rows with speculation) and the engine's fixed rows (:class:`~.capacity.HotBufferReport`)."""
    return {
        "model": dataclasses.asdict(report.model),
        "inputs": dataclasses.asdict(report.inputs),
        "modes": [dataclasses.asdict(m) for m in report.modes],
        "skipped": [dataclasses.asdict(s) for s in report.skipped],
        "hot_buffer": dataclasses.asdict(report.hot_buffer) if report.hot_buffer is not None else None,
    }


def header(report: CapacityReport) -> str:
    m, i = report.model, report.inputs
    n = m.cache_layers(i.mtp)
    mtp = f"+{m.mtp_layers} MTP {'on' if i.mtp else 'off'}"
    weights = f" ({i.hbm_bytes / GIB:g} - weights {i.weights_bytes / GIB:g})" if i.weights_bytes else ""
    hot_rows = (f"{i.rows} fixed" if i.rows is not None else "1 set per request") + f", {i.rows_per_req(m)}/request"
    hot = f"{i.hot(m)}"
    if i.rows_per_req(m) > 1:
        hot = f"{i.hot_per_request(m)}/request (shared by its verify rows)"
    return (
        f"{m.name}: {m.num_layers} layers ({mtp}; {n} cache-bearing), main KV {m.main_bytes_per_layer} "
        f"B/layer, indexer {i.indexer_dtype} {m.indexer_bytes_per_layer(i.indexer_dtype)} B/layer, "
        f"top-k {m.index_topk} | HBM for KV {i.kv_hbm_bytes / GIB:g} GiB/device{weights} | host "
        f"{i.host_bytes / GIB:g} GiB/node | tp {i.tp} dp {i.dp} pcp {i.pcp} | context {i.context} | "
        f"page {i.page_size} | hot {hot} | rows {hot_rows} | layerwise B={i.shared_buffers} "
        f"I={i.independent_layers}"
    )


def format_table(report: CapacityReport) -> str:
    cols = [
        "mode",
        "dev B/tok",
        "host B/tok",
        "dev MiB/req",
        "dev MiB fixed",
        "dev B/ctx-tok",
        "host B/ctx-tok",
        "tokens",
        "requests",
        "host GiB/node",
        "x full",
        "limited by",
    ]
    table = [cols]
    for mc in report.modes:
        table.append(
            [
                mc.name,
                f"{mc.device_bytes_per_token:,}",
                f"{mc.host_bytes_per_token:,}",
                f"{mc.device_bytes_per_request / MIB:,.1f}",
                f"{mc.device_fixed_bytes / MIB:,.1f}",
                f"{mc.device_bytes_per_context_token:,.0f}",
                f"{mc.host_bytes_per_context_token:,.0f}",
                f"{mc.tokens:,}",
                f"{mc.requests:,}",
                f"{mc.host_bytes_per_node / GIB:,.1f}",
                "-" if mc.requests_vs_full is None else f"{mc.requests_vs_full:.2f}",
                mc.limited_by,
            ]
        )
    widths = [max(len(r[c]) for r in table) for c in range(len(cols))]
    lines = []
    for k, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, len(cols) - 1)]
        lines.append("  ".join(cells + [r[-1]]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        "tokens/requests: node totals over dp; requests at the given context; B/ctx-tok: one request's "
        "device/host bytes / context; host GiB/node: the host KV pools at that capacity, one per DP "
        "rank (its TP ranks share it)"
    )
    for mc in report.modes:
        lines.append(f"  {mc.name}: {mc.description}")
    for s in report.skipped:
        lines.append(f"  skipped {s.name}: {s.reason}")
    if report.model.notes:
        lines.append(f"  model note: {report.model.notes}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        model, inputs = inputs_from_args(args)
        report = plan(model, inputs)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    text = json.dumps(report_to_json(report), indent=1) if args.json else f"{header(report)}\n\n{format_table(report)}"
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into `head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")
    return 0
