"""``python -m sglang_ascend_offload env --npu-check [--json]``: pre-flight of an Ascend node.

One :class:`Check` per capability the features need, each with pass / fail, what was
found and the fix:

* ``cann``: CANN version and SoC read from the installed build (``cann_install.py``; no
  NPU initialisation). Fails when the SoC is undecided or the Ascend 950 series (which
  sparse decode offload refuses).
* ``torch_npu``: importable, with an NPU visible.
* ``torch_npu.<op>``: each torch_npu op the ``npu`` rung calls (``ops/npu_impls.py``) is
  registered under ``torch.ops.npu`` and its schema equals one expected in
  ``npu_api/torch_npu_ops.json`` (the schemas extracted from the torch_npu wheel the
  plugin was written against). What could not be compared is ``unknown``, with the
  reason: the file missing or unreadable, the op missing from it, or an installed op
  whose schema cannot be read.
* ``_C_ascend.<op>``: each operator of the AscendC extension (``ascendc_ops/``) is
  registered under ``torch.ops.sglang_ascend_offload``.
* ``memfabric``: ``memfabric_hybrid`` imports and initialises (then uninitialises).
* ``memcache``: ``memcache_hybrid`` imports with the copy directions the store uses.
* ``host_register``: a small host tensor can be registered for device access (the
  extension's ``aclrtHostRegister`` call that Copy-SFA reads the host pool through).

* ``qualify.<op>``: the kernel qualification a server runs at startup
  (``ops/qualify.py``), for the sparse decode config and model given
  (:class:`QualifyRequest`; default: the sparse decode defaults on DeepSeek-V3.2): the
  plan is selected as the server selects it on this node (the built extension), and each
  fused op it selects is run at the served shape against the separate operators. A plan
  that cannot run is one failed ``qualify`` check with its fix; off an Ascend NPU the
  check fails saying it was not run (``bench kernels --qualify`` runs the same
  qualification on the CPU functional model).

Each check is ``pass``, ``fail`` (with the fix) or ``unknown`` (not checked, with the
reason): nothing passes that was not checked. Contract: :func:`run_checks` never raises
for a missing or broken piece; every check returns a result. On a machine without an NPU
every check fails with its fix and the report is still complete. :func:`main` exits 0
only when every check passes, or with ``allow_unknown`` when none fails.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from .config import SparseDecodeOffloadConfig
from .model_specs import ModelShape, preset

#: torch_npu ops the ``npu`` rung calls (ops/npu_impls.py) -> the feature that needs it
TORCH_NPU_OPS: Tuple[Tuple[str, str], ...] = (
    ("npu_lightning_indexer", "sparse decode offload (ops=npu, bf16 indexer)"),
    ("npu_quant_lightning_indexer", "sparse decode offload (ops=npu, indexer_dtype=int8)"),
    ("npu_sparse_flash_attention", "sparse decode offload (ops=npu)"),
)
SCHEMAS_FILE = Path(__file__).parent / "npu_api" / "torch_npu_ops.json"
SETUP_HINT = "run bash scripts/setup_npu_env.sh on the Ascend node (README, 'Using it on an Ascend node')"


STATUSES = ("pass", "fail", "unknown")
_TAGS = {"pass": "pass", "fail": "FAIL", "unknown": "UNKNOWN"}


@dataclass(frozen=True)
class Check:
    """One capability: ``name``, ``ok`` (it passed), ``detail`` (what was found; for an
    ``unknown`` check, why it was not checked), ``fix`` (what to do when it does not pass;
    empty when it passes), ``needed_by`` (the features that use it), ``status``: ``pass``
    / ``fail`` / ``unknown`` (default from ``ok``)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    needed_by: str = ""
    status: str = ""

    def __post_init__(self):
        if not self.status:
            object.__setattr__(self, "status", "pass" if self.ok else "fail")
        if self.status not in STATUSES or self.ok != (self.status == "pass"):
            raise ValueError(f"check {self.name}: status {self.status!r} with ok={self.ok}")


def unknown(name: str, reason: str, fix: str, needed_by: str = "") -> Check:
    """A capability that was not checked, and why: never a pass."""
    return Check(name, False, reason, fix, needed_by, status="unknown")


def _guard(name: str, needed_by: str, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a broken install is a failed check, not a crash
        return Check(name, False, f"the check raised {exc!r}", SETUP_HINT, needed_by)


def _dist_version(dist: str) -> str:
    from .versions import installed_version

    return installed_version(dist) or "(version unknown)"


def _torch_npu_reason() -> Optional[str]:
    from .ops.npu_impls import torch_npu_unavailable

    return torch_npu_unavailable()


def check_cann() -> Check:
    from . import cann_install

    need = "every NPU feature; sparse decode offload refuses an undecided or 950 SoC"
    info = cann_install.detect()
    version = info.version or "unknown"
    where = f"CANN at {info.root}" if info.root else "no CANN install"
    notes = "".join(f"; {n}" for n in info.notes)
    if not info.decided:
        return Check(
            "cann",
            False,
            f"{where}, version {version}; SoC undecided: {info.reason}{notes}",
            "install the CANN toolkit and the operator package of this node's SoC (A2/A3), then source its set_env.sh",
            need,
        )
    detail = (
        f"{where}, version {version} ({info.version_file or 'no version file'}), SoC {info.soc} ({info.family}){notes}"
    )
    if info.family == "950":
        return Check(
            "cann",
            False,
            detail,
            "sparse decode offload is refused on the Ascend 950 series: "
            "run it on an A2/A3 node (P/D and layerwise prefill still serve)",
            need,
        )
    if info.version is None:
        return Check(
            "cann", False, detail, "the toolkit install info has no version= line: reinstall the CANN toolkit", need
        )
    return Check("cann", True, detail, "", need)


def check_torch_npu() -> Check:
    need = "every NPU feature"
    reason = _torch_npu_reason()
    if reason is not None:
        return Check("torch_npu", False, reason, "pip install -e '.[npu,test]' (" + SETUP_HINT + ")", need)
    torch_npu = importlib.import_module("torch_npu")
    return Check("torch_npu", True, f"torch_npu {getattr(torch_npu, '__version__', '?')}, NPU visible", "", need)


SCHEMAS_FIX = (
    "restore sglang_ascend_offload/npu_api/torch_npu_ops.json from the checkout, or regenerate it: "
    "python scripts/extract_torch_npu_schemas.py (the wheel of the torch_npu release the plugin targets)"
)


def expected_schemas() -> Tuple[Optional[dict], str]:
    """``({op: [schema, ...]}, note)`` from ``npu_api/torch_npu_ops.json`` (each op's
    registered overloads); ``(None, why)`` when the file is absent or holds no op schemas.

    Accepted layouts: ``{op: "schema"}``, ``{op: {"schema": "..."}}``, ``{op: ["schema", ...]}``,
    or any of them under an ``"ops"`` key. A malformed file raises (the caller reports it)."""
    if not SCHEMAS_FILE.is_file():
        return None, f"{SCHEMAS_FILE.name} is not in npu_api/"
    data = json.loads(SCHEMAS_FILE.read_text(encoding="utf-8"))
    data = data.get("ops", data) if isinstance(data, dict) else {}
    out = {}
    for op, value in data.items():
        value = value.get("schema") if isinstance(value, dict) else value
        schemas = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        schemas = [v for v in schemas if isinstance(v, str)]
        if schemas:
            out[op] = schemas
    if not out:
        return None, f"{SCHEMAS_FILE.name} holds no op schemas"
    return out, f"schemas from {SCHEMAS_FILE.name}"


def _norm(schema: str) -> str:
    """A schema without its namespace (``npu::``) and with single spaces."""
    text = " ".join(str(schema).split())
    return text.split("::", 1)[1] if text.startswith("npu::") else text


def check_torch_npu_op(op: str, needed_by: str, expected: Optional[dict], note: str) -> Check:
    name = f"torch_npu.{op}"
    reason = _torch_npu_reason()
    if reason is not None:
        return Check(
            name, False, f"not checked: {reason}", "install torch_npu on an Ascend node (" + SETUP_HINT + ")", needed_by
        )
    import torch

    if not hasattr(torch.ops.npu, op):
        version = getattr(importlib.import_module("torch_npu"), "__version__", "?")
        return Check(
            name,
            False,
            f"torch.ops.npu has no {op} (torch_npu {version})",
            "install a torch_npu / CANN release that ships it, or use ops=reference|triton",
            needed_by,
        )
    try:
        got = str(getattr(torch.ops.npu, op).default._schema)
    except Exception as exc:  # noqa: BLE001
        return unknown(
            name,
            f"registered, but its schema cannot be read ({exc!r}): the call's arguments were not compared",
            "check the torch_npu install (python -c 'import torch_npu') and " + SETUP_HINT,
            needed_by,
        )
    if expected is None:
        return unknown(name, f"registered ({got}); schema not compared: {note}", SCHEMAS_FIX, needed_by)
    wants = expected.get(op)
    if not wants:
        return unknown(
            name, f"registered ({got}); schema not compared: {SCHEMAS_FILE.name} has no {op}", SCHEMAS_FIX, needed_by
        )
    if _norm(got) not in {_norm(w) for w in wants}:
        return Check(
            name,
            False,
            f"schema differs: installed {got!r}, expected {wants[0]!r}",
            "install the torch_npu release the plugin was written against (pyproject [npu] extra), "
            "or update the call and npu_api/torch_npu_ops.json",
            needed_by,
        )
    return Check(name, True, f"registered, schema matches ({note})", "", needed_by)


def check_fused_op(kernel: str) -> Check:
    from .ops.npu_impls import fused_op_unavailable

    need = "fused LIM / LIM-C8 / Copy-SFA (ops=fused, fused_lim, fused_copy_sfa)"
    reason = fused_op_unavailable(kernel)
    if reason is not None:
        return Check(
            f"_C_ascend.{kernel}",
            False,
            reason,
            "bash ascendc_ops/build.sh --install (scripts/setup_npu_env.sh does it)",
            need,
        )
    return Check(f"_C_ascend.{kernel}", True, f"torch.ops.sglang_ascend_offload.{kernel} registered", "", need)


def check_memfabric() -> Check:
    name, need = "memfabric", "P/D transfer (engine=memfabric), host pool kind=memfabric, the MemFabric shared pool"
    fix = "pip install -e '.[npu]' on an Ascend node with CANN (memfabric-hybrid), then mfcli kernel install"
    if importlib.util.find_spec("memfabric_hybrid") is None:
        return Check(name, False, "memfabric_hybrid is not installed", fix, need)
    try:
        mf = importlib.import_module("memfabric_hybrid")
    except Exception as exc:  # noqa: BLE001
        return Check(
            name, False, f"memfabric_hybrid fails to import: {exc!r}", "source CANN's set_env.sh; " + fix, need
        )
    version = _dist_version("memfabric-hybrid")
    if _torch_npu_reason() is not None:
        return Check(
            name,
            False,
            f"memfabric_hybrid {version} imports; initialisation not tried: {_torch_npu_reason()}",
            "run on an Ascend node with torch_npu",
            need,
        )
    rc = mf.initialize()
    if rc != 0:
        err = getattr(mf, "get_last_err_msg", lambda: "")()
        return Check(
            name,
            False,
            f"memfabric_hybrid.initialize() returned {rc}: {err}",
            "check the Ascend driver and that mfcli kernel install has run",
            need,
        )
    getattr(mf, "uninitialize", lambda: None)()
    return Check(name, True, f"memfabric_hybrid {version} initialises", "", need)


def check_memcache() -> Check:
    from .layerwise_prefill.store import StoreUnavailable
    from .layerwise_prefill.store_memcache import _memcache

    need = "layerwise prefill offload with buffer reuse (store_backend=memcache)"
    try:
        _memcache()
    except StoreUnavailable as exc:
        return Check("memcache", False, str(exc), "pip install -e '.[npu]' (memcache-hybrid) on the Ascend node", need)
    if _torch_npu_reason() is not None:
        return Check(
            "memcache",
            False,
            f"memcache_hybrid imports; no device to serve: {_torch_npu_reason()}",
            "run on an Ascend node with torch_npu",
            need,
        )
    return Check(
        "memcache",
        True,
        f"memcache_hybrid {_dist_version('memcache-hybrid')} imports, copy directions "
        "match; the store connects at serve time (mmc-local.conf)",
        "",
        need,
    )


def check_host_register() -> Check:
    from .ops import fused
    from .ops.npu_impls import fused_op_unavailable

    name, need = "host_register", "Copy-SFA reading the host KV pool (fused_copy_sfa)"
    reason = fused_op_unavailable(fused.REGISTER_HOST_KERNEL)
    if reason is not None:
        return Check(
            name,
            False,
            f"not tried: {reason}",
            "build the AscendC extension: bash ascendc_ops/build.sh --install",
            need,
        )
    import torch

    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    address = fused.register_host_memory(host)
    if not address:
        return Check(
            name,
            False,
            "registration returned a null device address",
            "check the driver's host-register support (aclrtHostRegister)",
            need,
        )
    return Check(name, True, f"1 MiB pinned host tensor registered at device address {address:#x}", "", need)


# ------------------------------------------------------------------ kernel qualification
QUALIFY_NEEDED_BY = "sparse decode offload's fused ops (the qualification every server start runs)"


def _default_model() -> ModelShape:
    return preset("deepseek-v3.2")


@dataclass(frozen=True)
class QualifyRequest:
    """What to qualify: the sparse decode config (``None``: the config has no sparse decode
    section, nothing to qualify), the model, the attention heads per rank, the index-K page
    size and the verify rows per request."""

    sparse_decode: Optional[SparseDecodeOffloadConfig] = field(default_factory=SparseDecodeOffloadConfig)
    model: ModelShape = field(default_factory=_default_model)
    heads: int = 16
    page_size: int = 128
    verify_rows: int = 1

    def shape(self):
        """The served shape (``ops.qualify_problem.ServedShape``) of this config and model."""
        from .ops.qualify_problem import ServedShape
        from .sparse_decode.sizing import resolve_hot_tokens

        sd, m, n = self.sparse_decode, self.model, self.verify_rows
        top_k = m.index_topk
        return ServedShape(
            hot_tokens=resolve_hot_tokens(sd.hot_tokens, top_k, self.page_size),
            top_k=top_k,
            rows_per_request=n,
            indexer_dtype=sd.indexer_dtype,
            page_size=self.page_size,
            index_heads=m.index_n_heads,
            index_dim=m.index_head_dim,
            heads=self.heads,
            latent_dim=m.kv_lora_rank,
            rope_dim=m.qk_rope_head_dim,
        )


def qualify_checks(request: Optional[QualifyRequest] = None) -> List[Check]:
    """The qualification checks for ``request`` (default :class:`QualifyRequest`); never raises."""
    request = request if request is not None else QualifyRequest()
    if request.sparse_decode is None:
        return []
    try:
        return _qualify_checks(request)
    except Exception as exc:  # noqa: BLE001 - a broken install is a failed check, not a crash
        return [Check("qualify", False, f"the check raised {exc!r}", SETUP_HINT, QUALIFY_NEEDED_BY)]


def _qualify_checks(request: QualifyRequest) -> List[Check]:
    from . import platform
    from .sparse_decode.op_selection import select_for_config

    if platform.device_kind() != "npu":
        return [
            Check(
                "qualify",
                False,
                "not run: no Ascend NPU here (the fused ops it qualifies are the _C_ascend extension on the node)",
                "run env --npu-check on the Ascend node; bench kernels --qualify runs the same qualification on "
                "the CPU functional model",
                QUALIFY_NEEDED_BY,
            )
        ]
    shape = request.shape()
    plan = select_for_config(
        request.sparse_decode,
        "npu",
        rows_per_request=shape.rows_per_request,
        hot_tokens=shape.hot_tokens,
        top_k=shape.top_k,
    )
    if plan.problems:
        problems = "; ".join(f"[{p.rule}] {p.problem}" for p in plan.problems)
        fixes = "; ".join(p.fix for p in plan.problems)
        return [Check("qualify", False, f"the config's operator plan cannot run: {problems}", fixes, QUALIFY_NEEDED_BY)]
    return qualification_checks(plan, shape)


def qualification_checks(plan, shape) -> List[Check]:
    """One check per fused op of ``plan``, qualified at ``shape`` (one passing ``qualify``
    check when the plan selects none)."""
    from .ops.qualify import fix_for, fused_ops_of, qualify_plan

    if not fused_ops_of(plan):
        detail = f"the plan selects no fused op ({plan.describe()}): nothing to qualify"
        return [Check("qualify", True, detail, "", QUALIFY_NEEDED_BY)]
    out = []
    for r in qualify_plan(plan, shape):
        name = f"qualify.{r.label}"
        if r.qualified:
            cov = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.coverage.items())
            detail = f"equals {r.against} at {shape.describe()} ({r.steps} steps: {cov}) in {r.seconds:.3f} s"
            out.append(Check(name, True, detail, "", QUALIFY_NEEDED_BY))
        else:
            detail = f"fused {r.label} differs from {r.against} at {shape.describe()}: {r.difference.describe()}"
            out.append(Check(name, False, detail, fix_for(r.op), QUALIFY_NEEDED_BY))
    return out


def run_checks(qualification=None) -> List[Check]:
    """Every check, in report order; never raises. ``qualification``: a
    :class:`QualifyRequest` (the config and model whose fused ops
    are qualified; default: the sparse decode defaults on DeepSeek-V3.2)."""
    out = [_guard("cann", "every NPU feature", check_cann), _guard("torch_npu", "every NPU feature", check_torch_npu)]
    try:
        expected, note = expected_schemas()
    except Exception as exc:  # noqa: BLE001 - a malformed file is reported (unknown), the checks go on
        expected, note = None, f"{SCHEMAS_FILE.name} is unreadable ({exc!r})"
    for op, need in TORCH_NPU_OPS:
        out.append(
            _guard(f"torch_npu.{op}", need, lambda op=op, need=need: check_torch_npu_op(op, need, expected, note))
        )
    from .ops.npu_impls import FUSED_KERNELS

    for kernel in FUSED_KERNELS:
        out.append(_guard(f"_C_ascend.{kernel}", "fused ops", lambda k=kernel: check_fused_op(k)))
    out.append(_guard("memfabric", "P/D transfer, MemFabric host memory", check_memfabric))
    out.append(_guard("memcache", "layerwise prefill offload", check_memcache))
    out.append(_guard("host_register", "Copy-SFA", check_host_register))
    out += qualify_checks(qualification)
    return out


def report(checks: List[Check]) -> dict:
    """``ok`` (every check passed), the checks, and the ``unknown`` ones with their reasons."""
    return {
        "ok": all(c.ok for c in checks),
        "checks": [asdict(c) for c in checks],
        "unknown": [{"name": c.name, "reason": c.detail} for c in checks if c.status == "unknown"],
    }


def exit_status(checks: List[Check], allow_unknown: bool = False) -> int:
    """0 when every check passes (``allow_unknown``: none fails); 1 otherwise."""
    bad = {"fail"} if allow_unknown else {"fail", "unknown"}
    return 1 if any(c.status in bad for c in checks) else 0


def main(as_json: bool = False, allow_unknown: bool = False, qualification=None) -> int:
    """Print the report (text, or exactly one JSON document); the exit status of :func:`exit_status`."""
    checks = run_checks(qualification)
    doc = report(checks)
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        for c in checks:
            print(f"[{_TAGS[c.status]}] {c.name}: {c.detail}")
            if not c.ok:
                print(f"       fix: {c.fix}")
                print(f"       needed by: {c.needed_by}")
        counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
        print(
            f"npu-check: {counts['pass']}/{len(checks)} passed, {counts['fail']} failed, {counts['unknown']} unknown"
            + (" (allowed: --allow-unknown)" if allow_unknown and counts["unknown"] else "")
        )
    return exit_status(checks, allow_unknown)
