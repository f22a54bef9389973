"""The server's startup verdict on the fused-operator plan (``sparse_decode/op_selection.py``),
and the sparse decode pool's host rows where the fused Copy-SFA registers them.

This machine has no AscendC extension and no torch_npu: with ``device="npu"`` in the
server arguments it is an NPU node without the build.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_launcher
from startup_verdict import dsa_hf_config, server_verdict

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.ops import fused
from sglang_ascend_offload.rules import RULES
from sglang_ascend_offload.sparse_decode import op_selection

NPU = dict(attention_backend="ascend_offload", disable_cuda_graph=True, device="npu", page_size=128)
BUILD = "ascendc_ops/build.sh --install"
TOP_K_2048 = dsa_hf_config(index_topk=2048)  # DeepSeek-V3.2's top-k, which the fused kernels take


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
    def rules(sd, draft_tokens):
        spec = dict(speculative_algorithm="NEXTN", speculative_num_draft_tokens=draft_tokens)
        spec.update(speculative_num_steps=draft_tokens - 1, disable_overlap_schedule=True)
        found = server_verdict(
            cfg.OffloadConfig(sparse_decode=sd), hf_config=dsa_hf_config(index_topk=2048), **NPU, **spec
        )
        return found, [v.rule for v in found]

    sd = cfg.SparseDecodeOffloadConfig(fused_copy_sfa=True)
    _, two = rules(sd, 2)
    assert "sparse_decode.fused_copy_sfa_engine" not in two  # a request's 2 verify rows share its row, fused
    assert "sglang.fused_unavailable" in two  # ... which needs the extension this machine lacks
    many, _ = rules(sd, 15)
    found = [v for v in many if v.rule == "sparse_decode.fused_copy_sfa_engine"]
    assert found and "at most 14" in found[0].problem
    assert RULES["sparse_decode.fused_copy_sfa_engine"].scope == "server"
    # the default gives way to 15 verify rows: nothing fused to build
    _, default = rules(cfg.SparseDecodeOffloadConfig(), 15)
    assert [r for r in default if r.startswith(("sglang.fused", "sparse_decode.fused"))] == []


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
    off = cfg.SparseDecodeOffloadConfig(hot_tokens=2 * TOPK, fused_copy_sfa=False)  # the fused miss copy registers
    assert _host_pool(off, monkeypatch, "npu")[0].host_pool.shape.tokens == rows


def test_a_top_k_the_kernels_do_not_take_is_refused_when_asked_for_and_a_default_gives_way():
    explicit = [v for v in _verdict(top_k=16, fused_lim=True) if v.rule == "sglang.fused_not_wired"]
    assert len(explicit) == 1 and "top-k 16 is not a multiple of 32" in explicit[0].problem
    assert "sglang.fused_not_wired" not in [v.rule for v in _verdict(top_k=16)]  # the default gives way


def test_a_fused_copy_sfa_asked_for_at_a_top_k_it_does_not_take_is_a_launch_refusal():
    """``ops: "fused"`` (or ``fused_copy_sfa: true``) on a top-k-16 model: the launch
    validation plans what the engine would, with the served residency shape, and refuses
    it (the engine would raise ``OpSelectionError`` in the scheduler). The same plan
    without the shape (the launch's plan before) finds nothing: the shape is what decides."""
    for sd in (dict(ops="fused"), dict(fused_copy_sfa=True)):
        found = [v for v in _verdict(top_k=16, **sd) if v.rule == "sparse_decode.fused_copy_sfa_engine"]
        assert len(found) == 1 and "top-k 16 is not a multiple of 128" in found[0].problem, sd
        assert "fused_copy_sfa" in found[0].fix
    cpu = dict(NPU, device="cpu", page_size=64)
    on_cpu = server_verdict(cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(ops="fused")), **cpu)
    assert [v.rule for v in on_cpu] == ["sparse_decode.fused_copy_sfa_engine"]
    no_shape = op_selection.select_for_config(cfg.SparseDecodeOffloadConfig(ops="fused"), "cpu")
    assert "sparse_decode.fused_copy_sfa_engine" not in [p.rule for p in no_shape.problems]  # negative control


@pytest.mark.slow
def test_the_launcher_refuses_fused_ops_at_top_k_16_before_any_scheduler_starts():
    """The issue's case: ``{"ops": "fused"}`` on ``tests/fixtures/tiny_dsa`` used to pass the
    launch validation ("validated configuration") and kill the scheduler with an
    ``OpSelectionError``; the launcher now refuses it with the rule id and the fix."""
    args = ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", '{"ops": "fused"}']
    result = run_launcher([*args, "--max-running-requests", "4"], timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "[sparse_decode.fused_copy_sfa_engine]" in out and 'set "fused_copy_sfa": false' in out, out[-3000:]
    assert "validated configuration" not in out and "OpSelectionError" not in out, out[-3000:]
    assert "Load weight" not in out  # no scheduler process started
