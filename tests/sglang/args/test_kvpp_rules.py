"""KVPP startup rules in SGLang: the flags, each SGLang-side rule on its own, and SGLang's
real argument resolution listing every reason at once / publishing a valid config."""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from startup_verdict import server_rule_ids

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.rules import RULES
from sglang_ascend_offload.sglang_plugin.args import carrier, flags
from sglang_ascend_offload.sglang_plugin.args.rules.kvpp import kvpp_violations
from sglang_ascend_offload.testing.sglang_args import server_args_stub

TINY_DSA_8L = REPO / "tests" / "fixtures" / "tiny_dsa_8l"


def view(**kw):
    base = dict(
        attention_backend="ascend_offload",
        prefill_attention_backend=None,
        decode_attention_backend=None,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
        enable_hierarchical_cache=False,
        disaggregation_mode="null",
        tp_size=2,
        dp_size=1,
        attn_dp_size=1,
        enable_dp_attention=False,
    )
    base.update(kw)
    return server_args_stub(**base)  # every other server argument at SGLang's default


KV = cfg.OffloadConfig(kvpp=cfg.KVPPConfig())


def test_flags_parse_into_the_kvpp_section():
    raw = flags.RawFlags(enabled={"kvpp": True}, configs={"kvpp": '{"broadcast": "full", "prefetch": false}'})
    config, problems = flags.parse(raw)
    assert problems == [] and config.kvpp == cfg.KVPPConfig(broadcast="full", prefetch=False)
    _, problems = flags.parse(flags.RawFlags(enabled={"kvpp": True}, configs={"kvpp": '{"broadcast": "x"}'}))
    assert [p.rule for p in problems] and "broadcast" in problems[0].problem
    _, problems = flags.parse(flags.RawFlags(enabled={}, configs={"kvpp": "{}"}))
    assert [p.rule for p in problems] == ["flags.config_without_enable"]
    assert "--kvpp-config" in problems[0].problem


def test_a_servable_setup_has_no_violation():
    assert kvpp_violations(KV, view()) == []
    assert kvpp_violations(cfg.OffloadConfig(), view(attention_backend="torch_native")) == []


@pytest.mark.parametrize(
    "config,server,rule",
    [
        (KV, view(attention_backend="ascend"), "sglang.kvpp_backend"),
        (KV, view(attn_dp_size=2), "sglang.kvpp_dp_attention"),
        (KV, view(enable_dp_attention=True, dp_size=2), "sglang.kvpp_dp_attention"),
        (KV, view(enable_two_batch_overlap=True), "sglang.kvpp_tbo"),
        (KV, view(enable_pdmux=True), "sglang.kvpp_tbo"),
        (KV, view(enable_hierarchical_cache=True), "sglang.kvpp_hicache"),
        (KV, view(pp_size=2), "sglang.kvpp_pp"),
    ],
)
def test_each_rule(config, server, rule):
    """Each rule alone in the server's whole startup verdict (the DP attention and PP rules
    are decided by the deployment facts, the others by SGLang arguments)."""
    args = {k: getattr(server, k) for k in vars(server) if getattr(server, k) != getattr(view(), k, None)}
    base = dict(attention_backend="ascend_offload", tp_size=2)
    assert server_rule_ids(config, **{**base, **args}) == [rule]
    assert rule in RULES


def _server_args(**kw):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=str(TINY_DSA_8L), device="cpu", load_format="dummy", skip_tokenizer_init=True, **kw)


def test_resolution_lists_every_reason(plugins_loaded, clean_state):
    """tp 1 (no group), another backend, layerwise prefill offload and a P/D prefill node at once."""
    sa = _server_args(tp_size=1, disaggregation_mode="prefill", attention_backend="torch_native")
    flags.remember(
        flags.RawFlags(
            enabled={"kvpp": True, "layerwise_prefill": True},
            configs={"kvpp": None, "layerwise_prefill": '{"store_backend": "local"}'},
        )
    )
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    rules = {v.rule for v in info.value.violations}
    assert {"kvpp.group", "sglang.kvpp_backend", "kvpp.layerwise_prefill", "kvpp.pd_prefill"} <= rules, rules
    assert carrier.published_text() is None


def test_valid_config_is_published(plugins_loaded, clean_state):
    from sglang.srt.arg_groups.model_override_base import resolving_view

    sa = _server_args(tp_size=2, disable_cuda_graph=True)
    flags.remember(flags.RawFlags(enabled={"kvpp": True}, configs={"kvpp": '{"broadcast": "full"}'}))
    sa.resolve_once()
    assert resolving_view(sa).attention_backend == "ascend_offload"
    assert json.loads(carrier.published_text())["kvpp"]["broadcast"] == "full"
    assert carrier.active_config().kvpp.broadcast == "full"


def test_cell_size_is_the_fullest_ranks_owned_plus_two_scratch():
    from sglang_ascend_offload.sglang_plugin.mem_cache.sizing.kvpp import kvpp_cell_size, kvpp_layer_caches

    assert kvpp_layer_caches(8, 2) == 6 and kvpp_layer_caches(8, 3) == 5 and kvpp_layer_caches(61, 8) == 10
    assert kvpp_cell_size(8 * 1408, 8, 2) == 6 * 1408
    assert kvpp_cell_size(8 * 1284, 8, 3) == 5 * 1284
    assert kvpp_cell_size(2 * 1408, 2, 2) == 3 * 1408  # few layers: KVPP costs more, and says so
    assert kvpp_cell_size(1000, 8, 1) == 1000  # no group, nothing changes
