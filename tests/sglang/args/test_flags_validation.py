"""Flags -> typed config -> validation against SGLang's resolved arguments -> published JSON."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from conftest import TINY_DSA
from startup_verdict import dsa_hf_config, server_rule_ids, server_verdict

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload import platform
from sglang_ascend_offload.sglang_plugin.args import carrier, flags, resolution
from sglang_ascend_offload.sglang_plugin.args.deployment import (
    build_deployment,
    graph_mode,
    main_kv_dtype,
    model_kind,
)
from sglang_ascend_offload.testing.sglang_args import server_args_stub


def raw(sparse=None, layerwise=None, sparse_on=None, layerwise_on=None):
    return flags.RawFlags(
        enabled={
            "sparse_decode": sparse is not None if sparse_on is None else sparse_on,
            "layerwise_prefill": layerwise is not None if layerwise_on is None else layerwise_on,
        },
        configs={"sparse_decode": sparse, "layerwise_prefill": layerwise},
    )


# ------------------------------------------------------------------ flags -> typed config
def test_parse_builds_typed_sections(tmp_path):
    path = tmp_path / "lw.json"
    path.write_text(json.dumps({"shared_buffers": 2, "store_backend": "local"}))
    config, problems = flags.parse(raw(sparse='{"hot_tokens": 64, "ops": "reference"}', layerwise=f"@{path}"))
    assert problems == []
    assert config.sparse_decode == cfg.SparseDecodeOffloadConfig(hot_tokens=64, ops="reference")
    assert config.layerwise_prefill.shared_buffers == 2
    assert config.layerwise_prefill.store_backend == "local"
    assert config.pd_transfer is None and config.kvpp is None


def test_enable_without_config_uses_defaults():
    config, problems = flags.parse(raw(sparse_on=True))
    assert problems == [] and config.sparse_decode == cfg.SparseDecodeOffloadConfig()


def test_parse_lists_every_problem_of_every_section(tmp_path):
    config, problems = flags.parse(
        raw(
            sparse='{"hot_tokens": "many", "bogus": 1}',
            layerwise=f"@{tmp_path / 'missing.json'}",
            layerwise_on=False,
        )
    )
    rules = sorted(p.rule for p in problems)
    assert rules == ["flags.config_without_enable", "parse.type", "parse.unknown_key"]
    assert all(p.problem.startswith("--") for p in problems)  # names the flag
    # The bad key keeps its default, so every other rule can still be checked; the
    # section given without its enable flag stays off.
    assert config == cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig())


# ------------------------------------------------------------------ deployment facts
def test_model_kind_and_kv_dtype():
    dsa = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=16, kv_lora_rank=512)
    assert model_kind(dsa) == "dsa"
    assert model_kind(SimpleNamespace(architectures=["GlmMoeDsaForCausalLM"])) == "dsa"
    assert model_kind(SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512)) == "mla"
    assert model_kind(SimpleNamespace(architectures=["LlamaForCausalLM"])) == "other"
    assert main_kv_dtype("auto", SimpleNamespace(torch_dtype="bfloat16")) == "bf16"
    assert main_kv_dtype("fp8_e4m3", dsa) == "fp8_e4m3"


def test_graph_mode_per_role():
    cg = SimpleNamespace(prefill=SimpleNamespace(backend="disabled"), decode=SimpleNamespace(backend="full"))
    assert graph_mode(cg, False, "colocated") == "full"
    assert graph_mode(cg, False, "prefill") == "eager"
    assert graph_mode(cg, True, "decode") == "eager"
    cg2 = SimpleNamespace(prefill=SimpleNamespace(backend="breakable"), decode=SimpleNamespace(backend="disabled"))
    assert graph_mode(cg2, False, "prefill") == "piecewise"


def test_build_deployment_from_server_args_shape():
    args = server_args_stub(
        device="npu",
        kv_cache_dtype="auto",
        page_size=128,
        dp_size=2,
        tp_size=8,
        pp_size=1,
        attn_cp_size=1,
        enable_prefill_cp=False,
        dcp_size=1,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="ascend",
        cuda_graph_config=None,
        disable_cuda_graph=True,
        speculative_algorithm="NEXTN",
        speculative_adaptive=False,
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
        speculative_eagle_topk=1,
        disable_overlap_schedule=True,
    )
    hf = SimpleNamespace(
        architectures=["DeepseekV32ForCausalLM"],
        index_topk=2048,
        num_hidden_layers=61,
        torch_dtype="bfloat16",
        layer_types=["indexed_attention"] * 61,
    )
    d = build_deployment(args, hf, soc="Ascend910_9391")
    assert (d.device, d.model_kind, d.main_kv_dtype, d.index_topk, d.page_size) == ("npu", "dsa", "bf16", 2048, 128)
    assert (d.dp, d.tp, d.pd_role, d.graph_mode, d.speculative_method) == (2, 8, "decode", "eager", "mtp")
    assert d.soc_family == "A3" and d.hybrid_kv is False
    assert (d.speculative_rows, d.speculative_steps, d.speculative_topk, d.overlap_schedule) == (4, 3, 1, False)
    assert (d.decode_graph_mode, d.dp_attention) == ("eager", False)
    assert cfg.violations(cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(hot_tokens=8192)), d) == []


def test_plugin_rules(monkeypatch):
    """The server's whole startup verdict (deployment-scope and server-scope rules)."""
    full_graph = SimpleNamespace(decode=SimpleNamespace(backend="full"))
    # decode graphs serve offload; what they cannot do is record traces (the recorder reads top-k on the host)
    config = cfg.OffloadConfig(
        sparse_decode=cfg.SparseDecodeOffloadConfig(record_trace="/tmp/trace.npz"),
        layerwise_prefill=cfg.LayerwisePrefillOffloadConfig(store_backend="local"),
    )
    monkeypatch.setenv("SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD", "1")
    rules = server_rule_ids(
        config,
        attention_backend="ascend",
        enable_hisparse=True,
        disable_cuda_graph=False,
        enable_torch_compile=True,
        cuda_graph_config=full_graph,
        page_size=64,
    )
    monkeypatch.delenv("SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD")
    assert {
        "sglang.attention_backend",
        "sglang.hisparse",
        "sglang.npu_sparse_kv_offload",
        "sglang.sparse_decode_graph",
        "sglang.layerwise_sparse_decode",
    } <= set(rules), rules
    unwired = cfg.OffloadConfig(
        sparse_decode=cfg.SparseDecodeOffloadConfig(
            indexer_dtype="int8", fused_lim=True, ops="npu", policy="lru_k2_guarded"
        )
    )
    rules2 = server_rule_ids(unwired, attention_backend="ascend_offload", disable_cuda_graph=True)
    assert "sglang.fused_not_wired" in rules2 and "sglang.indexer_dtype" not in rules2  # int8 is served
    if platform.device_kind() != "npu":
        assert "sglang.ops_unavailable" in rules2  # no torch_npu operators on this machine
    plain = cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig())
    eager = dict(attention_backend="ascend_offload", disable_cuda_graph=True, page_size=64)
    assert server_rule_ids(plain, **eager) == []
    graphs = dict(
        attention_backend="ascend_offload",
        disable_cuda_graph=False,
        enable_torch_compile=True,
        cuda_graph_config=full_graph,
        page_size=64,
    )
    assert server_rule_ids(plain, **graphs) == []  # offload with decode graphs is served
    assert server_rule_ids(plain, **graphs, tp_size=2) == ["sglang.sparse_decode_graph"]
    # shadow verification recomputes rows on the host between layers: refused with graphs, served eagerly
    shadow = cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(verify_sample_rate=1e-3))
    found = server_verdict(shadow, **graphs)
    assert [v.rule for v in found] == ["sglang.sparse_decode_graph"] and "verify_sample_rate=0.001" in found[0].problem
    assert server_rule_ids(shadow, **eager) == []
    cpu_eager = dict(graphs, enable_torch_compile=False, tp_size=2)
    assert server_rule_ids(plain, **cpu_eager) == []  # the CPU engine captures only with torch.compile


# ------------------------------------------------------------------ real resolution, in process
def _server_args(**kw):
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path=str(TINY_DSA), device="cpu", load_format="dummy", skip_tokenizer_init=True)
    return ServerArgs(**{**args, "disable_cuda_graph": True, **kw})


def test_resolution_selects_the_backend_and_bf16_on_cpu(plugins_loaded, clean_state):
    from sglang.srt.arg_groups.model_override_base import resolving_view

    sa = _server_args()
    flags.remember(raw())
    sa.resolve_once()  # the CUDA capability probes of DSA resolution do not raise on CPU
    view = resolving_view(sa)
    assert view.attention_backend == "ascend_offload"
    assert view.kv_cache_dtype == "bfloat16"
    assert carrier.published_text() is None  # nothing enabled, nothing published


def test_on_an_npu_the_plugin_backend_is_declared_after_sglangs_npu_defaults(plugins_loaded, clean_state, monkeypatch):
    """SGLang's NPU defaults (``set_default_server_args``) declare ``ascend`` for the
    attention, prefill and decode backends, over ``--attention-backend ascend_offload`` too:
    the plugin's step declares its backend for all three after them, else every NPU launch
    with offload would be refused (``sglang.attention_backend``). Found by ``check-config
    --launch`` on an A3 node's facts (test_check_config_launch.py)."""
    import types

    from sglang.srt.arg_groups import platform_hook
    from sglang.srt.arg_groups.cuda_graph_hook import handle_cuda_graph_config
    from sglang.srt.arg_groups.model_override_base import resolving_view

    from sglang_ascend_offload.sglang_plugin.args import launch_command

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # SGLang's NPU defaults import it

    def backends(step, **kw):
        sa = _server_args(device="npu", **kw)
        handle_cuda_graph_config(sa)  # the pipeline's step before (the NPU defaults read its result)
        with launch_command.without_device():  # SGLang's NPU defaults ask the device's memory capacity
            step(sa, platform_hook.handle_npu_backends)
        return {getattr(resolving_view(sa), name) for name in resolution.BACKEND_FIELDS}

    flags.remember(raw(sparse="{}"))
    assert backends(lambda sa, sglang_step: sglang_step(sa)) == {"ascend"}  # SGLang's step alone
    assert backends(resolution._select_backend) == {"ascend"}  # the CPU step's order on an NPU: negative control
    assert backends(resolution._select_npu_backend) == {"ascend_offload"}
    assert backends(resolution._select_npu_backend, attention_backend="ascend_offload") == {"ascend_offload"}
    assert backends(resolution._select_npu_backend, attention_backend="ascend") == {"ascend"}  # refused by the rule
    flags.forget()
    assert backends(resolution._select_npu_backend) == {"ascend"}  # no offload: SGLang's own backend


def test_cpu_serving_needs_sglang_cpu_engine(plugins_loaded, clean_state, monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    flags.remember(raw())
    with pytest.raises(cfg.ConfigError, match="SGLANG_USE_CPU_ENGINE=1"):
        _server_args().resolve_once()


def test_invalid_config_stops_resolution_with_every_reason(plugins_loaded, clean_state):
    sa = _server_args(kv_cache_dtype="fp8_e4m3", attention_backend="torch_native")
    flags.remember(raw(sparse='{"hot_tokens": 8, "ops": "npu"}', layerwise="{}", layerwise_on=False))
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    rules = {v.rule for v in info.value.violations}
    assert {
        "flags.config_without_enable",
        "sparse_decode.hot_tokens_topk",
        "sparse_decode.hot_tokens_page",
        "sparse_decode.main_kv_dtype",
        "sparse_decode.fused_device",
        "sglang.attention_backend",
    } <= rules
    assert carrier.published_text() is None


def test_valid_config_is_published_for_child_processes(plugins_loaded, clean_state, monkeypatch):
    sa = _server_args()  # SGLang forces page size 64 for DSA off NPU/XPU
    flags.remember(raw(sparse='{"hot_tokens": 64}'))
    sa.resolve_once()
    published = json.loads(carrier.published_text())
    assert published["sparse_decode"]["hot_tokens"] == 64
    assert carrier.active_config().sparse_decode.hot_tokens == 64


def test_fused_copy_sfa_is_the_npu_default_and_its_extension_is_required_at_startup():
    """On an Ascend NPU with ops auto (or fused) the fused Copy-SFA serves the decode step
    unless ``fused_copy_sfa: false``; without the AscendC extension that default is refused
    before anything starts, with the build command, never a silent fallback. This machine
    has no extension, which is what an NPU node without the build looks like."""
    npu = dict(attention_backend="ascend_offload", disable_cuda_graph=True, device="npu", page_size=128)
    top_k_2048 = dsa_hf_config(index_topk=2048)  # a top-k the fused kernels take (DeepSeek-V3.2's)

    def rules_and_text(sd):
        found = server_verdict(cfg.OffloadConfig(sparse_decode=sd), hf_config=top_k_2048, **npu)
        return [v.rule for v in found], "\n".join(f"{v.problem} -> {v.fix}" for v in found)

    rules, text = rules_and_text(cfg.SparseDecodeOffloadConfig())
    assert "sglang.fused_unavailable" in rules
    assert "the default on an Ascend NPU" in text and "scripts/setup_npu_env.sh" in text
    assert '"fused_copy_sfa": false' in text
    rules, text = rules_and_text(cfg.SparseDecodeOffloadConfig(fused_copy_sfa=True))
    assert "sglang.fused_unavailable" in rules and "fused_copy_sfa=true cannot run" in text
    assert "sglang.fused_not_wired" not in rules
    for opted_out in (
        cfg.SparseDecodeOffloadConfig(fused_copy_sfa=False, fused_lim=False),
        cfg.SparseDecodeOffloadConfig(ops="npu"),
    ):
        assert "sglang.fused_unavailable" not in rules_and_text(opted_out)[0]
    cpu = dict(npu, device="cpu", page_size=64)
    found = server_verdict(
        cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig()), hf_config=top_k_2048, **cpu
    )
    assert found == []  # off the NPU the default is the separate copy + attention


def test_fused_copy_sfa_required_follows_the_setting_then_the_device():
    sd = cfg.SparseDecodeOffloadConfig
    assert cfg.fused_copy_sfa_required(sd(), "npu") and cfg.fused_copy_sfa_required(sd(ops="fused"), "npu")
    assert not cfg.fused_copy_sfa_required(sd(), "cpu") and not cfg.fused_copy_sfa_required(sd(ops="npu"), "npu")
    assert cfg.fused_copy_sfa_required(sd(fused_copy_sfa=True), "cpu")
    assert not cfg.fused_copy_sfa_required(sd(fused_copy_sfa=False), "npu")
