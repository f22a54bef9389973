"""Every user of the hot-buffer plan counts the bytes the pool allocates.

For each server of a grid (speculative verify rows 1 / 4, a P/D decode with extra request
slots, adaptive residency, the int8 indexer, attention TP 1 / 2, 1 to 6 running requests,
``hot_tokens`` left to its default or set) the device bytes of the hot buffers and their
residency tables, as computed by

* ``launch``: the startup memory check (``args/launch_checks``: the smallest server, one
  request; compared where the grid runs one request),
* ``budget``: the device-budget split (``resolve_pool_config_around``: the bytes it takes
  out of SGLang's budget before the token pool is sized),
* ``check_config``: ``check-config --model-config ... --requests N --json``,
* ``capacity``: the planner's sparse-decode footprint at ``N`` requests,

equal what the real ``HostMainKVPool`` allocates, built by the pool hook's builder over
SGLang's real request pool (``ReqToTokenPool``, or ``DecodeReqToTokenPool`` with its
pre-allocation slots) of the size the budget split left: the engine's hot-buffer tensors
and residency tables, measured (each TP rank's). Stand-ins: SGLang's KV cache
configurator (its budget and token-pool arithmetic) and the served-config lookup.

Negative controls: one user (or the pool) counting one more row fails the comparison,
and names that user.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import types
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
from conftest import TINY_DSA
from dsa_harness import published_context

from sglang_ascend_offload import capacity, config_cli, memory_budget
from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.model_specs import load_hf_config
from sglang_ascend_offload.sglang_plugin.args import launch_checks
from sglang_ascend_offload.sglang_plugin.mem_cache.pool import sparse_decode as pool_mod
from sglang_ascend_offload.sglang_plugin.mem_cache.sizing import sparse_decode as offload_sizing
from sglang_ascend_offload.sparse_decode.hot_buffer import HotBuffers

PAGE = 16
SLOTS = 32 * PAGE  # SGLang's token pool of the stand-in configurator (its own cell arithmetic)
CELL = 4096  # bytes per token of the stand-in's token pool
PD_EXTRA_SLOTS = 3
HF = json.loads((Path(TINY_DSA) / "config.json").read_text())


@dataclasses.dataclass(frozen=True)
class Server:
    verify_rows: int
    pd_decode: bool
    tp: int
    requests: int
    adaptive: bool
    int8: bool
    hot_tokens: Optional[int]

    def __str__(self) -> str:
        return (
            f"verify{self.verify_rows}-{'pd' if self.pd_decode else 'colo'}-tp{self.tp}-req{self.requests}"
            f"{'-adaptive' if self.adaptive else ''}{'-int8' if self.int8 else ''}-hot{self.hot_tokens}"
        )

    @property
    def config(self) -> cfg.OffloadConfig:
        """What the user asks for (the startup rules and ``resolve_defaults`` see this)."""
        return cfg.OffloadConfig(
            sparse_decode=cfg.SparseDecodeOffloadConfig(
                hot_tokens=self.hot_tokens,
                indexer_dtype="int8" if self.int8 else "bf16",
                residency="adaptive" if self.adaptive else "always",
            )
        )

    @property
    def deployment(self) -> cfg.Deployment:
        spec = dict(speculative_method="mtp", speculative_rows=self.verify_rows, speculative_steps=self.verify_rows - 1)
        return cfg.Deployment(
            device="cpu",
            num_layers=HF["num_hidden_layers"],
            index_topk=HF["index_topk"],
            page_size=PAGE,
            tp=self.tp,
            pd_role="decode" if self.pd_decode else "colocated",
            speculative_topk=1 if self.verify_rows > 1 else None,
            **(spec if self.verify_rows > 1 else {}),
        )

    @property
    def extra_slots(self) -> int:
        return PD_EXTRA_SLOTS if self.pd_decode else 0

    def server_args(self) -> dict:
        """SGLang's server arguments of this server (what its runtime context publishes)."""
        kw = dict(page_size=PAGE)
        if self.verify_rows > 1:
            kw.update(
                speculative_algorithm="EAGLE",
                speculative_num_draft_tokens=self.verify_rows,
                speculative_num_steps=self.verify_rows - 1,
                speculative_eagle_topk=1,
            )
        if self.pd_decode:
            kw.update(disaggregation_mode="decode", disaggregation_decode_extra_slots=self.extra_slots)
        return kw


def _grid() -> List[Server]:
    """Every combination of verify rows, P/D role and TP, each at 1, 3 and 6 requests, with
    adaptive residency, the int8 indexer and a set hot_tokens spread over them."""
    out = []
    for k, (verify_rows, pd_decode, tp, requests) in enumerate(
        itertools.product((1, 4), (False, True), (1, 2), (1, 3, 6))
    ):
        hot = None if k % 3 else 2 * verify_rows * HF["index_topk"]  # a multiple of the page, above the least
        int8 = k % 4 >= 2 and not (pd_decode and verify_rows > 1)  # rule sglang.indexer_int8_pd
        out.append(Server(verify_rows, pd_decode, tp, requests, adaptive=k % 2 == 1, int8=int8, hot_tokens=hot))
    return out


GRID = _grid()


# ------------------------------------------------------------------ each user's bytes
def launch_bytes(server: Server, monkeypatch) -> int:
    """The hot-buffer bytes the startup memory check plans (it checks the smallest server)."""
    seen = []
    monkeypatch.setattr(memory_budget, "check", lambda items, device, **kw: seen.append(list(items)) or [])
    view = types.SimpleNamespace(
        disaggregation_mode="decode" if server.pd_decode else "null",
        disaggregation_decode_extra_slots=server.extra_slots if server.pd_decode else 0,
        max_total_tokens=None,
    )
    found = launch_checks.launch_violations(server.config, view, types.SimpleNamespace(**HF), server.deployment)
    assert found == [] and len(seen) == 1
    return next(item.nbytes for item in seen[0] if item.name == "hot buffers")


class _Configurator:
    """SGLang's ``KVCacheConfigurator`` as the budget hook and the pool builder use it: the
    profiled budget, a token pool from a budget (``budget // CELL``), SGLang's request
    count for a token pool (``requests``), the model and its layers."""

    def __init__(self, budget: int, requests: int):
        self.budget, self.requests, self.budgets_sized = budget, requests, []
        self.model_config = types.SimpleNamespace(
            hf_config=types.SimpleNamespace(index_topk=HF["index_topk"], index_head_dim=HF["index_head_dim"]),
            kv_lora_rank=HF["kv_lora_rank"],
            qk_rope_head_dim=HF["qk_rope_head_dim"],
            index_head_dim=HF["index_head_dim"],
            context_len=1024,
        )
        layers = HF["num_hidden_layers"]
        self.layer_info = types.SimpleNamespace(start_layer=0, end_layer=layers, num_effective_layers=layers)
        self.device, self.kv_cache_dtype, self.is_draft_worker = "cpu", torch.bfloat16, False

    def _profile_available_bytes(self, pre_model_load_memory):
        return self.budget

    def config_from_budget(self, budget_bytes):
        self.budgets_sized.append(budget_bytes)
        return types.SimpleNamespace(max_total_num_tokens=min(budget_bytes // CELL, SLOTS), max_running_requests=None)

    def resolve_max_num_reqs(self, token_capacity):
        return self.requests


def budget_split(server: Server, monkeypatch) -> _Configurator:
    """Run the device-budget hook for ``server.requests``; the configurator records what it
    sized the token pool from (the budget less the hot buffers)."""
    import sglang.srt.model_executor.pool_configurator as pool_configurator

    monkeypatch.setattr(offload_sizing, "_served", lambda kvc: server.config.sparse_decode)
    monkeypatch.setattr(
        pool_configurator,
        "create_memory_pool_configurator",
        lambda kvc: types.SimpleNamespace(_cell_size=CELL, finalize_with_max_running_requests=lambda config: config),
    )
    kvc = _Configurator(budget=2**30, requests=server.requests)
    config = offload_sizing.resolve_pool_config_around(None, kvc, 0)
    assert config.max_running_requests == server.requests  # nothing capped: the grid's servers fit
    kvc.max_running_requests = config.max_running_requests
    return kvc


def check_config_bytes(server: Server) -> int:
    parser = argparse.ArgumentParser()
    config_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            *("--config", cfg.to_json(server.config), "--deployment", cfg.to_json(server.deployment), "--json"),
            *("--model-config", str(TINY_DSA), "--requests", str(server.requests)),
            *("--decode-extra-slots", str(server.extra_slots)),
        ]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert config_cli.main(args) == 0, out.getvalue()
    return json.loads(out.getvalue())["hot_buffer"]["device_bytes"]


def capacity_bytes(server: Server) -> int:
    model = load_hf_config(str(TINY_DSA))
    inputs = capacity.CapacityInputs(
        hbm_bytes=64 << 30,
        host_bytes=64 << 30,
        tp=server.tp,
        context=1024,
        page_size=PAGE,
        indexer_dtype="int8" if server.int8 else "bf16",
        hot_tokens=server.hot_tokens,
        rows_per_request=server.verify_rows,
        decode_extra_slots=server.extra_slots,
    )
    capacity.check_inputs(inputs, model)
    fp = capacity.footprints(model, inputs)[0]["sparse-decode"][0]
    return fp.device_fixed + server.requests * fp.device_per_request


def allocated_bytes(pool) -> int:
    """What the pool's engine holds on its device for the hot rows: the hot-buffer tensors
    (with the overflow area, where verify rows may overflow) and every layer's residency
    table (slot_token, slot_stamp, row_req)."""
    engine = pool.engine
    hot = engine.hot.nbytes
    tables = [m.table for m in engine.managers]
    return hot + sum(t.numel() * t.element_size() for tb in tables for t in (tb.slot_token, tb.slot_stamp, tb.row_req))


def _request_pool(server: Server, size: int):
    if server.pd_decode:
        from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

        return DecodeReqToTokenPool(
            size=size, max_context_len=1024, device="cpu", enable_memory_saver=False, pre_alloc_size=server.extra_slots
        )
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(size=size, max_context_len=1024, device="cpu", enable_memory_saver=False)


def pool_bytes(server: Server, kvc: _Configurator, tmp_path, monkeypatch) -> List[int]:
    """Each TP rank's pool, built as the pool hook builds it (``build_offload_pool``) over
    the request pool SGLang sizes from the budget split's request count."""
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp

    made, pools = [], []

    def allocate(shape, kind, **_):  # attention TP ranks of one group share the host pool
        if not made:
            shared = shp.create_pool(shape, group_size=server.tp, directory=tmp_path)
        else:
            shared = shp.attach_pool(shape, made[0].path, made[0].session, rank=len(made))
        made.append(shared)
        return shp.RankPool(shared.pool, shared.order, shared.rank, None, shared)

    monkeypatch.setattr(pool_mod, "allocate_rank_pool", allocate)
    published = cfg.OffloadConfig(
        sparse_decode=launch_checks.resolve_defaults(server.config, server.deployment)[0].sparse_decode
    )
    try:
        for _ in range(server.tp):
            pool = pool_mod.build_offload_pool(
                kvc,
                published.sparse_decode,
                max_total_num_tokens=SLOTS,
                is_dsa_model=True,
                req_to_token_pool=_request_pool(server, kvc.max_running_requests),
            )
            pools.append(allocated_bytes(pool))
    finally:
        for shared in reversed(made):
            shared.pool.close()
    return pools


def measure(server: Server, tmp_path, monkeypatch) -> Dict[str, int]:
    """Every user's hot-buffer bytes for ``server`` and what each TP rank's pool allocates."""
    import sglang.srt.runtime_context as runtime_context

    out: Dict[str, int] = {}
    if server.requests == 1:
        out["launch"] = launch_bytes(server, monkeypatch)
    out["check_config"] = check_config_bytes(server)
    out["capacity"] = capacity_bytes(server)
    with published_context(**server.server_args()):
        assert runtime_context.get_schedule().page_size == PAGE
        kvc = budget_split(server, monkeypatch)
        out["budget"] = kvc.budget - kvc.budgets_sized[-1]
        for rank, nbytes in enumerate(pool_bytes(server, kvc, tmp_path, monkeypatch)):
            out[f"pool_rank{rank}"] = nbytes
    return out


def disagreements(measured: Dict[str, int]) -> List[str]:
    """The users (and TP ranks) whose bytes differ from TP rank 0's pool."""
    pool = measured["pool_rank0"]
    return sorted(name for name, nbytes in measured.items() if nbytes != pool)


# ------------------------------------------------------------------ the checks
@pytest.mark.parametrize("server", GRID, ids=str)
def test_every_user_counts_what_the_pool_allocates(server, tmp_path, monkeypatch):
    measured = measure(server, tmp_path, monkeypatch)
    assert disagreements(measured) == [], measured
    expected_users = {"check_config", "capacity", "budget", "pool_rank0"} | (
        {"launch"} if server.requests == 1 else set()
    )
    assert expected_users | {f"pool_rank{r}" for r in range(server.tp)} == set(measured)
    # by hand: requests + P/D extra slots + padding slot + sink row, each 2 layers x hot_tokens
    # slots of a 1152 B row and 12 B of residency, + 8 B per row and layer, + the overflow
    # area's rows (verify rows x top-k beyond hot_tokens, in 16-row blocks; one for all layers)
    hot_rows = server.requests + server.extra_slots + 2
    hot = server.hot_tokens or -(-2 * HF["index_topk"] // PAGE) * PAGE
    beyond = server.verify_rows * HF["index_topk"] - hot
    overflow = -(-beyond // 16) * 16 if beyond > 0 else 0
    assert measured["pool_rank0"] == hot_rows * (2 * (hot * (1152 + 12) + 8) + overflow * 1152)


def test_the_grid_covers_what_it_claims():
    assert {s.verify_rows for s in GRID} == {1, 4} and {s.tp for s in GRID} == {1, 2}
    assert {s.pd_decode for s in GRID} == {True, False} and {s.requests for s in GRID} == {1, 3, 6}
    assert any(s.adaptive for s in GRID) and any(s.int8 for s in GRID)
    assert {s.hot_tokens is None for s in GRID} == {True, False}
    # verify rows with the default buffer (an overflow area) and with a worst-case one (none)
    assert {s.hot_tokens is None for s in GRID if s.verify_rows == 4} == {True, False}


def _one_more_fixed_row(plan):
    return dataclasses.replace(plan, pre_alloc_slots=plan.pre_alloc_slots + 1)


PLANTED = {
    "launch": (launch_checks, "smallest_hot_plan"),
    "budget": (offload_sizing, "served_hot_plan"),
    "check_config": (config_cli, "hot_buffer_plan"),
}


@pytest.mark.parametrize("user", ["launch", "budget", "check_config", "capacity", "pool"])
def test_one_user_counting_one_more_row_is_caught(user, tmp_path, monkeypatch):
    """Negative control: the same comparison, with one user (or the pool) adding a row."""
    server = Server(4, True, 2, 1, adaptive=False, int8=False, hot_tokens=None)
    if user in PLANTED:
        module, name = PLANTED[user]
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: _one_more_fixed_row(original(*a, **kw)))
    elif user == "capacity":
        original = capacity.CapacityInputs.hot_plan
        monkeypatch.setattr(
            capacity.CapacityInputs, "hot_plan", lambda *a, **kw: _one_more_fixed_row(original(*a, **kw))
        )
    else:  # the engine allocating a row the plan does not have
        original = HotBuffers.__init__
        monkeypatch.setattr(
            HotBuffers, "__init__", lambda self, layers, rows, *a, **kw: original(self, layers, rows + 1, *a, **kw)
        )
    found = disagreements(measure(server, tmp_path, monkeypatch))
    if user == "pool":
        assert found == ["budget", "capacity", "check_config", "launch"]  # rank 1 adds the same row
    else:
        assert found == [user]
