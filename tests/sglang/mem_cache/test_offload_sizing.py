"""One device budget for sparse decode offload (``sglang_plugin/mem_cache/sizing/sparse_decode.py``).

* the split itself (:func:`plan_device_budget`): the token pool's reservation first, then
  as many requests' hot buffers as fit, capped to what SGLang would run; not even one
  request is a ``ConfigError`` with the numbers;
* the resolution hook on a stand-in of SGLang's KV cache configurator (the four steps
  SGLang runs, with the budget split in the middle): the token pool is sized from the
  budget less the hot buffers, ``max_running_requests`` is capped and the cap logged;
* the device cell off the CPU is SGLang's indexer cell, on the CPU SGLang's own;
* served: a hot buffer so large that one request cannot fit SGLang's budget stops the
  server at pool sizing with that error (cheap: nothing is allocated).

The capped served case (the README's ``hot_tokens: 4096`` at SGLang's default
concurrency on the tiny fixture) fills the whole budget with hot buffers, ~9 GiB here:
measured by hand (docs/sglang_integration.md, "One device budget"), not run in the suite.
"""

from __future__ import annotations

import json
import logging
import types

import pytest

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.memory_budget import format_bytes
from sglang_ascend_offload.sglang_plugin import compat
from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import sparse_decode as offload_sizing
from sglang_ascend_offload.sglang_plugin.mem_cache.sizing.sparse_decode import plan_device_budget
from sglang_ascend_offload.sglang_plugin.speculative import eagle as speculative
from sglang_ascend_offload.sparse_decode.sizing import HotBufferPlan
from sglang_ascend_offload.testing.servers import ServerProcess

MiB = 2**20


def hot_plan(requests: int = 1, hot_tokens: int = 4096, layers: int = 2, pre_alloc: int = 0) -> HotBufferPlan:
    """The tiny fixture's hot-buffer plan (2 layers, 576-element rows, top-k 16)."""
    return HotBufferPlan(
        layers=layers,
        row_dim=576,
        top_k=16,
        hot_tokens=hot_tokens,
        verify_rows=1,
        running_requests=requests,
        pre_alloc_slots=pre_alloc,
    )


# ------------------------------------------------------------------ the split
def test_everything_fits_nothing_is_capped():
    h = hot_plan().device_bytes_per_row
    plan = plan_device_budget(100 * h, hot_plan(4), reserved_token_bytes=10 * h)
    assert not plan.capped and plan.max_running_requests == 4
    assert plan.hot.device_bytes == (4 + 2) * h and plan.token_budget_bytes == 94 * h


def test_too_many_requests_are_capped_to_the_hot_buffers_that_fit():
    h = hot_plan().device_bytes_per_row
    plan = plan_device_budget(100 * h, hot_plan(2048), reserved_token_bytes=10 * h)
    # (100 - 10) hot rows fit, 2 of them SGLang's padding slot and the engine's sink row
    assert plan.capped and plan.max_running_requests == 88 and plan.requested_requests == 2048
    assert plan.hot.device_bytes == 90 * h and plan.token_budget_bytes == 10 * h
    assert plan.token_budget_bytes >= plan.reserved_token_bytes


def test_a_pd_decodes_pre_allocation_slots_are_fixed_rows():
    h = hot_plan().device_bytes_per_row
    plan = plan_device_budget(100 * h, hot_plan(2048, pre_alloc=8), reserved_token_bytes=10 * h)
    assert plan.max_running_requests == 90 - (8 + 2) and plan.hot.device_bytes == 90 * h


@pytest.mark.parametrize(
    "budget_rows,hot_tokens,reserved_rows",
    [(10, 64, 0), (64, 4096, 30), (3, 7, 1), (4000, 128, 1000), (7, 64, 2)],
)
def test_plan_invariants(budget_rows, hot_tokens, reserved_rows):
    h = hot_plan(hot_tokens=hot_tokens).device_bytes_per_row
    budget, reserved = budget_rows * h + h // 3, reserved_rows * h
    for requested in (1, 2, 7, 2048):
        try:
            plan = plan_device_budget(budget, hot_plan(requested, hot_tokens), reserved)
        except cfg.ConfigError:
            assert (budget - min(reserved, budget)) // h - 2 < 1
            continue
        assert 1 <= plan.max_running_requests <= requested
        assert plan.hot.device_bytes + plan.token_budget_bytes == budget
        assert plan.token_budget_bytes >= min(reserved, budget)
        # one more request would not have fit, unless none was cut
        assert plan.max_running_requests == requested or plan.hot.device_bytes + h > budget - min(reserved, budget)


def test_not_even_one_request_is_refused_with_the_numbers():
    h = hot_plan().device_bytes_per_row
    with pytest.raises(cfg.ConfigError) as info:
        plan_device_budget(3 * h + h // 2, hot_plan(4), reserved_token_bytes=h)
    (v,) = info.value.violations
    assert v.rule == "memory.device_budget" and "not even one request" in v.problem
    assert f"one request needs {format_bytes(3 * h)} (3 hot rows (1 request + 1 padding slot + 1 sink row)" in (
        v.problem
    )
    assert "hot_tokens" in v.fix and "--mem-fraction-static" in v.fix


# ------------------------------------------------------------------ the resolution hook
class _StandInConfigurator:
    """What the hook uses of SGLang's KVCacheConfigurator: the profile, the token pool
    from a budget (``budget // cell``, capped by ``--max-total-tokens``) and SGLang's
    request count for a token pool (the user's value, at most tokens // 2)."""

    def __init__(self, budget, cell, max_total_tokens=None, max_running_requests=None, context_len=2048):
        self.budget, self.cell = budget, cell
        self.max_total_tokens, self.max_running_requests = max_total_tokens, max_running_requests
        self.model_config = types.SimpleNamespace(
            hf_config=types.SimpleNamespace(index_topk=16),
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            context_len=context_len,
        )
        self.layer_info = types.SimpleNamespace(start_layer=0, end_layer=2, num_effective_layers=2)
        self.device = "cpu"
        self.budgets_sized = []

    def _profile_available_bytes(self, pre_model_load_memory):
        return self.budget

    def config_from_budget(self, budget_bytes):
        self.budgets_sized.append(budget_bytes)
        tokens = budget_bytes // self.cell
        if self.max_total_tokens:
            tokens = min(tokens, self.max_total_tokens)
        return types.SimpleNamespace(max_total_num_tokens=tokens, max_running_requests=None)

    def resolve_max_num_reqs(self, token_capacity):
        want = self.max_running_requests or 2048
        return min(want, token_capacity // 2)


@pytest.fixture
def sizing_env(monkeypatch):
    """The hook's SGLang lookups, pointed at stand-ins: served config, speculative rows,
    schedule, P/D role, the pool configurator (cell size + finalize)."""
    import sglang.srt.model_executor.pool_configurator as pool_configurator
    import sglang.srt.runtime_context as runtime_context

    state = types.SimpleNamespace(sd=cfg.SparseDecodeOffloadConfig(hot_tokens=4096), kvc=None)
    monkeypatch.setattr(offload_sizing, "_served", lambda kvc: state.sd)
    monkeypatch.setattr(speculative, "verify_rows_per_request", lambda: 1)  # no speculative decoding
    monkeypatch.setattr(
        runtime_context,
        "get_schedule",
        lambda: types.SimpleNamespace(
            max_total_tokens=state.kvc.max_total_tokens, mem_fraction_static=0.5, page_size=64
        ),
    )
    monkeypatch.setattr(
        runtime_context,
        "get_disagg",
        lambda: types.SimpleNamespace(disaggregation_mode="null", disaggregation_decode_extra_slots=0),
    )
    monkeypatch.setattr(
        pool_configurator,
        "create_memory_pool_configurator",
        lambda kvc: types.SimpleNamespace(
            _cell_size=kvc.cell, finalize_with_max_running_requests=lambda config: config
        ),
    )
    return state


def _original_must_not_run(self, pre):
    raise AssertionError("SGLang's resolution ran although the plugin's pool is served")


def test_hook_caps_requests_and_sizes_tokens_from_the_rest(sizing_env, caplog):
    h = hot_plan().device_bytes_per_row  # 9 MiB: the README's hot_tokens 4096 on the tiny fixture
    kvc = sizing_env.kvc = _StandInConfigurator(budget=200 * h, cell=2568, max_total_tokens=4096)
    with caplog.at_level(logging.INFO, logger=offload_sizing.__name__):
        config = offload_sizing.resolve_pool_config_around(_original_must_not_run, kvc, 0)
    reserved = 4096 * 2568  # the user's --max-total-tokens come first
    fitting = (200 * h - reserved) // h - 2
    assert config.max_running_requests == fitting < 2048
    assert config.max_total_num_tokens == 4096 and config.mem_fraction_static == 0.5
    assert kvc.budgets_sized[-1] == 200 * h - (fitting + 2) * h  # the token pool's budget: B less the hot buffers
    text = caplog.text
    assert f"max_running_requests capped from 2048 to {fitting}" in text and "device KV budget" in text


def test_hook_leaves_a_fitting_server_alone_but_sizes_tokens_from_the_rest(sizing_env, caplog):
    h = hot_plan().device_bytes_per_row
    kvc = sizing_env.kvc = _StandInConfigurator(budget=200 * h, cell=2568, max_running_requests=4)
    with caplog.at_level(logging.INFO, logger=offload_sizing.__name__):
        config = offload_sizing.resolve_pool_config_around(_original_must_not_run, kvc, 0)
    assert config.max_running_requests == 4 and "capped" not in caplog.text
    assert config.max_total_num_tokens == (200 * h - 6 * h) // 2568  # no user cap: the rest is tokens


def test_hook_passes_through_when_the_offload_pool_is_not_served(sizing_env):
    sizing_env.sd = None
    sentinel = object()
    assert offload_sizing.resolve_pool_config_around(lambda self, pre: sentinel, object(), 0) is sentinel


def test_hook_refuses_when_one_request_cannot_fit(sizing_env):
    h = hot_plan().device_bytes_per_row
    kvc = sizing_env.kvc = _StandInConfigurator(budget=3 * h, cell=2568, max_total_tokens=4096)
    with pytest.raises(cfg.ConfigError, match="not even one request"):
        offload_sizing.resolve_pool_config_around(_original_must_not_run, kvc, 0)


def test_device_cell_is_the_indexer_off_the_cpu(monkeypatch):
    monkeypatch.setattr(offload_sizing, "_served", lambda kvc: cfg.SparseDecodeOffloadConfig())
    configurator = types.SimpleNamespace(_compute_dsa_indexer_cell_size=lambda kvc, num_layers: 132 * num_layers)
    npu = types.SimpleNamespace(device="npu")
    assert offload_sizing.cell_size_after(1284 * 61, configurator, npu, 61) == 132 * 61
    cpu = types.SimpleNamespace(device="cpu")  # host pool and device share the memory: SGLang's cell
    assert offload_sizing.cell_size_after(1284 * 61, configurator, cpu, 61) is None
    monkeypatch.setattr(offload_sizing, "_served", lambda kvc: None)
    assert offload_sizing.cell_size_after(1284 * 61, configurator, npu, 61) is None


def test_compat_notices_when_sglang_resolves_its_pool_differently(monkeypatch):
    assert not [p for p in compat.problems() if "_resolve_memory_pool_config" in p]
    monkeypatch.setattr(
        compat,
        "RESOLVE_POOL_CONFIG_CALLS",
        (
            "config_from_budget",
            "_profile_available_bytes",
            "resolve_max_num_reqs",
            "create_memory_pool_configurator",
            "finalize_with_max_running_requests",
        ),
    )
    found = [p for p in compat.problems() if "_resolve_memory_pool_config" in p]
    assert found and "reproduces those steps" in found[0]


# ------------------------------------------------------------------ served
def _total_memory_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024


@pytest.mark.slow
def test_server_refuses_hot_buffers_that_leave_no_room_for_one_request(tmp_path):
    """4.7 GiB of hot buffers per hot row (2 layers x 2,170,048 slots x 1,164 B with the
    residency table): the startup check passes (one request's row + padding slot + sink
    row: 14.1 GiB of this machine's memory), but SGLang's KV budget at
    --mem-fraction-static 0.5 (about half the free memory) holds fewer than those three
    rows, so the server stops at pool sizing."""
    if _total_memory_bytes() > 30 * 2**30:
        pytest.skip("sized for a 24 GiB machine: with more than 30 GiB SGLang's budget would hold one request")
    hot = 2_170_048  # a multiple of the page size (64)
    server = ServerProcess(
        [
            "--max-running-requests",
            "2",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps({"hot_tokens": hot}),
        ],
        log_path=tmp_path / "server.log",
        startup_timeout_s=300,
    )
    with pytest.raises(RuntimeError):
        server.start()
    server.stop()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "memory.device_budget" in log and "not even one request" in log, log[-3000:]
    one = hot_plan(1, hot_tokens=hot)
    assert f"one request needs {format_bytes(one.device_bytes)} (3 hot rows" in log, log[-3000:]
    assert f"x {format_bytes(one.device_bytes_per_row)} of hot buffers and residency tables per row" in log
    assert "sparse decode offload: host pool" not in log  # refused before any pool was allocated
