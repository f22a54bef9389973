"""Capacity planner: hand-computed bytes, fitting properties, CLI contract, model configs."""

from __future__ import annotations

import json

import pytest

from sglang_ascend_offload import cli
from sglang_ascend_offload.capacity import (
    GIB,
    CapacityInputs,
    check_inputs,
    footprints,
    kvpp_owned_layers,
    physical_layer_buffers,
    plan,
)
from sglang_ascend_offload.config import ConfigError
from sglang_ascend_offload.model_specs import HF_KEYS, PRESETS, load_hf_config, preset, shape_from_hf_dict

DSV32 = PRESETS["deepseek-v3.2"]
CTX = 131072


def inputs(**kw) -> CapacityInputs:
    base = dict(hbm_bytes=64 * GIB, host_bytes=512 * GIB, context=CTX)
    base.update(kw)
    return CapacityInputs(**base)


def by_name(report):
    return {m.name: m for m in report.modes}


# ------------------------------------------------------------------ hand-computed bytes
def test_deepseek_v32_per_token_bytes_by_hand():
    modes = by_name(plan(DSV32, inputs(tp=8)))
    main, idx = 576 * 2, 128 * 2
    assert modes["full-device"].device_bytes_per_token == 61 * (main + idx) == 85888
    assert modes["full-device"].host_bytes_per_token == 0
    assert modes["sparse-decode"].device_bytes_per_token == 61 * idx
    assert modes["sparse-decode"].host_bytes_per_token == 61 * main
    # hot buffer 2 x top-k rows of 1152 B + residency (int32 token + int64 stamp per slot, int64 per row)
    assert modes["sparse-decode"].device_bytes_per_request == 61 * (4096 * main + 4096 * 12 + 8)
    # and the engine's two fixed rows (SGLang's padding slot, the sink row) once
    assert modes["sparse-decode"].device_fixed_bytes == 2 * 61 * (4096 * main + 4096 * 12 + 8)
    assert modes["layerwise-prefill"].device_bytes_per_token == (1 + min(4, 60)) * (main + idx)
    assert modes["layerwise-prefill"].host_bytes_per_token == 61 * (main + idx)
    # KVPP over 8 ranks: rank 0 owns ceil(61 / 8) = 8 layers, + 2 scratch bundles
    assert modes["kvpp"].device_bytes_per_token == (8 + 2) * (main + idx)
    # SGLang's in-tree offload: per slot a top-k device cache and an int32 slot map of
    # (ctx // 8 + 1) * 8 per layer; a host slot of max context per TP rank
    peer = modes["sglang-npu-offload"]
    assert peer.device_bytes_per_token == 61 * idx
    assert peer.device_bytes_per_request == 61 * 2048 * main + 61 * 4 * (CTX // 8 + 1) * 8
    assert peer.host_bytes_per_request == 8 * 61 * CTX * main


def test_deepseek_v32_full_device_requests_by_hand():
    full = by_name(plan(DSV32, inputs()))["full-device"]
    assert full.requests == (64 * GIB) // (CTX * 61 * 1408)  # == 6
    assert full.tokens == (64 * GIB) // (61 * 1408) // 128 * 128
    assert full.limited_by == "hbm"


def test_mtp_and_int8_indexer_change_the_per_token_bytes():
    modes = by_name(plan(DSV32.with_indexer_dtype("int8"), inputs(mtp=True, indexer_dtype="int8", tp=2)))
    assert modes["full-device"].device_bytes_per_token == 62 * (1152 + 128 + 2)
    # sparse decode offloads the 61 target layers; the MTP (draft) layer stays on device: main + indexer
    assert modes["sparse-decode"].device_bytes_per_token == 61 * 130 + 1 * (1152 + 130)
    assert modes["sparse-decode"].host_bytes_per_token == 61 * 1152
    assert "1 MTP layer(s): main KV + indexer on device" in modes["sparse-decode"].description
    # MTP layers are replicated, not partitioned: ceil(61 / 2) = 31 owned + 1 MTP + 2 scratch
    assert modes["kvpp"].device_bytes_per_token == (31 + 1 + 2) * 1282


def test_glm5_presets_have_verified_shapes():
    for name in ("glm-5", "glm-5.1"):
        m = preset(name)
        assert (
            m.num_layers,
            m.kv_lora_rank,
            m.qk_rope_head_dim,
            m.index_head_dim,
            m.index_n_heads,
            m.index_topk,
            m.mtp_layers,
        ) == (78, 512, 64, 128, 32, 2048, 1)
    assert preset("GLM5") is PRESETS["glm-5"]


def test_layer_partition_and_buffer_formulas():
    for layers in (1, 7, 61, 78):
        for group in (1, 2, 3, 8, 16, 100):
            owned = [kvpp_owned_layers(layers, group, r) for r in range(group)]
            assert sum(owned) == layers and max(owned) - min(owned) <= 1 and owned[0] == max(owned)
    assert physical_layer_buffers(61, 1, 4) == 5
    assert physical_layer_buffers(61, 1, 100) == 61  # never more than one buffer per layer
    assert physical_layer_buffers(61, 0, 2) == 2


# ------------------------------------------------------------------ fitting properties
BUDGET_CASES = [
    dict(),
    dict(tp=4, dp=2),
    dict(rows=3),
    dict(hbm_bytes=8 * GIB, context=4096, mtp=True, tp=2),
    dict(host_bytes=16 * GIB, hot_tokens=2048),
    dict(context=1000, page_size=64, pcp=2),
]


@pytest.mark.parametrize("kw", BUDGET_CASES)
def test_requests_fit_and_one_more_does_not(kw):
    inp = inputs(**kw)
    fps, _ = footprints(DSV32, inp)
    report = plan(DSV32, inp)
    req_tokens = inp.paged(inp.context)
    for m in report.modes:
        fp = fps[m.name][0]
        r = m.requests_per_dp_rank

        def fits(n):
            dev = fp.device_fixed + n * (fp.device_per_request + req_tokens * fp.device_per_token)
            host = fp.host_fixed + n * (fp.host_per_request + req_tokens * fp.host_per_token)
            rows_ok = fp.max_requests is None or n <= fp.max_requests
            return dev <= inp.kv_hbm_bytes and host <= inp.host_bytes_per_dp and rows_ok

        assert fits(r), m.name
        assert not fits(r + 1), m.name
        # the token pool left for r requests fits too, and holds their tokens
        t = m.tokens_per_dp_rank
        assert fp.device_fixed + r * fp.device_per_request + t * fp.device_per_token <= inp.kv_hbm_bytes
        assert fp.host_fixed + r * fp.host_per_request + t * fp.host_per_token <= inp.host_bytes_per_dp
        assert t >= r * inp.context
        if fp.slotted:  # per-request slots of exactly `context` tokens (not paged)
            assert t == r * inp.context
        else:
            assert t % inp.page_size == 0
        assert (m.tokens, m.requests) == (t * inp.dp, r * inp.dp)


def test_monotone_in_memory_and_context():
    def caps(**kw):
        return {m.name: (m.tokens, m.requests) for m in plan(DSV32, inputs(tp=8, **kw)).modes}

    for small, big in [
        (dict(hbm_bytes=16 * GIB), dict(hbm_bytes=32 * GIB)),
        (dict(host_bytes=64 * GIB), dict(host_bytes=256 * GIB)),
    ]:
        a, b = caps(**small), caps(**big)
        for name in a:
            assert b[name][0] >= a[name][0] and b[name][1] >= a[name][1], name
    short, long = caps(context=8192), caps(context=65536)
    for name in short:
        assert long[name][1] <= short[name][1], name
    # device-only modes ignore the host
    assert caps(host_bytes=1 * GIB)["full-device"] == caps(host_bytes=1024 * GIB)["full-device"]


def test_monotone_in_knobs():
    def req(mode, **kw):
        return by_name(plan(DSV32, inputs(**kw)))[mode]

    hots = [req("sparse-decode", hot_tokens=h) for h in (2048, 4096, 8192)]
    assert [m.device_bytes_per_request for m in hots] == sorted(m.device_bytes_per_request for m in hots)
    assert hots[0].requests >= hots[1].requests >= hots[2].requests
    layerwise = [req("layerwise-prefill", shared_buffers=b).device_bytes_per_token for b in (1, 2, 8, 64)]
    assert layerwise == sorted(layerwise) and layerwise[-1] == req("full-device").device_bytes_per_token
    kvpp = [req("kvpp", tp=tp).device_bytes_per_token for tp in (2, 4, 8, 16)]
    assert kvpp == sorted(kvpp, reverse=True)
    assert req("kvpp", tp=2, pcp=4).device_bytes_per_token == req("kvpp", tp=8).device_bytes_per_token


def test_limiting_resource_switches():
    sd = "sparse-decode"
    assert by_name(plan(DSV32, inputs()))[sd].limited_by == "hbm"
    tight_host = by_name(plan(DSV32, inputs(host_bytes=20 * GIB)))[sd]
    assert tight_host.limited_by == "host" and tight_host.requests == (20 * GIB) // (CTX * 61 * 1152)
    # fixed rows are requests: a request's verify rows share its row (one hot buffer); the
    # engine's padding slot and sink row come on top
    few = inputs(rows=4, rows_per_request=2)
    few_rows = by_name(plan(DSV32, few))[sd]
    assert few_rows.limited_by == "rows" and few_rows.requests == few.rows
    assert few_rows.device_fixed_bytes == (few.rows + 2) * plan(DSV32, few).hot_buffer.device_bytes_per_request
    # a host pool split over more DP ranks can flip the limit from hbm to host
    assert by_name(plan(DSV32, inputs(dp=8)))[sd].limited_by == "host"
    # the in-tree peer keeps one host slot per TP rank: more TP ranks, host-bound
    assert by_name(plan(DSV32, inputs(tp=1)))["sglang-npu-offload"].limited_by == "hbm"
    assert by_name(plan(DSV32, inputs(tp=8)))["sglang-npu-offload"].limited_by == "host"


def test_offload_beats_full_device_and_kvpp_is_skipped_without_a_group():
    report = plan(DSV32, inputs())
    modes = by_name(report)
    assert "kvpp" not in modes and [s.name for s in report.skipped] == ["kvpp"]
    for name in ("sglang-npu-offload", "sparse-decode", "layerwise-prefill", "sparse-decode+layerwise-prefill"):
        assert modes[name].requests > modes["full-device"].requests, name
    # the colocated combination pays for the prefill buffers on top of sparse decode
    combo, sd = modes["sparse-decode+layerwise-prefill"], modes["sparse-decode"]
    assert combo.device_fixed_bytes == 5 * 1152 * CTX + sd.device_fixed_bytes
    assert combo.tokens < sd.tokens and combo.requests <= sd.requests


# ------------------------------------------------------------------ input checking
def test_check_inputs_lists_every_problem():
    bad = CapacityInputs(
        hbm_bytes=0,
        host_bytes=-1,
        tp=0,
        dp=0,
        context=0,
        hot_tokens=100,
        independent_layers=70,
        indexer_dtype="fp8",
        weights_bytes=-1,
    )
    with pytest.raises(ConfigError) as exc:
        check_inputs(bad, DSV32)
    rules = {v.rule for v in exc.value.violations}
    assert {
        "capacity.hbm",
        "capacity.host",
        "capacity.tp",
        "capacity.dp",
        "capacity.context",
        "capacity.hot_tokens",
        "capacity.independent_layers",
        "capacity.indexer_dtype",
        "capacity.weights",
    } <= rules


def run_cli(capsys, *argv):
    rc = cli.main(["capacity", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_reports_all_problems_at_once(capsys):
    rc, out, err = run_cli(
        capsys, "--hbm-gb", "abc", "--tp", "0", "--context", "1.5", "--hot-tokens", "16", "--weights-gb", "-2"
    )
    assert rc == 2 and out == ""
    for needle in (
        "--hbm-gb 'abc'",
        "--host-gb is missing",
        "tp is 0",
        "--context '1.5'",
        "hot_tokens 16 < top-k 2048",
        "weights take -2",
    ):
        assert needle in err, needle


def test_cli_json_contract(capsys):
    rc, out, _ = run_cli(
        capsys,
        "--model",
        "deepseek-v3.2",
        "--hbm-gb",
        "64",
        "--host-gb",
        "512",
        "--context",
        "128k",
        "--tp",
        "8",
        "--json",
    )
    assert rc == 0
    data = json.loads(out)
    required = {"name", "device_bytes_per_token", "host_bytes_per_token", "tokens", "requests", "limited_by"}
    assert [m["name"] for m in data["modes"]] == [
        "full-device",
        "sglang-npu-offload",
        "sparse-decode",
        "layerwise-prefill",
        "kvpp",
        "sparse-decode+layerwise-prefill",
    ]
    for m in data["modes"]:
        assert required <= set(m)
        assert all(isinstance(m[k], int) for k in required - {"name", "limited_by"})
    assert data["inputs"]["context"] == CTX and data["model"]["num_layers"] == 61
    expected = plan(DSV32, inputs(tp=8))
    assert [(m["tokens"], m["requests"]) for m in data["modes"]] == [(m.tokens, m.requests) for m in expected.modes]


def test_cli_table(capsys):
    rc, out, _ = run_cli(capsys, "--hbm-gb", "64", "--host-gb", "512")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("deepseek-v3.2: 61 layers") and "HBM for KV 64 GiB/device" in lines[0]
    table = lines[2:9]
    assert table[0].split()[:3] == ["mode", "dev", "B/tok"]
    assert len({len(line) for line in table[:2]}) == 1  # header and rule aligned
    full = by_name(plan(DSV32, inputs()))["full-device"]
    assert any(line.startswith("full-device") and f"{full.tokens:,}" in line for line in table)
    assert "skipped kvpp" in out


# ------------------------------------------------------------------ model configs
HF_DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "hidden_size": 7168,
}


def test_model_config_reads_the_hf_keys(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(HF_DSV32))
    for path in (tmp_path / "config.json", tmp_path):
        shape = load_hf_config(str(path))
        for field in (
            "num_layers",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "index_head_dim",
            "index_n_heads",
            "index_topk",
            "mtp_layers",
        ):
            assert getattr(shape, field) == getattr(DSV32, field), field
    nested = shape_from_hf_dict({"text_config": dict(HF_DSV32, num_hidden_layers=3)})
    assert nested.num_layers == 3
    rc, out, _ = run_cli(
        capsys, "--model-config", str(tmp_path / "config.json"), "--hbm-gb", "64", "--host-gb", "512", "--json"
    )
    from_file = json.loads(out)["modes"]
    rc2, out2, _ = run_cli(capsys, "--hbm-gb", "64", "--host-gb", "512", "--json")
    assert rc == rc2 == 0 and from_file == json.loads(out2)["modes"]


def test_model_config_errors_list_every_key(tmp_path, capsys):
    partial = {k: v for k, v in HF_DSV32.items() if k not in ("index_topk", "kv_lora_rank", "index_head_dim")}
    partial["num_hidden_layers"] = "61"
    partial["num_nextn_predict_layers"] = -1
    with pytest.raises(ConfigError) as exc:
        shape_from_hf_dict(partial, name="cfg")
    text = str(exc.value)
    assert "cfg lacks kv_lora_rank, index_head_dim, index_topk" in text
    assert 'num_hidden_layers="61"' in text and "num_nextn_predict_layers=-1" in text
    assert all(key in text for key, _, _ in HF_KEYS)  # the fix names every required key
    (tmp_path / "bad.json").write_text("{not json")
    rc, _, err = run_cli(capsys, "--model-config", str(tmp_path / "bad.json"), "--hbm-gb", "1", "--host-gb", "1")
    assert rc == 2 and "not valid JSON" in err
    rc, _, err = run_cli(
        capsys, "--model-config", str(tmp_path / "none.json"), "--model", "glm-5", "--hbm-gb", "1", "--host-gb", "1"
    )
    assert rc == 2 and "both --model and --model-config" in err


# ------------------------------------------------------------------ agreement with the real allocators
TINY = shape_from_hf_dict(
    dict(
        HF_DSV32,
        num_hidden_layers=3,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        index_head_dim=16,
        index_topk=4,
        num_nextn_predict_layers=1,
    ),
    name="tiny",
)


def test_sparse_decode_row_bytes_match_hot_buffers_and_residency_tables():
    torch = pytest.importorskip("torch")
    from sglang_ascend_offload.ops.contract import ResidencyTable
    from sglang_ascend_offload.sparse_decode.hot_buffer import HotBuffers

    layers = TINY.num_layers  # hot buffers of the target layers only (MTP KV stays on device)

    def hot_bytes(rows, slots, overflow=0):
        return HotBuffers(
            layers=layers,
            rows=rows,
            hot_tokens=slots,
            row_dim=TINY.main_kv_dim,
            dtype=torch.bfloat16,
            overflow_slots=overflow,
        ).nbytes

    def table_bytes(rows, slots):
        table = ResidencyTable.empty(rows=rows, hot_tokens=slots)
        return sum(t.numel() * t.element_size() for t in (table.slot_token, table.slot_stamp, table.row_req))

    def engine_row(slots, overflow=0):
        """What one more engine row costs (the engine's fixed padding sink row is not per request)."""
        hot = hot_bytes(2, slots, overflow) - hot_bytes(1, slots, overflow)
        return hot + layers * (table_bytes(2, slots) - table_bytes(1, slots))

    for mtp in (False, True):
        inp = CapacityInputs(
            hbm_bytes=GIB, host_bytes=GIB, context=64, page_size=16, hot_tokens=8, mtp=mtp, rows_per_request=1
        )
        assert by_name(plan(TINY, inp))["sparse-decode"].device_bytes_per_request == engine_row(8)
    # With MTP a request decodes 1 + MTP-layers verify rows by default (here 2); they share one
    # engine row of hot_tokens slots, by default 2 x top-k rounded up to the page (16), and the
    # overflow area's rows for the union beyond it (rows x top-k - hot_tokens, in 16-row blocks).
    top_k = TINY.index_topk
    for rows_per_request, hot_tokens, slots in ((None, 8, 8), (2, 8, 8), (4, None, 16), (4, 32, 32)):
        inp = CapacityInputs(
            hbm_bytes=GIB,
            host_bytes=GIB,
            context=64,
            page_size=16,
            hot_tokens=hot_tokens,
            mtp=True,
            rows_per_request=rows_per_request,
        )
        assert inp.hot_per_request(TINY) == slots
        beyond = (rows_per_request or 2) * top_k - slots
        overflow = -(-beyond // 16) * 16 if beyond > 0 else 0
        sd = by_name(plan(TINY, inp))["sparse-decode"]
        assert sd.device_bytes_per_request == engine_row(slots, overflow), rows_per_request


def test_layerwise_buffers_match_the_buffer_planner():
    pytest.importorskip("torch")
    from sglang_ascend_offload.layerwise_prefill.planner import TensorSpec, plan_buffers, uniform_specs

    main = [TensorSpec((16, 512), "bfloat16"), TensorSpec((16, 64), "bfloat16")]
    for layers, mtp, shared, indep in [(61, 0, 4, (0,)), (61, 1, 2, (0, 1)), (5, 1, 8, (0,)), (7, 0, 1, ())]:
        bp = plan_buffers(uniform_specs(layers, main, num_mtp_layers=mtp), shared, indep)
        assert physical_layer_buffers(layers + mtp, len(indep), shared) == bp.num_physical


# ------------------------------------------------------------------ speculative verify rows
def _per_row_design(model, inp):
    """Requests of the sparse-decode mode if each verify row had its own engine row and
    hot buffer (``rows_per_request`` buffers of the per-row size per request)."""
    from dataclasses import replace as _replace

    from sglang_ascend_offload.capacity import solve

    one_row = by_name(plan(model, _replace(inp, rows_per_request=1)))["sparse-decode"].device_bytes_per_request
    fp, desc = footprints(model, inp)[0]["sparse-decode"]
    return solve("sparse-decode", desc, _replace(fp, device_per_request=inp.rows_per_req(model) * one_row), inp)


def test_verify_rows_share_one_hot_buffer_per_request():
    m = DSV32.with_indexer_dtype("int8")
    for rows_per_request in (2, 4, 6):
        inp = inputs(mtp=True, indexer_dtype="int8", rows_per_request=rows_per_request)
        report = plan(m, inp)
        hb = report.hot_buffer
        slots = 2 * m.index_topk  # the served default, with or without verify rows
        overflow = max(0, rows_per_request * m.index_topk - slots)  # the union beyond it (one area, all layers)
        assert (hb.rows_per_request, hb.hot_tokens_per_row, hb.hot_tokens_per_request) == (
            rows_per_request,
            2 * m.index_topk,
            slots,
        )
        assert hb.overflow_slots_per_request == overflow
        assert hb.verify_rows_share_buffer and hb.per_row_hot_tokens_per_request == rows_per_request * 2 * m.index_topk
        sd = by_name(report)["sparse-decode"]
        per_request = m.num_layers * (slots * 1152 + slots * 12 + 8) + overflow * 1152
        assert sd.device_bytes_per_request == hb.device_bytes_per_request == per_request
        assert (
            hb.fixed_hot_rows == 2 and sd.device_fixed_bytes == hb.device_fixed_bytes == 2 * sd.device_bytes_per_request
        )
        assert f"{slots} hot rows/layer/request" in sd.description
        old = _per_row_design(m, inp)
        assert sd.requests >= old.requests
    # DeepSeek-V3.2 at MTP-3 (4 verify rows): plain decode's 4,096 slots per request (+ 4,096
    # overflow rows for all layers) instead of 4 x 4,096: as many requests as MTP-1 (issue 50)
    inp = inputs(mtp=True, indexer_dtype="int8", rows_per_request=4)
    new, old = by_name(plan(m, inp))["sparse-decode"], _per_row_design(m, inp)
    peer = by_name(plan(m, inp))["sglang-npu-offload"]
    mtp1 = by_name(plan(m, inputs(mtp=True, indexer_dtype="int8", rows_per_request=2)))["sparse-decode"]
    assert plan(m, inp).hot_buffer.hot_tokens_per_request == 4096
    assert new.requests >= 45 and new.requests == mtp1.requests
    assert new.requests >= 1.5 * old.requests and new.requests >= peer.requests
    # the worst-case sizing (4 x top-k, no overflow) holds fewer: what the default gains
    worst = by_name(plan(m, inputs(mtp=True, indexer_dtype="int8", rows_per_request=4, hot_tokens=8192)))
    assert worst["sparse-decode"].requests < new.requests
    # a larger --hot-tokens is kept; one below top-k is refused, as the server refuses it
    assert inputs(mtp=True, rows_per_request=4, hot_tokens=12288).hot_per_request(m) == 12288
    with pytest.raises(ConfigError) as info:
        plan(m, inputs(mtp=True, rows_per_request=4, hot_tokens=1024))
    (v,) = info.value.violations
    assert v.rule == "capacity.hot_tokens" and "top-k 2048" in v.problem and ">= 2048" in v.fix
    # without speculation nothing changes: one row per request, --hot-tokens slots
    plain = plan(m, inputs(indexer_dtype="int8")).hot_buffer
    assert (plain.rows_per_request, plain.hot_tokens_per_request, plain.verify_rows_share_buffer) == (1, 4096, False)


def test_cli_mtp_reports_the_shared_buffer(capsys):
    argv = [
        "--model",
        "deepseek-v3.2",
        "--hbm-gb",
        "64",
        "--host-gb",
        "512",
        "--context",
        "131072",
        "--indexer-dtype",
        "int8",
        "--mtp",
        "--rows-per-request",
        "4",
    ]
    rc, out, _ = run_cli(capsys, *argv, "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["hot_buffer"] == {
        "rows_per_request": 4,
        "hot_tokens_per_row": 4096,
        "hot_tokens_per_request": 4096,
        "verify_rows_share_buffer": True,
        "per_row_hot_tokens_per_request": 16384,
        "device_bytes_per_request": 61 * (4096 * 1152 + 4096 * 12 + 8) + 4096 * 1152,
        "fixed_hot_rows": 2,
        "device_fixed_bytes": 2 * (61 * (4096 * 1152 + 4096 * 12 + 8) + 4096 * 1152),
        "overflow_slots_per_request": 4096,
    }
    modes = {m_["name"]: m_ for m_ in data["modes"]}
    assert modes["sparse-decode"]["requests"] >= modes["sglang-npu-offload"]["requests"]
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0 and "hot 4096/request (shared by its verify rows)" in out.splitlines()[0]
