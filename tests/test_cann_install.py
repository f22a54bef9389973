"""The SoC of an NPU deployment comes from the installed CANN build's own files
(``cann_install.py``), and sparse decode offload refuses a 950 or an undecided SoC.

The fixtures under ``tests/fixtures/cann/`` are CANN install trees reduced to the files
read: ``<arch>-linux/ascend_toolkit_install.info`` and the per-SoC operator kernel
directories ``opp/built-in/op_impl/ai_core/tbe/kernel/<short soc>/<op>/``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_ascend_offload import cann_install, platform
from sglang_ascend_offload.config import Deployment, parse_config, violations
from sglang_ascend_offload.sglang_plugin.args.deployment import build_deployment
from sglang_ascend_offload.testing.sglang_args import server_args_stub

FIXTURES = Path(__file__).parent / "fixtures" / "cann"
SD = parse_config({"sparse_decode": {"hot_tokens": 4096}})


def _env(name: str) -> dict:
    return {"ASCEND_HOME_PATH": str(FIXTURES / name)}


def _rules(soc, soc_unknown, device="npu"):
    d = Deployment(
        device=device,
        soc=soc,
        soc_unknown=soc_unknown,
        model_kind="dsa",
        num_layers=61,
        index_topk=2048,
        page_size=128,
        tp=8,
    )
    return [v.rule for v in violations(SD, d)]


@pytest.mark.parametrize(
    "name, soc, family", [("a2", "Ascend910B", "A2"), ("a3", "Ascend910_93", "A3"), ("950", "Ascend910_95", "950")]
)
def test_single_soc_builds_are_read(name, soc, family):
    info = cann_install.detect(_env(name), arch="x86_64")
    assert (info.soc, info.family, info.version) == (soc, family, "8.5.0")
    assert info.version_file.endswith("x86_64-linux/ascend_toolkit_install.info")
    assert info.reason is None and info.decided


def test_a2_and_a3_pass_950_refuses():
    for name in ("a2", "a3"):
        soc, unknown = cann_install.deployment_soc(env=_env(name))
        assert unknown is None
        assert _rules(soc, unknown) == [], name
    soc, unknown = cann_install.deployment_soc(env=_env("950"))
    assert _rules(soc, unknown) == ["sparse_decode.soc_950"]


def test_950_kernels_next_to_a3_still_refuse():
    info = cann_install.detect(_env("a3_950"), arch="x86_64")
    assert info.family == "950" and info.installed_families == ("950", "A3")
    assert any("treated as a 950" in n for n in info.notes)
    assert _rules(*cann_install.deployment_soc(env=_env("a3_950"))) == ["sparse_decode.soc_950"]


@pytest.mark.parametrize(
    "env, words",
    [
        ({}, "no CANN install found"),
        ({"ASCEND_HOME_PATH": "/nonexistent/cann"}, "does not exist"),
        (_env("toolkit_only"), "no operator kernels of a known SoC"),
        (_env("a2_a3"), "several SoC families"),
    ],
)
def test_undecidable_refuses_with_its_rule(env, words, monkeypatch):
    monkeypatch.setattr(cann_install, "DEFAULT_ROOTS", ())
    soc, unknown = cann_install.deployment_soc(env=env)
    assert soc is None and words in unknown
    assert _rules(soc, unknown) == ["sparse_decode.soc_unknown"]


def test_unreadable_kernel_tree_refuses(tmp_path):
    kernel = tmp_path / cann_install.KERNEL_SUBDIR
    kernel.parent.mkdir(parents=True)
    kernel.write_text("not a directory")  # a broken install: the kernel tree is a file
    info = cann_install.detect({"ASCEND_HOME_PATH": str(tmp_path), "ASCEND_OPP_PATH": str(tmp_path)})
    assert not info.decided and info.reason
    assert _rules(info.soc, info.reason) == ["sparse_decode.soc_unknown"]


def test_version_without_a_version_line_is_reported():
    info = cann_install.detect(_env("no_version"), arch="x86_64")
    assert info.version is None and info.family == "A3"
    assert any("no version= line" in n for n in info.notes)


def test_runtime_name_is_only_a_cross_check():
    # picks among several installed A2/A3 families; contradicting the build is undecided
    assert cann_install.deployment_soc("Ascend910_9391", env=_env("a2_a3")) == ("Ascend910_9391", None)
    soc, unknown = cann_install.deployment_soc("Ascend910B3", env=_env("a3"))
    assert soc is None and "device reports" in unknown
    # the runtime cannot lift a 950 build's refusal
    assert cann_install.deployment_soc("Ascend910_9391", env=_env("950"))[0] == "Ascend910_95"


def test_cann_8_5_950_names_are_the_950_family():
    from sglang_ascend_offload.soc import soc_family

    assert soc_family("Ascend910_9599") == "950"
    assert soc_family("Ascend910_95") == "950"
    assert soc_family("Ascend910_9391") == "A3"
    assert soc_family("Ascend910B3") == "A2"


def test_cpu_deployments_are_unaffected(monkeypatch):
    monkeypatch.setenv("ASCEND_HOME_PATH", "/nonexistent/cann")
    hf = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=4, num_hidden_layers=2)
    args = server_args_stub(device="cpu", kv_cache_dtype="auto", page_size=1, tp_size=1, disable_cuda_graph=True)
    d = build_deployment(args, hf, soc=None, soc_unknown="ignored off the NPU")
    assert d.device == "cpu" and d.soc_unknown is None
    assert "sparse_decode.soc_unknown" not in [v.rule for v in violations(SD, d)]


def test_installed_soc_reads_the_build_on_an_npu(monkeypatch):
    monkeypatch.setenv("ASCEND_HOME_PATH", str(FIXTURES / "a3"))
    monkeypatch.setattr(platform, "soc_name", lambda: None)
    assert platform.installed_soc() == ("Ascend910_93", None)
