"""Launches that would fail after the model loaded are refused at startup, with
every problem listed (issue: invalid launches past validation).

In-process resolution (``ServerArgs.resolve_once``, the step the launcher runs
before it spawns anything) covers each rule; one real ``launch_server`` run per
refusal class proves that the refusal happens before any model loads.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import TINY_DSA, run_launcher

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload import memory_budget
from sglang_ascend_offload.sglang_plugin.args import carrier, flags


def raw(sparse=None, layerwise=None):
    enabled = {"sparse_decode": sparse is not None, "layerwise_prefill": layerwise is not None}
    return flags.RawFlags(enabled=enabled, configs={"sparse_decode": sparse, "layerwise_prefill": layerwise})


def _server_args(model=TINY_DSA, **kw):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(model),
        device="cpu",
        load_format="dummy",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        **kw,
    )


def _rules(exc_info):
    return [v.rule for v in exc_info.value.violations]


@pytest.fixture
def no_indexer_model(tmp_path):
    """The tiny DSA fixture with the indexer fields removed (DSA architecture kept)."""
    model = tmp_path / "dsa_without_indexer"
    shutil.copytree(TINY_DSA, model)
    data = json.loads((model / "config.json").read_text())
    for key in ("index_topk", "index_head_dim", "index_n_heads"):
        data.pop(key)
    (model / "config.json").write_text(json.dumps(data))
    return model


# ------------------------------------------------------------------ in-process resolution
def test_speculative_algorithm_other_than_nextn_with_offload_is_refused(plugins_loaded, clean_state):
    """Only the NextN / MTP draft (EAGLE / NEXTN) is served with offload; the chain
    itself is served (tests/sglang/test_speculative_offload.py)."""
    flags.remember(raw(sparse="{}"))
    with pytest.raises(cfg.ConfigError) as info:
        _server_args(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(TINY_DSA),
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
        ).resolve_once()
    assert "sglang.sparse_decode_speculative" in _rules(info)
    assert "'standalone'" in str(info.value)  # the method the deployment facts name
    assert carrier.published_text() is None


def test_dsa_architecture_without_indexer_fields_is_refused(plugins_loaded, clean_state, no_indexer_model):
    flags.remember(raw(sparse="{}"))
    with pytest.raises(cfg.ConfigError) as info:
        _server_args(model=no_indexer_model).resolve_once()
    problem = next(v for v in info.value.violations if v.rule == "sglang.model_config")
    for key in ("index_topk", "index_head_dim", "index_n_heads"):
        assert key in problem.problem


def test_parse_error_does_not_hide_the_other_rules(plugins_loaded, clean_state):
    """One bad value (``policy: "fifo"``) next to rule violations: all are listed."""
    flags.remember(raw(sparse='{"policy": "fifo", "hot_tokens": 40, "ops": "npu", "record_trace_max_steps": 0}'))
    with pytest.raises(cfg.ConfigError) as info:
        _server_args(kv_cache_dtype="fp8_e4m3").resolve_once()
    rules = _rules(info)
    assert {
        "parse.type",
        "parse.range",
        "sparse_decode.hot_tokens_page",
        "sparse_decode.main_kv_dtype",
        "sparse_decode.fused_device",
    } <= set(rules), rules
    text = str(info.value)
    assert "fifo" in text and "record_trace_max_steps=0" in text and ">= 1" in text  # the range is stated
    assert carrier.published_text() is None  # a config that came with problems never runs


def test_startup_checks_one_request_and_leaves_concurrency_to_the_device_budget(
    plugins_loaded, clean_state, monkeypatch
):
    """The README's ``hot_tokens: 4096`` at SGLang's default request count passes the startup
    check: the pool sizing caps the running requests to the hot buffers that fit SGLang's
    KV budget (test_offload_sizing.py). What the startup check refuses is a hot buffer that
    does not fit even for one request: its hot row, SGLang's padding slot and the engine's
    sink row (hot buffers and residency tables), with the numbers."""
    monkeypatch.setattr(memory_budget, "available_bytes", lambda device: {"host": 16 * 2**30, "device": None})
    flags.remember(raw(sparse='{"hot_tokens": 4096}'))
    _server_args(max_total_tokens=4096).resolve_once()
    assert json.loads(carrier.published_text())["sparse_decode"]["hot_tokens"] == 4096
    carrier.clear()
    hot = 4096 * 1024  # 3 rows x 2 layers x 4M slots x (1152 B + 12 B) = 27.3 GiB > 16 GiB
    flags.remember(raw(sparse=json.dumps({"hot_tokens": hot})))
    with pytest.raises(cfg.ConfigError) as info:
        _server_args(max_total_tokens=4096, max_running_requests=4).resolve_once()
    problem = next(v for v in info.value.violations if v.rule == "memory.insufficient")
    assert memory_budget.format_bytes(3 * 2 * (hot * (1152 + 12) + 8)) in problem.problem
    assert "3 hot rows (1 request + 1 padding slot + 1 sink row)" in problem.problem
    assert f"{hot} hot_tokens" in problem.problem and "hot_tokens" in problem.fix


def test_memory_check_sums_each_memory():
    items = [
        memory_budget.Allocation("hot buffers", "device", 6 * 2**30, "f1", "hot_tokens"),
        memory_budget.Allocation("host pool", "host", 5 * 2**30, "f2", "host_pool_tokens"),
    ]
    # NPU: device and host are separate budgets.
    assert memory_budget.check(items, "npu", available={"device": 7 * 2**30, "host": 6 * 2**30}) == []
    low = memory_budget.check(items, "npu", available={"device": 6 * 2**30, "host": 6 * 2**30})
    assert len(low) == 1 and "npu device memory" in low[0].problem and "hot_tokens" in low[0].fix
    # CPU: one memory holds both.
    both = memory_budget.check(items, "cpu", available={"host": 11 * 2**30})
    assert len(both) == 1 and "11.0 GiB" in both[0].problem and "host_pool_tokens" in both[0].fix
    assert memory_budget.check(items, "cpu", available={"host": 13 * 2**30}) == []
    # Unknown availability is not a pass nor a failure: it is checked where it is known (the pool).
    assert memory_budget.check(items, "npu", available={"device": None, "host": None}) == []


def test_defaults_obey_the_rules_and_are_published(plugins_loaded, clean_state):
    """No config: hot_tokens = 2 x top-k (32) rounded up to SGLang's DSA page size (64);
    the same value given explicitly passes the page rule."""
    flags.remember(raw(sparse="{}"))
    _server_args(max_running_requests=4).resolve_once()
    assert json.loads(carrier.published_text())["sparse_decode"]["hot_tokens"] == 64
    carrier.clear()
    flags.remember(raw(sparse='{"hot_tokens": 64}'))
    _server_args(max_running_requests=4).resolve_once()
    carrier.clear()
    flags.remember(raw(sparse='{"hot_tokens": 32}'))
    with pytest.raises(cfg.ConfigError) as info:
        _server_args(max_running_requests=4).resolve_once()
    page = next(v for v in info.value.violations if v.rule == "sparse_decode.hot_tokens_page")
    assert "e.g. 64" in page.fix
    hint = cfg.violations(
        cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(hot_tokens=8)),
        cfg.Deployment(index_topk=16, page_size=64),
    )
    topk_rule = next(v for v in hint if v.rule == "sparse_decode.hot_tokens_topk")
    assert "set hot_tokens >= 64" in topk_rule.fix and "(64 recommended" in topk_rule.fix
    # Every number the hint recommends is itself accepted.
    for value in map(int, re.findall(r"\d+", topk_rule.fix.split("(")[0] + topk_rule.fix.split("(")[1][:6])):
        ok = cfg.violations(
            cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(hot_tokens=value)),
            cfg.Deployment(index_topk=16, page_size=64),
        )
        assert [v.rule for v in ok if v.rule.startswith("sparse_decode.hot_tokens")] == [], value


def test_layerwise_default_store_is_local_on_cpu(plugins_loaded, clean_state):
    flags.remember(raw(layerwise='{"shared_buffers": 1}'))
    _server_args().resolve_once()
    assert json.loads(carrier.published_text())["layerwise_prefill"]["store_backend"] == "local"
    assert cfg.LayerwisePrefillOffloadConfig().effective_store_backend("npu") == "memcache"
    assert cfg.LayerwisePrefillOffloadConfig(store_backend="local").effective_store_backend("npu") == "local"


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "offload.json"
    bad.write_text("{hot_tokens: 64")
    _, problems = flags.parse(raw(sparse=f"@{bad}"))
    assert len(problems) == 1 and str(bad) in problems[0].problem
    # The example in the hint of each flag is a valid value of that flag.
    example = re.search(r"e\.g\. '(.*)'", problems[0].fix).group(1)
    config, again = flags.parse(raw(sparse=example))
    assert again == [] and config.sparse_decode is not None
    with pytest.raises(cfg.ConfigError) as info:
        cfg.parse_config("{sparse_decode: 1}")
    top_example = re.search(r"e\.g\. '(.*)'", info.value.violations[0].fix).group(1)
    assert cfg.parse_config(top_example).sparse_decode is not None


# ------------------------------------------------------------------ the real launcher
@pytest.mark.slow
@pytest.mark.parametrize("case", ["speculative", "no_indexer"])
def test_launcher_refuses_before_any_model_loads(case, no_indexer_model):
    args = ["--enable-sparse-decode-offload", "--max-running-requests", "4"]
    if case == "speculative":
        args += [
            "--speculative-algorithm",
            "STANDALONE",
            "--speculative-draft-model-path",
            str(TINY_DSA),
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ]
        rule = "sglang.sparse_decode_speculative"
    else:
        args += ["--model-path", str(no_indexer_model)]
        rule = "sglang.model_config"
    result = run_launcher(args, timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert rule in out, out[-3000:]
    assert "Load weight" not in out and "load weight" not in out.lower()  # refused before any model loads


def test_pool_checks_the_exact_buffers_before_allocating():
    """At pool construction the request pool's rows are known: buffers that cannot fit
    are refused with the numbers before anything is allocated."""
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import _require_memory
    from sglang_ascend_offload.sparse_decode.sizing import HotBufferPlan

    small = HotBufferPlan(layers=2, row_dim=576, top_k=32, hot_tokens=64, verify_rows=1, running_requests=4)
    _require_memory(small, 4096, device="cpu")  # 1.5 MB: fits
    large = HotBufferPlan(layers=61, row_dim=576, top_k=2048, hot_tokens=4096, verify_rows=1, running_requests=2048)
    with pytest.raises(cfg.ConfigError) as info:
        _require_memory(large, 4096, device="cpu")
    problem = info.value.violations[0]
    assert problem.rule == "memory.insufficient"
    assert "2050 hot rows (2048 requests + 1 padding slot + 1 sink row) x 61 layers x 4096 hot_tokens" in (
        problem.problem
    )
    assert memory_budget.format_bytes(2050 * 61 * (4096 * (1152 + 12) + 8)) in problem.problem
