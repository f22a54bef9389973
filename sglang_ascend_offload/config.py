"""Typed configuration for every feature, parsing, and deployment validation.

Data flows one way: JSON text (a flag value or ``@file``) -> :func:`parse_config`
/ :func:`parse_section` -> frozen dataclasses -> :func:`validate` against the
facts of a :class:`Deployment` -> the runtime of each feature.

Two kinds of problems are reported, and both list **every** problem at once:

* :class:`ConfigError` from parsing: unknown keys, wrong types, values out of range;
* :class:`ConfigError` from :func:`validate`: a config that is well-formed but that
  the deployment (device, model, parallelism, P/D role, graph mode, speculative
  decoding) cannot run. Each :class:`Violation` names its rule and what to change.

The rules encode what each feature supports (docs/<feature>.md explains the limits);
the rule ids are listed in :data:`RULES` and in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from . import rules as _rule_registry
from .config_fields import knob, limit_problems
from .errors import ConfigError, Violation  # noqa: F401 - their home is errors.py; re-exported

# ------------------------------------------------------------------ feature configs
# The accepted names come from their registries (one home each): the operator
# ladder's choices and the residency policies.
from .ops.contract import CHOICES as _OPS_CHOICES  # noqa: E402
from .sparse_decode import sizing as _hot_sizing  # noqa: E402
from .sparse_decode.policies import POLICIES as _POLICIES  # noqa: E402

OpsChoice = Literal[_OPS_CHOICES]
ResidencyPolicy = Literal[tuple(_POLICIES)]


@dataclass(frozen=True)
class SparseDecodeOffloadConfig:
    """Sparse decode offload: the main KV stays in a host pool; each decode step moves to
    the device hot buffers only the top-k rows not yet resident (docs/sparse_decode.md)."""

    hot_tokens: Optional[int] = knob(None, ge=1, note="and >= the model's top-k, a multiple of the page size")
    """Device slots per layer and request (a request's speculative verify rows share them).
    ``None`` = 2 x top-k rounded up to a multiple of the KV page size, with or without
    speculation (``sparse_decode/sizing.py``, the hot-buffer plan). Must be >= top-k and a
    multiple of the KV page size; a verify round whose rows' union does not fit is served
    exactly from the overflow area (``sparse_decode/overflow.py``)."""

    host_pool_tokens: Optional[int] = knob(None, ge=1, note="null = SGLang's token capacity")
    """Token rows of the host pool (per DP rank, all layers); ``None`` = SGLang's own token
    capacity (``max_total_tokens``). Where the fused Copy-SFA reads the pool, its rows per
    layer are rounded up to a multiple of 32 (each layer's slice 4 KiB-aligned for
    ``aclrtHostRegister``)."""

    ops: OpsChoice = "auto"
    """Operator ladder rung (``ops/registry.py``): the operator plan names, for each decode
    stage, the rung that runs it (``docs/operators.md``)."""

    fused_lim: Optional[bool] = None
    """The AscendC LIM (LIM-C8 with an int8 indexer), chosen in one place
    (``sparse_decode/op_selection.py``, ``docs/fused_ops.md``): ``true`` = fused (an error
    where it cannot run), ``false`` = the separate indexer and residency operators, ``None``
    = fused with ``ops`` ``fused``, and the default on an Ascend NPU with ``ops`` ``auto``,
    where a missing extension or op is a startup error (``sglang.fused_unavailable``) naming
    every missing op and the build command. It serves decode and verify steps of policy
    ``lru`` (up to 14 verify rows per request) where the kernels take the residency shape
    (``hot_tokens`` up to 4096; a verify round's union beyond it overflows); elsewhere
    ``fused_lim: true`` is refused (``sglang.fused_not_wired``) and a default fused indexer
    runs as the separate indexer, logged. On CPU the fused operators are the AscendC
    kernels on their functional model: a correctness path, not a fast one."""

    fused_copy_sfa: Optional[bool] = None
    """The AscendC Copy-SFA (miss copies and sparse attention in one operator); the same
    choices as ``fused_lim``."""

    indexer_dtype: Literal["bf16", "int8"] = "bf16"
    """``bf16``, or ``int8`` (LIM-C8): the device index-K cache holds Hadamard-rotated int8
    keys + one fp16 scale per token (130 B instead of 256 B per token and layer at 128
    dims), and the decode indexer is the C8 lightning indexer over them
    (``docs/sparse_decode.md``, "int8 indexer"). Served off the NPU and, on an NPU, through
    the fused LIM-C8; refused on an NPU without it (``sglang.indexer_int8_device``) and on
    a P/D decode with speculative decoding (``sglang.indexer_int8_pd``); a P/D decode
    receives int8 keys + scales."""

    policy: ResidencyPolicy = "lru"
    """Residency replacement policy; ``lru`` (the default) is exact per-row LRU, the
    specification in ``docs/residency_contract.md`` that every other policy reuses with its
    own victim order."""

    record_trace: Optional[str] = None
    """Path of an ``.npz`` trace to record served top-k selections into (speculative
    servers record verify rounds as a speculative trace)."""

    record_trace_max_steps: int = knob(4096, ge=1)
    """Bound on recorded decode steps (the file stays bounded)."""

    record_trace_rank_depth: int = knob(0, ge=0, note="0 = off, else >= the model's top-k")
    """0 = off; R >= top-k = also record ``ranked`` (the first R positions of every decode
    step's indexer ranking). While recording, the indexer selects top-R instead of top-k
    (the first k are the top-k the model uses). Needs ``record_trace``."""

    rank_depth: int = knob(0, ge=0, note="0 = off, else >= the model's top-k")
    """0 = off; D >= top-k = serving rank depth: on every eager decode step the indexer
    selects top-D instead of top-k, the model still gets the first k (the top-k, unchanged)
    and the residency manager gets the ``[rows, D]`` ranking. Required by the score-aware
    policies (``score_rank``, ``score_rank_guarded``, ``score_rank_smooth``) and refused
    with any other policy. Cost: a top-D selection per layer and decode step instead of
    top-k (same scores), D x 4 bytes per row and layer kept until the layer's residency
    step. Not with decode graphs or speculative decoding (rules
    ``sglang.sparse_decode_graph``, ``sparse_decode.score_speculative``)."""

    metrics_log_interval_s: float = knob(30.0, ge=0, note="0 = off")
    """Period of the one-line statistics summary in the log (0 = off)."""

    metrics_export_interval_s: float = knob(1.0, ge=0, note="0 = every decode step")
    """With ``--enable-metrics``, the longest the Prometheus counters lag the engine during
    decode (0 = export every step). An export costs one counter update per layer and
    counter (~0.7 ms of Python on 61 layers); a finished request's output and an idle
    scheduler export at once regardless."""

    verify_sample_rate: float = knob(0.0, ge=0, le=1, note="0 = off; e.g. 1e-3")
    """Shadow verification, 0 = off: the probability per layer and eager decode step of
    recomputing one row's attention over the host pool with logical indices, on the served
    row's device with the engine's own attention op, and comparing it with the served row
    (bit-exact where only copies happened; ``sparse_decode/shadow.py``). 1e-3 costs one
    row's gather and attention per thousand layer steps. Not with decode graphs (rule
    ``sglang.sparse_decode_graph``)."""

    verify_action: Literal["log", "fail"] = "log"
    """On a shadow-verification mismatch (always counted and logged with layer, row and
    request): ``log``, or ``fail`` (the forward raises, so SGLang stops the batch with the
    error)."""

    residency: Literal["always", "adaptive"] = "always"
    """``always`` (every request reads its main KV through the hot buffer and the residency
    policy) or ``adaptive``: a request whose context fits its hot buffer (``hot_tokens``),
    extended over the hot buffers of request slots SGLang has free, is served from them
    directly, with no residency lookups and no miss copies; it is demoted in place to the
    residency when a new request needs a slot it borrowed or it cannot grow
    (``sparse_decode/direct_rows.py``). Policy ``lru`` only; the fused indexer steps every
    row's residency, so ``adaptive`` runs the separate indexer (the NPU default opts out,
    logged; ``fused_lim: true`` is refused); with the fused Copy-SFA a request fits its own
    buffer only. Eager and graph decode, and speculative verify rows."""

    qualify_kernels: bool = True
    """Before the server accepts requests, every fused operator the plan selects (LIM /
    LIM-C8, Copy-SFA) runs once at the served shapes on a small deterministic problem and is
    compared with the separate operators on the same inputs (``ops/qualify.py``; indices,
    residency state and miss copies exact, attention within the stated tolerance); a
    difference stops startup naming the op, the shape, the first differing element and the
    fix. ``false`` skips it (logged as a warning). Costs well under a second at
    DeepSeek-V3.2 shapes on an NPU (target < 2 s); on CPU the kernels run on their
    functional model (``docs/fused_ops.md``, "Qualification at startup"). Without a fused
    operator it does nothing."""

    def _check(self) -> List[str]:
        """Field limits, then the rules across fields."""
        errs = limit_problems(self)
        if self.record_trace_rank_depth > 0 and not self.record_trace:
            errs.append("record_trace_rank_depth needs record_trace (the file to record into)")
        from .sparse_decode.policies import POLICIES as _P

        if self.residency == "adaptive" and self.policy != "lru":
            errs.append(
                f"residency 'adaptive' with policy {self.policy!r}: a request outgrowing its hot buffer is "
                "demoted into the exact-LRU state; use policy lru, or residency 'always'"
            )
        if _P[self.policy].needs_ranked and self.rank_depth <= 0:
            errs.append(
                f"policy={self.policy!r} needs the indexer's ranking every step: set rank_depth to D >= the "
                "model's top-k (e.g. 2 x hot_tokens; the indexer then selects top-D per layer and decode "
                "step), or serve a policy that needs only the top-k (lru, lru_k2, lru_k2_guarded)"
            )
        if self.rank_depth > 0 and not _P[self.policy].needs_ranked:
            errs.append(
                f"rank_depth={self.rank_depth} with policy={self.policy!r}, which does not read the ranking "
                "(it would only cost a top-D selection per layer and step): drop rank_depth or choose a "
                "score policy (" + ", ".join(p for p in _P if _P[p].needs_ranked) + ")"
            )
        return errs


def fused_copy_sfa_required(sd: "SparseDecodeOffloadConfig", device: str, rows_per_request: int = 1) -> bool:
    """Whether serving runs the fused Copy-SFA operator on ``device``: the attention stage
    of the operator plan (``sparse_decode/op_selection.py``), availability aside."""
    from .sparse_decode.op_selection import select_for_config

    plan = select_for_config(sd, device, rows_per_request=rows_per_request, available=lambda op: None)
    return plan.attention.fused


def residency_shape(sd: "SparseDecodeOffloadConfig", d: "Deployment") -> dict:
    """``hot_tokens`` / ``top_k`` of the served pool for the fused-kernel shape check (the
    configured hot buffer or its default, resolved as the hot-buffer plan resolves it), or
    nothing without the top-k."""
    if d.index_topk is None:
        return {}
    hot = _hot_sizing.resolve_hot_tokens(sd.hot_tokens, d.index_topk, d.page_size)
    return dict(hot_tokens=hot, top_k=d.index_topk)


@dataclass(frozen=True)
class MemcacheConfig:
    """Settings of the Memcache host KV pool (memcache-hybrid)."""

    meta_config: Optional[str] = None
    """Path of ``mmc-meta.conf`` (``None`` = the file shipped with memcache-hybrid)."""

    local_config: Optional[str] = None
    """Path of ``mmc-local.conf`` (``None`` = the file shipped with memcache-hybrid)."""

    start_meta_service: bool = False
    """Start the meta service in-process (single node / tests)."""

    protocol: Literal["host_rdma", "host_urma", "host_tcp", "host_shm", "device_rdma", "device_sdma"] = "host_shm"
    """``LocalConfig.protocol`` of the store client."""

    lease_ttl_ms: int = knob(60_000, ge=0)
    """Lease on allocated objects, released after the last layer."""

    device_id: Optional[int] = None
    """The NPU the store client registers memory for (``None`` = the rank's device)."""

    def _check(self) -> List[str]:
        return limit_problems(self)


@dataclass(frozen=True)
class LayerwisePrefillOffloadConfig:
    """Layerwise prefill offload: layers share fewer device buffers, each layer's KV saved to
    a host store once written and reloaded ahead of its compute (docs/layerwise_prefill.md)."""

    shared_buffers: Optional[int] = knob(None, ge=1, note="null = one buffer per layer")
    """B, reusable physical buffers; ``None`` = one per layer (no reuse)."""

    independent_layers: Union[List[int], Literal["all"]] = field(default_factory=lambda: [0])
    """Layers with a dedicated buffer (default ``[0]``), or ``"all"``: distinct,
    non-negative layer indices."""

    prefetch_depth: Optional[int] = knob(None, ge=1, note="null = min(B, 8)")
    """Layers loaded ahead of compute; ``None`` = min(B, 8)."""

    store_backend: Optional[Literal["memcache", "local"]] = None
    """``memcache`` (Ascend production) or ``local`` (in-process host pool); ``None`` = the
    one that works on the device: ``memcache`` on an Ascend NPU, ``local`` elsewhere
    (:meth:`effective_store_backend`)."""

    memcache: MemcacheConfig = field(default_factory=MemcacheConfig)
    """Settings of the Memcache store (``store_backend`` ``memcache``)."""

    wait_timeout_s: float = knob(60.0, gt=0)
    """Deadline of every wait on a buffer gate."""

    store_block_tokens: Optional[int] = knob(None, ge=1, note="null = the KV page size")
    """Tokens per host-store object; ``None`` = the KV page size (a served pool stores one
    object per page and refuses any other value, rule ``sglang.layerwise_block_tokens``)."""

    key_namespace: Optional[str] = None
    """Prefix of host-store keys (model + rank), so deployments sharing one Memcache never
    collide; ``None`` = derived from the model path and rank."""

    def _check(self) -> List[str]:
        """Field limits and the layer list (the Memcache section checks itself)."""
        errs = limit_problems(self)
        if isinstance(self.independent_layers, list):
            if any(i < 0 for i in self.independent_layers):
                errs.append("independent_layers must be non-negative layer indices")
            if len(set(self.independent_layers)) != len(self.independent_layers):
                errs.append("independent_layers has duplicates")
        return errs

    def effective_store_backend(self, device: str) -> str:
        """The host store this config uses on ``device`` (``npu`` / ``cuda`` / ``cpu``)."""
        if self.store_backend is not None:
            return self.store_backend
        return "memcache" if device == "npu" else "local"


@dataclass(frozen=True)
class PDTransferConfig:
    """Remote device-to-host P/D transfer: decode pulls each prefill layer into its host
    pool (docs/pd_transfer.md)."""

    engine: Literal["memfabric", "mooncake"] = "memfabric"
    """``memfabric`` (Ascend production) or ``mooncake`` (TCP on CPU, RDMA elsewhere)."""

    protocol: Literal["sdma", "device_rdma", "device_urma"] = "sdma"
    """MemFabric data path; prefill and decode must match."""

    mooncake_protocol: Literal["tcp", "rdma", "efa"] = "tcp"
    """Mooncake transport: ``tcp`` on CPU machines, ``rdma`` on clusters without MemFabric."""

    mooncake_device_name: str = ""
    """The RDMA NIC name of Mooncake's ``rdma`` transport."""

    kv_port: int = knob(30100, ge=1024, le=65535)
    """Base of the decode control ports (``kv_port + dp_rank * d_tp + tp_rank``)."""

    host: str = "127.0.0.1"
    """Address the control sockets bind to, which is also the address peers connect to: a
    concrete interface address, never a wildcard (0.0.0.0, ::)."""

    store_url: Optional[str] = None
    """MemFabric config store (``tcp://host:port``)."""

    handshake_timeout_s: float = knob(100.0, gt=0)
    """Deadline of the metadata handshake (default 100 s, the handshake timeout of
    vLLM-Ascend's P/D connector, whose message set this protocol follows)."""

    layer_timeout_s: float = knob(30.0, gt=0)
    """Deadline of every per-layer wait, so a lost answer from a live peer fails the request
    instead of holding its slot forever; on decode it is also the no-progress deadline of a
    request."""

    read_retries: int = knob(2, ge=0)
    """Failed reads retried this many times before the request fails."""

    peer_tp: Optional[int] = knob(None, ge=1)
    """The other side's attention TP size, where the operator states it; then an invalid TP
    pair stops startup instead of failing every request when the two sides meet."""

    peer_protocol: Optional[Literal["sdma", "device_rdma", "device_urma"]] = None
    """The other side's MemFabric protocol, where the operator states it; then a mismatch
    stops startup."""

    def _check(self) -> List[str]:
        """Field limits, then the bind address."""
        errs = limit_problems(self)
        if self.host.strip() in ("", "0.0.0.0", "::", "[::]", "*"):
            errs.append(f"host {self.host!r} is a wildcard: give the interface address peers connect to")
        return errs


@dataclass(frozen=True)
class KVPPConfig:
    """KV layer parallelism: KV sharded by layer across the TP group (docs/kvpp.md)."""

    prefetch: bool = True
    """Broadcast the next layer while the current one computes."""

    scratch_alignment_bytes: int = knob(2 * 1024 * 1024, gt=0, power_of_two=True)
    """Alignment of the two scratch buffers (2 MiB)."""

    broadcast: Literal["active", "full"] = "active"
    """``active`` (only the KV pages the forward's requests read, gathered into a contiguous
    staging buffer) or ``full`` (the whole layer bundle, every allocated block: the simple
    scheme, kept for comparison)."""

    def _check(self) -> List[str]:
        return limit_problems(self)


@dataclass(frozen=True)
class OffloadConfig:
    """All features; a section that is ``None`` is off."""

    sparse_decode: Optional[SparseDecodeOffloadConfig] = None
    """Sparse decode offload (``--enable-sparse-decode-offload``)."""

    layerwise_prefill: Optional[LayerwisePrefillOffloadConfig] = None
    """Layerwise prefill offload (``--enable-layerwise-prefill-offload``)."""

    pd_transfer: Optional[PDTransferConfig] = None
    """The P/D transfer backend (``--enable-pd-transfer``)."""

    kvpp: Optional[KVPPConfig] = None
    """KV layer parallelism (``--enable-kvpp``)."""

    device_kv_budget_bytes: Optional[int] = knob(None, gt=0, note="a positive number of bytes")
    """The most device memory SGLang's KV pool (plus the sparse decode hot buffers) may take,
    in bytes; ``None`` = what ``--mem-fraction-static`` leaves (SGLang's own profile). The
    smaller of the two is used. On a CPU it also makes the server account like a device of
    that size: the sparse decode host pool is host memory outside the budget, as on an NPU
    node (``sglang_plugin/mem_cache/sizing/device_kv_budget.py``)."""

    def _check(self) -> List[str]:
        return limit_problems(self)


# ------------------------------------------------------------------ deployment facts
@dataclass(frozen=True)
class Deployment:
    """Facts about where a config will run (from SGLang's ServerArgs or a JSON file)."""

    device: Literal["npu", "cuda", "cpu"] = "npu"
    """The device kind."""

    soc: Optional[str] = None
    """CANN SoC name (e.g. ``Ascend910_9391``) or family (``A2``, ``A3``, ``950PR``,
    ``950DT``), where known."""

    soc_unknown: Optional[str] = None
    """Why the SoC of an NPU deployment could not be read from the installed CANN build
    (``cann_install.py``); set, it refuses sparse decode offload."""

    model_kind: Literal["dsa", "mla", "other"] = "dsa"
    """``dsa`` (MLA + indexer + top-k sparse attention, DeepSeek-V3.2 style), ``mla``
    (dense MLA) or ``other``."""

    hybrid_kv: bool = False
    """The model mixes KV layouts."""

    main_kv_dtype: str = "bf16"
    """Dtype of the main (latent) KV cache."""

    main_kv_packing: Literal["none", "c8", "tq4"] = "none"
    """Packing of the main (latent) KV cache."""

    num_layers: Optional[int] = knob(None, ge=1)
    """Layers with a KV cache, where known."""

    index_topk: Optional[int] = knob(None, ge=1)
    """The model's index top-k, where known."""

    page_size: Optional[int] = knob(None, ge=1)
    """KV page size in tokens, where known."""

    dp: int = knob(1, ge=1)
    """Data-parallel groups of the attention (SGLang's ``attn_dp_size`` with DP attention)."""

    tp: int = knob(1, ge=1)
    """TP size."""

    attn_tp: Optional[int] = knob(None, ge=1)
    """Attention TP size (``tp // (attention DP x attention CP)``; ``None`` = ``tp``); at most
    ``tp``."""

    cp: int = knob(1, ge=1)
    """Context-parallel size."""

    pp: int = knob(1, ge=1)
    """Pipeline-parallel size."""

    pcp: int = knob(1, ge=1)
    """Prefill context-parallel size."""

    dcp: int = knob(1, ge=1)
    """Decode context-parallel size."""

    pd_role: Literal["colocated", "prefill", "decode"] = "colocated"
    """The P/D role of this server."""

    peer_tp: Optional[int] = knob(None, ge=1)
    """The other side's attention TP size, where known."""

    peer_protocol: Optional[str] = None
    """The other side's MemFabric protocol, where known."""

    disaggregation_transfer_backend: Optional[str] = None
    """SGLang's ``--disaggregation-transfer-backend``."""

    graph_mode: Literal["eager", "piecewise", "full"] = "eager"
    """How the model runs: eager, or captured graphs (piecewise or full)."""

    speculative_method: Optional[str] = None
    """``None`` or e.g. ``mtp``, ``dspark``, ``eagle``."""

    speculative_fixed: bool = True
    """The speculative method's number of draft tokens is fixed."""

    speculative_rows: Optional[int] = knob(None, ge=1)
    """Verify rows per request (``--speculative-num-draft-tokens``), where known."""

    speculative_steps: Optional[int] = knob(None, ge=1)
    """Draft steps (``--speculative-num-steps``), where known; a chain has ``steps + 1``
    verify rows."""

    speculative_topk: Optional[int] = knob(None, ge=1)
    """Drafts per step (``--speculative-eagle-topk``; > 1 is a draft tree), where known."""

    overlap_schedule: Optional[bool] = None
    """SGLang's overlap scheduler runs (on by default in SGLang; ``--disable-overlap-schedule``
    turns it off), where known."""

    decode_graph_mode: Optional[Literal["eager", "piecewise", "full"]] = None
    """The mode of decode steps, where it differs from ``graph_mode`` (``None`` =
    ``graph_mode``); on a CPU, SGLang captures decode graphs only with
    ``--enable-torch-compile``."""

    dp_attention: bool = False
    """The ``dp`` groups are DP-attention groups (``--enable-dp-attention`` or
    ``--attn-dp-size``), which run different batches through one model."""

    def _check(self) -> List[str]:
        """Field limits, then attention TP within TP."""
        errs = limit_problems(self)
        if self.attn_tp is not None and not 1 <= self.attn_tp <= self.tp:
            errs.append("attn_tp must be between 1 and tp")
        return errs

    @property
    def attention_tp(self) -> int:
        """Attention TP size (what the P/D protocol calls p_tp / d_tp)."""
        return self.tp if self.attn_tp is None else self.attn_tp

    @property
    def verify_rows(self) -> int:
        """Query rows per request in a decode step: :attr:`speculative_rows` with a
        speculative method, else 1 (``sparse_decode.sizing.verify_rows``)."""
        return _hot_sizing.verify_rows(self.speculative_method, self.speculative_rows)

    @property
    def host_pool_tensor_view(self) -> bool:
        """The sparse decode host pool has a tensor view the fused Copy-SFA can read: every
        pool but the group's MemFabric pool, which an NPU with attention TP > 1 reaches
        through global addresses (:data:`TP_SHARED_HOST_POOL_DEVICES`)."""
        return self.device in TP_SHARED_HOST_POOL_DEVICES or self.attention_tp == 1

    @property
    def decode_graphs(self) -> bool:
        """Decode steps run as captured graphs."""
        return (self.decode_graph_mode or self.graph_mode) != "eager"

    @property
    def soc_family(self) -> Optional[str]:
        """``"950"``, ``"A3"``, ``"A2"``... from :attr:`soc` (name or family)."""
        from .soc import soc_family

        return soc_family(self.soc)


# ------------------------------------------------------------------ parsing
def load_json_arg(value: Union[str, dict, None], example: str = '{"sparse_decode": {"hot_tokens": 4096}}') -> Any:
    """A flag value: inline JSON, ``@path`` to a JSON file, or an already-parsed dict.

    ``example``: a valid value of this flag, shown in the error when the text is not JSON.
    """
    if value is None or isinstance(value, dict):
        return value or {}
    text = value.strip()
    source = "inline value"
    if text.startswith("@"):
        path = os.path.expanduser(text[1:])
        source = f"file {path}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(
                [Violation("parse.file", f"cannot read {path}: {exc.strerror}", "pass an existing JSON file as @path")]
            ) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                [Violation("parse.file", f"{path} is not UTF-8 text ({exc.reason})", "pass a JSON text file as @path")]
            ) from exc
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [Violation("parse.json", f"{source} is not valid JSON: {exc}", f"pass a JSON object, e.g. '{example}'")]
        ) from exc


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
        errors.append(
            Violation(
                "parse.type",
                f"{path or 'config'} must be a JSON object, got {type(data).__name__}",
                "wrap the settings in {...}",
            )
        )
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            errors.append(
                Violation("parse.unknown_key", f"unknown key '{path}{key}'", f"known keys: {', '.join(sorted(names))}")
            )
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
            errors.append(
                Violation(
                    "parse.type",
                    f"{path}{f.name}={json.dumps(value)} has the wrong type or value",
                    f"expected {_describe(tp)}",
                )
            )
            continue
        kwargs[f.name] = float(value) if tp is float else value
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - all fields have defaults
        errors.append(Violation("parse.type", str(exc), "check the keys"))
        return None
    for msg in obj._check():
        errors.append(Violation("parse.range", f"{path}{msg}", "set a value in the stated range"))
    return obj


def _example_of(cls: type) -> str:
    if cls is OffloadConfig:
        return '{"sparse_decode": {"hot_tokens": 4096}}'
    first = next(
        (
            f
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING
            and isinstance(f.default, (int, str))
            and not isinstance(f.default, bool)
        ),
        None,
    )
    return "{}" if first is None else json.dumps({first.name: first.default})


def parse_section_partial(cls: type, value: Union[str, dict, None]) -> Tuple[Optional[Any], List[Violation]]:
    """``(config, problems)``: like :func:`parse_section`, but a key with a bad type or
    value keeps its default so the rest can still be checked (every rule, every
    problem in one report). ``config`` is ``None`` only when the text is not a JSON
    object. Never run a config that came with problems.
    """
    try:
        data = load_json_arg(value, _example_of(cls))
    except ConfigError as exc:
        return None, list(exc.violations)
    errors: List[Violation] = []
    obj = _build(cls, data, "", errors)
    return obj, errors


def parse_section(cls: type, value: Union[str, dict, None], what: Optional[str] = None):
    """Parse one feature section (a flag value) into ``cls``; every problem at once."""
    obj, errors = parse_section_partial(cls, value)
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


# ------------------------------------------------------------------ validation
#: The rules :func:`violations` decides, id -> what each requires (the registry
#: ``rules.py`` defines them; this is its ``deployment`` scope).
RULES: Dict[str, str] = {
    rule_id: _rule_registry.RULES[rule_id].requires for rule_id in _rule_registry.ids_in_scope("deployment")
}

_BF16_NAMES = {"bf16", "bfloat16"}
_Add = typing.Callable[[str, str, str], None]


def validate(config: OffloadConfig, deployment: Deployment) -> None:
    """Check ``config`` against ``deployment``; raise one :class:`ConfigError` with
    every violation, or return ``None`` when the deployment can run the config."""
    found = violations(config, deployment)
    if found:
        raise ConfigError(found, "offload configuration for this deployment")


def violations(config: OffloadConfig, deployment: Deployment) -> List[Violation]:
    """All broken rules, in a stable order (see :data:`RULES`).

    The one verdict on a config and its deployment facts: ``check-config`` calls it
    on the facts it is given, the server's startup on the facts it reads from SGLang's
    resolved arguments (``sglang_plugin/args/deployment.py``).
    """
    out: List[Violation] = []

    def add(rule: str, problem: str, fix: str) -> None:
        assert rule in RULES, rule
        out.append(Violation(rule, problem, fix))

    d = deployment
    for msg in d._check():
        out.append(_rule_registry.violation("deployment.range", msg))
    if config.sparse_decode is not None:
        _check_sparse_decode(config, d, add)
    if config.layerwise_prefill is not None:
        _check_layerwise(config, d, add)
    if config.pd_transfer is not None:
        _check_pd(config, d, add)
    if config.kvpp is not None:
        _check_kvpp(d, add, layerwise=config.layerwise_prefill is not None)
    return out


def _check_sparse_decode(config: OffloadConfig, d: Deployment, add: _Add) -> None:
    sd = config.sparse_decode
    assert sd is not None
    _check_sparse_decode_model(d, add)
    _check_sparse_decode_hot_tokens(sd, d, add)
    _check_sparse_decode_settings(sd, d, add)
    _check_sparse_decode_speculative(d, add)
    _check_sparse_decode_graphs(sd, d, add)
    if config.kvpp is not None:
        add("sparse_decode.kvpp", "sparse decode offload and KVPP are both on", "enable only one of them on a node")


def _check_sparse_decode_model(d: Deployment, add: _Add) -> None:
    """The model, the main KV format, the parallelism and the node."""
    if d.model_kind != "dsa":
        add(
            "sparse_decode.model",
            f"model kind is {d.model_kind!r}",
            "serve a DSA model (DeepSeek-V3.2 / GLM-5 style) or disable sparse decode offload",
        )
    if d.main_kv_dtype.lower() not in _BF16_NAMES:
        add(
            "sparse_decode.main_kv_dtype",
            f"main KV dtype is {d.main_kv_dtype!r}",
            "use a bfloat16 KV cache (--kv-cache-dtype bfloat16)",
        )
    if d.main_kv_packing != "none":
        add(
            "sparse_decode.main_kv_packing",
            f"main KV is packed as {d.main_kv_packing!r}",
            "use an unpacked BF16 main KV cache",
        )
    cps = {k: getattr(d, k) for k in ("cp", "pcp", "dcp") if getattr(d, k) > 1}
    if cps:
        add(
            "sparse_decode.context_parallel",
            "context parallelism is on (" + ", ".join(f"{k}={v}" for k, v in cps.items()) + ")",
            "set every context-parallel size to 1 (DP and TP are supported)",
        )
    if d.pp > 1:
        add("sparse_decode.pipeline_parallel", f"pp={d.pp}", "set the pipeline-parallel size to 1")
    if d.soc_family == "950":
        add(
            "sparse_decode.soc_950",
            f"SoC {d.soc!r} is Ascend 950PR/950DT series",
            "run sparse decode offload on A2/A3 nodes",
        )
    if d.soc_unknown and d.device == "npu" and d.soc_family is None:
        add(
            "sparse_decode.soc_unknown",
            f"the SoC is undecided: {d.soc_unknown}",
            "install the A2/A3 CANN operator package this node serves and source its set_env.sh "
            "(python -m sglang_ascend_offload env --npu-check shows what the build says)",
        )
    if d.hybrid_kv:
        add(
            "sparse_decode.hybrid_kv",
            "the model uses a hybrid KV cache layout",
            "use a model with a uniform MLA KV layout",
        )
    if d.pd_role == "prefill":
        add(
            "sparse_decode.prefill_node",
            "this is a prefill-only node",
            "enable sparse decode offload on the decode node",
        )


def _check_sparse_decode_hot_tokens(sd: "SparseDecodeOffloadConfig", d: Deployment, add: _Add) -> None:
    if sd.hot_tokens is not None and d.index_topk is not None and sd.hot_tokens < d.index_topk:
        add(
            "sparse_decode.hot_tokens_topk",
            f"hot_tokens={sd.hot_tokens} < top-k={d.index_topk}",
            f"set hot_tokens >= {_hot_sizing.least_hot_tokens(d.index_topk, d.page_size)} "
            f"({_hot_sizing.default_hot_tokens(d.index_topk, d.page_size)} recommended: "
            "2 x top-k rounded up to the page size)",
        )
    if sd.hot_tokens is not None and d.page_size is not None and sd.hot_tokens % d.page_size:
        add(
            "sparse_decode.hot_tokens_page",
            f"hot_tokens={sd.hot_tokens} is not a multiple of the page size {d.page_size}",
            f"round hot_tokens to a multiple of {d.page_size}, "
            f"e.g. {_hot_sizing.round_to_page(sd.hot_tokens, d.page_size)}",
        )


def _check_sparse_decode_settings(sd: "SparseDecodeOffloadConfig", d: Deployment, add: _Add) -> None:
    """Operators, indexer dtype and ranking depth."""
    # The fused operators run on an Ascend NPU, and on CPU as the AscendC kernels on their
    # functional model (a correctness path); the torch_npu rung only on an NPU.
    wants_npu = [
        name
        for name, on in (
            ("ops=" + sd.ops, sd.ops == "npu" or (sd.ops == "fused" and d.device != "cpu")),
            ("fused_lim", sd.fused_lim is True and d.device != "cpu"),
            ("fused_copy_sfa", sd.fused_copy_sfa is True and d.device != "cpu"),
        )
        if on
    ]
    if wants_npu and d.device != "npu":
        add(
            "sparse_decode.fused_device",
            f"{', '.join(wants_npu)} requested on a {d.device} device",
            "use ops=auto|reference|triton off Ascend (ops=fused runs the fused kernels' functional model on "
            "CPU), or run on an Ascend NPU",
        )
    if sd.indexer_dtype == "int8":
        _check_int8_indexer(sd, d, add)
    if sd.fused_lim is True or sd.record_trace_rank_depth > 0:
        from .sparse_decode.op_selection import select_for_config

        plan = select_for_config(
            sd, d.device, rows_per_request=d.verify_rows, **residency_shape(sd, d), available=lambda op: None
        )
        for p in plan.problems:
            if p.rule == "sglang.fused_not_wired" and sd.fused_lim is True:
                add(p.rule, p.problem, p.fix)
        if sd.record_trace_rank_depth > 0 and plan.indexer.fused:
            add(
                "sparse_decode.trace_ranking_fused",
                f"record_trace_rank_depth={sd.record_trace_rank_depth} with the fused indexer ({plan.indexer.reason}), "
                "which returns the top-k only, not the ranking beyond it",
                'set "fused_lim": false (the separate indexer ranks) or drop record_trace_rank_depth',
            )
    for name, depth in (("rank_depth", sd.rank_depth), ("record_trace_rank_depth", sd.record_trace_rank_depth)):
        if depth > 0 and d.index_topk is not None and depth < d.index_topk:
            add(
                "sparse_decode.rank_depth_topk",
                f"{name}={depth} < top-k={d.index_topk}",
                f"set {name} >= {d.index_topk} (e.g. {2 * d.index_topk} or 2 x hot_tokens)",
            )
    if sd.rank_depth > 0 and d.speculative_method:
        add(
            "sparse_decode.score_speculative",
            f"policy {sd.policy!r} (rank_depth={sd.rank_depth}) with "
            f"speculative method {d.speculative_method!r}: verify rows get no ranking of their own",
            "serve lru / lru_k2_guarded with speculative decoding, or disable speculative decoding",
        )


def _check_int8_indexer(sd: "SparseDecodeOffloadConfig", d: Deployment, add: _Add) -> None:
    """Where the int8 (LIM-C8) index-K cache is served: the plugin's own indexer path
    (rotate + quantise the keys into the cache, the C8 indexer over it), which runs off
    the NPU, and on an NPU where the fused LIM-C8 serves (the backend then runs the
    indexer instead of SGLang's ``forward_npu``). On a P/D decode the prefill packs its
    bf16 keys into int8 + scales for it, but not next to a speculative draft layer (one
    indexer tensor, one dtype)."""
    if d.device == "npu":
        from .sparse_decode.op_selection import select_for_config

        plan = select_for_config(
            sd, "npu", rows_per_request=d.verify_rows, **residency_shape(sd, d), available=lambda op: None
        )
        if not plan.indexer.fused:
            add(
                "sglang.indexer_int8_device",
                "indexer_dtype='int8' on an Ascend NPU without the fused LIM-C8 "
                f"({plan.indexer.reason}): SGLang's own NPU indexer (forward_npu) would write bf16 index K and "
                "call the bf16 lightning indexer, so the int8 cache would hold unrotated, unscaled keys",
                'leave fused_lim unset (the NPU default serves LIM-C8), or set "indexer_dtype": "bf16"',
            )
    if d.pd_role == "decode" and d.speculative_method:
        add(
            "sglang.indexer_int8_pd",
            f"indexer_dtype='int8' on a P/D decode node with speculative method "
            f"{d.speculative_method!r}: the draft layer's bf16 index K would share the transfer's one indexer "
            "tensor with the target's int8 keys + scales (role indexer_scale)",
            'set "indexer_dtype": "bf16" on the P/D decode node, or serve it without speculation',
        )


#: Speculative methods (``Deployment.speculative_method``) whose drafts the sparse decode
#: engine and the layerwise pool serve: SGLang's NextN / MTP draft (``EAGLE`` / ``NEXTN``).
SERVED_DRAFT_METHODS = ("mtp",)


def _check_sparse_decode_speculative(d: Deployment, add: _Add) -> None:
    """Verify rows as the engine serves them: one fixed chain of ``steps + 1`` rows per
    request, set up on the host each round (no overlap scheduling, no device graphs)."""
    if not d.speculative_method:
        return
    rule = "sglang.sparse_decode_speculative"
    if not d.speculative_fixed:
        add(
            "sparse_decode.speculative",
            f"speculative method {d.speculative_method!r} has a variable token count",
            "use a fixed number of speculative tokens",
        )
    if d.speculative_method not in SERVED_DRAFT_METHODS:
        add(
            rule,
            f"speculative method {d.speculative_method!r} with sparse decode offload: only the NextN / "
            "MTP draft (--speculative-algorithm EAGLE / NEXTN) is served",
            "use --speculative-algorithm NEXTN (or EAGLE), or disable sparse decode offload",
        )
        return
    if d.speculative_topk is not None and d.speculative_topk != 1:
        add(
            rule,
            f"--speculative-eagle-topk {d.speculative_topk}: a draft tree; sparse decode offload verifies "
            "a chain (one verify row per draft position)",
            "use --speculative-eagle-topk 1",
        )
    if (
        d.speculative_steps is not None
        and d.speculative_rows is not None
        and d.speculative_rows != d.speculative_steps + 1
    ):
        add(
            rule,
            f"--speculative-num-draft-tokens {d.speculative_rows} with --speculative-num-steps "
            f"{d.speculative_steps}: sparse decode offload needs exactly steps + 1 verify rows per request "
            "(a fixed count)",
            f"use --speculative-num-draft-tokens {d.speculative_steps + 1}",
        )
    if d.decode_graphs and d.device != "cpu":
        add(
            rule,
            f"decode graphs ({d.decode_graph_mode or d.graph_mode}) on device {d.device!r} with "
            "speculative decoding and sparse decode offload: the verify step sets up its engine rows on the host "
            "every round, and only the plugin's CPU verify graph runner (--device cpu --enable-torch-compile) "
            "repeats that before each replay; device graph runners would replay stale rows",
            "run decode eagerly (--disable-cuda-graph), or serve on a CPU with --enable-torch-compile",
        )
    if d.overlap_schedule:
        add(
            rule,
            "overlap scheduling with speculative decoding and sparse decode offload: the verify step "
            "takes each request's committed length from the host when it starts (not tested with overlap)",
            "add --disable-overlap-schedule",
        )


def _check_sparse_decode_graphs(sd: "SparseDecodeOffloadConfig", d: Deployment, add: _Add) -> None:
    """Rule ``sglang.sparse_decode_graph``: host work between the layers of a decode step,
    which a captured step cannot do; one violation per feature that needs it."""
    if not d.decode_graphs:
        return
    mode = d.decode_graph_mode or d.graph_mode
    eager = "run decode eagerly (--disable-cuda-graph, or on a CPU without --enable-torch-compile)"
    refusals = [
        (
            d.attention_tp > 1,
            f"decode graphs with sparse decode offload at attention TP {d.attention_tp}: the ranks of an "
            "attention-TP group share one host pool whose appends TP rank 0 publishes from the host per layer, "
            "which a captured decode step cannot do",
            f"{eager} or use attention TP 1 (attention DP for more ranks)",
        ),
        (
            bool(sd.record_trace),
            f"record_trace with decode graphs on ({mode}): the trace recorder reads each layer's top-k on the "
            "host, which a captured decode step cannot do",
            f"drop record_trace, or {eager}",
        ),
        (
            sd.verify_sample_rate > 0,
            f"verify_sample_rate={sd.verify_sample_rate} with decode graphs on ({mode}): shadow verification "
            "recomputes a sampled row between layers on the host, which a captured decode step cannot do",
            f"set verify_sample_rate to 0, or {eager}",
        ),
        (
            sd.rank_depth > 0,
            f"policy {sd.policy!r} (rank_depth={sd.rank_depth}) with decode graphs on ({mode}): the graph decode "
            "path selects top-k only and does not hand the indexer's ranking to the residency manager",
            f"{eager}, or serve lru / lru_k2_guarded with decode graphs",
        ),
    ]
    for on, problem, fix in refusals:
        if on:
            add("sglang.sparse_decode_graph", problem, fix)


def _check_layerwise(config: OffloadConfig, d: Deployment, add: _Add) -> None:
    lw = config.layerwise_prefill
    assert lw is not None
    _check_layerwise_buffers(lw, d, add)
    _check_layerwise_serving(config, d, add)


def _check_layerwise_buffers(lw: LayerwisePrefillOffloadConfig, d: Deployment, add: _Add) -> None:
    """Buffer reuse, the store and the layer plan."""
    n = d.num_layers
    independent = (n or 0) if lw.independent_layers == "all" else len(lw.independent_layers)
    reusable = None if n is None else max(n - independent, 0)
    reuse = lw.shared_buffers is not None and (reusable is None or lw.shared_buffers < reusable)
    if reuse and d.graph_mode != "eager":
        add(
            "layerwise_prefill.eager",
            f"graph mode is {d.graph_mode!r} with shared_buffers={lw.shared_buffers}",
            "run the prefill node in eager mode (--disable-cuda-graph) or leave shared_buffers unset",
        )
    if reuse and lw.effective_store_backend(d.device) != "memcache" and d.device != "cpu":
        add(
            "layerwise_prefill.memcache",
            f"store_backend={lw.store_backend!r} with buffer reuse on {d.device}",
            'set "store_backend": "memcache" (the local backend is for CPU development)',
        )
    if reuse and d.pd_role == "prefill" and (d.disaggregation_transfer_backend or "") not in ("", "ascend_offload"):
        add(
            "layerwise_prefill.mooncake_layerwise",
            f"P/D backend {d.disaggregation_transfer_backend!r} gives no per-buffer completion gate",
            "use --disaggregation-transfer-backend ascend_offload or leave shared_buffers unset",
        )
    if n is not None and isinstance(lw.independent_layers, list):
        bad = [i for i in lw.independent_layers if i >= n]
        if bad:
            add(
                "layerwise_prefill.layers",
                f"independent_layers {bad} do not exist (model has {n})",
                f"use layer indices in 0..{n - 1}",
            )
    if lw.prefetch_depth is not None and lw.shared_buffers is not None and lw.prefetch_depth > lw.shared_buffers:
        add(
            "layerwise_prefill.prefetch",
            f"prefetch_depth={lw.prefetch_depth} > shared_buffers={lw.shared_buffers}",
            f"set prefetch_depth <= {lw.shared_buffers}",
        )
    if lw.store_block_tokens is not None and d.page_size is not None and lw.store_block_tokens != d.page_size:
        add(
            "sglang.layerwise_block_tokens",
            f"store_block_tokens={lw.store_block_tokens} but the KV page "
            f"size is {d.page_size} (the SGLang pool stores one object per page)",
            "drop store_block_tokens",
        )


def _check_layerwise_serving(config: OffloadConfig, d: Deployment, add: _Add) -> None:
    """The node, the model, the parallelism and what else runs in the server."""
    if d.hybrid_kv:
        add(
            "layerwise_prefill.hybrid_kv",
            "the model uses a hybrid KV cache layout",
            "use a model with a uniform KV layout",
        )
    if d.pd_role == "decode":
        add(
            "layerwise_prefill.decode_node",
            "this is a decode-only node",
            "enable layerwise prefill offload on the prefill node",
        )
    if config.sparse_decode is not None:
        add(
            "sglang.layerwise_sparse_decode",
            "sparse decode offload and layerwise prefill offload are both on in one server",
            "enable layerwise prefill offload on the prefill node and sparse decode offload on the decode node",
        )
    if d.speculative_method and d.speculative_method not in SERVED_DRAFT_METHODS:
        add(
            "sglang.layerwise_speculative",
            f"speculative method {d.speculative_method!r} with layerwise prefill "
            "offload: only the NextN / MTP draft (EAGLE / NEXTN) is wired (its layer gets a dedicated buffer)",
            "use --speculative-algorithm NEXTN, or drop the speculative decoding flags",
        )
    if d.speculative_method and d.speculative_topk is not None and d.speculative_topk != 1:
        add(
            "sglang.layerwise_speculative",
            f"--speculative-eagle-topk {d.speculative_topk}: a draft tree; "
            "layerwise prefill offload is served and tested with draft chains",
            "use --speculative-eagle-topk 1",
        )
    if d.pp > 1:
        add(
            "sglang.layerwise_pp",
            f"pp={d.pp}: the layer buffers are planned per model, not per pipeline stage",
            "set --pp-size 1 with layerwise prefill offload",
        )


def _check_pd(config: OffloadConfig, d: Deployment, add: _Add) -> None:
    pd = config.pd_transfer
    assert pd is not None
    if d.pd_role == "colocated":
        add(
            "pd_transfer.role",
            "P/D transfer configured on a colocated server",
            "start the servers with --disaggregation-mode prefill|decode",
        )
    if d.pd_role in ("prefill", "decode") and d.peer_tp is not None:
        p_tp, d_tp = (d.attention_tp, d.peer_tp) if d.pd_role == "prefill" else (d.peer_tp, d.attention_tp)
        if p_tp < d_tp or p_tp % d_tp:
            add(
                "pd_transfer.tp_ratio",
                f"p_tp={p_tp}, d_tp={d_tp}",
                "use a prefill TP that is a multiple of (and >=) the decode TP",
            )
    _check_pd_engine(pd, d, add)
    if d.pd_role == "decode" and d.attention_tp > 1:
        _check_pd_decode_tp(d, add, main_kv_offloaded=config.sparse_decode is not None)
    d_tp = d.attention_tp if d.pd_role == "decode" else (d.peer_tp or 1)
    last_port = pd.kv_port + (d.dp - 1) * d_tp + (d_tp - 1)
    if last_port > 65535:
        add(
            "pd_transfer.ports",
            f"ports {pd.kv_port}..{last_port} exceed 65535 (dp={d.dp}, d_tp={d_tp})",
            f"lower kv_port to <= {65535 - (last_port - pd.kv_port)}",
        )
    parallel = {name: getattr(d, name) for name in ("pp", "cp", "pcp", "dcp") if getattr(d, name) > 1}
    if parallel:
        add(
            "sglang.pd_parallel",
            ", ".join(f"{k}={v}" for k, v in parallel.items()),
            "use TP (and DP) only with the ascend_offload P/D backend",
        )
    if d.speculative_method and d.pd_role == "prefill" and config.layerwise_prefill is not None:
        add(
            "sglang.pd_speculative",
            f"speculative method {d.speculative_method!r} with layerwise prefill offload "
            "on the prefill: the layerwise pool's layer listener publishes the base layers, not the draft layer",
            "drop the speculative flags on the prefill, or layerwise prefill offload",
        )
    if d.speculative_method and d.pd_role == "decode" and d.attention_tp > 1:
        add(
            "sglang.pd_speculative",
            f"speculative method {d.speculative_method!r} with decode attention TP "
            f"{d.attention_tp}: the draft layer's KV is received by attention TP 1 decode servers only",
            "use attention TP 1 on the decode (DP attention for more ranks), or drop the speculative flags",
        )


def _check_pd_engine(pd: PDTransferConfig, d: Deployment, add: _Add) -> None:
    """The transfer engine and protocol for the device and the peer."""
    if d.device == "npu" and pd.engine != "memfabric":
        add("pd_transfer.memfabric_only", f"engine={pd.engine!r} on an Ascend node", 'set "engine": "memfabric"')
    if d.device != "npu" and pd.engine == "memfabric":
        add(
            "sglang.pd_engine_device",
            f"engine 'memfabric' on a {d.device} device",
            'set "engine": "mooncake" in --pd-transfer-config (TCP on CPU machines)',
        )
    if d.peer_protocol is not None and d.peer_protocol != pd.protocol:
        add(
            "pd_transfer.protocol_match",
            f"protocol={pd.protocol!r} but the peer uses {d.peer_protocol!r}",
            "configure the same protocol on prefill and decode",
        )
    fam = d.soc_family
    if pd.engine == "memfabric" and fam is not None:
        if fam == "950" and pd.protocol != "device_urma":
            add(
                "pd_transfer.protocol_soc",
                f"protocol={pd.protocol!r} on a 950 series node",
                'set "protocol": "device_urma"',
            )
        if fam in ("A2", "A3") and pd.protocol == "device_urma":
            add(
                "pd_transfer.protocol_soc",
                f"protocol='device_urma' on an {fam} node",
                'set "protocol": "sdma" (default) or "device_rdma"',
            )


#: Devices whose sparse-decode host pool is one memory shared by an attention-DP group's
#: TP ranks *and mapped by each of them*, so a P/D engine can write a rank's range into it
#: (``sglang_plugin/mem_cache/pool_host/shared.py::allocate_rank_pool``). On Ascend the group's
#: MemFabric pool is reached through global addresses and has no tensor view to receive into.
TP_SHARED_HOST_POOL_DEVICES = ("cpu", "cuda")


def _check_pd_decode_tp(d: Deployment, add, main_kv_offloaded: bool) -> None:
    """Decode attention TP > 1: the P/D protocol writes each main-KV block once, into the
    decode DP rank's TP-shared pool (``transfer/topology.py``)."""
    dp_attention = "run decode with attention TP 1 instead: DP attention (--tp N --dp N --enable-dp-attention)"
    if not main_kv_offloaded:
        add(
            "pd_transfer.decode_tp",
            f"decode attention TP {d.attention_tp} without sparse decode offload: the "
            "device main KV is per TP rank, and the protocol sends each decode rank only its share of a "
            "request's main KV",
            "enable sparse decode offload on the decode node (--enable-sparse-decode-"
            f"offload: one host pool shared by the TP ranks), or {dp_attention}",
        )
    elif d.device not in TP_SHARED_HOST_POOL_DEVICES:
        add(
            "pd_transfer.decode_tp",
            f"decode attention TP {d.attention_tp} on {d.device}: the attention-DP "
            "group's sparse-decode host pool is reached through global addresses there and has no mapping a "
            "P/D engine can write a decode rank's share of the main KV into",
            dp_attention,
        )


def _check_kvpp(d: Deployment, add, *, layerwise: bool) -> None:
    if layerwise:
        # shared device layer buffers saved to a host store vs. owner ranks + scratch layers
        add(
            "kvpp.layerwise_prefill",
            "KVPP and layerwise prefill offload are both on: each replaces the KV pool "
            "with its own layer placement and no combined pool exists",
            "enable one of them (layerwise prefill offload on a P/D prefill node, KVPP on a colocated server)",
        )
    if d.pd_role == "prefill":
        # a rank's non-owned layers live in a scratch buffer the next layer overwrites, so a
        # P/D sender (one prefill rank per decode rank, every layer) would need each layer's owner
        add(
            "kvpp.pd_prefill",
            "a P/D prefill node with KVPP: the P/D transfer backends send every layer from "
            "the paired prefill rank, which under KVPP keeps only its owned layers",
            "run KVPP on a colocated server, or disable KVPP on the prefill node",
        )
    if d.dcp > 1:
        add("kvpp.dcp", f"dcp={d.dcp}", "disable decode context parallelism or KVPP")
    if d.pd_role == "decode":
        add("kvpp.decode_node", "this is a decode-only node", "disable KVPP on decode nodes")
    if d.graph_mode not in ("eager", "piecewise"):
        add(
            "kvpp.graph_mode",
            f"graph mode is {d.graph_mode!r}",
            "run eagerly (--disable-cuda-graph) or with piecewise graphs",
        )
    if d.model_kind not in ("mla", "dsa") or d.hybrid_kv:
        kind = "hybrid " + d.model_kind if d.hybrid_kv else d.model_kind
        add("kvpp.model", f"model kind is {kind!r}", "use KVPP only with non-hybrid MLA models")
    if d.speculative_method and d.speculative_method.lower() not in ("mtp", "dspark"):
        add(
            "kvpp.speculative_method",
            f"speculative method {d.speculative_method!r}",
            "use mtp or dspark, or disable speculative decoding",
        )
    if d.speculative_method and not d.speculative_fixed:
        add(
            "kvpp.speculative_fixed",
            "the number of speculative tokens varies",
            "fix the number of speculative tokens (no adaptive verification)",
        )
    if d.tp * d.pcp < 2:
        add("kvpp.group", f"tp x pcp = {d.tp * d.pcp}", "use tensor parallelism >= 2 or disable KVPP")
    if d.pp > 1:
        add(
            "sglang.kvpp_pp",
            f"pp={d.pp}: per-stage KVPP groups are not wired in the SGLang plugin",
            "set --pp-size 1 with KVPP",
        )
    if d.dp_attention and d.dp > 1:
        add(
            "sglang.kvpp_dp_attention",
            f"DP attention with {d.dp} attention-DP groups: the replicated domain is "
            "the attention-TP group, and DP ranks run different batches (padding, idle forwards)",
            "drop --enable-dp-attention / --attn-dp-size with KVPP",
        )
