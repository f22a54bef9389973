"""``python -m sglang_ascend_offload env --npu-check [--json]``: pre-flight of an Ascend node.

One :class:`Check` per capability the features need, each with pass / fail, what was
found and the fix:

* ``cann``: CANN version and SoC read from the installed build (``cann_install.py``; no
  NPU initialisation). Fails when the SoC is undecided or the Ascend 950 series (which
  sparse decode offload refuses).
* ``torch_npu``: importable, with an NPU visible.
* ``torch_npu.<op>``: each torch_npu op the ``npu`` rung calls (``ops/npu_impls.py``) is
  registered under ``torch.ops.npu``; its schema is compared with the expected one in
  ``npu_api/torch_npu_ops.json`` when that file exists (otherwise the detail says the
  comparison was skipped).
* ``_C_ascend.<op>``: each operator of the AscendC extension (``ascendc_ops/``) is
  registered under ``torch.ops.sglang_ascend_offload``.
* ``memfabric``: ``memfabric_hybrid`` imports and initialises (then uninitialises).
* ``memcache``: ``memcache_hybrid`` imports with the copy directions the store uses.
* ``host_register``: a small host tensor can be registered for device access (the
  extension's ``aclrtHostRegister`` call that Copy-SFA reads the host pool through).

Contract: :func:`run_checks` never raises for a missing or broken piece; every check
returns a result. On a machine without an NPU every check fails with its fix and the
report is still complete. :func:`main` exits 0 only when every check passes.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

#: torch_npu ops the ``npu`` rung calls (ops/npu_impls.py) -> the feature that needs it
TORCH_NPU_OPS: Tuple[Tuple[str, str], ...] = (
    ("npu_lightning_indexer", "sparse decode offload (ops=npu, bf16 indexer)"),
    ("npu_quant_lightning_indexer", "sparse decode offload (ops=npu, indexer_dtype=int8)"),
    ("npu_sparse_flash_attention", "sparse decode offload (ops=npu)"),
)
SCHEMAS_FILE = Path(__file__).parent / "npu_api" / "torch_npu_ops.json"
SETUP_HINT = "run bash scripts/setup_npu_env.sh on the Ascend node (README, 'Using it on an Ascend node')"


@dataclass(frozen=True)
class Check:
    """One capability: ``name``, ``ok``, ``detail`` (what was found), ``fix`` (what to do
    when it fails; empty when it passes), ``needed_by`` (the features that use it)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    needed_by: str = ""


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


def expected_schemas() -> Tuple[Optional[dict], str]:
    """``({op: schema}, note)`` from ``npu_api/torch_npu_ops.json``; ``(None, why)`` when absent.

    Accepted layouts: ``{op: "schema"}``, ``{op: {"schema": "..."}}`` or either under an
    ``"ops"`` key.
    """
    if not SCHEMAS_FILE.is_file():
        return None, f"schema comparison skipped: {SCHEMAS_FILE.name} is not in npu_api/"
    data = json.loads(SCHEMAS_FILE.read_text(encoding="utf-8"))
    data = data.get("ops", data) if isinstance(data, dict) else {}
    out = {}
    for op, value in data.items():
        schema = value.get("schema") if isinstance(value, dict) else value
        if isinstance(schema, str):
            out[op] = schema
    return out, f"schemas from {SCHEMAS_FILE.name}"


def _norm(schema: str) -> str:
    return " ".join(str(schema).split())


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
        return Check(name, True, f"registered; schema unreadable ({exc!r}); {note}", "", needed_by)
    if expected is None:
        return Check(name, True, f"registered: {got}; {note}", "", needed_by)
    want = expected.get(op)
    if want is None:
        return Check(
            name, True, f"registered: {got}; no expected schema for {op} in {SCHEMAS_FILE.name}", "", needed_by
        )
    if _norm(want) != _norm(got):
        return Check(
            name,
            False,
            f"schema differs: installed {got!r}, expected {want!r}",
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


def run_checks() -> List[Check]:
    """Every check, in report order; never raises."""
    out = [_guard("cann", "every NPU feature", check_cann), _guard("torch_npu", "every NPU feature", check_torch_npu)]
    try:
        expected, note = expected_schemas()
    except Exception as exc:  # noqa: BLE001 - a malformed file is reported, the checks go on
        expected, note = None, f"schema comparison skipped: {SCHEMAS_FILE.name} unreadable ({exc!r})"
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
    return out


def report(checks: List[Check]) -> dict:
    return {"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}


def main(as_json: bool = False) -> int:
    """Print the report (text, or exactly one JSON document); 0 when every check passes."""
    checks = run_checks()
    doc = report(checks)
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        for c in checks:
            print(f"[{'pass' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
            if not c.ok:
                print(f"       fix: {c.fix}")
                print(f"       needed by: {c.needed_by}")
        failed = sum(not c.ok for c in checks)
        print(f"npu-check: {len(checks) - failed}/{len(checks)} passed" + ("" if doc["ok"] else f", {failed} failed"))
    return 0 if doc["ok"] else 1
