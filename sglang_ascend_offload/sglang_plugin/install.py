"""Everything the plugin registers with SGLang 0.5.23, through SGLang's own extension
points; the only module that calls ``HookRegistry``.

SGLang extension points used (besides HookRegistry):

=====================================================  ==================================
extension point                                        what the plugin puts there
=====================================================  ==================================
``attention_registry.register_attention_backend``      ``ascend_offload`` backend factory
``server_args.add_attention_backend_choices``          ``ascend_offload`` as a CLI choice
DeepSeek ``AttentionBackendRegistry.register``         handler: absorbed MLA for our backend
``resolution_hooks.register_resolution_hook``          backend choice, CPU probe guard,
                                                       validation (:mod:`.args.resolution`);
                                                       the P/D backend's step
                                                       (:mod:`.disaggregation.ascend_offload`)
``choices.add_disagg_transfer_backend_choices``        ``ascend_offload`` as a P/D backend
=====================================================  ==================================

The HookRegistry hooks are the rows of :data:`HOOKS`, a ledger in the manner of
vllm-ascend's patch list: target (a ``compat.TARGET_*`` path, the one home of every
hooked name), kind, the handler's module and name, why the hook exists, whether the
target is private to SGLang (:attr:`Hook.private`: a leading underscore anywhere in its
path, so any SGLang release may rename it without notice) and ``upstream``, the SGLang
change that would let the hook go. No SGLang file is changed and nothing is patched
outside HookRegistry. ``docs/sglang_integration.md`` ("The hook ledger") is generated
from these rows by ``scripts/gen_hook_ledger.py``.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from . import compat

logger = logging.getLogger(__name__)

__all__ = ["Hook", "HOOKS", "FLAG_HOOKS", "install_flags", "install_runtime"]


@dataclass(frozen=True)
class Hook:
    """One HookRegistry registration.

    target: the hooked callable's dotted path (``compat.TARGET_*``). kind: ``AROUND`` /
    ``AFTER`` / ``BEFORE`` / ``REPLACE``. handler: ``"module:name"`` relative to this
    package; with ``build`` it names a factory whose result is registered. why: what the
    plugin needs from it. upstream: the SGLang change that would make the hook unnecessary
    (required: a hook nobody knows how to remove is a hook forever). when:
    ``"module:name"`` of a predicate; the hook is registered only when it returns true.
    """

    target: str
    kind: str
    handler: str
    why: str
    upstream: str = ""
    build: bool = False
    when: Optional[str] = None

    @property
    def private(self) -> bool:
        """The target is private to SGLang (some part of its path starts with ``_``)."""
        return any(part.startswith("_") for part in self.target.split("."))


def _resolve(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


#: The server flags; registered on every SGLang, supported or not (on another release
#: the refusing variant of ``from_cli_args`` replaces the second one).
FLAG_HOOKS: Tuple[Hook, ...] = (
    Hook(
        compat.TARGET_ADD_CLI,
        "AROUND",
        "args.flags:add_cli_args_around",
        "the plugin's flags",
        upstream="a plugin API for argument groups (declared by the plugin, parsed and kept on ServerArgs by SGLang)",
    ),
    Hook(
        compat.TARGET_FROM_CLI,
        "AROUND",
        "args.flags:from_cli_args_around",
        "keep the flag values",
        upstream="the same plugin argument-group API (values read back from ServerArgs)",
    ),
)

#: Every runtime hook, in registration order.
HOOKS: Tuple[Hook, ...] = (
    Hook(
        compat.TARGET_POOL,
        "AROUND",
        "features:build_pool_around",
        "the active feature's KV pool when the ascend_offload backend runs",
        upstream=(
            "a KV-pool factory registry keyed by attention backend in KVCacheConfigurator, like "
            "register_attention_backend"
        ),
    ),
    Hook(
        compat.TARGET_INDEXER,
        "AROUND",
        "attention.dsa_backend:forward_native_around",
        "the CPU indexer forward routes to the backend",
        upstream="the DSA Indexer dispatching through its attention backend (a backend-provided indexer forward)",
    ),
    Hook(
        compat.TARGET_NPU_INDEXER,
        "AROUND",
        "attention.dsa_backend:forward_npu_around",
        "the NPU indexer forward routes to the backend where it runs the fused LIM / LIM-C8",
        upstream="the same backend-provided indexer forward on the NPU path of the DSA Indexer",
    ),
    Hook(
        compat.TARGET_CAPABILITY,
        "AROUND",
        "cpu_capability:capability_around",
        '"no CUDA" while resolving on a CPU',
        upstream="argument resolution checking the platform before probing torch.cuda capability for DSA models",
    ),
    Hook(
        compat.TARGET_GET_KV_CLASS,
        "AROUND",
        "disaggregation.ascend_offload.install:get_kv_class_around",
        "TransferBackend.ASCEND -> the plugin's P/D classes",
        upstream=(
            "a transfer-backend registry (name -> KV manager / sender / receiver classes) instead of the closed "
            "TransferBackend enum"
        ),
    ),
    Hook(
        compat.TARGET_CONFIG_STORE,
        "AROUND",
        "disaggregation.ascend_offload.install:config_store_around",
        "the MemFabric config store of the plugin's P/D",
        upstream="the same transfer-backend registry providing the backend's config store",
    ),
    Hook(
        compat.TARGET_PREFILL_MANAGER,
        "AFTER",
        "disaggregation.ascend_offload.install:attach_pool_after_prefill",
        "hand the prefill queue's KV pool to the manager",
        upstream="KVArgs carrying the KV pool object, not only its buffer pointers",
    ),
    Hook(
        compat.TARGET_DECODE_MANAGER,
        "AFTER",
        "disaggregation.ascend_offload.install:attach_pool_after_decode",
        "hand the decode queue's KV pool to the manager",
        upstream="KVArgs carrying the KV pool object, not only its buffer pointers",
    ),
    Hook(
        compat.TARGET_IDLE_SLEEP,
        "AROUND",
        "disaggregation.ascend_offload.idle:maybe_sleep_on_idle_around",
        "--sleep-on-idle on the P/D backend: short sleeps while transfers are in flight, parked otherwise",
        upstream="a transfer-backend 'work in flight' callback consulted by Scheduler.maybe_sleep_on_idle",
    ),
    Hook(
        compat.TARGET_ON_IDLE,
        "AFTER",
        "observability.export_hooks:flush_after_idle",
        "export the offload counters the decode interval held back",
        upstream="a scheduler metrics-export callback for plugins (on idle)",
    ),
    Hook(
        compat.TARGET_STREAM_OUTPUT,
        "BEFORE",
        "observability.export_hooks:flush_before_stream_output",
        "export the offload counters before a finished request's output is sent",
        upstream="a scheduler metrics-export callback for plugins (before a finished request is streamed)",
    ),
    Hook(
        compat.TARGET_RUN_BATCH,
        "BEFORE",
        "disaggregation.ascend_offload.install:announce_last_chunks_before",
        "layerwise prefill: announce the requests whose last chunk this forward computes",
        upstream="a per-forward callback to the transfer backend naming the requests whose last prefill chunk runs",
    ),
    Hook(
        compat.TARGET_CELL_SIZE,
        "AFTER",
        "mem_cache.sizing.cell:cell_size_after",
        "per-token device KV bytes of the active feature's pool",
        upstream="the KV-pool factory registry reporting the per-token device bytes of the pool it builds",
    ),
    Hook(
        compat.TARGET_PROFILE_BYTES,
        "AROUND",
        "mem_cache.sizing.kvpp:fixed_budget_around",
        "a fixed KV byte budget for reproducible sizing",
        upstream="a server flag for a fixed KV budget in bytes (SGLang has --max-total-tokens, in tokens)",
        when="mem_cache.sizing.kvpp:fixed_budget_requested",
    ),
    Hook(
        compat.TARGET_RESOLVE_POOL_CONFIG,
        "AROUND",
        "mem_cache.sizing.sparse_decode:resolve_pool_config_around",
        "sparse decode: hot buffers drawn from SGLang's KV budget",
        upstream="the KV-pool factory registry reserving a pool's fixed (not per-token) device bytes",
    ),
    Hook(
        compat.TARGET_PROFILE_BYTES,
        "AFTER",
        "mem_cache.sizing.device_kv_budget:profile_after",
        "--device-kv-budget caps the KV budget",
        upstream="the same fixed-bytes KV budget flag",
    ),
    Hook(
        compat.TARGET_SYNC,
        "AROUND",
        "speculative.eagle:synchronize_around",
        "no CUDA sync on a CPU",
        upstream=(
            "the EAGLE worker calling the platform's synchronize (a no-op on CPU) instead of torch.cuda.synchronize"
        ),
    ),
    Hook(
        compat.TARGET_EMBED_HEAD,
        "AROUND",
        "speculative.eagle:set_embed_and_head_around",
        "the draft shares the target's embedding and head without a CUDA sync",
        upstream="set_embed_and_head using the platform's synchronize",
    ),
    Hook(
        compat.TARGET_DRAFT_FACTORY,
        "AROUND",
        "speculative.eagle:create_backend_around",
        "draft backends of EAGLE / NextN on ascend_offload",
        upstream=(
            "DraftBackendFactory consulting the attention-backend registry for out-of-tree backends' draft backends"
        ),
    ),
    Hook(
        compat.TARGET_LAST_LOC,
        "AROUND",
        "speculative.eagle:get_last_loc_around",
        "torch last-slot lookup",
        upstream=(
            "get_last_loc choosing its torch path by platform or by a backend capability, not by a list of "
            "backend names"
        ),
    ),
    Hook(
        compat.TARGET_CPU_GRAPH_RUNNER,
        "REPLACE",
        "speculative.cpu_graph:runner_class",
        "CPU verify graphs of speculative decoding",
        upstream="SGLang's CPU graph runner capturing TARGET_VERIFY (speculative verify) batches",
        build=True,
    ),
    Hook(
        compat.TARGET_IS_CPU_GRAPH,
        "AROUND",
        "speculative.cpu_graph:is_cpu_graph_around",
        "TARGET_VERIFY replays a CPU verify graph",
        upstream="ForwardMode.is_cpu_graph including TARGET_VERIFY where the CPU graph runner captures it",
    ),
)


def _register(hooks: Tuple[Hook, ...]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"AROUND": HookType.AROUND, "AFTER": HookType.AFTER, "BEFORE": HookType.BEFORE, "REPLACE": HookType.REPLACE}
    for hook in hooks:
        if hook.when is not None and not _resolve(hook.when)():
            continue
        handler = _resolve(hook.handler)
        HookRegistry.register(hook.target, handler() if hook.build else handler, kinds[hook.kind])


def install_flags(refuse_reason: str = "") -> None:
    """The flag hooks; with ``refuse_reason`` (an unsupported SGLang) the flags are
    documented but refused at argument parsing."""
    if not refuse_reason:
        _register(FLAG_HOOKS)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .args.flags import add_cli_args_around, refusing_from_cli_args

    HookRegistry.register(compat.TARGET_ADD_CLI, add_cli_args_around, HookType.AROUND)
    HookRegistry.register(compat.TARGET_FROM_CLI, refusing_from_cli_args(refuse_reason), HookType.AROUND)


def install_runtime() -> None:
    """The backend, the DeepSeek handler, the resolution steps, the P/D backend's choice
    and step, then every row of :data:`HOOKS`."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .args import resolution
    from .attention.dsa_backend import create_backend, handle_deepseek_attention
    from .disaggregation.ascend_offload.install import install as install_pd_backend
    from .names import BACKEND_NAME

    register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    AttentionBackendRegistry.register(BACKEND_NAME, handle_deepseek_attention)
    assert ATTENTION_BACKENDS[BACKEND_NAME] is create_backend
    resolution.install()
    install_pd_backend()
    _register(HOOKS)
