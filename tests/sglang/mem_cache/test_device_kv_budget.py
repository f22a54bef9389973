"""``--device-kv-budget`` (``sglang_plugin/mem_cache/sizing/device_kv_budget.py``): the flag, the cap on
SGLang's profiled KV budget, and a CPU server's per-token device bytes when it accounts
like a device. The served effect (``max_total_num_tokens`` of both servers at one
budget) is checked by the capacity benchmark's served test (``test_bench_capacity.py``)."""

from __future__ import annotations

import argparse
import types

import pytest

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.memory_budget import parse_size
from sglang_ascend_offload.sglang_plugin import compat
from sglang_ascend_offload.sglang_plugin.args import carrier, flags
from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import device_kv_budget
from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import sparse_decode as offload_sizing

MiB = 2**20


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1048576", MiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * 2**29),
        ("64M", 64 * MiB),
        ("2 KiB", 2048),
        ("3g", 3 * 2**30),
    ],
)
def test_sizes_in_bytes_or_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-5MiB", "5 MB MB", "", "1e9"])
def test_a_size_that_is_not_one_says_the_accepted_forms(text):
    with pytest.raises(ValueError, match="512MiB"):
        parse_size(text)


def _namespace(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flag_reaches_the_typed_config():
    raw = flags.take_from_namespace(_namespace("--device-kv-budget", "6MiB"))
    assert raw.any_given  # the budget alone is a reason to validate and publish
    config, problems = flags.parse(raw)
    assert problems == [] and config.device_kv_budget_bytes == 6 * MiB and config.sparse_decode is None
    back = cfg.parse_config(cfg.to_json(config))  # what spawned processes read
    assert back.device_kv_budget_bytes == 6 * MiB


@pytest.mark.parametrize("value", ["plenty", "0"])
def test_a_bad_budget_is_listed_with_the_other_problems(value):
    raw = flags.take_from_namespace(_namespace("--device-kv-budget", value, "--sparse-decode-offload-config", "{}"))
    config, problems = flags.parse(raw)
    assert sorted(p.rule for p in problems) == ["flags.config_without_enable", "flags.device_kv_budget"]
    assert config.device_kv_budget_bytes is None
    assert any("--device-kv-budget" in p.problem for p in problems)


def test_a_non_positive_budget_in_json_is_a_range_problem():
    with pytest.raises(cfg.ConfigError, match="device_kv_budget_bytes=-1"):
        cfg.parse_config('{"device_kv_budget_bytes": -1}')


@pytest.fixture
def published(monkeypatch):
    """Publish an OffloadConfig for this process (as the launcher does) and forget it after."""

    def publish(config: cfg.OffloadConfig) -> None:
        monkeypatch.setenv(carrier.CONFIG_ENV, cfg.to_json(config))

    yield publish
    monkeypatch.delenv(carrier.CONFIG_ENV, raising=False)


def test_the_budget_caps_what_sglang_profiled(published):
    assert device_kv_budget.profile_after(10 * 2**30, object(), 0) is None  # no budget: SGLang's figure
    published(cfg.OffloadConfig(device_kv_budget_bytes=6 * MiB))
    assert device_kv_budget.profile_after(10 * 2**30, object(), 0) == 6 * MiB
    assert device_kv_budget.profile_after(5 * MiB, object(), 0) is None  # already below: SGLang's stands


def _kvc(device="cpu", index_head_dim=128):
    hf = types.SimpleNamespace(index_topk=16)
    if index_head_dim is not None:
        hf.index_head_dim = index_head_dim
    return types.SimpleNamespace(
        device=device, model_config=types.SimpleNamespace(hf_config=hf, kv_lora_rank=512, qk_rope_head_dim=64)
    )


def test_device_bytes_per_token_of_the_plugin_pools():
    kvc = _kvc()
    # tiny fixture: 2 layers, latent 512 + rope 64 and index K 128, all bf16
    assert device_kv_budget.cpu_cell_bytes(kvc, 2, offloaded=False) == 2 * ((512 + 64) * 2 + 128 * 2) == 2816
    assert device_kv_budget.cpu_cell_bytes(kvc, 2, offloaded=True) == 2 * 128 * 2 == 512
    assert device_kv_budget.cpu_cell_bytes(_kvc(index_head_dim=None), 2, offloaded=False) is None


def test_a_cpu_server_with_a_budget_accounts_like_a_device(published, monkeypatch):
    served = {"sd": None}
    monkeypatch.setattr(offload_sizing, "_served", lambda kvc: served["sd"])
    monkeypatch.setattr(carrier, "serves_plugin_pool", lambda kvc: True)
    configurator = types.SimpleNamespace(_compute_dsa_indexer_cell_size=lambda kvc, num_layers: 132 * num_layers)
    cpu, npu = _kvc("cpu"), _kvc("npu")
    sglang_cell = 2568
    assert offload_sizing.cell_size_after(sglang_cell, configurator, cpu, 2) is None  # no budget: SGLang's

    published(cfg.OffloadConfig(device_kv_budget_bytes=6 * MiB))
    assert offload_sizing.cell_size_after(sglang_cell, configurator, cpu, 2) == 2816  # device KV, no offload
    served["sd"] = cfg.SparseDecodeOffloadConfig()
    published(cfg.OffloadConfig(sparse_decode=served["sd"], device_kv_budget_bytes=6 * MiB))
    assert offload_sizing.cell_size_after(sglang_cell, configurator, cpu, 2) == 512  # the host pool is outside
    # an NPU is a device already: its offload cell is SGLang's indexer cell, budget or not
    assert offload_sizing.cell_size_after(sglang_cell, configurator, npu, 2) == 264
    # the layerwise pool sizes itself: not this hook's
    published(cfg.OffloadConfig(layerwise_prefill=cfg.LayerwisePrefillOffloadConfig(), device_kv_budget_bytes=MiB))
    served["sd"] = None
    assert offload_sizing.cell_size_after(sglang_cell, configurator, cpu, 2) is None


def test_the_profile_target_is_in_the_compat_table():
    assert compat.TARGET_PROFILE_BYTES.endswith("KVCacheConfigurator._profile_available_bytes")
    assert any(h.path == compat.TARGET_PROFILE_BYTES for h in compat.HOOKED)
    assert not [p for p in compat.problems() if "_profile_available_bytes" in p]
