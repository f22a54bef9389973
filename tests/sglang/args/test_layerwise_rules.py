"""Startup rules of layerwise prefill offload in SGLang: each SGLang-side rule on its
own, and SGLang's real argument resolution (backend choice, every problem at once,
publication of a valid config for the spawned processes)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import REPO
from startup_verdict import server_rule_ids

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.rules import RULES
from sglang_ascend_offload.sglang_plugin import compat
from sglang_ascend_offload.sglang_plugin.args import carrier, flags
from sglang_ascend_offload.sglang_plugin.args.flags import RawFlags
from sglang_ascend_offload.sglang_plugin.args.rules.layerwise_prefill import layerwise_violations
from sglang_ascend_offload.testing.sglang_args import server_args_stub

TINY_DSA_4L = REPO / "tests" / "fixtures" / "tiny_dsa_4l"


def view(**kw):
    base = dict(
        attention_backend="ascend_offload",
        prefill_attention_backend=None,
        decode_attention_backend=None,
        speculative_algorithm=None,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
        enable_hierarchical_cache=False,
        page_size=64,
    )
    base.update(kw)
    return server_args_stub(**base)  # every other server argument at SGLang's default


def lw(**kw):
    return cfg.OffloadConfig(layerwise_prefill=cfg.LayerwisePrefillOffloadConfig(store_backend="local", **kw))


def test_a_servable_setup_has_no_violation():
    assert layerwise_violations(lw(shared_buffers=2), view()) == []
    # the NextN / MTP chain: its draft layer is an independent layer of the plan
    assert layerwise_violations(lw(), view(speculative_algorithm="NEXTN", speculative_eagle_topk=1)) == []
    assert layerwise_violations(cfg.OffloadConfig(), view(attention_backend="torch_native")) == []


@pytest.mark.parametrize(
    "config,server,rule",
    [
        (lw(), view(attention_backend="ascend"), "sglang.layerwise_backend"),
        (lw(), view(decode_attention_backend="fa3"), "sglang.layerwise_backend"),
        (
            cfg.OffloadConfig(
                layerwise_prefill=cfg.LayerwisePrefillOffloadConfig(store_backend="local"),
                sparse_decode=cfg.SparseDecodeOffloadConfig(),
            ),
            view(),
            "sglang.layerwise_sparse_decode",
        ),
        (lw(), view(speculative_algorithm="STANDALONE"), "sglang.layerwise_speculative"),
        (lw(), view(speculative_algorithm="EAGLE", speculative_eagle_topk=4), "sglang.layerwise_speculative"),
        (lw(), view(enable_two_batch_overlap=True), "sglang.layerwise_tbo"),
        (lw(), view(enable_pdmux=True), "sglang.layerwise_tbo"),
        (lw(), view(enable_hierarchical_cache=True), "sglang.layerwise_hicache"),
        (lw(store_block_tokens=16), view(), "sglang.layerwise_block_tokens"),
        (lw(), view(pp_size=2), "sglang.layerwise_pp"),
    ],
)
def test_each_rule(config, server, rule):
    """Each rule alone in the server's whole startup verdict (some are decided by the
    deployment facts, the others by SGLang arguments)."""
    args = {k: getattr(server, k) for k in vars(server) if getattr(server, k) != getattr(view(), k, None)}
    base = dict(attention_backend="ascend_offload", page_size=64)
    assert server_rule_ids(config, **{**base, **args}) == [rule]
    assert rule in RULES


def test_memcache_without_the_package_is_rejected_only_with_reuse():
    import importlib.util

    config = cfg.OffloadConfig(layerwise_prefill=cfg.LayerwisePrefillOffloadConfig(shared_buffers=1))
    rules = [v.rule for v in layerwise_violations(config, view())]
    if importlib.util.find_spec("memcache_hybrid") is None:
        assert rules == ["sglang.layerwise_store"]
    else:
        assert rules == []
    no_reuse = cfg.OffloadConfig(layerwise_prefill=cfg.LayerwisePrefillOffloadConfig())
    assert layerwise_violations(no_reuse, view()) == []


# ------------------------------------------------------------------ real resolution
def _raw(layerwise: str, sparse: str = None) -> RawFlags:
    return RawFlags(
        enabled={"sparse_decode": sparse is not None, "layerwise_prefill": True},
        configs={"sparse_decode": sparse, "layerwise_prefill": layerwise},
    )


def _server_args(**kw):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(TINY_DSA_4L),
        device="cpu",
        load_format="dummy",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        **kw,
    )


def test_resolution_selects_the_backend_and_publishes(plugins_loaded, clean_state):
    from sglang.srt.arg_groups.model_override_base import resolving_view

    sa = _server_args()
    flags.remember(_raw('{"shared_buffers": 1, "store_backend": "local"}'))
    sa.resolve_once()
    assert resolving_view(sa).attention_backend == "ascend_offload"
    published = json.loads(carrier.published_text())
    assert published["layerwise_prefill"]["shared_buffers"] == 1
    assert carrier.active_config().layerwise_prefill.store_backend == "local"


def test_resolution_lists_every_layerwise_problem(plugins_loaded, clean_state):
    sa = _server_args(attention_backend="torch_native")
    flags.remember(
        _raw(
            '{"shared_buffers": 1, "store_backend": "local", "store_block_tokens": 16, "independent_layers": [0, 9]}',
            sparse='{"hot_tokens": 64}',
        )
    )
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    rules = {v.rule for v in info.value.violations}
    assert {
        "sglang.layerwise_backend",
        "sglang.layerwise_block_tokens",
        "sglang.layerwise_sparse_decode",
        "layerwise_prefill.layers",
    } <= rules
    assert "sglang.feature_not_wired" not in rules
    assert carrier.published_text() is None


# ------------------------------------------------------------------ memory profile
def test_cell_size_scaled_by_physical_layer_caches(plugins_loaded, clean_state):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import layerwise_prefill as sizing

    lw1 = cfg.LayerwisePrefillOffloadConfig(shared_buffers=1, store_backend="local")
    assert sizing.physical_layer_caches(lw1, 61) == 2
    assert sizing.scaled_cell_size(61 * 1408, lw1, 61) == 2 * 1408
    assert sizing.scaled_cell_size(1000, cfg.LayerwisePrefillOffloadConfig(shared_buffers=2), 4) == 750
    assert sizing.scaled_cell_size(1000, cfg.LayerwisePrefillOffloadConfig(), 4) == 1000  # no reuse
    assert compat.TARGET_CELL_SIZE in HookRegistry._hooks  # registered by the plugin's install_runtime

    kvc = SimpleNamespace(is_draft_worker=False, use_mla_backend=True)
    from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import cell

    sglang_cell = 4 * 1408  # SGLang's per-token bytes of 4 layers
    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu", attention_backend="ascend_offload"),
        role="test",
        ranks=SpawnRanks(world_rank=0, dp_rank=None),
    )
    try:
        assert sizing.cell_size_after(sglang_cell, None, kvc, 4) is None  # feature off: SGLang's figure
        assert cell.cell_size_after(sglang_cell, None, kvc, 4) is None
        carrier.publish(cfg.OffloadConfig(layerwise_prefill=lw1))
        assert sizing.cell_size_after(sglang_cell, None, kvc, 4) == 2 * 1408  # 2 of 4 layer caches
        assert cell.cell_size_after(sglang_cell, None, kvc, 4) == 2 * 1408  # the one hook asks the feature
        draft = SimpleNamespace(is_draft_worker=True, use_mla_backend=True)
        assert sizing.cell_size_after(sglang_cell, None, draft, 4) is None
    finally:
        reset_context()
