"""Typed configuration for every feature, parsing, and deployment validation.

Data flows one way: JSON text (a flag value or ``@file``) -> :func:`parse_config`
/ :func:`parse_section` -> frozen dataclasses -> :func:`validate` against the
facts of a :class:`Deployment` -> the runtime of each feature.

Two kinds of problems are reported, and both list **every** problem at once:

* :class:`ConfigError` from parsing: unknown keys, wrong types, values out of range;
* :class:`ConfigError` from :func:`validate`: a config that is well-formed but that
  the deployment (device, model, parallelism, P/D role, graph mode, speculative
  decoding) cannot run. Each :class:`Violation` names its rule and what to change.

The rules encode the limits of the specification (seed 000 §8 and seed 002 §6);
the rule ids are listed in :data:`RULES` and in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

# ------------------------------------------------------------------ feature configs
OpsChoice = Literal["auto", "reference", "triton", "npu", "fused"]
ResidencyPolicy = Literal["lru", "lru_k2", "belady_hint"]


@dataclass(frozen=True)
class SparseDecodeOffloadConfig:
    """Sparse decode offload (seed 000 §4).

    hot_tokens: device slots per layer and decode row; ``None`` = 2 x top-k.
        Must be >= top-k and a multiple of the KV page size.
    host_pool_tokens: token rows of the host pool (per DP rank, all layers);
        ``None`` = SGLang's own token capacity (``max_total_tokens``).
    ops: operator ladder rung (see ``ops/registry.py``).
    fused_lim / fused_copy_sfa: use the AscendC LIM / Copy-SFA operators.
        ``None`` = use them when ``ops`` resolves to ``fused``.
    indexer_dtype: ``bf16`` or ``int8`` (LIM-C8: Hadamard-rotated int8 + fp16 scales).
    policy: residency replacement policy; ``lru`` is the reference design.
    record_trace: path of an ``.npz`` trace to record served top-k selections into.
    record_trace_max_steps: bound on recorded decode steps (the file stays bounded).
    metrics_log_interval_s: period of the one-line statistics summary in the log (0 = off).
    """

    hot_tokens: Optional[int] = None
    host_pool_tokens: Optional[int] = None
    ops: OpsChoice = "auto"
    fused_lim: Optional[bool] = None
    fused_copy_sfa: Optional[bool] = None
    indexer_dtype: Literal["bf16", "int8"] = "bf16"
    policy: ResidencyPolicy = "lru"
    record_trace: Optional[str] = None
    record_trace_max_steps: int = 4096
    metrics_log_interval_s: float = 30.0

    def _check(self) -> List[str]:
        errs = []
        if self.hot_tokens is not None and self.hot_tokens < 1:
            errs.append("hot_tokens must be >= 1")
        if self.host_pool_tokens is not None and self.host_pool_tokens < 1:
            errs.append("host_pool_tokens must be >= 1")
        if self.record_trace_max_steps < 1:
            errs.append("record_trace_max_steps must be >= 1")
        if self.metrics_log_interval_s < 0:
            errs.append("metrics_log_interval_s must be >= 0")
        return errs


@dataclass(frozen=True)
class MemcacheConfig:
    """Settings of the Memcache host KV pool (memcache-hybrid).

    meta_config / local_config: paths of ``mmc-meta.conf`` / ``mmc-local.conf``
        (``None`` = the files shipped with memcache-hybrid).
    start_meta_service: start the meta service in-process (single node / tests).
    protocol: LocalConfig.protocol of the store client.
    lease_ttl_ms: lease on allocated objects, released after the last layer.
    """

    meta_config: Optional[str] = None
    local_config: Optional[str] = None
    start_meta_service: bool = False
    protocol: Literal[
        "host_rdma", "host_urma", "host_tcp", "host_shm", "device_rdma", "device_sdma"
    ] = "host_shm"
    lease_ttl_ms: int = 60_000
    device_id: Optional[int] = None

    def _check(self) -> List[str]:
        return [] if self.lease_ttl_ms >= 0 else ["memcache.lease_ttl_ms must be >= 0"]


@dataclass(frozen=True)
class LayerwisePrefillOffloadConfig:
    """Layerwise prefill offload (seed 000 §3).

    shared_buffers: B, reusable physical buffers; ``None`` = one per layer (no reuse).
    independent_layers: layers with a dedicated buffer (default ``[0]``), or ``"all"``.
    prefetch_depth: layers loaded ahead of compute; ``None`` = min(B, 8).
    store_backend: ``memcache`` (Ascend production) or ``local`` (in-process host pool).
    wait_timeout_s: deadline of every wait on a buffer gate.
    """

    shared_buffers: Optional[int] = None
    independent_layers: Union[List[int], Literal["all"]] = field(default_factory=lambda: [0])
    prefetch_depth: Optional[int] = None
    store_backend: Literal["memcache", "local"] = "memcache"
    memcache: MemcacheConfig = field(default_factory=MemcacheConfig)
    wait_timeout_s: float = 60.0

    def _check(self) -> List[str]:
        errs = []
        if self.shared_buffers is not None and self.shared_buffers < 1:
            errs.append("shared_buffers must be >= 1")
        if self.prefetch_depth is not None and self.prefetch_depth < 1:
            errs.append("prefetch_depth must be >= 1")
        if isinstance(self.independent_layers, list):
            if any(i < 0 for i in self.independent_layers):
                errs.append("independent_layers must be non-negative layer indices")
            if len(set(self.independent_layers)) != len(self.independent_layers):
                errs.append("independent_layers has duplicates")
        if self.wait_timeout_s <= 0:
            errs.append("wait_timeout_s must be > 0")
        return errs + self.memcache._check()


@dataclass(frozen=True)
class PDTransferConfig:
    """Remote device-to-host P/D transfer (seed 000 §5-7).

    engine: ``memfabric`` (Ascend production) or ``mooncake`` (TCP on CPU, RDMA elsewhere).
    protocol: MemFabric data path; prefill and decode must match.
    kv_port: base of the decode control ports (kv_port + dp_rank * d_tp + tp_rank).
    host: address the control sockets bind to.
    store_url: MemFabric config store (``tcp://host:port``).
    handshake_timeout_s: deadline of the metadata handshake (100 s as in the reference).
    layer_timeout_s: deadline of every per-layer wait (the reference has none).
    read_retries: failed reads retried this many times before the request fails.
    """

    engine: Literal["memfabric", "mooncake"] = "memfabric"
    protocol: Literal["sdma", "device_rdma", "device_urma"] = "sdma"
    kv_port: int = 30100
    host: str = "127.0.0.1"
    store_url: Optional[str] = None
    handshake_timeout_s: float = 100.0
    layer_timeout_s: float = 30.0
    read_retries: int = 2

    def _check(self) -> List[str]:
        errs = []
        if not 1024 <= self.kv_port <= 65535:
            errs.append(f"kv_port {self.kv_port} must be in 1024..65535")
        if self.handshake_timeout_s <= 0:
            errs.append("handshake_timeout_s must be > 0")
        if self.layer_timeout_s <= 0:
            errs.append("layer_timeout_s must be > 0")
        if self.read_retries < 0:
            errs.append("read_retries must be >= 0")
        return errs


@dataclass(frozen=True)
class KVPPConfig:
    """KV layer parallelism (seed 002): KV sharded by layer across the TP group.

    prefetch: broadcast the next layer while the current one computes.
    scratch_alignment_bytes: alignment of the two scratch buffers (2 MiB).
    """

    prefetch: bool = True
    scratch_alignment_bytes: int = 2 * 1024 * 1024

    def _check(self) -> List[str]:
        a = self.scratch_alignment_bytes
        return [] if a > 0 and (a & (a - 1)) == 0 else ["scratch_alignment_bytes must be a power of two"]


@dataclass(frozen=True)
class OffloadConfig:
    """All features; a section that is ``None`` is off."""

    sparse_decode: Optional[SparseDecodeOffloadConfig] = None
    layerwise_prefill: Optional[LayerwisePrefillOffloadConfig] = None
    pd_transfer: Optional[PDTransferConfig] = None
    kvpp: Optional[KVPPConfig] = None

    def _check(self) -> List[str]:
        return []


# ------------------------------------------------------------------ deployment facts
@dataclass(frozen=True)
class Deployment:
    """Facts about where a config will run (from SGLang's ServerArgs or a JSON file).

    device: ``npu`` / ``cuda`` / ``cpu``; soc: CANN SoC name (e.g. ``Ascend910_9391``)
    or family (``A2``, ``A3``, ``950PR``, ``950DT``) where known.
    model_kind: ``dsa`` (MLA + indexer + top-k sparse attention, DeepSeek-V3.2 style),
    ``mla`` (dense MLA), ``other``. hybrid_kv: the model mixes KV layouts.
    main_kv_dtype / main_kv_packing: the main (latent) KV cache format.
    pd_role: ``colocated`` / ``prefill`` / ``decode``; peer_tp: the other side's TP size.
    peer_protocol: the other side's MemFabric protocol, where known.
    graph_mode: ``eager`` / ``piecewise`` / ``full``.
    speculative_method: ``None`` or e.g. ``mtp``, ``dspark``, ``eagle``;
    speculative_fixed: its number of draft tokens is fixed.
    disaggregation_transfer_backend: SGLang's ``--disaggregation-transfer-backend``.
    """

    device: Literal["npu", "cuda", "cpu"] = "npu"
    soc: Optional[str] = None
    model_kind: Literal["dsa", "mla", "other"] = "dsa"
    hybrid_kv: bool = False
    main_kv_dtype: str = "bf16"
    main_kv_packing: Literal["none", "c8", "tq4"] = "none"
    num_layers: Optional[int] = None
    index_topk: Optional[int] = None
    page_size: Optional[int] = None
    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    pcp: int = 1
    dcp: int = 1
    pd_role: Literal["colocated", "prefill", "decode"] = "colocated"
    peer_tp: Optional[int] = None
    peer_protocol: Optional[str] = None
    disaggregation_transfer_backend: Optional[str] = None
    graph_mode: Literal["eager", "piecewise", "full"] = "eager"
    speculative_method: Optional[str] = None
    speculative_fixed: bool = True

    def _check(self) -> List[str]:
        errs = []
        for name in ("dp", "tp", "cp", "pp", "pcp", "dcp"):
            if getattr(self, name) < 1:
                errs.append(f"{name} must be >= 1")
        if self.peer_tp is not None and self.peer_tp < 1:
            errs.append("peer_tp must be >= 1")
        for name in ("num_layers", "index_topk", "page_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                errs.append(f"{name} must be >= 1")
        return errs

    @property
    def soc_family(self) -> Optional[str]:
        """``"950"``, ``"A3"``, ``"A2"``... from :attr:`soc` (name or family)."""
        if not self.soc:
            return None
        s = self.soc.upper().replace("ASCEND", "")
        if s.startswith("950"):
            return "950"
        if s.startswith("910_93") or s == "A3":
            return "A3"
        if s.startswith("910B") or s == "A2":
            return "A2"
        return s


# ------------------------------------------------------------------ errors
@dataclass(frozen=True)
class Violation:
    """One broken rule: its id, what is wrong, and what to change."""

    rule: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.problem} -> {self.fix}"


class ConfigError(ValueError):
    """Every problem found, in one error. ``violations`` keeps them typed."""

    def __init__(self, violations: List[Violation], what: str = "configuration"):
        self.violations = list(violations)
        lines = "\n".join(f"  {i + 1}. {v}" for i, v in enumerate(self.violations))
        super().__init__(f"invalid {what} ({len(self.violations)} problem(s)):\n{lines}")


# ------------------------------------------------------------------ parsing
def load_json_arg(value: Union[str, dict, None]) -> Any:
    """A flag value: inline JSON, ``@path`` to a JSON file, or an already-parsed dict."""
    if value is None or isinstance(value, dict):
        return value or {}
    text = value.strip()
    if text.startswith("@"):
        path = os.path.expanduser(text[1:])
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError([Violation("parse.file", f"cannot read {path}: {exc.strerror}",
                                         "pass an existing JSON file as @path")]) from exc
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([Violation("parse.json", f"not valid JSON: {exc}",
                                     "pass a JSON object, e.g. '{\"hot_tokens\": 4096}'")]) from exc


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return True
    if origin is Union:
        return any(_type_ok(value, a) for a in args)
    if origin is Literal:
        return value in args
    if tp is type(None):
        return value is None
    if origin in (list, List):
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return False


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin is Union:
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, List):
        return f"list of {_describe(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _is_dataclass_type(tp: Any) -> Optional[type]:
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is Union:
        for a in typing.get_args(tp):
            if dataclasses.is_dataclass(a):
                return a
    return None


def _build(cls: type, data: Any, path: str, errors: List[Violation]):
    if not isinstance(data, dict):
        errors.append(Violation("parse.type", f"{path or 'config'} must be a JSON object, got "
                                f"{type(data).__name__}", "wrap the settings in {...}"))
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            errors.append(Violation("parse.unknown_key", f"unknown key {path}{key!r}",
                                    f"known keys: {', '.join(sorted(names))}"))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, tp = data[f.name], hints[f.name]
        sub = _is_dataclass_type(tp)
        if sub is not None and isinstance(value, dict):
            built = _build(sub, value, f"{path}{f.name}.", errors)
            if built is not None:
                kwargs[f.name] = built
            continue
        if sub is not None and value is None and _type_ok(None, tp):
            kwargs[f.name] = None
            continue
        if not _type_ok(value, tp):
            errors.append(Violation("parse.type", f"{path}{f.name}={json.dumps(value)} has the wrong "
                                    "type or value", f"expected {_describe(tp)}"))
            continue
        kwargs[f.name] = float(value) if tp is float else value
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - all fields have defaults
        errors.append(Violation("parse.type", str(exc), "check the keys"))
        return None
    for msg in obj._check():
        errors.append(Violation("parse.range", f"{path}{msg}", "change the value"))
    return obj


def parse_section(cls: type, value: Union[str, dict, None], what: Optional[str] = None):
    """Parse one feature section (a flag value) into ``cls``; every problem at once."""
    data = load_json_arg(value)
    errors: List[Violation] = []
    obj = _build(cls, data, "", errors)
    if errors:
        raise ConfigError(errors, what or cls.__name__)
    return obj


def parse_config(value: Union[str, dict, None]) -> OffloadConfig:
    """Parse ``{"sparse_decode": {...}, "layerwise_prefill": {...}, ...}``."""
    return parse_section(OffloadConfig, value, "offload configuration")


def parse_deployment(value: Union[str, dict, None]) -> Deployment:
    return parse_section(Deployment, value, "deployment description")


def to_dict(obj: Any) -> Dict[str, Any]:
    """JSON-ready dict of a config (inverse of the parsers)."""
    return dataclasses.asdict(obj)


def to_json(obj: Any) -> str:
    return json.dumps(to_dict(obj), sort_keys=True)
