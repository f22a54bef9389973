"""Configuration parsing and deployment validation: every rule, all at once."""

import json
import subprocess
import sys

import pytest

from sglang_ascend_offload.config import (
    RULES,
    ConfigError,
    Deployment,
    KVPPConfig,
    LayerwisePrefillOffloadConfig,
    OffloadConfig,
    PDTransferConfig,
    SparseDecodeOffloadConfig,
    parse_config,
    parse_deployment,
    parse_section,
    validate,
    violations,
)

# A deployment every feature accepts in its own role (facts of a DeepSeek-V3.2 node).
GOOD = dict(
    device="npu",
    soc="Ascend910_9391",
    model_kind="dsa",
    main_kv_dtype="bf16",
    num_layers=61,
    index_topk=2048,
    page_size=128,
    tp=8,
    dp=1,
)

SD = {"sparse_decode": {"hot_tokens": 4096}}
LW = {"layerwise_prefill": {"shared_buffers": 6, "store_backend": "memcache"}}
PD = {"pd_transfer": {"engine": "memfabric", "protocol": "sdma"}}
KV = {"kvpp": {}}

# rule -> (config, deployment overrides) that breaks exactly that rule.
CASES = {
    "sparse_decode.model": (SD, dict(model_kind="mla")),
    "sparse_decode.main_kv_dtype": (SD, dict(main_kv_dtype="fp8_e4m3")),
    "sparse_decode.main_kv_packing": (SD, dict(main_kv_packing="c8")),
    "sparse_decode.context_parallel": (SD, dict(dcp=2)),
    "sparse_decode.pipeline_parallel": (SD, dict(pp=2)),
    "sparse_decode.soc_950": (SD, dict(soc="Ascend950DT")),
    "sparse_decode.soc_unknown": (SD, dict(soc=None, soc_unknown="no CANN install found")),
    "sparse_decode.hybrid_kv": (SD, dict(hybrid_kv=True)),
    "sparse_decode.hot_tokens_topk": ({"sparse_decode": {"hot_tokens": 1024}}, {}),
    "sparse_decode.hot_tokens_page": ({"sparse_decode": {"hot_tokens": 4100}}, {}),
    "sparse_decode.prefill_node": (SD, dict(pd_role="prefill")),
    "sparse_decode.fused_device": ({"sparse_decode": {"fused_copy_sfa": True}}, dict(device="cuda", soc=None)),
    "sparse_decode.speculative": (SD, dict(speculative_method="mtp", speculative_fixed=False)),
    "sparse_decode.kvpp": ({**SD, **KV}, {}),
    "sparse_decode.rank_depth_topk": (
        {"sparse_decode": {"hot_tokens": 4096, "policy": "score_rank", "rank_depth": 1024}},
        {},
    ),
    "sparse_decode.score_speculative": (
        {"sparse_decode": {"hot_tokens": 4096, "policy": "score_rank_guarded", "rank_depth": 8192}},
        dict(speculative_method="mtp"),
    ),
    "layerwise_prefill.eager": (LW, dict(graph_mode="piecewise")),
    "layerwise_prefill.memcache": ({"layerwise_prefill": {"shared_buffers": 6, "store_backend": "local"}}, {}),
    "layerwise_prefill.mooncake_layerwise": (LW, dict(pd_role="prefill", disaggregation_transfer_backend="mooncake")),
    "layerwise_prefill.hybrid_kv": (LW, dict(hybrid_kv=True)),
    "layerwise_prefill.layers": ({"layerwise_prefill": {"independent_layers": [0, 61]}}, {}),
    "layerwise_prefill.prefetch": ({"layerwise_prefill": {"shared_buffers": 2, "prefetch_depth": 4}}, {}),
    "layerwise_prefill.decode_node": (LW, dict(pd_role="decode")),
    "pd_transfer.role": (PD, {}),
    "pd_transfer.tp_ratio": (PD, dict(pd_role="prefill", tp=3, peer_tp=2)),
    "pd_transfer.memfabric_only": (
        {"pd_transfer": {"engine": "mooncake"}},
        dict(pd_role="decode", peer_tp=8, attn_tp=1, dp=8),
    ),
    "pd_transfer.protocol_match": (PD, dict(pd_role="decode", peer_tp=8, peer_protocol="device_rdma", attn_tp=1, dp=8)),
    "pd_transfer.protocol_soc": (
        {"pd_transfer": {"protocol": "device_urma"}},
        dict(pd_role="decode", peer_tp=8, attn_tp=1, dp=8),
    ),
    "pd_transfer.ports": ({"pd_transfer": {"kv_port": 65530}}, dict(pd_role="decode", peer_tp=8, attn_tp=1, dp=8)),
    "pd_transfer.decode_tp": (PD, dict(pd_role="decode", peer_tp=8)),  # attention TP 8, device main KV
    "kvpp.dcp": (KV, dict(dcp=2)),
    "kvpp.decode_node": (KV, dict(pd_role="decode")),
    "kvpp.graph_mode": (KV, dict(graph_mode="full")),
    "kvpp.model": (KV, dict(model_kind="other")),
    "kvpp.speculative_method": (KV, dict(speculative_method="eagle")),
    "kvpp.speculative_fixed": (KV, dict(speculative_method="mtp", speculative_fixed=False)),
    "kvpp.group": (KV, dict(tp=1)),
    "kvpp.layerwise_prefill": ({**KV, **LW}, {}),
    "kvpp.pd_prefill": (KV, dict(pd_role="prefill")),
    "sglang.kvpp_pp": (KV, dict(pp=2)),
    "sglang.kvpp_dp_attention": (KV, dict(dp=2, dp_attention=True)),
    "sglang.indexer_int8_device": (
        {"sparse_decode": {"hot_tokens": 4096, "indexer_dtype": "int8", "fused_lim": False}},
        {},
    ),
    "sglang.indexer_int8_pd": (
        {"sparse_decode": {"hot_tokens": 4096, "indexer_dtype": "int8"}},
        dict(device="cpu", soc=None, pd_role="decode", speculative_method="mtp"),
    ),
    "sglang.fused_not_wired": (
        {"sparse_decode": {"hot_tokens": 4096, "fused_lim": True, "policy": "lru_k2_guarded"}},
        {},
    ),
    "sparse_decode.trace_ranking_fused": (  # the NPU default's fused LIM returns the top-k only
        {"sparse_decode": {"hot_tokens": 4096, "record_trace": "/tmp/t.npz", "record_trace_rank_depth": 4096}},
        {},
    ),
    "sglang.sparse_decode_graph": (SD, dict(graph_mode="full", attn_tp=2)),
    "sglang.sparse_decode_speculative": (
        {"sparse_decode": {"hot_tokens": 8192}},
        dict(speculative_method="mtp", speculative_rows=4, speculative_topk=2),
    ),
    "sglang.layerwise_sparse_decode": ({**SD, **LW}, {}),
    "sglang.layerwise_speculative": (LW, dict(speculative_method="standalone")),
    "sglang.layerwise_pp": (LW, dict(pp=2)),
    "sglang.layerwise_block_tokens": (
        {"layerwise_prefill": {"shared_buffers": 6, "store_backend": "memcache", "store_block_tokens": 64}},
        {},
    ),
    "sglang.pd_engine_device": (
        {"pd_transfer": {"engine": "memfabric"}},
        dict(device="cpu", soc=None, pd_role="decode", peer_tp=8, attn_tp=1, dp=8),
    ),
    "sglang.pd_parallel": (PD, dict(pd_role="prefill", pp=2, peer_tp=8)),
    "sglang.pd_speculative": (
        {**PD, **LW},
        dict(pd_role="prefill", peer_tp=8, speculative_method="mtp", disaggregation_transfer_backend="ascend_offload"),
    ),
}


def _run(config: dict, overrides: dict):
    return violations(parse_config(config), parse_deployment({**GOOD, **overrides}))


def test_a_recorded_ranking_shorter_than_the_top_k_is_refused_like_a_served_one():
    """``record_trace_rank_depth`` is held to the top-k by the rule that holds ``rank_depth``
    (the trace recorder's own check no longer is the first to see it)."""
    config = {"sparse_decode": {"hot_tokens": 4096, "ops": "npu", "record_trace": "/tmp/t.npz"}}
    config["sparse_decode"]["record_trace_rank_depth"] = 1024
    found = _run(config, {})
    assert [v.rule for v in found] == ["sparse_decode.rank_depth_topk"], found
    assert "record_trace_rank_depth=1024 < top-k=2048" in found[0].problem
    config["sparse_decode"]["record_trace_rank_depth"] = 2048
    assert _run(config, {}) == []


def test_every_rule_has_a_case():
    assert set(CASES) == set(RULES)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_rejects_with_its_name(rule):
    config, overrides = CASES[rule]
    found = _run(config, overrides)
    assert [v.rule for v in found] == [rule], found
    with pytest.raises(ConfigError) as err:
        validate(parse_config(config), parse_deployment({**GOOD, **overrides}))
    assert f"[{rule}]" in str(err.value)
    assert found[0].fix  # says what to change


@pytest.mark.parametrize("config", [SD, LW, KV])
def test_good_colocated_deployment_passes(config):
    assert _run(config, {}) == []


def test_int8_indexer_is_served_off_the_npu():
    """indexer_dtype int8 (LIM-C8) passes on a CPU / CUDA node, colocated, with decode
    graphs and with speculation, and on a P/D decode; the NPU and a P/D decode with
    speculation refuse it with their own ids."""
    int8 = {"sparse_decode": {"hot_tokens": 8192, "indexer_dtype": "int8"}}
    for device in ("cpu", "cuda"):
        assert _run(int8, dict(device=device, soc=None)) == []
        assert _run(int8, dict(device=device, soc=None, graph_mode="full", attn_tp=1)) == []
    assert (
        _run(
            int8,
            dict(
                device="cpu",
                soc=None,
                speculative_method="mtp",
                speculative_rows=4,
                speculative_steps=3,
                speculative_topk=1,
                overlap_schedule=False,
            ),
        )
        == []
    )
    assert _run(int8, dict(device="cpu", soc=None, pd_role="decode")) == []
    # on an NPU the fused LIM-C8 serves plain decode and verify rows (the backend runs the
    # indexer) where its residency step takes the shape: 4096 hot slots, 2 rows x top-k 2048 ...
    int8_4k = {"sparse_decode": {"hot_tokens": 4096, "indexer_dtype": "int8"}}
    assert [v.rule for v in _run(int8_4k, dict(device="npu"))] == []
    assert [
        v.rule
        for v in _run(
            int8_4k,
            dict(device="npu", speculative_method="mtp", speculative_rows=2, speculative_steps=1, speculative_topk=1),
        )
    ] == []
    # ... not 8192 slots (above the kernels' 4096), and a P/D decode with a draft cannot
    # carry two index-K dtypes
    big = _run(int8, dict(device="npu"))
    assert [v.rule for v in big] == ["sglang.indexer_int8_device"] and "hot_tokens 8192" in big[0].problem
    found = _run(
        int8_4k,
        dict(
            device="npu",
            pd_role="decode",
            speculative_method="mtp",
            speculative_rows=2,
            speculative_steps=1,
            speculative_topk=1,
        ),
    )
    assert [v.rule for v in found] == ["sglang.indexer_int8_pd"]
    assert all('"indexer_dtype": "bf16"' in v.fix for v in found)


def test_verify_rows_need_only_one_top_k_of_hot_tokens():
    """With speculation the hot buffer needs only top-k slots (a round whose verify rows'
    union exceeds it overflows, sparse_decode/overflow.py): 4096 and 2048 pass at MTP-3,
    1024 < top-k 2048 is refused as without speculation."""
    mtp3 = dict(speculative_method="mtp", speculative_rows=4)
    assert _run(SD, mtp3) == []
    assert _run({"sparse_decode": {"hot_tokens": 2048}}, mtp3) == []
    found = _run({"sparse_decode": {"hot_tokens": 1024}}, mtp3)
    assert [v.rule for v in found] == ["sparse_decode.hot_tokens_topk"] and ">= 2048" in found[0].fix


def test_good_pd_deployments_pass():
    assert _run({**PD, **SD}, dict(pd_role="decode", tp=2, attn_tp=1, dp=2, peer_tp=8)) == []
    # decode attention TP 2 with the TP-shared host pool of sparse decode offload (CPU)
    assert (
        _run(
            {"pd_transfer": {"engine": "mooncake"}, **SD},
            dict(device="cpu", soc=None, pd_role="decode", tp=2, peer_tp=4),
        )
        == []
    )
    assert (
        _run({**PD, **LW}, dict(pd_role="prefill", tp=8, peer_tp=2, disaggregation_transfer_backend="ascend_offload"))
        == []
    )
    # KVPP on that prefill node: refused by check-config as by the server (its rule ids)
    found = _run(
        {**PD, **LW, **KV}, dict(pd_role="prefill", tp=8, peer_tp=2, disaggregation_transfer_backend="ascend_offload")
    )
    assert [v.rule for v in found] == ["kvpp.layerwise_prefill", "kvpp.pd_prefill"]


def test_kvpp_piecewise_and_fixed_mtp_accepted():
    assert _run(KV, dict(graph_mode="piecewise", speculative_method="mtp")) == []


def test_layerwise_without_reuse_needs_no_memcache_or_eager():
    cfg = {"layerwise_prefill": {"store_backend": "local"}}  # B unset: one buffer per layer
    assert _run(cfg, dict(graph_mode="full")) == []


def test_local_store_allowed_on_cpu():
    cfg = {"layerwise_prefill": {"shared_buffers": 2, "store_backend": "local"}}
    assert _run(cfg, dict(device="cpu")) == []


def test_protocol_matches_soc_family():
    assert _run({"pd_transfer": {"protocol": "device_urma"}}, dict(soc="Ascend950PR", pd_role="prefill")) == []
    found = _run({"pd_transfer": {"protocol": "sdma"}}, dict(soc="Ascend950PR", pd_role="prefill"))
    assert [v.rule for v in found] == ["pd_transfer.protocol_soc"]


def test_several_violations_all_listed():
    config = {**SD, **KV, "pd_transfer": {"engine": "mooncake"}}
    overrides = dict(
        main_kv_dtype="fp8", pp=2, soc="Ascend950PR", pd_role="decode", tp=2, peer_tp=3, dcp=2, graph_mode="full"
    )
    with pytest.raises(ConfigError) as err:
        validate(parse_config(config), parse_deployment({**GOOD, **overrides}))
    rules = {v.rule for v in err.value.violations}
    expected = {
        "sparse_decode.main_kv_dtype",
        "sparse_decode.pipeline_parallel",
        "sparse_decode.soc_950",
        "sparse_decode.context_parallel",
        "sparse_decode.kvpp",
        "pd_transfer.tp_ratio",
        "pd_transfer.memfabric_only",
        "kvpp.dcp",
        "kvpp.decode_node",
        "kvpp.graph_mode",
    }
    assert expected <= rules
    text = str(err.value)
    assert f"({len(err.value.violations)} problem(s))" in text
    for rule in expected:
        assert f"[{rule}]" in text


def test_parse_reports_every_problem():
    bad = '{"sparse_decode": {"hot_tokens": "x", "foo": 1, "ops": "gpu", "record_trace_max_steps": 0}, "bar": 2}'
    with pytest.raises(ConfigError) as err:
        parse_config(bad)
    msgs = [str(v) for v in err.value.violations]
    assert len(msgs) == 5, msgs
    assert any("record_trace_max_steps=0 is out of range: it must be >= 1" in m for m in msgs)
    assert any("'bar'" in m for m in msgs)
    assert any("'sparse_decode.foo'" in m for m in msgs)
    assert any("hot_tokens" in m and "int | null" in m for m in msgs)
    assert any('"auto"' in m for m in msgs)


def test_range_checks_and_nested_sections():
    with pytest.raises(ConfigError) as err:
        parse_section(
            LayerwisePrefillOffloadConfig,
            '{"shared_buffers": 0, "independent_layers": [1, 1], "memcache": {"lease_ttl_ms": -1}}',
        )
    text = str(err.value)
    assert "shared_buffers=0 is out of range: it must be >= 1" in text
    assert "duplicates" in text
    assert "lease_ttl_ms" in text


def test_metrics_intervals_must_not_be_negative():
    with pytest.raises(ConfigError) as err:
        parse_section(SparseDecodeOffloadConfig, '{"metrics_export_interval_s": -1, "metrics_log_interval_s": -2}')
    text = str(err.value)
    assert "metrics_export_interval_s=-1" in text and "metrics_log_interval_s=-2" in text
    assert parse_section(SparseDecodeOffloadConfig, '{"metrics_export_interval_s": 0}').metrics_export_interval_s == 0


def test_parse_from_file_and_roundtrip(tmp_path):
    path = tmp_path / "sd.json"
    path.write_text(json.dumps({"hot_tokens": 4096, "policy": "lru", "indexer_dtype": "int8"}))
    sd = parse_section(SparseDecodeOffloadConfig, f"@{path}")
    assert sd == SparseDecodeOffloadConfig(hot_tokens=4096, indexer_dtype="int8")
    full = OffloadConfig(
        sparse_decode=sd,
        layerwise_prefill=LayerwisePrefillOffloadConfig(),
        pd_transfer=PDTransferConfig(),
        kvpp=KVPPConfig(),
    )
    import dataclasses

    assert parse_config(dataclasses.asdict(full)) == full
    with pytest.raises(ConfigError, match="cannot read"):
        parse_section(SparseDecodeOffloadConfig, f"@{tmp_path}/missing.json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_section(SparseDecodeOffloadConfig, "{hot_tokens: 1}")


def test_deployment_soc_family():
    assert Deployment(soc="Ascend910_9391").soc_family == "A3"
    assert Deployment(soc="Ascend910B3").soc_family == "A2"
    assert Deployment(soc="Ascend950DT").soc_family == "950"
    assert Deployment(soc="950PR").soc_family == "950"
    assert Deployment().soc_family is None


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "sglang_ascend_offload", "check-config", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_config_cli_ok_and_violations(tmp_path):
    dep = tmp_path / "dep.json"
    dep.write_text(json.dumps(GOOD))
    ok = _cli("--config", json.dumps(SD), "--deployment", f"@{dep}")
    assert ok.returncode == 0 and ok.stdout.splitlines()[0] == "ok", ok.stderr
    assert "undecided: " in ok.stdout  # the server rules these facts do not decide
    bad = _cli("--config", json.dumps({**SD, **KV}), "--deployment", json.dumps({**GOOD, "pp": 2, "dcp": 2}))
    assert bad.returncode == 1
    for rule in ("sparse_decode.pipeline_parallel", "sparse_decode.context_parallel", "sparse_decode.kvpp", "kvpp.dcp"):
        assert f"[{rule}]" in bad.stderr
    js = _cli("--config", '{"sparse_decode": {"foo": 1}}', "--deployment", '{"tp": 0}', "--json")
    assert js.returncode == 1
    out = json.loads(js.stdout)
    assert out["ok"] is False
    assert {v["rule"] for v in out["violations"]} == {"parse.unknown_key", "parse.range"}


def test_configuration_doc_is_current():
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("gen_config_doc", root / "scripts" / "gen_config_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (root / "docs" / "configuration.md").read_text() == gen.render(), (
        "docs/configuration.md is stale: run scripts/gen_config_doc.py"
    )


def test_check_config_states_the_hot_buffer_plan_for_a_model():
    """With a model, check-config states the hot buffers the server would allocate (the
    hot-buffer plan; that they equal the pool's is test_hot_buffer_agreement.py)."""
    dep = json.dumps({"device": "cpu", "page_size": 64, "pd_role": "decode"})
    text = _cli("--config", '{"sparse_decode": {}}', "--deployment", dep, "--model", "deepseek-v3.2")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == "ok"
    assert (
        "832.1 MiB = 3 hot rows (1 request + 1 padding slot + 1 sink row) x 61 layers x 4096 hot_tokens" in text.stdout
    )
    js = _cli(
        *("--config", '{"sparse_decode": {}}', "--deployment", dep, "--model", "deepseek-v3.2", "--json"),
        *("--requests", "4", "--decode-extra-slots", "8"),
    )
    plan = json.loads(js.stdout)["hot_buffer"]
    assert plan["hot_tokens"] == 4096 and plan["hot_rows"] == 4 + 8 + 2
    assert plan["device_bytes"] == 14 * 61 * (4096 * (1152 + 12) + 8)
    # without a model (or with violations) there is no plan
    no_model = _cli("--config", '{"sparse_decode": {}}', "--deployment", dep, "--json")
    assert json.loads(no_model.stdout)["hot_buffer"] is None
    bad = _cli(
        *("--config", '{"sparse_decode": {}}', "--deployment", json.dumps({"device": "cpu", "index_topk": 64})),
        *("--model", "deepseek-v3.2", "--requests", "0", "--json"),
    )
    out = json.loads(bad.stdout)
    assert bad.returncode == 1 and out["hot_buffer"] is None
    assert {v["rule"] for v in out["violations"]} == {"check_config.model", "check_config.count"}


def test_every_config_field_documents_itself_and_its_limits_are_checked():
    """Declarative config (``config_fields.py``): every field of every section has its own
    docstring, and each field's :class:`Limits` refuses a value outside them at parsing with
    the field, the value and the constraint (negative control: an allowed value passes)."""
    import dataclasses as dc

    from sglang_ascend_offload import config as cfg
    from sglang_ascend_offload.config_fields import field_docs

    for section in (
        cfg.SparseDecodeOffloadConfig,
        cfg.LayerwisePrefillOffloadConfig,
        cfg.MemcacheConfig,
        cfg.PDTransferConfig,
        cfg.KVPPConfig,
        cfg.OffloadConfig,
        cfg.Deployment,
    ):
        docs = field_docs(section)
        missing = [f.name for f in dc.fields(section) if not docs.get(f.name)]
        assert missing == [], (section.__name__, missing)
        for f in dc.fields(section):
            limits = f.metadata.get("limits")
            if limits is None or limits.ge is None:
                continue
            bad = limits.ge - 1
            assert f"{f.name}={bad} is out of range: it must be {limits.describe()}" in "\n".join(
                section(**{f.name: bad})._check()
            ), (section.__name__, f.name)
            assert not any(m.startswith(f"{f.name}=") for m in section(**{f.name: limits.ge})._check())
