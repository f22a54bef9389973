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

import logging
from typing import Any, Callable, Tuple

from . import compat
from .features import FEATURES, Hook, resolve

logger = logging.getLogger(__name__)

__all__ = ["Hook", "HOOKS", "FLAG_HOOKS", "install_flags", "install_runtime"]


def _resolve(spec: str) -> Callable[..., Any]:
    return resolve(spec)


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

#: Hooks of the ``ascend_offload`` backend itself, whatever feature is on: its pools, the CPU
#: indexer and capability probe, the per-token cell size, speculative decoding.
BACKEND_HOOKS: Tuple[Hook, ...] = (
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
        compat.TARGET_CAPABILITY,
        "AROUND",
        "cpu_capability:capability_around",
        '"no CUDA" while resolving on a CPU',
        upstream="argument resolution checking the platform before probing torch.cuda capability for DSA models",
    ),
    Hook(
        compat.TARGET_CELL_SIZE,
        "AFTER",
        "mem_cache.sizing.cell:cell_size_after",
        "per-token device KV bytes of the active feature's pool",
        upstream="the KV-pool factory registry reporting the per-token device bytes of the pool it builds",
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

#: Hooks that must wrap every feature's hook on the same target (registered last):
#: ``--device-kv-budget`` caps whatever budget a feature fixed.
BUDGET_HOOKS: Tuple[Hook, ...] = (
    Hook(
        compat.TARGET_PROFILE_BYTES,
        "AFTER",
        "mem_cache.sizing.device_kv_budget:profile_after",
        "--device-kv-budget caps the KV budget",
        upstream="the same fixed-bytes KV budget flag",
    ),
)

#: Every runtime hook, in registration order (hooks on one target apply in this order):
#: the backend's, each feature's (``features.FEATURES``), then the budget cap.
HOOKS: Tuple[Hook, ...] = BACKEND_HOOKS + tuple(h for f in FEATURES for h in f.hooks) + BUDGET_HOOKS


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
