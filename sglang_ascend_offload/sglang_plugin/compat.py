"""What the plugin assumes about SGLang, written down once and checked loudly.

The plugin leans on SGLang 0.5.23's internals: server-argument names, the names of
resolution steps, the paths and signatures of the functions it wraps through
``HookRegistry``. A rename in SGLang must stop startup with a message naming what
changed, never let a rule pass silently (``getattr(args, name, default)`` would
return the default for a renamed field and a safety rule would not fire).

* :data:`SERVER_ARGS` -- every server argument the plugin reads, with why; each must
  be a field of ``ServerArgs``.
* :func:`arg` -- the strict reader: reads a server argument listed there; a missing
  attribute is :class:`SGLangIncompatible` naming it and the SGLang version.
* :data:`OBJECT_FIELDS` / :func:`field` -- the same for fields of other SGLang objects
  (scheduler, P/D queues, batches, requests, KV args, model config).
* :data:`HOOKED` -- every SGLang callable the plugin wraps (its ``TARGET_*`` path, the
  one the registering module imports from here), with the parameters its
  wrapper relies on; :data:`RESOLUTION_STEPS` -- the resolution steps it wraps, and
  :data:`VALIDATION_STEP` must stay SGLang's last one (the plugin validates the fully
  resolved arguments there).
* :func:`problems` / :func:`require_compatible` -- resolve and check all of it; run
  by the validation step before anything else, so an incompatible SGLang stops the
  launch with every difference listed.

This module imports nothing of the plugin at module level (only the package's version
constant), so every plugin module may import it; ``tests/test_structure.py`` checks
that no import, not even one inside a function, points back.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .. import SUPPORTED_SGLANG_VERSION

__all__ = [
    "SGLangIncompatible",
    "SERVER_ARGS",
    "HOOKED",
    "RESOLUTION_STEPS",
    "VALIDATION_STEP",
    "arg",
    "arg_or",
    "problems",
    "require_compatible",
    "resolve_path",
    "last_resolution_step",
    "OBJECT_FIELDS",
    "field",
    "CALLED",
    "RESOLVE_POOL_CONFIG_CALLS",
    "called_names",
]

VALIDATION_STEP = "validate_deepep_v2_dispatch_token_budget"

# The resolution steps the plugin wraps (resolution.py), all overridable by name.
RESOLUTION_STEPS: Tuple[str, ...] = (
    "handle_cpu_backends",
    "handle_npu_backends",
    "handle_model_specific_adjustments",
    VALIDATION_STEP,
)

# Server argument -> what the plugin reads it for.
SERVER_ARGS: Dict[str, str] = {
    "attention_backend": "our backend is selected / required",
    "prefill_attention_backend": "a per-phase backend other than ours cannot serve offload",
    "decode_attention_backend": "a per-phase backend other than ours cannot serve offload",
    "cuda_graph_config": "graph mode per phase (layerwise reuse and KVPP need eager / piecewise)",
    "disable_cuda_graph": "graph mode",
    "enable_torch_compile": "SGLang's CPU engine captures decode graphs only with it (record_trace needs eager decode)",
    "enable_hisparse": "one sparse-attention offload per server",
    "speculative_algorithm": "the NextN / MTP draft is the speculative algorithm served with offload",
    "speculative_eagle_topk": "offload verifies a chain of draft tokens (topk 1)",
    "speculative_num_steps": "offload needs steps + 1 verify rows per request",
    "speculative_num_draft_tokens": "verify rows per request (engine rows, hot-buffer memory)",
    "disable_overlap_schedule": "offload verify reads committed lengths on the host",
    "speculative_adaptive": "offload and KVPP need a fixed speculative token count",
    "enable_two_batch_overlap": "interleaved forwards break the layerwise gates",
    "enable_pdmux": "interleaved forwards break the layerwise gates",
    "enable_hierarchical_cache": "HiCache owns the layer counter",
    "pp_size": "PP is rejected / planned per model",
    "page_size": "hot_tokens and store blocks are pages",
    "device": "cpu / npu / cuda",
    "kv_cache_dtype": "main KV must be bf16",
    "tp_size": "TP group, P/D ratio, KVPP group",
    "dp_size": "DP replicas",
    "attn_dp_size": "attention DP groups (one host pool each)",
    "enable_dp_attention": "old spelling of attention DP",
    "attn_cp_size": "context parallelism is rejected",
    "enable_prefill_cp": "prefill context parallelism is rejected",
    "dcp_size": "DCP is rejected (KVPP, sparse decode)",
    "disaggregation_mode": "P/D role",
    "disaggregation_decode_extra_slots": "a P/D decode's extra request slots each have a hot row (hot-buffer plan)",
    "disaggregation_transfer_backend": "P/D backend",
    "max_total_tokens": "host-pool tokens in the startup memory check",
    "model_path": "trace metadata",
    "enable_metrics": "Prometheus counters",
    "disaggregation_decode_enable_radix_cache": "P/D decode pulls whole requests (no radix reuse)",
    "disaggregation_decode_host_receive_threshold": "P/D decode receives into the host pool in full",
    "disaggregation_decode_allocation_policy": "P/D decode allocates early",
    "enable_pd_role_switch": "P/D roles are fixed per server",
    "optimistic_prefill_attempts": "layerwise P/D prefill needs every request bootstrapped before its forward",
    "disaggregation_decode_retraction_backup": "P/D decode on CPU keeps retracted KV in CPU tensors",
}


@dataclass(frozen=True)
class Hooked:
    """One SGLang callable the plugin wraps: its dotted path and the parameter names
    the wrapper passes through (they must all exist in SGLang's signature)."""

    path: str
    params: Tuple[str, ...]
    why: str
    signature_of: str = ""  # where the parameters are declared, when ``path`` takes ``*args``


# Dotted paths of the SGLang callables the plugin wraps through HookRegistry. This is
# their one home: install.py, which registers every hook, names them from here, so this
# module imports nothing of the plugin and every module may read it.
TARGET_ADD_CLI = "sglang.srt.server_args.ServerArgs.add_cli_args"
# torch callables the plugin wraps on a CPU (no CUDA): not SGLang's, so not in HOOKED
TARGET_CAPABILITY = "torch.cuda.get_device_capability"
TARGET_SYNC = "torch.cuda.synchronize"
TARGET_FROM_CLI = "sglang.srt.server_args.ServerArgs.from_cli_args"
TARGET_POOL = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool"
TARGET_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.forward_native"
TARGET_NPU_INDEXER = "sglang.srt.layers.attention.dsa.dsa_npu_indexer.DSANPUIndexerMixin.forward_npu"
TARGET_CELL_SIZE = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
TARGET_RESOLVE_POOL_CONFIG = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config"
)
TARGET_PROFILE_BYTES = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
TARGET_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
TARGET_CONFIG_STORE = "sglang.srt.managers.disagg_service.maybe_create_ascend_config_store"
TARGET_PREFILL_MANAGER = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager"
TARGET_DECODE_MANAGER = "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager"
TARGET_RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
TARGET_IDLE_SLEEP = "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle"
TARGET_ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
TARGET_STREAM_OUTPUT = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output"
TARGET_EMBED_HEAD = "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head"
TARGET_DRAFT_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
TARGET_LAST_LOC = "sglang.srt.mem_cache.allocation.get_last_loc"
TARGET_CPU_GRAPH_RUNNER = "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner"
TARGET_IS_CPU_GRAPH = "sglang.srt.model_executor.forward_batch_info.ForwardMode.is_cpu_graph"

# SGLang callables the plugin calls (not wraps), with the parameters it passes.
_KVC = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
CALLED: Tuple[Hooked, ...] = (
    Hooked(
        f"{_KVC}._profile_available_bytes",
        ("self", "pre_model_load_memory"),
        "sparse decode offload sizing: SGLang's KV byte budget",
    ),
    Hooked(
        f"{_KVC}.config_from_budget",
        ("self", "budget_bytes"),
        "sparse decode offload sizing: the token pool from the budget less the hot buffers",
    ),
    Hooked(
        f"{_KVC}.resolve_max_num_reqs",
        ("self", "token_capacity"),
        "sparse decode offload sizing: SGLang's max_running_requests for a token pool",
    ),
    Hooked(
        "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
        ("kvc",),
        "sparse decode offload sizing: the per-token cell size and the finalize step",
    ),
    Hooked(
        "sglang.srt.model_executor.pool_configurator.MemoryPoolConfigurator.finalize_with_max_running_requests",
        ("self", "config"),
        "sparse decode offload sizing: SGLang's finalize step",
    ),
    Hooked(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_dsa_indexer_cell_size",
        ("self", "kvc", "num_layers"),
        "sparse decode offload off the CPU: the device cell is the indexer's",
    ),
)
# What _resolve_memory_pool_config calls, in order: the sizing hook reproduces these steps
# around its split of the budget, so a change here must be looked at.
RESOLVE_POOL_CONFIG_CALLS = (
    "_profile_available_bytes",
    "config_from_budget",
    "resolve_max_num_reqs",
    "create_memory_pool_configurator",
    "finalize_with_max_running_requests",
)

HOOKED: Tuple[Hooked, ...] = (
    Hooked(TARGET_ADD_CLI, ("parser",), "the plugin's flags"),
    Hooked(TARGET_FROM_CLI, ("args",), "keep the plugin's flag values"),
    Hooked(TARGET_POOL, ("sizes", "is_dsa_model", "is_dsv4_model", "req_to_token_pool"), "build the plugin's KV pools"),
    Hooked(
        TARGET_INDEXER,
        ("x", "q_lora", "positions", "forward_batch", "layer_id", "return_indices"),
        "the CPU indexer forward",
        signature_of=TARGET_INDEXER.replace("forward_native", "forward_cuda"),
    ),
    Hooked(
        TARGET_NPU_INDEXER,
        ("x", "q_lora", "positions", "forward_batch", "layer_id", "input_on_attn_tp_slices", "dynamic_scale"),
        "the NPU indexer forward: the fused LIM / LIM-C8 path",
    ),
    Hooked(TARGET_CELL_SIZE, ("self",), "per-token KV bytes of the layerwise pool"),
    Hooked(TARGET_CELL_SIZE, ("self",), "per-token KV bytes of the KVPP pool"),
    Hooked(
        TARGET_CELL_SIZE,
        ("self", "kvc", "num_layers"),
        "per-token device KV bytes of sparse decode offload (the indexer only, off the CPU)",
    ),
    Hooked(
        TARGET_RESOLVE_POOL_CONFIG,
        ("self", "pre_model_load_memory"),
        "sparse decode offload: the hot buffers drawn from SGLang's KV byte budget (offload_sizing.py)",
    ),
    Hooked(
        TARGET_PROFILE_BYTES,
        ("self", "pre_model_load_memory"),
        "--device-kv-budget caps SGLang's KV byte budget (device_kv_budget.py)",
    ),
    Hooked(TARGET_GET_KV_CLASS, (), "the ascend_offload P/D classes"),
    Hooked(TARGET_CONFIG_STORE, (), "MemFabric config store"),
    Hooked(TARGET_PREFILL_MANAGER, ("self",), "the prefill KV manager"),
    Hooked(TARGET_DECODE_MANAGER, ("self",), "the decode KV manager"),
    Hooked(TARGET_RUN_BATCH, ("self", "batch"), "announce last chunks to the layerwise publisher"),
    Hooked(
        TARGET_IDLE_SLEEP,
        ("self",),
        "P/D servers with --sleep-on-idle sleep in short slices while transfers are in flight",
    ),
    Hooked(TARGET_ON_IDLE, ("self",), "export the offload counters the decode interval held back"),
    Hooked(
        TARGET_STREAM_OUTPUT,
        ("self", "reqs", "return_logprob", "skip_req"),
        "export the offload counters before a finished request's output is sent",
    ),
    Hooked(
        TARGET_EMBED_HEAD,
        ("self", "embed", "head"),
        "no CUDA sync when the draft shares the target's embedding and head on a CPU",
    ),
    Hooked(
        TARGET_DRAFT_FACTORY,
        ("self", "backend_name", "backend_map", "error_template", "stamps_children"),
        "draft backends for ascend_offload",
    ),
    Hooked(
        TARGET_LAST_LOC,
        ("req_to_token", "req_pool_indices_tensor", "prefix_lens_tensor"),
        "torch last-slot lookup for EAGLE draft slots",
    ),
    Hooked(
        TARGET_CPU_GRAPH_RUNNER,
        ("model_runner",),
        "CPU verify graphs of speculative decoding (REPLACE by a subclass; cpu_spec_graph.py)",
    ),
    Hooked(TARGET_IS_CPU_GRAPH, ("self",), "TARGET_VERIFY replays a CPU verify graph"),
)


class SGLangIncompatible(RuntimeError):
    """The installed SGLang differs from what the plugin was written against."""


def installed_sglang_version() -> Optional[str]:
    """The installed ``sglang`` distribution's version, ``None`` when there is none."""
    from ..versions import installed_version as dist_version

    return dist_version("sglang")


def installed_version() -> str:
    """:func:`installed_sglang_version` for messages."""
    return installed_sglang_version() or "(not installed)"


def _incompatible(what: str) -> SGLangIncompatible:
    return SGLangIncompatible(
        f"{what} (SGLang {installed_version()} is installed; sglang-ascend-offload "
        f"was written against SGLang {SUPPORTED_SGLANG_VERSION})"
    )


def arg(args: Any, name: str) -> Any:
    """Server argument ``name`` of ``args`` (ServerArgs, its resolving view, or a test
    stand-in). ``name`` must be in :data:`SERVER_ARGS`; a missing attribute raises
    :class:`SGLangIncompatible` (never a default)."""
    if name not in SERVER_ARGS:
        raise KeyError(f"compat.arg({name!r}): add {name!r} to compat.SERVER_ARGS with the reason it is read")
    try:
        return getattr(args, name)
    except AttributeError:
        raise _incompatible(f"SGLang's server arguments have no {name!r} (read for: {SERVER_ARGS[name]})") from None


def arg_or(args: Any, name: str, default: Any) -> Any:
    """:func:`arg`, with ``default`` standing for an unset (``None``) value only."""
    value = arg(args, name)
    return default if value is None else value


# SGLang objects other than the server arguments whose fields the plugin reads:
# class path -> {field: what it is read for}. Each must be a declared field of the
# class (dataclass / annotated) or set by one of its methods; :func:`field` reads them.
#: ``CPUGraphRunner`` fields the plugin's verify graph runner sets before capturing
#: (``speculative/cpu_graph.py``): SGLang's capture and replay methods read them.
CPU_GRAPH_RUNNER_FIELDS = (
    "bs",
    "capture_bs",
    "capture_forward_mode",
    "capture_hidden_mode",
    "captured_forward_batches",
    "captured_forward_batches_cross",
    "captured_req_width",
    "custom_mask",
    "device",
    "disable_padding",
    "enable_profile_cuda_graph",
    "enable_return_hidden_states",
    "enable_torch_compile",
    "enable_two_batch_overlap",
    "encoder_len_fill_value",
    "encoder_lens",
    "graphs",
    "graphs_cross",
    "input_ids",
    "is_encoder_decoder",
    "max_bs",
    "max_num_token",
    "model_runner",
    "mrope_positions",
    "num_dp_ranks",
    "num_token_non_padded",
    "out_cache_loc",
    "output_buffers",
    "positions",
    "pp_size",
    "raw_bs",
    "raw_num_token",
    "req_pool_indices",
    "require_attn_tp_gather",
    "require_gathered_buffer",
    "require_mlp_sync",
    "require_mlp_tp_gather",
    "return_hidden_states_mode",
    "seq_len_fill_value",
    "seq_lens",
    "speculative_algorithm",
    "tp_size",
)

OBJECT_FIELDS: Dict[str, Dict[str, str]] = {
    TARGET_CPU_GRAPH_RUNNER: {
        name: "set by the plugin's CPU verify graph runner before SGLang's capture" for name in CPU_GRAPH_RUNNER_FIELDS
    },
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch": {
        "rids": "request identity per batch row (sparse decode offload resets a row whose request changed); "
        "None outside the scheduler and on a padded graph replay",
        "_original_num_tokens": "DP-attention padding: the real decode rows before padding (None unpadded)",
    },
    "sglang.srt.disaggregation.base.conn.KVArgs": {
        "state_types": "the P/D manager moves main KV and the DSA indexer only",
        "gpu_id": "device of the P/D transfer engine",
    },
    "sglang.srt.disaggregation.common.conn.PrefillServerInfo": {
        "attn_cp_size": "P/D pair check (context parallel prefill is rejected)",
        "pp_size": "P/D pair check (pipeline parallel prefill is rejected)",
    },
    "sglang.srt.configs.model_config.ModelConfig": {
        "model_path": "namespace of the layerwise prefill host store",
        "context_len": "P/D: the longest request's page count sizes the publisher's block tables",
    },
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator": {
        "_cell_size": "sparse decode offload sizing: device KV bytes per token of the token pool",
    },
    "sglang.srt.managers.scheduler.Scheduler": {
        "disagg_prefill_bootstrap_queue": "layerwise P/D prefill: the queue whose KV manager announces last chunks",
        "model_config": "P/D: the context length when the KV manager gets its pool",
    },
    "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue": {
        "kv_manager": "layerwise P/D prefill: the manager whose publisher runs during the forward",
        "scheduler": "P/D: the model config (context length) when the KV manager gets its pool",
        "draft_token_to_kv_pool": "P/D: the draft (NextN) KV pool, moved after the base layers",
    },
    "sglang.srt.disaggregation.decode.DecodePreallocQueue": {
        "scheduler": "P/D: the model config (context length) when the KV manager gets its pool",
        "draft_token_to_kv_pool": "P/D: the draft (NextN) KV pool, moved after the base layers",
    },
    "sglang.srt.managers.schedule_batch.ScheduleBatch": {
        "forward_mode": "layerwise P/D prefill: only extend forwards finish requests",
        "reqs": "layerwise P/D prefill: the requests whose last chunk a forward computes",
        "req_pool_indices_cpu": "layerwise P/D prefill: their req_to_token rows, in request order",
    },
    "sglang.srt.managers.schedule_batch.Req": {
        "extend_end": "layerwise P/D prefill: a chunk reaching the end of the input is the last",
        "bootstrap_room": "layerwise P/D prefill: the room a finished request is announced under",
        "pending_bootstrap": "layerwise P/D prefill: optimistic requests without a decode peer are skipped",
        "disagg_kv_sender": "layerwise P/D prefill: requests without a KV sender are not P/D requests",
        "kv": "layerwise P/D prefill: the request's req_to_token row (when the batch has none)",
    },
    "sglang.srt.managers.schedule_batch.ReqKvInfo": {
        "req_pool_idx": "layerwise P/D prefill: the request's req_to_token row (when the batch has none)",
    },
}


def field(obj: Any, cls_path: str, name: str) -> Any:
    """Field ``name`` of SGLang object ``obj`` (an instance of ``cls_path``, or a test
    stand-in); the pair must be in :data:`OBJECT_FIELDS`. A missing attribute raises
    :class:`SGLangIncompatible` naming the class, the field and the SGLang version."""
    why = OBJECT_FIELDS.get(cls_path, {}).get(name)
    if why is None:
        raise KeyError(
            f"compat.field({cls_path!r}, {name!r}): add it to compat.OBJECT_FIELDS with the reason it is read"
        )
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _incompatible(f"SGLang's {cls_path.rsplit('.', 1)[-1]} has no {name!r} (read for: {why})") from None


def _declared_fields(cls: Any, wanted: Any = ()) -> set:
    """Fields of ``cls``: dataclass / msgspec fields, annotations and ``self.X = ...`` in
    ``__init__`` of ``cls`` and its bases; when that misses a name of ``wanted``, also
    ``self.X = ...`` in every other method (SGLang sets many fields in ``init_*`` helpers
    its ``__init__`` calls, e.g. ``Scheduler.model_config``)."""
    mro = [k for k in getattr(cls, "__mro__", (cls,)) if k is not object]
    names = set(getattr(cls, "__dataclass_fields__", {}) or {}) | set(getattr(cls, "__struct_fields__", ()) or ())
    for klass in mro:
        names |= set(getattr(klass, "__annotations__", {}) or {})
        init = klass.__dict__.get("__init__") if hasattr(klass, "__dict__") else None
        if init is not None:
            try:
                names |= assigned_self_attributes(init)
            except (OSError, TypeError):  # no source (C types): annotations only
                pass
    for klass in mro:
        if not set(wanted) - names:
            break
        names |= _assigned_in_class(klass)
    return names


def _assigned_in_class(klass: Any) -> set:
    """``self.X`` assigned anywhere in ``klass``'s body (its module parsed once; empty
    without source)."""
    tree = _module_tree(getattr(klass, "__module__", ""))
    node: Any = tree
    for part in getattr(klass, "__qualname__", "").split("."):
        node = next((n for n in getattr(node, "body", []) if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            return set()
    return _self_targets(node)


_TREES: Dict[str, Any] = {}


def _module_tree(module: str) -> Any:
    if module not in _TREES:
        try:
            _TREES[module] = ast.parse(inspect.getsource(importlib.import_module(module)))
        except (OSError, TypeError, ImportError, SyntaxError):
            _TREES[module] = ast.Module(body=[], type_ignores=[])
    return _TREES[module]


def resolve_path(path: str) -> Any:
    """The object at a dotted ``module.attr.attr`` path (longest importable module prefix)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no importable module in {path!r}")


def called_names(fn: Any) -> List[str]:
    """Names of the functions and methods ``fn``'s body calls, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [getattr(n.func, "attr", None) or getattr(n.func, "id", "") for n in calls]


def last_resolution_step() -> str:
    """Name of the last step ``run_resolution_pipeline`` runs (from its source)."""
    from sglang.srt.arg_groups import pipeline

    tree = ast.parse(textwrap.dedent(inspect.getsource(pipeline.run_resolution_pipeline)))
    names = [
        node.args[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "run_hook"
        and node.args
        and isinstance(node.args[0], ast.Name)
    ]
    linenos = {
        node.args[0].id: node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "run_hook"
        and node.args
        and isinstance(node.args[0], ast.Name)
    }
    if not names:
        raise _incompatible("run_resolution_pipeline calls no run_hook(step, ...)")
    return max(linenos, key=linenos.get)


# Attributes SGLang's NPU MLA pool ``__init__`` sets that the plugin's pools set
# themselves after ``DeviceDSAPool._init_without_buffers`` (each pool places its KV).
POOL_BUFFERS = frozenset({"k_buffer", "v_buffer", "index_k_buffer"})


def assigned_self_attributes(fn: Any) -> set:
    """Names ``X`` of every ``self.X = ...`` (or annotated / augmented) in ``fn``'s source."""
    return _self_targets(ast.parse(textwrap.dedent(inspect.getsource(fn))))


def _self_targets(tree: Any) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def pool_attributes_not_set(init_without_buffers: Any = None) -> List[str]:
    """Attributes SGLang's NPU MLA pool ``__init__`` (and the ``__init__`` chain it calls
    through ``super()``) sets that ``init_without_buffers`` (default
    ``DeviceDSAPool._init_without_buffers``, plus ``KVCache.__init__`` which it calls)
    does not, buffers excepted (:data:`POOL_BUFFERS`)."""
    from sglang.srt.mem_cache.memory_pool import KVCache

    from .mem_cache.pool.device import DeviceDSAPool

    fn = init_without_buffers or DeviceDSAPool._init_without_buffers
    parent: set = set()
    for cls in DeviceDSAPool.__mro__[1:]:
        if cls is KVCache:
            break
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        parent |= assigned_self_attributes(init)
        if "super().__init__" not in inspect.getsource(init):
            break
    ours = assigned_self_attributes(fn) | assigned_self_attributes(KVCache.__init__)
    return sorted(parent - ours - POOL_BUFFERS)


def _server_arg_fields() -> set:
    from sglang.srt.server_args import ServerArgs

    fields = getattr(ServerArgs, "__struct_fields__", None)
    if fields is None:
        fields = [n for c in ServerArgs.__mro__ for n in getattr(c, "__annotations__", {})]
    return set(fields)


def problems() -> List[str]:
    """Every difference between the installed SGLang and this module's tables."""
    out: List[str] = []
    try:
        fields = _server_arg_fields()
        out += [
            f"ServerArgs has no field {name!r} (read for: {why})"
            for name, why in SERVER_ARGS.items()
            if name not in fields
        ]
    except Exception as exc:  # noqa: BLE001
        out.append(f"cannot read ServerArgs' fields: {exc}")
    for target in HOOKED + CALLED:
        kind = "hook target" if target in HOOKED else "called function"
        try:
            obj = resolve_path(target.path)
        except Exception as exc:  # noqa: BLE001
            out.append(f"{kind} {target.path} not found ({type(exc).__name__}: {exc}); used for {target.why}")
            continue
        try:
            params = set(
                inspect.signature(resolve_path(target.signature_of) if target.signature_of else obj).parameters
            )
        except (AttributeError, ImportError) as exc:
            out.append(f"{target.signature_of} not found ({exc}); it declares the parameters of {target.path}")
            continue
        except (TypeError, ValueError):
            continue  # builtins without a signature (torch.cuda.*): existence is what we rely on
        missing = [p for p in target.params if p not in params]
        if missing:
            out.append(
                f"{kind} {target.path} lost parameter(s) {missing} (has {sorted(params)}); used for {target.why}"
            )
    try:
        calls = called_names(resolve_path(TARGET_RESOLVE_POOL_CONFIG))
        if [c for c in calls if c in RESOLVE_POOL_CONFIG_CALLS] != list(RESOLVE_POOL_CONFIG_CALLS):
            out.append(
                f"{TARGET_RESOLVE_POOL_CONFIG} now calls {calls}, not {list(RESOLVE_POOL_CONFIG_CALLS)} in "
                "that order: the sparse decode offload sizing hook reproduces those steps"
            )
    except Exception as exc:  # noqa: BLE001
        out.append(f"cannot inspect {TARGET_RESOLVE_POOL_CONFIG}: {exc}")
    for cls_path, wanted in OBJECT_FIELDS.items():
        try:
            declared = _declared_fields(resolve_path(cls_path), wanted)
        except Exception as exc:  # noqa: BLE001
            out.append(f"{cls_path} not found ({type(exc).__name__}: {exc}); the plugin reads {sorted(wanted)}")
            continue
        out += [
            f"{cls_path} has no field {name!r} (read for: {why})"
            for name, why in wanted.items()
            if name not in declared
        ]
    try:
        from sglang.srt.arg_groups import resolution_hooks

        allowed = getattr(resolution_hooks, "_OVERRIDABLE_HOOKS", None)
        if allowed is not None:
            out += [
                f"resolution step {name!r} is no longer overridable" for name in RESOLUTION_STEPS if name not in allowed
            ]
        last = last_resolution_step()
        if last != VALIDATION_STEP:
            out.append(
                f"the last resolution step is {last!r}, not {VALIDATION_STEP!r}: the plugin would "
                "validate arguments that later steps still change"
            )
    except Exception as exc:  # noqa: BLE001
        out.append(f"cannot inspect SGLang's resolution pipeline: {exc}")
    try:
        missing = pool_attributes_not_set()
        if missing:
            out.append(
                f"SGLang's NPU MLA pool now sets {missing} in __init__, which "
                "DeviceDSAPool._init_without_buffers does not: the plugin's pools would lack them"
            )
    except Exception as exc:  # noqa: BLE001
        out.append(f"cannot inspect SGLang's NPU MLA pool: {exc}")
    return out


def require_compatible() -> None:
    """Raise :class:`SGLangIncompatible` listing every problem (no-op when none)."""
    found = problems()
    if found:
        lines = "\n".join(f"  - {p}" for p in found)
        raise _incompatible(f"SGLang differs from what sglang-ascend-offload hooks:\n{lines}\n")
