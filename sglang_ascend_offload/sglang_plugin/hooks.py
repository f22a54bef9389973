"""Everything the plugin registers with SGLang 0.5.23, through SGLang's own extension points.

=====================================================  ==================================
extension point                                        what the plugin puts there
=====================================================  ==================================
``attention_registry.register_attention_backend``      ``ascend_offload`` backend factory
``server_args.add_attention_backend_choices``          ``ascend_offload`` as a CLI choice
DeepSeek ``AttentionBackendRegistry.register``         handler: absorbed MLA for our backend
``resolution_hooks.register_resolution_hook``          backend choice, CPU probe guard,
                                                       validation (:mod:`.args.resolution`)
HookRegistry AROUND ``ServerArgs.add_cli_args``        the plugin's flags (:mod:`.args.flags`)
HookRegistry AROUND ``ServerArgs.from_cli_args``       keep the flag values
HookRegistry AROUND ``KVCacheConfigurator.             the plugin's pools when our backend
_build_token_to_kv_pool``                              is selected
HookRegistry AROUND ``KVCacheConfigurator.             sparse decode: hot buffers from
_resolve_memory_pool_config``, AFTER ``DefaultPool      SGLang's KV budget, device bytes
Configurator._compute_cell_size``                      per token (:mod:`.mem_cache.sizing.sparse_decode`)
HookRegistry AFTER ``KVCacheConfigurator.              ``--device-kv-budget`` caps the
_profile_available_bytes``                             budget (:mod:`.mem_cache.sizing.device_kv_budget`)
HookRegistry AROUND ``Indexer.forward_native``         the CPU indexer forward (routes to
                                                       the backend; otherwise unchanged)
HookRegistry AROUND ``torch.cuda.                      "no CUDA" while resolving on a CPU
get_device_capability``                                (:mod:`.cpu_capability`)
HookRegistry AROUND ``DraftBackendFactory.             speculative decoding (EAGLE / NextN):
_create_backend``, ``allocation.get_last_loc``,          draft backends, torch last-slot lookup,
``set_embed_and_head``, ``torch.cuda.synchronize``     no CUDA sync on a CPU (:mod:`.speculative.eagle`)
=====================================================  ==================================

No SGLang file is changed and nothing is patched outside HookRegistry.
"""

from __future__ import annotations

import logging

from .args import carrier, flags
from .compat import TARGET_ADD_CLI as _TARGET_ADD_CLI
from .compat import TARGET_FROM_CLI as _TARGET_FROM_CLI
from .compat import TARGET_INDEXER as _TARGET_INDEXER
from .compat import TARGET_POOL as _TARGET_POOL

logger = logging.getLogger(__name__)

_TARGET_CAPABILITY = "torch.cuda.get_device_capability"


class UnsupportedSGLangVersion(RuntimeError):
    """The plugin's flags were used with an SGLang release it does not support."""


# ------------------------------------------------------------------ flags
def _add_cli_args_around(original, parser):
    original(parser)
    flags.add_arguments(parser)


def _from_cli_args_around(original, cls, args):
    flags.remember(flags.take_from_namespace(args))
    return original(cls, args)


def _make_refusing_from_cli_args(reason: str):
    def _from_cli_args_refuse(original, cls, args):
        raw = flags.take_from_namespace(args)
        if raw.any_given:
            raise UnsupportedSGLangVersion(
                f"sglang-ascend-offload flags were given, but {reason}. Install sglang==0.5.23 "
                "or drop the --enable-*-offload / --*-offload-config flags."
            )
        return original(cls, args)

    return _from_cli_args_refuse


def install_flags(refuse_reason: str = "") -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET_ADD_CLI, _add_cli_args_around, HookType.AROUND)
    around = _make_refusing_from_cli_args(refuse_reason) if refuse_reason else _from_cli_args_around
    HookRegistry.register(_TARGET_FROM_CLI, around, HookType.AROUND)


# ------------------------------------------------------------------ pools
def _build_pool_around(original, self, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    from sglang.srt.runtime_context import get_exec

    from .names import BACKEND_NAME

    if get_exec().kernel.attention_backend != BACKEND_NAME:
        return original(self, sizes=sizes, is_dsa_model=is_dsa_model, is_dsv4_model=is_dsv4_model,
                        req_to_token_pool=req_to_token_pool)
    if not self.use_mla_backend or is_dsv4_model or self.is_hybrid_swa or self.mambaish_config:
        raise ValueError(
            f"attention backend {BACKEND_NAME} serves MLA / DSA models with a uniform KV layout "
            "(DeepSeek-V3.2 style); choose another backend for this model"
        )
    if carrier.active_config().layerwise_prefill is not None:  # layerwise prefill offload pool
        from .mem_cache.pool.layerwise_prefill import build_layerwise_pool

        return build_layerwise_pool(self, max_total_num_tokens=sizes.max_total_num_tokens,
                                    is_dsa_model=is_dsa_model)
    if carrier.active_config().kvpp is not None:  # KVPP: layers sharded over the TP group
        from .mem_cache.pool.kvpp import build_kvpp_pool

        return build_kvpp_pool(self, max_total_num_tokens=sizes.max_total_num_tokens, is_dsa_model=is_dsa_model)
    if carrier.sparse_decode_enabled():
        from .mem_cache.pool.sparse_decode import build_offload_pool

        return build_offload_pool(self, max_total_num_tokens=sizes.max_total_num_tokens,
                                  is_dsa_model=is_dsa_model, rows=req_to_token_pool.req_to_token.shape[0])
    from .mem_cache.pool.device import build_device_pool

    return build_device_pool(self, max_total_num_tokens=sizes.max_total_num_tokens, is_dsa_model=is_dsa_model)


# ------------------------------------------------------------------ indexer (CPU path)
def _indexer_forward_native_around(original, self, x, q_lora, positions, forward_batch, layer_id,
                                   return_indices: bool = True, **kwargs):
    from sglang.srt.model_executor.forward_context import get_attn_backend

    from .attention.dsa_backend import AscendOffloadAttnBackend

    try:
        backend = get_attn_backend()
    except Exception:  # noqa: BLE001 - no forward context: not our forward
        backend = None
    if isinstance(backend, AscendOffloadAttnBackend):
        return backend.run_indexer(self, x, q_lora, positions, forward_batch, layer_id, return_indices)
    return original(self, x, q_lora, positions, forward_batch, layer_id, return_indices, **kwargs)


# ------------------------------------------------------------------ install
def install_runtime() -> None:
    """Backend, DeepSeek handler, pools, CPU DSA path, resolution steps."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .args import resolution
    from .attention.dsa_backend import create_backend, handle_deepseek_attention
    from .names import BACKEND_NAME
    from .cpu_capability import capability_around

    register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    AttentionBackendRegistry.register(BACKEND_NAME, handle_deepseek_attention)
    HookRegistry.register(_TARGET_POOL, _build_pool_around, HookType.AROUND)
    HookRegistry.register(_TARGET_INDEXER, _indexer_forward_native_around, HookType.AROUND)
    HookRegistry.register(_TARGET_CAPABILITY, capability_around, HookType.AROUND)
    resolution.install()
    from .disaggregation.ascend_offload.install import install as install_pd_backend  # P/D transfer backend ascend_offload

    install_pd_backend()
    assert ATTENTION_BACKENDS[BACKEND_NAME] is create_backend
    from .mem_cache.sizing.layerwise_prefill import install as install_layerwise_sizing  # layerwise prefill: memory profile

    install_layerwise_sizing()
    from .mem_cache.sizing.kvpp import install as install_kvpp_sizing  # KVPP: per-rank KV bytes per token

    install_kvpp_sizing()
    from .mem_cache.sizing.device_kv_budget import install as install_device_kv_budget  # --device-kv-budget
    from .mem_cache.sizing.sparse_decode import install as install_offload_sizing  # sparse decode: one device budget

    install_offload_sizing()
    install_device_kv_budget()
    from .speculative.eagle import install as install_speculative  # EAGLE / NextN (MTP) on the backend

    install_speculative()
    from .speculative.cpu_graph import install as install_cpu_spec_graph  # CPU verify graphs (torch.compile)

    install_cpu_spec_graph()
