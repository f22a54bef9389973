"""The server's startup verdict on the fused-operator plan (``sparse_decode/op_selection.py``),
and the sparse decode pool's host rows where the fused Copy-SFA registers them.

This machine has no AscendC extension and no torch_npu: with ``device="npu"`` in the
server arguments it is an NPU node without the build.
"""

from __future__ import annotations

import pytest
import torch
from startup_verdict import dsa_hf_config, server_verdict

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.ops import fused
from sglang_ascend_offload.rules import RULES
from sglang_ascend_offload.sglang_plugin.args import resolution
from sglang_ascend_offload.sparse_decode import op_selection
from sglang_ascend_offload.testing.sglang_args import server_args_stub

NPU = dict(attention_backend="ascend_offload", disable_cuda_graph=True, device="npu", page_size=128)
BUILD = "ascendc_ops/build.sh --install"


def _verdict(soc="Ascend910_9391", top_k=2048, **sd):
    """The startup verdict on an NPU node serving a model with DeepSeek-V3.2's top-k (the
    fused kernels take it; the tiny fixture's 16 they do not, see the last test)."""
    return server_verdict(
        cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(**sd)),
        hf_config=dsa_hf_config(index_topk=top_k),
        soc=soc,
        **NPU,
    )


def test_npu_defaults_need_the_extension_and_the_error_names_every_missing_op():
    found = [v for v in _verdict() if v.rule == "sglang.fused_unavailable"]
    assert len(found) == 1, found  # one violation listing every missing op
    text = found[0].problem + " -> " + found[0].fix
    assert fused.COPY_SFA_KERNEL in text and fused.REGISTER_HOST_KERNEL in text and BUILD in text
    assert "the default on an Ascend NPU" in text
    # the served backend calls the fused LIM: the NPU default needs it too
    assert fused.LIM_KERNEL in text
    int8 = [v for v in _verdict(indexer_dtype="int8") if v.rule == "sglang.fused_unavailable"]
    assert int8 and fused.LIM_C8_KERNEL in int8[0].problem


def test_npu_opt_outs_and_explicit_requests():
    # opting out of one stage leaves the other's default: still fused, still needs the build
    copy_off = [v for v in _verdict(fused_copy_sfa=False) if v.rule == "sglang.fused_unavailable"]
    assert copy_off and fused.LIM_KERNEL in copy_off[0].problem and fused.COPY_SFA_KERNEL not in copy_off[0].problem
    assert "sglang.fused_unavailable" not in [v.rule for v in _verdict(fused_copy_sfa=False, fused_lim=False)]
    assert "sglang.fused_unavailable" not in [v.rule for v in _verdict(ops="npu")]
    explicit = [v for v in _verdict(fused_copy_sfa=True) if v.rule == "sglang.fused_unavailable"]
    assert explicit and "fused_copy_sfa=true cannot run" in explicit[0].problem
    assert "sglang.fused_not_wired" not in [v.rule for v in _verdict(ops="fused")]
    assert "sglang.fused_not_wired" not in [v.rule for v in _verdict(fused_lim=True)]  # served: lru, no verify rows
    # fused_lim=true where the fused LIM cannot serve is refused once, by the deployment rule check-config shares
    score = _verdict(fused_lim=True, policy="score_rank", rank_depth=256)
    assert [v.rule for v in score].count("sglang.fused_not_wired") == 1
    assert "exact LRU" in next(v.problem for v in score if v.rule == "sglang.fused_not_wired")


def test_verify_rows_serve_fused_up_to_14_per_request_and_more_are_refused_at_startup():
    sd = cfg.SparseDecodeOffloadConfig(fused_copy_sfa=True)
    two = server_args_stub(
        **NPU, speculative_algorithm="NEXTN", speculative_num_draft_tokens=2, speculative_num_steps=1
    )
    rules = [v.rule for v in resolution.plugin_violations(cfg.OffloadConfig(sparse_decode=sd), two)]
    assert "sparse_decode.fused_copy_sfa_engine" not in rules  # a request's 2 verify rows share its row, fused
    assert "sglang.fused_unavailable" in rules  # ... which needs the extension this machine lacks
    many = server_args_stub(
        **NPU, speculative_algorithm="NEXTN", speculative_num_draft_tokens=15, speculative_num_steps=14
    )
    found = [
        v
        for v in resolution.plugin_violations(cfg.OffloadConfig(sparse_decode=sd), many)
        if v.rule == "sparse_decode.fused_copy_sfa_engine"
    ]
    assert found and "at most 14" in found[0].problem
    assert RULES["sparse_decode.fused_copy_sfa_engine"].scope == "server"
    default = cfg.SparseDecodeOffloadConfig()  # the default gives way to 15 verify rows: nothing fused to build
    assert [
        v.rule
        for v in resolution.plugin_violations(cfg.OffloadConfig(sparse_decode=default), many)
        if v.rule.startswith(("sglang.fused", "sparse_decode.fused"))
    ] == []


def test_cpu_defaults_are_never_fused():
    cpu = dict(NPU, device="cpu", page_size=64)
    plain = cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig())
    assert server_verdict(plain, **cpu) == []


# ------------------------------------------------------------------ host pool rows
@pytest.fixture
def ctx():
    from dsa_harness import published_context

    with published_context():
        yield


PAGE, SLOTS = 16, 8 * 16  # SGLang's slot space: 9 pages of 16 = 144 rows, not a multiple of 32


def _host_pool(sd, monkeypatch, platform_kind):
    from dsa_harness import INDEX_DIM, LATENT, ROPE, TOPK, hot_plan_for

    from sglang_ascend_offload.sglang_plugin.mem_cache.pool import sparse_decode as pool_mod

    monkeypatch.setattr(pool_mod, "platform_of", lambda device: platform_kind)  # the pool's view of the platform
    common = dict(
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        index_head_dim=INDEX_DIM,
    )
    plan = hot_plan_for(common, sd, top_k=TOPK, req_slots=4)
    return pool_mod.HostMainKVPool(SLOTS, hot_plan=plan, offload=sd, **common), (LATENT + ROPE) * 2


@pytest.mark.usefixtures("plugins_loaded", "ctx")
def test_the_pool_rounds_its_rows_per_layer_where_the_npu_fused_copy_sfa_registers_them(monkeypatch):
    from dsa_harness import TOPK

    sd = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK)
    slots = (SLOTS // PAGE + 1) * PAGE
    pool, row_bytes = _host_pool(sd, monkeypatch, "npu")
    rows = pool.host_pool.shape.tokens
    assert rows == op_selection.fused_host_pool_rows(slots, row_bytes) and rows > slots
    assert rows * row_bytes % op_selection.HOST_ALIGN_BYTES == 0  # every layer slice 4 KiB-aligned
    assert _host_pool(sd, monkeypatch, "cpu")[0].host_pool.shape.tokens == slots
    off = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK, fused_copy_sfa=False)
    assert _host_pool(off, monkeypatch, "npu")[0].host_pool.shape.tokens == slots


def test_a_top_k_the_kernels_do_not_take_is_refused_when_asked_for_and_a_default_gives_way():
    explicit = [v for v in _verdict(top_k=16, fused_lim=True) if v.rule == "sglang.fused_not_wired"]
    assert len(explicit) == 1 and "top-k 16 is not a multiple of 32" in explicit[0].problem
    assert "sglang.fused_not_wired" not in [v.rule for v in _verdict(top_k=16)]  # the default gives way
