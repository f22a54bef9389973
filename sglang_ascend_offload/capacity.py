"""KV capacity of every KV placement mode, for one model on one machine.

Pure computation: :class:`CapacityInputs` + :class:`~.model_specs.ModelShape` in,
:class:`CapacityReport` out (:func:`plan`). The CLI (``python -m sglang_ascend_offload
capacity``) lives in :mod:`.capacity_cli`, which imports this module (never the
reverse). docs/capacity.md explains
every formula with the numbers for DeepSeek-V3.2.

Model of memory. Each mode is a :class:`Footprint` of *one DP rank*: on each of its
devices (TP ranks replicate MLA KV, so every device holds the same bytes) and on the
host share of that DP rank (``host_bytes / dp``), an affine function of the number
of requests ``R`` and of the KV pool's token capacity ``T``::

    bytes = fixed + R * per_request + T * per_token

With ``R`` concurrent requests of ``context`` tokens each (the token pool rounded
up to whole pages per request), ``requests`` is the largest ``R`` that fits the
HBM budget, the host budget and, where decode rows are fixed (``--rows``), the
rows; ``limited_by`` names the binding one. ``tokens`` is the pool capacity left
for that many requests (whole pages; for modes whose KV lives in per-request slots
of ``context`` tokens, at most ``R * context``). Totals multiply by ``dp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from . import rules as rule_registry
from .errors import ConfigError, Violation
from .model_specs import INDEXER_DTYPES, ModelShape
from .sparse_decode import sizing as hot_sizing

GIB = 1 << 30
MIB = 1 << 20
KVPP_SCRATCH_BUFFERS = 2  # the current non-owned layer + the next one's prefetch (broadcast ahead)
KVPP_SCRATCH_ALIGNMENT = 2 * MIB  # default alignment of the scratch buffers (KVPPConfig)

MODE_NAMES: Tuple[str, ...] = (
    "full-device",
    "sglang-npu-offload",
    "sparse-decode",
    "layerwise-prefill",
    "kvpp",
    "sparse-decode+layerwise-prefill",
)


@dataclass(frozen=True)
class CapacityInputs:
    """The machine and the knobs (the model is passed separately).

    hbm_bytes: HBM per device available to KV-related allocations (pools, hot
        buffers, layer buffers, scratch, residency metadata), i.e. what is left after
        weights, activations and workspace. ``weights_bytes`` (default 0) is
        subtracted from it first, for callers who pass the whole HBM instead.
    host_bytes: host memory of the node available to host KV pools (all DP ranks).
    tp / dp / pcp: attention TP size per DP rank (MLA KV replicated over it), DP
        ranks, prefill context parallel size; devices = tp * dp * pcp. KVPP shards
        over tp * pcp; the other modes ignore pcp.
    context: tokens per request (prompt + output) for the request count.
    page_size: KV page size; token pools hold whole pages.
    indexer_dtype: ``bf16`` (256 B / token / layer for 128 dims) or ``int8`` (LIM-C8).
    mtp: speculative decoding with the model's MTP layers (they carry KV too).
    hot_tokens: sparse decode hot-buffer slots per layer and request, shared by its verify
        rows; None = the served default (``sparse_decode.sizing.default_hot_tokens``:
        2 x top-k rounded up to the page size, with or without verify rows). Must be >=
        top-k, as the server requires; with verify rows the plan adds the overflow area
        for rounds whose union exceeds it (``sparse_decode/overflow.py``).
    rows: requests with a hot row (fixed); None = sized with the request count. Either
        way the engine adds its fixed rows (SGLang's padding slot and the sink row:
        :meth:`hot_plan`). rows_per_request: query tokens per request in a decode step
        (speculative verify rows); None = 1, or 1 + MTP layers with ``mtp``.
    decode_extra_slots: a P/D decode's extra request slots (SGLang's
        ``--disaggregation-decode-extra-slots``): each has a hot row, fixed.
    shared_buffers / independent_layers: layerwise prefill B and I.
    prefill_tokens: tokens the layerwise buffers hold in the colocated combination
        (the prefill in flight, prefix included); None = ``context``.
    """

    hbm_bytes: int
    host_bytes: int
    weights_bytes: int = 0
    tp: int = 1
    dp: int = 1
    pcp: int = 1
    context: int = 131072
    page_size: int = 128
    indexer_dtype: str = "bf16"
    mtp: bool = False
    hot_tokens: Optional[int] = None
    rows: Optional[int] = None
    rows_per_request: Optional[int] = None
    decode_extra_slots: int = 0
    shared_buffers: int = 4
    independent_layers: int = 1
    prefill_tokens: Optional[int] = None

    @property
    def kv_hbm_bytes(self) -> int:
        """HBM per device for KV: ``hbm_bytes - weights_bytes``."""
        return self.hbm_bytes - self.weights_bytes

    @property
    def host_bytes_per_dp(self) -> int:
        """Host bytes of one DP rank's pools (each DP rank owns its host pool)."""
        return self.host_bytes // self.dp

    @property
    def kvpp_group(self) -> int:
        """KVPP group size: the ranks that shard the layers, ``tp * pcp``."""
        return self.tp * self.pcp

    def hot(self, model: ModelShape) -> int:
        """Hot-buffer slots per layer of one query row (plain decode): ``hot_tokens`` or
        the served default for one row."""
        return hot_sizing.resolve_hot_tokens(self.hot_tokens, model.index_topk, self.page_size)

    def rows_per_req(self, model: ModelShape) -> int:
        if self.rows_per_request is not None:
            return self.rows_per_request
        return 1 + (model.mtp_layers if self.mtp else 0)

    def hot_plan(self, model: ModelShape, running_requests: int = 1) -> hot_sizing.HotBufferPlan:
        """The served hot-buffer plan of one DP rank's engine (its target layers; the MTP
        layers keep their KV on the device) for ``running_requests``: one hot row per
        request shared by its verify rows, plus the padding slot and the sink row."""
        return hot_sizing.HotBufferPlan.build(
            configured_hot_tokens=self.hot_tokens,
            top_k=model.index_topk,
            page_size=self.page_size,
            verify_rows=self.rows_per_req(model),
            layers=model.num_layers,
            row_dim=model.main_kv_dim,
            running_requests=running_requests,
            pre_alloc_slots=self.decode_extra_slots,
        )

    def hot_per_request(self, model: ModelShape) -> int:
        """Hot-buffer slots per layer and request (the plan's ``hot_tokens``)."""
        return self.hot_plan(model).hot_tokens

    def prefill_tok(self) -> int:
        return self.prefill_tokens if self.prefill_tokens is not None else self.context

    def paged(self, tokens: int) -> int:
        """``tokens`` rounded up to whole pages."""
        return -(-tokens // self.page_size) * self.page_size


@dataclass(frozen=True)
class Footprint:
    """Bytes one mode allocates for one DP rank: per device, and on its host share.

    Every ``*_per_token`` multiplies the KV pool's token capacity, every
    ``*_per_request`` the number of requests (structures sized per request or
    decode row), ``*_fixed`` is allocated once. ``slotted``: the KV lives in
    per-request slots of ``context`` tokens, so the usable tokens are at most
    ``requests * context``. ``max_requests``: a cap from fixed decode rows.
    """

    device_per_token: int
    device_per_request: int = 0
    device_fixed: int = 0
    host_per_token: int = 0
    host_per_request: int = 0
    host_fixed: int = 0
    slotted: bool = False
    max_requests: Optional[int] = None


@dataclass(frozen=True)
class ModeCapacity:
    """Capacity of one mode. ``tokens`` / ``requests`` are node totals (all DP ranks).

    device_bytes_per_token / host_bytes_per_token: bytes per KV-pool token (device:
    on each device; host: per DP rank's pool). device/host_bytes_per_request and
    *_fixed_bytes: the other terms of the :class:`Footprint`.
    device/host_bytes_per_context_token: everything one request of ``context``
    tokens costs (its tokens + its per-request structures), divided by ``context``.
    limited_by: ``hbm``, ``host`` or ``rows``. requests_vs_full: requests / requests
    of ``full-device`` (None when that is 0).
    """

    name: str
    description: str
    device_bytes_per_token: int
    host_bytes_per_token: int
    device_bytes_per_request: int
    host_bytes_per_request: int
    device_fixed_bytes: int
    host_fixed_bytes: int
    device_bytes_per_context_token: float
    host_bytes_per_context_token: float
    tokens: int
    requests: int
    tokens_per_dp_rank: int
    requests_per_dp_rank: int
    limited_by: str
    requests_vs_full: Optional[float] = None
    host_bytes_per_node: int = 0  # host pools of all DP ranks at this capacity (one pool per DP rank)


@dataclass(frozen=True)
class HotBufferReport:
    """Sparse decode hot buffers of the plan (``sparse_decode.sizing.HotBufferPlan``) in
    the planner's terms.

    rows_per_request: query rows per request and decode step (speculative verify rows).
    hot_tokens_per_row: the plain-decode size (``--hot-tokens``, default 2 x top-k).
    hot_tokens_per_request: slots per layer of the request's one buffer (the plan's
    ``hot_tokens``); verify_rows_share_buffer: several rows look up the union of their
    top-k in it. device_bytes_per_request: that buffer + its residency table on every
    target layer (one hot row). per_row_hot_tokens_per_request: what one buffer per
    verify row would take (``rows_per_request x hot_tokens_per_row``), for comparison.
    fixed_hot_rows: hot rows that serve no request (SGLang's padding slot, the engine's
    sink row, a P/D decode's extra slots); device_fixed_bytes: their bytes.
    overflow_slots_per_request: rows of the overflow area per request (one area for all
    layers, for the rounds whose verify rows' union exceeds the buffer; 0 = none), part
    of ``device_bytes_per_request``.
    """

    rows_per_request: int
    hot_tokens_per_row: int
    hot_tokens_per_request: int
    verify_rows_share_buffer: bool
    device_bytes_per_request: int
    per_row_hot_tokens_per_request: int
    fixed_hot_rows: int
    device_fixed_bytes: int
    overflow_slots_per_request: int = 0


@dataclass(frozen=True)
class SkippedMode:
    name: str
    reason: str


@dataclass(frozen=True)
class CapacityReport:
    model: ModelShape
    inputs: CapacityInputs
    modes: Tuple[ModeCapacity, ...]
    skipped: Tuple[SkippedMode, ...] = field(default_factory=tuple)
    hot_buffer: Optional[HotBufferReport] = None

    def mode(self, name: str) -> ModeCapacity:
        for m in self.modes:
            if m.name == name:
                return m
        raise KeyError(
            f"no mode {name!r} in this report (skipped: {', '.join(s.name for s in self.skipped) or 'none'})"
        )


# ------------------------------------------------------------------ validation
def input_problems(inputs: CapacityInputs, model: Optional[ModelShape]) -> List[Violation]:
    """Every problem with ``inputs`` (and with ``inputs`` against ``model`` when known)."""
    out: List[Violation] = []

    def bad(rule: str, problem: str, fix: str) -> None:
        out.append(rule_registry.violation(f"capacity.{rule}", problem, fix))

    if inputs.hbm_bytes <= 0:
        bad("hbm", f"HBM for KV is {inputs.hbm_bytes / GIB:g} GiB", "pass --hbm-gb > 0 (GiB per device)")
    if inputs.host_bytes <= 0:
        bad("host", f"host memory is {inputs.host_bytes / GIB:g} GiB", "pass --host-gb > 0 (GiB per node)")
    if inputs.weights_bytes < 0:
        bad("weights", f"weights take {inputs.weights_bytes / GIB:g} GiB", "pass --weights-gb >= 0")
    elif inputs.hbm_bytes > 0 and inputs.weights_bytes >= inputs.hbm_bytes:
        bad(
            "weights",
            f"--weights-gb {inputs.weights_bytes / GIB:g} leaves no HBM of --hbm-gb {inputs.hbm_bytes / GIB:g}",
            "--weights-gb must be below --hbm-gb",
        )
    for name in ("tp", "dp", "pcp", "context", "page_size", "shared_buffers"):
        if getattr(inputs, name) < 1:
            bad(name, f"{name} is {getattr(inputs, name)}", f"--{name.replace('_', '-')} must be >= 1")
    for name in ("hot_tokens", "rows", "rows_per_request", "prefill_tokens"):
        value = getattr(inputs, name)
        if value is not None and value < 1:
            bad(name, f"{name} is {value}", f"--{name.replace('_', '-')} must be >= 1 (or left out)")
    if inputs.decode_extra_slots < 0:
        bad(
            "decode_extra_slots",
            f"decode_extra_slots is {inputs.decode_extra_slots}",
            "--decode-extra-slots must be >= 0",
        )
    if inputs.independent_layers < 0:
        bad(
            "independent_layers",
            f"independent_layers is {inputs.independent_layers}",
            "--independent-layers must be >= 0",
        )
    if inputs.indexer_dtype not in INDEXER_DTYPES:
        bad(
            "indexer_dtype",
            f"indexer dtype {inputs.indexer_dtype!r}",
            f"--indexer-dtype must be one of {', '.join(INDEXER_DTYPES)}",
        )
    if model is None:
        return out
    if inputs.hot_tokens is not None and 1 <= inputs.hot_tokens < hot_sizing.required_hot_tokens(model.index_topk):
        least = hot_sizing.least_hot_tokens(model.index_topk, inputs.page_size)
        bad(
            "hot_tokens",
            f"hot_tokens {inputs.hot_tokens} < top-k {model.index_topk} of {model.name}",
            f"--hot-tokens must be >= {least} (a row's top-k needs a slot each; the server refuses less), "
            "or leave it out",
        )
    n_cache = model.cache_layers(inputs.mtp)
    if inputs.independent_layers > n_cache:
        bad(
            "independent_layers",
            f"independent_layers {inputs.independent_layers} > the {n_cache} cache-bearing layers of {model.name}",
            f"--independent-layers must be <= {n_cache}",
        )
    if inputs.mtp and model.mtp_layers == 0:
        bad("mtp", f"{model.name} has no MTP layers (num_nextn_predict_layers = 0)", "drop --mtp")
    return out


def check_inputs(inputs: CapacityInputs, model: ModelShape) -> None:
    """Raise :class:`ConfigError` listing every problem, or return."""
    problems = input_problems(inputs, model)
    if problems:
        raise ConfigError(problems, "capacity inputs")


# ------------------------------------------------------------------ footprints
def physical_layer_buffers(cache_layers: int, independent: int, shared: int) -> int:
    """Layerwise prefill physical buffers: ``I + min(B, N - I)`` (``I`` independent layers keep
    their own buffer; the other ``N - I`` share at most ``B``)."""
    return independent + min(shared, cache_layers - independent)


def kvpp_owned_layers(num_layers: int, group: int, rank: int) -> int:
    """Target layers KVPP rank ``rank`` owns: a contiguous, balanced partition of the layers
    (the first ``layers % group`` ranks own one more)."""
    base, remainder = divmod(num_layers, group)
    return base + int(rank < remainder)


def hot_buffer_report(model: ModelShape, inputs: CapacityInputs) -> HotBufferReport:
    """The request's hot buffer: one hot row per request, shared by its verify rows."""
    hot_plan = inputs.hot_plan(model)
    n, per_row = hot_plan.verify_rows, inputs.hot(model)
    return HotBufferReport(
        rows_per_request=n,
        hot_tokens_per_row=per_row,
        hot_tokens_per_request=hot_plan.hot_tokens,
        verify_rows_share_buffer=n > 1,
        device_bytes_per_request=hot_plan.device_bytes_per_row,
        per_row_hot_tokens_per_request=n * per_row,
        fixed_hot_rows=hot_plan.fixed_hot_rows,
        device_fixed_bytes=hot_plan.fixed_hot_rows * hot_plan.device_bytes_per_row,
        overflow_slots_per_request=hot_plan.overflow_slots,
    )


def _decode_rows(model: ModelShape, inputs: CapacityInputs) -> Dict[str, Optional[int]]:
    """Device bytes of the sparse decode engine's hot rows: per request (its verify rows
    share its row) and fixed (padding slot, sink row, P/D extra slots; all rows with ``--rows``), and
    the request cap of fixed rows."""
    hot_plan = inputs.hot_plan(model)
    if inputs.rows is None:
        fixed = hot_plan.fixed_hot_rows * hot_plan.device_bytes_per_row
        return {"per_request": hot_plan.device_bytes_per_row, "fixed": fixed, "max_requests": None}
    return {
        "per_request": 0,
        "fixed": hot_plan.with_running_requests(inputs.rows).device_bytes,
        "max_requests": inputs.rows,
    }


def _hot_description(model: ModelShape, inputs: CapacityInputs) -> str:
    """The sparse decode hot buffers in words."""
    hb = hot_buffer_report(model, inputs)
    extra = ", P/D extra slots" if inputs.decode_extra_slots else ""
    fixed = f" (+ {hb.fixed_hot_rows} fixed rows: padding slot, sink{extra})"
    if not hb.verify_rows_share_buffer:
        return f"{hb.hot_tokens_per_request} hot rows/layer/decode row{fixed}"
    overflow = (
        f", + {hb.overflow_slots_per_request} overflow rows/request for all layers (rounds whose union exceeds it)"
        if hb.overflow_slots_per_request
        else ""
    )
    return (
        f"{hb.hot_tokens_per_request} hot rows/layer/request, one buffer shared by its {hb.rows_per_request} "
        f"verify rows{overflow}{fixed}"
    )


def footprints(model: ModelShape, inputs: CapacityInputs) -> Tuple[Dict[str, Tuple[Footprint, str]], List[SkippedMode]]:
    """Footprint and one-line description of every applicable mode; the skipped ones with why."""
    n = model.cache_layers(inputs.mtp)
    main = model.main_bytes_per_layer
    idx = model.indexer_bytes_per_layer(inputs.indexer_dtype)
    bundle = main + idx
    topk = model.index_topk
    c = inputs.context
    out: Dict[str, Tuple[Footprint, str]] = {}
    skipped: List[SkippedMode] = []

    out["full-device"] = (
        Footprint(device_per_token=n * bundle),
        f"main KV + indexer of all {n} layers on every device",
    )

    # SGLang 0.5.23 sparsity_driven_kv_offload (manager.py): per request slot (max
    # running requests + 1 padding slot) and layer, a device cache of top-k rows and a
    # host buffer of max_context rows (one per device: shm named per device id), a
    # device slot map of int32 [(slots + 1), (max_context // 8 + 1) * 8]; the device
    # token pool keeps only the indexer (k/v buffers are None), in the pool dtype (bf16).
    peer_idx = model.indexer_bytes_per_layer("bf16")
    slot_dev = n * topk * main
    slot_map_row = n * 4 * ((c // 8 + 1) * 8)
    slot_host = inputs.tp * n * c * main
    out["sglang-npu-offload"] = (
        Footprint(
            device_per_token=n * peer_idx,
            device_per_request=slot_dev + slot_map_row,
            device_fixed=slot_dev + 2 * slot_map_row,
            host_per_request=slot_host,
            host_fixed=slot_host,
            slotted=True,
        ),
        "SGLang in-tree NPU offload: device top-k cache + slot map per request, host slot of "
        "max context per request and TP rank, bf16 indexer pool on device",
    )

    hot_rows = _decode_rows(model, inputs)
    # Sparse decode offloads the target layers only. The MTP (NextN draft) layers keep main
    # KV + indexer on the device (draft KV placement "device", sglang_plugin/speculative/eagle.py).
    draft = model.mtp_layers if inputs.mtp else 0
    sd_device_per_token = model.num_layers * idx + draft * bundle
    sd_host_per_token = model.num_layers * main
    draft_note = f"; {draft} MTP layer(s): main KV + indexer on device" if draft else ""
    out["sparse-decode"] = (
        Footprint(
            device_per_token=sd_device_per_token,
            device_per_request=hot_rows["per_request"] or 0,
            device_fixed=hot_rows["fixed"] or 0,
            host_per_token=sd_host_per_token,
            max_requests=hot_rows["max_requests"],
        ),
        f"indexer on device, {_hot_description(model, inputs)}, main KV in the DP rank's host pool{draft_note}",
    )

    p = physical_layer_buffers(n, inputs.independent_layers, inputs.shared_buffers)
    out["layerwise-prefill"] = (
        Footprint(device_per_token=p * bundle, host_per_token=n * bundle),
        f"{p} physical layer buffers (I={inputs.independent_layers} + min(B={inputs.shared_buffers}, "
        f"{n - inputs.independent_layers})) on device, every layer in the host KV pool",
    )

    g = inputs.kvpp_group
    if g < 2:
        skipped.append(
            SkippedMode(
                "kvpp",
                f"needs a group of >= 2 ranks (tp * pcp = {g}); with one rank it would only add two scratch layers",
            )
        )
    else:
        owned = kvpp_owned_layers(model.num_layers, g, 0)  # rank 0 owns the most
        mtp_local = model.mtp_layers if inputs.mtp else 0
        out["kvpp"] = (
            Footprint(
                device_per_token=(owned + mtp_local + KVPP_SCRATCH_BUFFERS) * bundle,
                device_fixed=KVPP_SCRATCH_BUFFERS * KVPP_SCRATCH_ALIGNMENT,
            ),
            f"per rank of {g}: {owned} owned layers + {mtp_local} MTP + {KVPP_SCRATCH_BUFFERS} scratch "
            "bundles (main + indexer)",
        )

    out["sparse-decode+layerwise-prefill"] = (
        Footprint(
            device_per_token=sd_device_per_token,
            device_per_request=hot_rows["per_request"] or 0,
            device_fixed=(hot_rows["fixed"] or 0) + p * main * inputs.paged(inputs.prefill_tok()),
            host_per_token=sd_host_per_token,
            max_requests=hot_rows["max_requests"],
        ),
        f"colocated: sparse decode + {p} main-KV layer buffers of {inputs.prefill_tok()} prefill tokens; "
        "one host copy of the main KV serves both",
    )
    return out, skipped


# ------------------------------------------------------------------ solving
def host_pool_bytes_per_node(
    bytes_per_token: int,
    tokens_per_pool: int,
    pools: int,
    *,
    fixed: int = 0,
    per_request: int = 0,
    requests_per_pool: int = 0,
) -> int:
    """Host bytes of a node's host KV pools: ``pools`` (one per DP rank on the node; its TP
    ranks share it) x (fixed + requests x per_request + tokens x per_token). The served
    plugin logs the same number at startup (``sglang_plugin.mem_cache.pool_host.shared``)."""
    return pools * (fixed + requests_per_pool * per_request + tokens_per_pool * bytes_per_token)


def _fit_requests(budget: int, fixed: int, per_request: int) -> Optional[int]:
    if per_request == 0:
        return None if fixed <= budget else 0
    return max(0, (budget - fixed) // per_request)


def _fit_tokens(budget: int, fixed: int, per_request: int, per_token: int, requests: int, page: int) -> Optional[int]:
    if per_token == 0:
        return None
    left = budget - fixed - requests * per_request
    return max(0, left // per_token) // page * page


def solve(name: str, description: str, fp: Footprint, inputs: CapacityInputs) -> ModeCapacity:
    """Requests, tokens and the binding resource of one footprint (see the module docstring)."""
    assert fp.device_per_token > 0, "every mode keeps something per token on the device"
    hbm, host = inputs.kv_hbm_bytes, inputs.host_bytes_per_dp
    req_tokens = inputs.paged(inputs.context)
    dev_req = fp.device_per_request + req_tokens * fp.device_per_token
    host_req = fp.host_per_request + req_tokens * fp.host_per_token
    bounds = {
        "hbm": _fit_requests(hbm, fp.device_fixed, dev_req),
        "host": _fit_requests(host, fp.host_fixed, host_req),
        "rows": fp.max_requests,
    }
    limited_by, requests = min(((k, v) for k, v in bounds.items() if v is not None), key=lambda kv: kv[1])
    token_bounds = [
        t
        for t in (
            _fit_tokens(hbm, fp.device_fixed, fp.device_per_request, fp.device_per_token, requests, inputs.page_size),
            _fit_tokens(host, fp.host_fixed, fp.host_per_request, fp.host_per_token, requests, inputs.page_size),
        )
        if t is not None
    ]
    tokens = min(token_bounds)
    if fp.slotted:
        tokens = min(tokens, requests * inputs.context)
    return ModeCapacity(
        name=name,
        description=description,
        device_bytes_per_token=fp.device_per_token,
        host_bytes_per_token=fp.host_per_token,
        device_bytes_per_request=fp.device_per_request,
        host_bytes_per_request=fp.host_per_request,
        device_fixed_bytes=fp.device_fixed,
        host_fixed_bytes=fp.host_fixed,
        device_bytes_per_context_token=round(dev_req / inputs.context, 1),
        host_bytes_per_context_token=round(host_req / inputs.context, 1),
        tokens=tokens * inputs.dp,
        requests=requests * inputs.dp,
        tokens_per_dp_rank=tokens,
        requests_per_dp_rank=requests,
        limited_by=limited_by,
        host_bytes_per_node=host_pool_bytes_per_node(
            fp.host_per_token,
            tokens,
            inputs.dp,
            fixed=fp.host_fixed,
            per_request=fp.host_per_request,
            requests_per_pool=requests,
        ),
    )


def plan(model: ModelShape, inputs: CapacityInputs) -> CapacityReport:
    """Capacity of every applicable mode, in :data:`MODE_NAMES` order; inputs checked first."""
    check_inputs(inputs, model)
    fps, skipped = footprints(model, inputs)
    modes = [solve(name, desc, fp, inputs) for name, (fp, desc) in fps.items()]
    full = next(m.requests for m in modes if m.name == "full-device")
    modes = [_with_ratio(m, full) for m in modes]
    order = {name: i for i, name in enumerate(MODE_NAMES)}
    modes.sort(key=lambda m: order[m.name])
    return CapacityReport(
        model=model,
        inputs=inputs,
        modes=tuple(modes),
        skipped=tuple(skipped),
        hot_buffer=hot_buffer_report(model, inputs),
    )


def _with_ratio(m: ModeCapacity, full_requests: int) -> ModeCapacity:
    ratio = None if full_requests == 0 else round(m.requests / full_requests, 2)
    return replace(m, requests_vs_full=ratio)


__all__ = [
    "CapacityInputs",
    "CapacityReport",
    "Footprint",
    "HotBufferReport",
    "ModeCapacity",
    "SkippedMode",
    "MODE_NAMES",
    "GIB",
    "check_inputs",
    "footprints",
    "hot_buffer_report",
    "input_problems",
    "kvpp_owned_layers",
    "physical_layer_buffers",
    "plan",
    "solve",
    "host_pool_bytes_per_node",
]
