"""Regenerate docs/configuration.md from the typed config (run after changing config.py).

    .venv/bin/python scripts/gen_config_doc.py

tests/test_config.py checks that the committed file is up to date.
"""

import dataclasses
import inspect
import pathlib
import typing

from sglang_ascend_offload import config as c
from sglang_ascend_offload.config_fields import field_docs

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
SECTIONS = [
    (c.SparseDecodeOffloadConfig, "`sparse_decode`"),
    (c.LayerwisePrefillOffloadConfig, "`layerwise_prefill`"),
    (c.MemcacheConfig, "`layerwise_prefill.memcache`"),
    (c.PDTransferConfig, "`pd_transfer`"),
    (c.KVPPConfig, "`kvpp`"),
    (c.Deployment, "Deployment description (`--deployment`)"),
]
INTRO = """# Configuration reference

Generated from `sglang_ascend_offload/config.py` by `scripts/gen_config_doc.py`.

Each feature is configured by a JSON object, given inline or as `@path/to/file.json`:

* on a server: `--sparse-decode-offload-config`, `--layerwise-prefill-offload-config` (each with its
  `--enable-...` flag);
* for `python -m sglang_ascend_offload check-config --config ... --deployment ...`: one object with a section per
  feature (`sparse_decode`, `layerwise_prefill`, `pd_transfer`, `kvpp`); a missing section means the feature is off;
* for `python -m sglang_ascend_offload check-config --launch "python -m sglang.launch_server ..."` (or `-- ARGS`):
  the server flags themselves, decided as the server's launcher decides them.

One key is not a feature: `device_kv_budget_bytes` (server flag `--device-kv-budget SIZE`, e.g. `512MiB`), the most
device memory SGLang's KV pool plus the sparse decode hot buffers may take; the smaller of it and what
`--mem-fraction-static` leaves is used. On a CPU the server then accounts like a device of that size: the sparse
decode host pool is host memory outside it (`sglang_plugin/mem_cache/sizing/device_kv_budget.py`;
`bench serve --capacity` gives both of its servers one such budget).

Unknown keys, wrong types and out-of-range values are all reported at once (rules `parse.*`). Then
`config.validate(config, deployment)` checks the config against the deployment and reports every broken rule
listed at the end, each with what to change.
"""


def render() -> str:
    out = [INTRO]
    for cls, title in SECTIONS:
        out += [f"## {title}", "", inspect.cleandoc(cls.__doc__ or "").replace("``", "`"), ""]
        out += ["| key | type | default | constraint | what it does |", "|---|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = "{...}" if dataclasses.is_dataclass(default) else repr(default)
            kind = c._describe(hints[f.name]).replace("|", "\\|")
            limits = f.metadata.get("limits")
            constraint = "" if limits is None else limits.describe() + (f" ({limits.note})" if limits.note else "")
            text = docs.get(f.name, "").replace("``", "`").replace("|", "\\|")
            out.append(f"| `{f.name}` | {kind} | `{shown}` | {constraint} | {text} |")
        out.append("")
    from sglang_ascend_offload.rules import DECIDED_AFTER_LAUNCH, RULES

    out += [
        "## Rules",
        "",
        "Every rule id, from `sglang_ascend_offload/rules.py`. Scope `deployment`: decided by "
        "the config and the deployment facts, so `check-config` and the server's startup give the same "
        "verdict; `server`: needs SGLang arguments the facts do not describe, the model files or the "
        "machine, checked by the server's launch validation before any process starts and by "
        "`check-config --launch`; `input`: malformed input. A rule marked *after launch* is decided only "
        "by the running server's startup (what decides it is in `rules.DECIDED_AFTER_LAUNCH`): "
        "`check-config` lists it as `undecided` where it applies.",
        "",
        "| rule | scope | requires | usual fix |",
        "|---|---|---|---|",
    ]
    out += [
        f"| `{r.id}` | {r.scope}{', after launch' if r.id in DECIDED_AFTER_LAUNCH else ''} | {r.requires} | "
        f"{r.fix} |".replace("\n", " ")
        for r in RULES.values()
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    DOC.write_text(render())
    print(f"wrote {DOC}")
