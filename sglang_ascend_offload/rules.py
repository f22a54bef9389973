"""Every rule the plugin checks, in one registry: rule id -> what it requires -> the fix.

A :class:`~sglang_ascend_offload.errors.Violation` names one of these ids; it carries
the problem and fix of the case at hand (with the actual values), while the registry
states the rule in general. Rule ids are public: scripts match on them and
``docs/configuration.md`` lists them, so an id is never renamed or reused.

Scopes say which inputs decide a rule, and so which command can check it:

``input``
    malformed input: a flag, a JSON value, a size (``parse.*``, ``flags.*``,
    ``capacity.*``, ``deployment.range``). Reported by whoever parses it.
``deployment``
    decided by the offload config and the :class:`~sglang_ascend_offload.config.Deployment`
    facts alone, in :func:`sglang_ascend_offload.config.violations`. ``check-config`` and
    the server's startup both call that function, the server on the facts it reads from
    SGLang's resolved arguments, so their verdicts on these rules cannot differ.
``server``
    needs what only the launch knows: SGLang arguments the deployment facts do not
    describe (attention backend choice, HiCache, overlap scheduling ...), the model files,
    the installed packages or the memory free now. Checked by the server's launch
    validation before any process starts, and the same way by ``check-config --launch``
    (``sglang_plugin/args/launch_command.py``).

A few rules are decided only after the launch validation, by the running server's startup
(its KV-pool sizing, the pool's allocation, the kernel qualification, the P/D handshake):
:data:`DECIDED_AFTER_LAUNCH` says what decides each, and ``check-config`` lists them as
``undecided`` where they apply, so its ``ok`` never claims them.

:func:`violation` is how code reports a broken rule; it refuses an unregistered id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Literal, Tuple

from .errors import Violation

__all__ = ["Rule", "RULES", "DECIDED_AFTER_LAUNCH", "violation", "ids_in_scope"]

Scope = Literal["input", "deployment", "server"]


@dataclass(frozen=True)
class Rule:
    """One rule: its public id, which inputs decide it, what it requires and the usual fix."""

    id: str
    scope: Scope
    requires: str
    fix: str


def _rules(scope: Scope, *entries: Tuple[str, str, str]) -> Tuple[Rule, ...]:
    return tuple(Rule(rule_id, scope, requires, fix) for rule_id, requires, fix in entries)


_ALL = (
    *_rules(
        "input",
        ("parse.json", "a config value is inline JSON or @file holding JSON", "fix the JSON text"),
        ("parse.file", "an @file config value names a readable UTF-8 file", "fix the path or the file's encoding"),
        ("parse.type", "every key has the documented type", "use the type docs/configuration.md gives"),
        ("parse.unknown_key", "only documented keys", "remove or correct the key"),
        ("parse.range", "every value is in its documented range", "set a value in the stated range"),
        (
            "deployment.range",
            "deployment facts are in range (sizes >= 1, attn_tp <= tp)",
            "fix the deployment description",
        ),
        (
            "flags.config_without_enable",
            "a feature's --*-config flag comes with its --enable-* flag",
            "add the enable flag or drop the config flag",
        ),
        ("flags.device_kv_budget", "--device-kv-budget is a positive size (e.g. 512MiB)", "pass a positive size"),
        ("capacity.parse", "capacity flags have the documented types", "pass a value of the stated type"),
        ("capacity.missing", "the capacity planner gets every flag it needs", "add the missing flag"),
        ("capacity.model", "one model source: --model or --model-config", "pass exactly one of them"),
        (
            "capacity.model_config",
            "the model config defines the fields the planner reads",
            "pass a complete DeepSeek-V3.2-style config.json",
        ),
        ("capacity.hbm", "--hbm-gb > 0 (GiB per device)", "pass --hbm-gb > 0"),
        ("capacity.host", "--host-gb > 0 (GiB per node)", "pass --host-gb > 0"),
        ("capacity.weights", "0 <= --weights-gb < --hbm-gb", "pass weights below the HBM"),
        *(
            (f"capacity.{name}", f"--{name.replace('_', '-')} >= 1", f"pass --{name.replace('_', '-')} >= 1")
            for name in (
                "tp",
                "dp",
                "pcp",
                "context",
                "page_size",
                "shared_buffers",
                "hot_tokens",
                "rows",
                "rows_per_request",
                "prefill_tokens",
            )
        ),
        (
            "capacity.independent_layers",
            "0 <= independent layers <= the model's layers",
            "pass a count within the model",
        ),
        ("capacity.indexer_dtype", "an indexer dtype the planner knows (bf16, int8)", "pass bf16 or int8"),
        ("capacity.decode_extra_slots", "--decode-extra-slots >= 0", "pass --decode-extra-slots >= 0"),
        (
            "check_config.model",
            "check-config's --model / --model-config has the deployment's num_layers and index_topk, where given",
            "drop them from the deployment or pass the deployment's model",
        ),
        ("check_config.count", "check-config's --requests >= 1 and --decode-extra-slots >= 0", "pass such counts"),
        (
            "check_config.launch",
            "check-config's --launch (or the words after --) is an SGLang launch command whose flags SGLang's "
            "parser accepts: python -m sglang.launch_server ARGS, sglang serve ARGS, or ARGS",
            "fix the flag SGLang's parser names",
        ),
        ("capacity.mtp", "--mtp only for a model with MTP layers", "drop --mtp"),
    ),
    *_rules(
        "deployment",
        # sparse decode offload (docs/sparse_decode.md)
        (
            "sparse_decode.model",
            "a DSA model (MLA latent KV + indexer + top-k sparse attention)",
            "serve a DSA model or disable sparse decode offload",
        ),
        (
            "sparse_decode.main_kv_dtype",
            "a BF16 main KV: the host pool, the hot buffers and Copy-SFA hold bf16 rows",
            "use --kv-cache-dtype bfloat16",
        ),
        (
            "sparse_decode.main_kv_packing",
            "an unpacked main KV: rows move between host and device unpacked",
            "use an unpacked BF16 main KV cache",
        ),
        (
            "sparse_decode.context_parallel",
            "no context parallelism (cp, pcp, dcp); DP and TP are supported",
            "set every context-parallel size to 1",
        ),
        ("sparse_decode.pipeline_parallel", "no pipeline parallelism", "set the pipeline-parallel size to 1"),
        (
            "sparse_decode.soc_950",
            "an A2/A3 node: the 950PR/950DT series is not supported, keep-device-cache and overlap paths included",
            "run sparse decode offload on A2/A3 nodes",
        ),
        (
            "sparse_decode.soc_unknown",
            "the installed CANN build says which SoC this is (an undecided SoC is refused)",
            "install and source the CANN operator package of this node",
        ),
        ("sparse_decode.hybrid_kv", "a uniform MLA KV layout (no hybrid KV cache)", "serve a non-hybrid model"),
        ("sparse_decode.hot_tokens_topk", "hot_tokens >= the model's top-k", "raise hot_tokens or leave it unset"),
        (
            "sparse_decode.hot_tokens_page",
            "hot_tokens is a multiple of the KV page size",
            "round hot_tokens to a multiple of the page size",
        ),
        (
            "sparse_decode.prefill_node",
            "a decode or colocated node: sparse decode offload is a decode-side feature",
            "enable it on the decode node",
        ),
        (
            "sparse_decode.fused_device",
            "fused LIM / Copy-SFA and ops=fused run on an Ascend NPU or on CPU (the "
            "kernels' functional model); ops=npu on an Ascend NPU",
            "use ops=auto|reference|triton off Ascend",
        ),
        (
            "sparse_decode.speculative",
            "speculative decoding with a fixed token count (rows per request)",
            "fix the number of speculative tokens",
        ),
        (
            "sparse_decode.rank_depth_topk",
            "rank_depth and record_trace_rank_depth, where on, >= the model's top-k (a ranking starts with the top-k)",
            "raise rank_depth / record_trace_rank_depth",
        ),
        (
            "sparse_decode.trace_ranking_fused",
            "record_trace_rank_depth only with the separate indexer (the fused LIM returns the top-k only)",
            'set "fused_lim": false or drop record_trace_rank_depth',
        ),
        (
            "sparse_decode.score_speculative",
            "no score-aware policy (rank_depth) with speculative verify rows",
            "serve lru / lru_k2_guarded with speculative decoding",
        ),
        (
            "sparse_decode.kvpp",
            "not with KVPP: KVPP shards the device main KV, which sparse decode offload keeps on the host",
            "enable only one of them on a node",
        ),
        (
            "sglang.indexer_int8_device",
            "an int8 indexer cache (LIM-C8) off the NPU, or on an NPU with the fused "
            "LIM-C8 (without it SGLang's own NPU indexer writes bf16 index K)",
            'leave fused_lim unset on an NPU, or set "indexer_dtype": "bf16"',
        ),
        (
            "sglang.indexer_int8_pd",
            "an int8 indexer cache (LIM-C8) on a P/D decode only without a speculative "
            "draft layer (one transferred indexer tensor, one dtype)",
            'set "indexer_dtype": "bf16" on the P/D decode node, or drop speculative decoding there',
        ),
        (
            "sglang.fused_not_wired",
            "fused_lim=true only where the fused LIM serves: residency policy lru, at most "
            "14 verify rows per request, a residency shape the kernels take (hot_tokens <= 4096)",
            'drop "fused_lim"',
        ),
        (
            "sglang.sparse_decode_graph",
            "no host work between the layers of a captured decode step: no decode "
            "graphs with attention TP > 1, record_trace, shadow verification or rank_depth",
            "run decode eagerly, or drop the feature that needs host work",
        ),
        (
            "sglang.sparse_decode_speculative",
            "speculative decoding with sparse decode offload as the engine "
            "serves it: the NextN / MTP draft as a chain (eagle top-k 1) of exactly steps + 1 verify rows, eager "
            "decode off the CPU, no overlap scheduling",
            "use --speculative-algorithm NEXTN, --speculative-eagle-topk 1, --speculative-num-draft-tokens "
            "steps+1 and --disable-overlap-schedule",
        ),
        # layerwise prefill offload (docs/layerwise_prefill.md)
        (
            "layerwise_prefill.eager",
            "eager mode with buffer reuse: each layer waits for its buffer's gates on the host",
            "run the prefill node eagerly or leave shared_buffers unset",
        ),
        (
            "layerwise_prefill.memcache",
            "the Memcache store with buffer reuse off CPU (the local store is for CPU development)",
            'set "store_backend": "memcache"',
        ),
        (
            "layerwise_prefill.mooncake_layerwise",
            "no buffer reuse with a layerwise Mooncake connector, which has no per-buffer completion gate",
            "use the ascend_offload transfer backend or leave shared_buffers unset",
        ),
        ("layerwise_prefill.hybrid_kv", "a uniform KV layout (no hybrid KV cache)", "serve a non-hybrid model"),
        (
            "layerwise_prefill.layers",
            "independent layers exist in the model",
            "use layer indices below the layer count",
        ),
        ("layerwise_prefill.prefetch", "prefetch depth <= the shared buffers", "lower prefetch_depth"),
        (
            "layerwise_prefill.decode_node",
            "a prefill or colocated node: layerwise prefill offload is a prefill-side feature",
            "enable it on the prefill node",
        ),
        (
            "sglang.layerwise_sparse_decode",
            "not with sparse decode offload in one server: both replace the KV pool",
            "enable layerwise prefill offload on the prefill node and sparse decode offload on the decode node",
        ),
        (
            "sglang.layerwise_speculative",
            "speculation only as the NextN / MTP draft chain, eagle top-k 1 (its "
            "draft layer is an independent layer of the plan)",
            "use --speculative-algorithm NEXTN --speculative-eagle-topk 1",
        ),
        (
            "sglang.layerwise_pp",
            "no pipeline parallelism: the layer buffers are planned per model, not per stage",
            "set --pp-size 1",
        ),
        (
            "sglang.layerwise_block_tokens",
            "store_block_tokens equals the KV page size (one stored object per page)",
            "drop store_block_tokens",
        ),
        # P/D transfer (docs/pd_transfer.md)
        ("pd_transfer.role", "a prefill or decode node", "start the servers with --disaggregation-mode prefill|decode"),
        (
            "pd_transfer.tp_ratio",
            "p_tp >= d_tp and p_tp % d_tp == 0: each decode rank is served by p_tp / d_tp prefill ranks",
            "use a prefill TP that is a multiple of the decode TP",
        ),
        (
            "pd_transfer.memfabric_only",
            "MemFabric on Ascend: the only remote D2H backend there",
            'set "engine": "memfabric"',
        ),
        (
            "pd_transfer.protocol_match",
            "the same transfer protocol on prefill and decode",
            "configure the same protocol on both",
        ),
        (
            "pd_transfer.protocol_soc",
            "sdma / device_rdma on A2/A3 nodes, device_urma on 950PR/950DT nodes",
            "set the protocol of the node's SoC",
        ),
        (
            "pd_transfer.ports",
            "decode control ports kv_port + dp_rank * d_tp + tp_rank fit in 1024..65535",
            "lower kv_port",
        ),
        (
            "pd_transfer.decode_tp",
            "decode attention TP > 1 only with a main KV the decode TP ranks share (sparse "
            "decode offload's host pool, on CPU / CUDA)",
            "enable sparse decode offload or use attention TP 1",
        ),
        ("sglang.pd_engine_device", "engine memfabric on an Ascend NPU", 'set "engine": "mooncake" off Ascend'),
        ("sglang.pd_parallel", "no PP, attention CP or DCP with the ascend_offload P/D backend", "use TP and DP"),
        (
            "sglang.pd_speculative",
            "speculative decoding on a P/D prefill only without layerwise prefill offload "
            "(its layer listener publishes the base layers), and on a P/D decode only at attention TP 1 (the "
            "draft layer's KV is per-rank device KV)",
            "drop the speculative flags on that node",
        ),
        # KVPP (docs/kvpp.md)
        ("kvpp.dcp", "no DCP with KVPP", "disable DCP or KVPP"),
        ("kvpp.decode_node", "KVPP off on decode-only nodes", "disable KVPP on decode nodes"),
        ("kvpp.graph_mode", "eager execution or PIECEWISE graphs", "run eagerly or with piecewise graphs"),
        ("kvpp.model", "a non-hybrid MLA model", "use KVPP only with non-hybrid MLA models"),
        ("kvpp.speculative_method", "speculation only as mtp or dspark", "use mtp or dspark"),
        ("kvpp.speculative_fixed", "a fixed number of speculative tokens", "fix the number of speculative tokens"),
        ("kvpp.group", "a TP x PCP group larger than 1", "use TP >= 2 or disable KVPP"),
        (
            "kvpp.layerwise_prefill",
            "not with layerwise prefill offload: each replaces the KV pool, no combined pool exists",
            "enable one of them",
        ),
        (
            "kvpp.pd_prefill",
            "not on a P/D prefill: a rank keeps only its owned layers, a P/D prefill sends every layer from one rank",
            "run KVPP on a colocated server",
        ),
        ("sglang.kvpp_pp", "no pipeline parallelism: per-stage KVPP groups are not wired", "set --pp-size 1"),
        (
            "sglang.kvpp_dp_attention",
            "no DP attention: the replicated domain is the attention-TP group and DP ranks run different batches",
            "drop --enable-dp-attention / --attn-dp-size",
        ),
    ),
    *_rules(
        "server",
        (
            "sglang.server_args",
            "SGLang's own argument resolution accepts the launch (it runs before the plugin's checks)",
            "fix what SGLang's message names",
        ),
        (
            "sglang.compat",
            "the installed SGLang has every hook target and field the plugin uses",
            "run the supported SGLang version",
        ),
        (
            "sglang.deployment",
            "the deployment facts can be read from the server arguments and model",
            "check the model path and server arguments",
        ),
        ("sglang.cpu_engine", "SGLANG_USE_CPU_ENGINE=1 with --device cpu", "export SGLANG_USE_CPU_ENGINE=1"),
        (
            "sglang.model_config",
            "the model config defines the fields each enabled feature's pool reads",
            "serve a complete DeepSeek-V3.2-style config.json",
        ),
        (
            "sglang.attention_backend",
            "the ascend_offload attention backend with sparse decode offload",
            "drop --attention-backend",
        ),
        ("sglang.hisparse", "one sparse-attention offload: not with --enable-hisparse", "drop --enable-hisparse"),
        (
            "sglang.npu_sparse_kv_offload",
            "SGLang's in-tree NPU sparse KV offload is off",
            "unset SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD",
        ),
        (
            "sglang.fused_unavailable",
            "the fused operators the plan selects (LIM / LIM-C8, Copy-SFA: the default on "
            "an Ascend NPU, or asked for) are built and installed",
            "build the AscendC extension (ascendc_ops/build.sh --install) or set fused_lim / fused_copy_sfa to false",
        ),
        (
            "sparse_decode.fused_copy_sfa_engine",
            "fused_copy_sfa=true or ops=fused only where the fused Copy-SFA "
            "serves the engine: at most 14 query rows per hot buffer (a request's verify rows), a top-k it takes "
            "(a multiple of 128 up to 2048) and a host pool with a tensor view",
            'set "fused_copy_sfa": false, or ops=auto|reference|triton',
        ),
        (
            "sglang.ops_unavailable",
            "every offload op has an implementation for the chosen ops rung",
            'use "ops": "auto" or install what the message names',
        ),
        (
            "memory.insufficient",
            "one request's hot buffers and the host pool fit in the memory available now",
            "lower hot_tokens, host_pool_tokens or --max-total-tokens",
        ),
        (
            "memory.device_budget",
            "the hot buffers of the running requests fit SGLang's device KV budget",
            "lower hot_tokens or --max-running-requests, or raise the budget",
        ),
        (
            "sparse_decode.host_pool_tokens",
            "host_pool_tokens, where set, holds SGLang's slot space (its token capacity + one padding page)",
            "raise host_pool_tokens (or leave it unset) or lower --max-total-tokens",
        ),
        (
            "sparse_decode.indexer_int8_head_dim",
            "indexer_dtype int8 with a power-of-two index_head_dim (the Hadamard rotation of the index keys)",
            'set "indexer_dtype": "bf16"',
        ),
        (
            "sparse_decode.kernel_qualification",
            "every fused operator the plan selects matches the separate operators at the served shapes on this "
            "node (qualify_kernels, ops/qualify.py: run once when the server starts)",
            'rebuild the extension (bash ascendc_ops/build.sh --install) or set "fused_lim" / "fused_copy_sfa" '
            "to false",
        ),
        (
            "sglang.layerwise_backend",
            "the ascend_offload attention backend with layerwise prefill offload",
            "drop --attention-backend",
        ),
        (
            "sglang.layerwise_tbo",
            "no two-batch overlap or PD-multiplexing with layerwise prefill offload",
            "drop --enable-two-batch-overlap / --enable-pdmux",
        ),
        (
            "sglang.layerwise_hicache",
            "no HiCache with layerwise prefill offload (it drives the layer counter)",
            "drop --enable-hierarchical-cache",
        ),
        (
            "sglang.layerwise_store",
            "memcache-hybrid installed when the Memcache store serves buffer reuse",
            "pip install memcache-hybrid memfabric-hybrid, or use the local store on a CPU",
        ),
        (
            "sglang.pd_backend",
            "--enable-pd-transfer and --disaggregation-transfer-backend ascend_offload together",
            "pass both flags",
        ),
        (
            "sglang.pd_attention_backend",
            "the ascend_offload attention backend with P/D transfer",
            "drop --attention-backend",
        ),
        (
            "sglang.pd_engine_unavailable",
            "the Mooncake transfer engine importable for engine mooncake",
            "pip install mooncake-transfer-engine(-non-cuda)",
        ),
        (
            "sglang.pd_unsupported",
            "no P/D feature the backend does not provide (decode radix cache, host receive, "
            "HiSparse, other allocation policies, staging buffers, role switch, optimistic layerwise prefill)",
            "drop those settings",
        ),
        (
            "sglang.pd_cpu_retraction_backup",
            "--disaggregation-decode-retraction-backup cpu_tensor on a CPU decode server",
            "pass --disaggregation-decode-retraction-backup cpu_tensor",
        ),
        ("sglang.kvpp_backend", "the ascend_offload attention backend with KVPP", "drop --attention-backend"),
        (
            "sglang.kvpp_tbo",
            "no two-batch overlap or PD-multiplexing with KVPP (a collective per layer)",
            "drop --enable-two-batch-overlap / --enable-pdmux",
        ),
        (
            "sglang.kvpp_hicache",
            "no HiCache with KVPP (it drives the layer counter)",
            "drop --enable-hierarchical-cache",
        ),
    ),
)

#: Every rule, by id (each id defined once: a repeated id fails at import).
RULES: Dict[str, Rule] = {}
for _rule in _ALL:
    if _rule.id in RULES:
        raise RuntimeError(f"rule id {_rule.id!r} is defined twice")
    RULES[_rule.id] = _rule
del _rule

#: Rule id -> what decides it after the launch validation (the running server's startup).
#: ``check-config`` lists each as ``undecided`` where it applies (``config_cli.py``).
DECIDED_AFTER_LAUNCH: Dict[str, str] = {
    "memory.device_budget": "SGLang's KV-pool sizing in each scheduler, after the weights load: the device "
    "memory left then decides how many requests' hot buffers fit (refused when not one request's does)",
    "memory.insufficient": "the sparse decode pool when it allocates: the hot buffers of every request slot "
    "and the host pool against the memory free then (before it, one request's hot buffers and the host pool "
    "are checked against the host memory free now; device memory only where the device runtime is already "
    "initialised, which check-config never does)",
    "sparse_decode.host_pool_tokens": "SGLang's token capacity, which its KV-pool sizing decides in the "
    "scheduler unless --max-total-tokens gives it",
    "sparse_decode.kernel_qualification": "running each fused operator the plan selects once at the served "
    "shapes when the server starts (ops/qualify.py; bench kernels --qualify runs it on demand)",
    "sparse_decode.soc_unknown": "the device's own SoC name, which the server's launch validation "
    "cross-checks against the installed CANN build (check-config reads the build only: it does not touch "
    "the device)",
    "pd_transfer.tp_ratio": "the P/D bootstrap handshake with the peer's attention TP, unless peer_tp is set "
    "in --pd-transfer-config",
    "sglang.pd_parallel": "the P/D bootstrap handshake with the peer's CP and PP sizes",
    "sglang.pd_engine_device": "node 0's MemFabric config store, created when the P/D backend starts: engine "
    "memfabric needs store_url there",
}
for _rule_id in DECIDED_AFTER_LAUNCH:
    if _rule_id not in RULES:
        raise RuntimeError(f"DECIDED_AFTER_LAUNCH names an unregistered rule {_rule_id!r}")
del _rule_id


def violation(rule_id: str, problem: str, fix: str = "") -> Violation:
    """A :class:`Violation` of a registered rule; ``fix`` defaults to the rule's usual fix.

    Raises ``KeyError`` for an id the registry does not define (a typo would otherwise
    create a rule no document or script knows).
    """
    if rule_id not in RULES:
        raise KeyError(f"unregistered rule id {rule_id!r}: add it to sglang_ascend_offload/rules.py")
    return Violation(rule_id, problem, fix or RULES[rule_id].fix)


def ids_in_scope(*scopes: Scope) -> Tuple[str, ...]:
    """The ids of every rule in ``scopes``, in registry order."""
    return tuple(r.id for r in _ALL if r.scope in scopes)
