"""The AscendC kernels checked on CPU: ``python -m sglang_ascend_offload check-kernels``.

* The command itself (run once per session, in a subprocess, with its compile cache),
  and the functional model on two more random seeds:
  every kernel compiles (vector and cube variant) against the asc-devkit headers, the
  negative control does not, and the functional model of every kernel matches the
  reference compositions (bit-exact copies and indices, attention within tolerance).
* The checks have teeth: the negative control fails with the wrong call reported; a
  kernel copy with a subtle residency mutation (victim tie order), a Copy-SFA
  mutation (gathering the latent part as the rope part) and a miss-copy mutation (a
  batch's rows all to its first slot) fails the functional check;
  the model catches an out-of-bounds GM write; the host tiling refuses a shape outside
  the kernel limits; missing headers are an error that says what to set.

Time on the 2-core machine: 70-130 s from a fresh clone depending on load (4 kernel
compiles + the negative control, two at a time, two model libraries, model runs),
30-60 s with the caches of ``ascendc_ops/build/kernel_check``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_ascend_offload.kernel_check import compile_check, copy_rows, functional
from sglang_ascend_offload.kernel_check import headers as hdr
from sglang_ascend_offload.kernel_check import model as km
from sglang_ascend_offload.ops.contract import ResidencyTable

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"name", "variant", "compiled", "functional_checked", "cases", "bit_exact", "max_abs_err"}
ENTRIES = {
    "sao_lightning_indexer_manage",
    "sao_quant_lightning_indexer_manage",
    "sao_scatter_copy_sparse_flash_attention",
    "sao_copy_miss_rows",
}


@pytest.fixture(scope="session")
def check_kernels():
    """(exit status, JSON document, stderr) of one ``check-kernels --json`` run."""
    env = dict(os.environ)
    env.pop(hdr.ENV_VAR, None)
    env.pop("ASCEND_HOME_PATH", None)
    res = subprocess.run(
        [sys.executable, "-m", "sglang_ascend_offload", "check-kernels", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        pytest.fail(
            f"check-kernels --json did not print one JSON document:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res.returncode, doc, res.stderr


def test_check_kernels_passes_with_the_documented_json(check_kernels):
    rc, doc, err = check_kernels
    assert set(doc) == {"kernels", "headers"}
    assert doc["headers"] == "8.5.0-beta.1"
    rows = doc["kernels"]
    assert {(r["name"], r["variant"]) for r in rows} == {(n, v) for n in ENTRIES for v in ("vec", "cube")}
    for r in rows:
        assert set(r) == KEYS, r
    assert rc == 0, err[-4000:]


def test_every_kernel_compiled_and_functionally_checked(check_kernels):
    _, doc, err = check_kernels
    for r in doc["kernels"]:
        assert r["compiled"] is True, (r, err[-3000:])
        assert r["functional_checked"] is True and r["bit_exact"] is True, (r, err[-3000:])
        assert r["cases"] >= 5, r
        if r["name"] == "sao_scatter_copy_sparse_flash_attention":
            # attention: a real (nonzero, bf16-sized) error, within the stated tolerance
            assert 0.0 < r["max_abs_err"] <= functional.ATTN_ATOL + 0.05, r
        else:
            assert r["max_abs_err"] == 0.0, r  # index outputs only


def test_negative_control_fails_with_the_wrong_call_reported(check_kernels):
    headers = hdr.locate()
    src = compile_check.negative_control_source()
    res = compile_check.compile_one(headers, src, "vec", "negative_control")  # cached by the command's run
    assert not res.ok and res.errors >= 1
    assert "DataCopyPad" in res.log
    # ... while the unmutated unit compiles cleanly
    ok = compile_check.compile_one(headers, compile_check.KERNELS_DIR / compile_check.NEGATIVE_UNIT, "vec", "lim")
    assert ok.ok and ok.errors == 0, ok.log


def test_kernel_headers_do_not_shadow_ascendc_headers(tmp_path):
    headers = hdr.locate()
    assert compile_check.shadowed_headers(headers) == []
    # the defect this caught: kernels/kernel_common.h stood in for the toolkit's own
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "kernel_common.h").write_text("")
    (tmp_path / "kernels" / "sao_kernel_common.h").write_text("")
    clash = compile_check.shadowed_headers(headers, [tmp_path / "kernels"])
    assert len(clash) == 1 and "kernels/kernel_common.h" in clash[0] and "basic_api" in clash[0]


def test_missing_headers_is_an_error_saying_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv(hdr.ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(hdr.HeadersNotFound, match=hdr.ENV_VAR):
        hdr.locate()


def test_toolkit_layout_and_ascend_home_path(tmp_path, monkeypatch):
    tik = tmp_path / "cann" / "compiler" / "tikcpp" / "tikcfw"
    (tik / "impl").mkdir(parents=True)
    (tik / "kernel_operator.h").write_text("")
    monkeypatch.delenv(hdr.ENV_VAR, raising=False)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "cann"))
    found = hdr.locate()
    assert found.layout == "toolkit" and found.source == "$ASCEND_HOME_PATH"
    assert found.include_dirs[0] == tik and tik / "impl" in found.include_dirs
    # a CANN root without the AscendC headers is an error, not a silent fallback to the devkit
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    with pytest.raises(hdr.HeadersNotFound, match="ASCEND_HOME_PATH"):
        hdr.locate()


def _mutated_kernels(tmp: Path) -> Path:
    dst = tmp / "kernels"
    shutil.copytree(compile_check.KERNELS_DIR, dst)
    res_h = dst / "residency_manage.h"
    text = res_h.read_text()
    old = "return sa < sb || (sa == sb && a < b);"
    assert old in text
    res_h.write_text(text.replace(old, "return sa < sb || (sa == sb && a > b);"))  # victim ties by slot reversed
    sfa = dst / "scatter_copy_sparse_flash_attention.cpp"
    text = sfa.read_text()
    old = "AscendC::DataCopyPad(kRope_[j * t_.ropeDim], buf[b * t_.rowDim + t_.latentDim], rope);"
    assert old in text
    sfa.write_text(text.replace(old, "AscendC::DataCopyPad(kRope_[j * t_.ropeDim], buf[b * t_.rowDim], rope);"))
    copy = dst / "copy_miss_rows.cpp"  # each batch's rows all written to its first row's slot
    text = copy.read_text()
    old = "int64_t dst = row * t_.hotTokens + missSlots_.GetValue(list + i0 + b);"
    assert old in text
    copy.write_text(text.replace(old, "int64_t dst = row * t_.hotTokens + missSlots_.GetValue(list + i0);"))
    return dst


def test_functional_check_catches_mutated_kernels(tmp_path):
    m = km.KernelModel(km.build(kernels=_mutated_kernels(tmp_path)))
    lim = functional.check_lim(m, False, steps=2, largest=False)
    assert not lim.ok and not lim.bit_exact
    assert any("slot_token differs" in f or "slots differs" in f for f in lim.failures), lim.failures[:3]
    sfa = functional.check_copy_sfa(m, largest=False)
    assert not sfa.ok and any("attention out of tolerance" in f for f in sfa.failures), sfa.failures[:3]
    miss_copy = copy_rows.check_copy_rows(m)
    assert not miss_copy.ok and not miss_copy.bit_exact
    assert any("rows differ from the spec" in f for f in miss_copy.failures), miss_copy.failures[:3]


def _union_mutated_kernels(tmp: Path) -> Path:
    """The union of a shared row keeps duplicates (a position two verify tokens select is
    looked up twice) and Copy-SFA attends only a shared row's first token."""
    dst = tmp / "kernels"
    shutil.copytree(compile_check.KERNELS_DIR, dst)
    res_h = dst / "residency_manage.h"
    text = res_h.read_text()
    old = "== pos) {\n                return;"
    assert text.count(old) == 1
    res_h.write_text(text.replace(old, "== pos) {\n                break;"))  # found: added once more
    sfa = dst / "scatter_copy_sparse_flash_attention.cpp"
    text = sfa.read_text()
    old = "for (uint32_t t = token + 1; shared && row >= 0 && t < t_.numTokens; ++t) {"
    assert old in text
    sfa.write_text(text.replace(old, "for (uint32_t t = token + 1; false && t < t_.numTokens; ++t) {"))
    return dst


def test_functional_check_catches_union_mutations_in_the_verify_row_cases_only(tmp_path):
    m = km.KernelModel(km.build(kernels=_union_mutated_kernels(tmp_path)))
    lim = functional.check_lim(m, False, steps=2, largest=False)
    assert not lim.ok and lim.failures
    assert all("tokens_per_row=1)" not in f for f in lim.failures), lim.failures[:3]  # one token per row: unchanged
    assert any("tokens_per_row=2" in f for f in lim.failures) and any("tokens_per_row=3" in f for f in lim.failures)
    sfa = functional.check_copy_sfa(m, largest=False)
    assert not sfa.ok and all("tokens_per_row" in f for f in sfa.failures), sfa.failures[:3]


def _overflow_mutated_kernels(tmp: Path, mutation: str) -> Path:
    """LIM's union past the hot buffer keeps other positions than the priority order's
    (``order``: the column's positions descending), or Copy-SFA reads an overflow index as a
    hot-buffer row (``gather``)."""
    dst = tmp / "kernels"
    shutil.copytree(compile_check.KERNELS_DIR, dst)
    file, old, new = {
        "order": (
            "lightning_indexer_manage.cpp",
            "for (; at > 0 && column[at - 1] > pos; --at) {",
            "for (; at > 0 && column[at - 1] < pos; --at) {",
        ),
        "gather": (
            "scatter_copy_sparse_flash_attention.cpp",
            "if (r >= hotRows) {  // a row of the overflow area",
            "if (false) {",
        ),
    }[mutation]
    src = dst / file
    text = src.read_text()
    assert text.count(old) == 1, f"{file} no longer holds {old!r}: update the mutation"
    src.write_text(text.replace(old, new))
    return dst


def test_functional_check_catches_overflow_mutations_in_the_overflow_cases_only(tmp_path):
    """Negative controls of the overflow cases: a union capped in another order changes
    the residency state of rows whose union overflowed (and nothing else); a Copy-SFA that
    gathers an overflow index from the hot buffer faults or attends the wrong rows."""
    m = km.KernelModel(km.build(kernels=_overflow_mutated_kernels(tmp_path / "order", "order")))
    lim = functional.check_lim(m, False, steps=2, largest=False)
    assert not lim.ok and lim.failures
    assert all("hot_tokens=128, top_k=64" in f or "hot_tokens=32, top_k=32" in f for f in lim.failures), lim.failures
    m = km.KernelModel(km.build(kernels=_overflow_mutated_kernels(tmp_path / "gather", "gather")))
    sfa = functional.check_copy_sfa(m, largest=False)
    assert not sfa.ok and all("overflow_rows" in f for f in sfa.failures), sfa.failures[:3]


@pytest.mark.parametrize("seed", [11, 12])
def test_functional_model_on_more_random_scenarios(seed):
    m = km.KernelModel()
    for quantized in (False, True):
        r = functional.check_lim(m, quantized, seed=seed, steps=3, largest=False)
        assert r.ok, r.failures[:3]
        assert r.coverage["hits"] > 0 and r.coverage["misses"] > 0 and r.coverage["topk_minus_one"] > 0
        assert r.coverage["first_fill_rows"] > 0 and r.coverage["steady_rows"] > 0
        assert r.coverage["owned_rows_without_misses"] > 0 and r.coverage["padding_tokens"] > 0
        assert r.coverage["shared_rows"] > 0 and r.coverage["overflow_rows"] > 0
    r = functional.check_copy_sfa(m, seed=seed, largest=False)
    assert r.ok, r.failures[:3]
    assert r.coverage["misses_copied"] > 0 and r.coverage["sparse_minus_one"] > 0 and r.coverage["shared_rows"] > 0
    assert r.coverage["overflow_reads"] > 0


def test_model_faults_on_out_of_bounds_gm_write():
    m = km.KernelModel()
    dims = functional.LimDims(rows=3, hot_tokens=64, top_k=32, max_len=80)
    sc = functional.Scenario(dims, seed=5, idle=0.0)
    sc.advance()
    inp = sc.inputs()
    table = ResidencyTable.empty(dims.rows, dims.hot_tokens)
    out, _ = functional._model_lim(m, inp, table.clone(), dims)  # fine as built
    assert int(out["miss_count"].min()) >= 0
    # the same launch with miss_slots one row short: the last row's store leaves the buffer
    launch = m.tile_lim(
        tokens=inp.token_rows.shape[0],
        requests=inp.cu.shape[0],
        index_heads=8,
        index_dim=128,
        block_size=32,
        max_blocks=inp.block_table.shape[1],
        rows=3,
        hot_tokens=64,
        top_k=32,
        sparse_mode=3,
        quantized=False,
    )
    t, r, k = inp.token_rows.shape[0], 3, 32
    i32 = torch.int32
    tab = table.clone()
    args = [
        inp.query,
        inp.key,
        inp.weights,
        inp.cu,
        inp.kv_len,
        inp.block_table,
        inp.token_rows,
        inp.req_ids,
        inp.stable,
        torch.tensor([inp.step]),
        tab.slot_token,
        tab.slot_stamp,
        tab.row_req,
        torch.empty(t, 1, k, dtype=i32),
        torch.empty(t, 1, k, dtype=i32),
        torch.empty(r, k, dtype=torch.uint8),
        torch.empty(r, k, dtype=i32),
        torch.empty(r, dtype=i32),
        torch.empty(r, k, dtype=i32),
        torch.empty(r - 1, k, dtype=i32),
    ]
    with pytest.raises(km.ModelFault, match="outside every registered buffer"):
        m.run(km.LIM, args, launch)


def test_host_tiling_refuses_shapes_outside_the_kernel_limits():
    m = km.KernelModel()
    with pytest.raises(km.ShapeUnsupported, match="index head dim must be 128"):
        m.tile_lim(
            tokens=1,
            requests=1,
            index_heads=8,
            index_dim=64,
            block_size=32,
            max_blocks=4,
            rows=1,
            hot_tokens=64,
            top_k=32,
            sparse_mode=3,
            quantized=False,
        )
    with pytest.raises(km.ShapeUnsupported, match="multiple of 128"):
        m.tile_copy_sfa(
            tokens=1, heads=8, latent_dim=512, rope_dim=64, rows=1, hot_tokens=128, top_k=96, max_ctx=256, scale=0.04
        )


def test_the_python_shape_limits_are_the_host_tilings():
    """``ops.fused.fused_shape_obstacles`` (what the server checks before it starts) says
    "cannot serve" exactly where the kernels' own host tiling refuses the shape, over hot
    buffers, top-k and verify rows around every limit; its constants are the header's."""
    from sglang_ascend_offload.ops import fused

    header = (compile_check.KERNELS_DIR.parent / "include" / "fused_tiling.h").read_text()
    for name, value in (
        ("kMaxRowTokens", fused.MAX_TOKENS_PER_ROW),
        ("kMaxHotTokens", fused.MAX_HOT_TOKENS),
        ("kMaxTopK", fused.MAX_TOP_K),
        ("kSortGroup", fused.TOP_K_ALIGN_LIM),
        ("kKvTile", fused.TOP_K_ALIGN_COPY_SFA),
    ):
        assert re.search(rf"constexpr uint32_t {name} = {value};", header), name
    assert re.search(r"constexpr uint32_t kLimPoolBytes = 144 \* 1024;", header)
    m = km.KernelModel()
    checked = refused = 0
    for hot in (96, 128, 1000, 2048, 3072, 4096, 4128, 8192):
        for top_k in (32, 64, 96, 128, 1024, 2048, 4096):
            for n in (1, 2, 3, 4, 14, 15):
                if hot < top_k:
                    continue  # the engine refuses these before any kernel (hot buffer < top-k)
                lim_says, sfa_says = fused.fused_shape_obstacles(hot, top_k, n)
                try:
                    m.tile_lim(
                        tokens=n,
                        requests=1,
                        index_heads=8,
                        index_dim=128,
                        block_size=64,
                        max_blocks=4,
                        rows=2,
                        hot_tokens=hot,
                        top_k=top_k,
                        sparse_mode=3,
                        quantized=False,
                        tokens_per_row=n,
                    )
                    lim_ok = True
                except km.ShapeUnsupported:
                    lim_ok = False
                try:
                    m.tile_copy_sfa(
                        tokens=n,
                        heads=8,
                        latent_dim=512,
                        rope_dim=64,
                        rows=2,
                        hot_tokens=hot,
                        top_k=top_k,
                        max_ctx=256,
                        scale=0.04,
                        miss_width=fused.union_width(hot, top_k, n),
                        row_tokens=n,
                    )
                    sfa_ok = True
                except km.ShapeUnsupported:
                    sfa_ok = False
                assert lim_ok == (lim_says == ""), (hot, top_k, n, lim_says)
                assert sfa_ok == (sfa_says == ""), (hot, top_k, n, sfa_says)
                checked += 1
                refused += (not lim_ok) + (not sfa_ok)
    assert checked > 60 and refused > 20
