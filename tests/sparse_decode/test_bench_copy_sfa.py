"""``bench kernels --copy-sfa``: the fused Copy-SFA against the separate copy + attention,
side by side in one run of the same workload.

On CPU the fused operator is the AscendC kernel on its functional model: the command's
fused run must go through it at every layer step (and the separate run never), both runs
must verify against attention over the full host KV and move the same rows; a fused
operator that returns a wrong output must make the command fail. On an NPU (``npu``
marker) the fused run is the built extension and the ratio is printed.
"""

from __future__ import annotations

import json
import os
import shutil

import npu_standin
import pytest
import torch
from npu_requirements import npu_present, require_npu, require_npu_extension

from sglang_ascend_offload import cli
from sglang_ascend_offload.ops import ascendc_cpu_ops, registry
from sglang_ascend_offload.ops.contract import OpImpl
from sglang_ascend_offload.ops.registry import _REGISTRY

needs_cxx = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ to build the AscendC functional model"
)
KEY = ("copy_sparse_flash_attention", "fused")
ARGS = ["bench", "kernels", "--copy-sfa", "--rows", "3", "--steps", "3", "--heads", "8", "--json"]


@pytest.fixture
def model_ops_removed_after():
    yield
    ascendc_cpu_ops.unregister()


def _counting_fused(monkeypatch, calls, corrupt: bool = False):
    """Wrap the fused rung (selected as ``ops=fused`` does, registering the model ops):
    count its calls, optionally add 1 to its output."""
    real = registry.select(*KEY)

    def counted(*args, **kwargs):
        calls.append(1)
        out = real.fn(*args, **kwargs)
        return out + 1 if corrupt else out

    monkeypatch.setitem(_REGISTRY.impls, KEY, OpImpl(KEY[0], KEY[1], counted, real.unavailable))


@needs_cxx
def test_copy_sfa_side_by_side_on_the_cpu_model(capsys, monkeypatch, model_ops_removed_after):
    calls = []
    _counting_fused(monkeypatch, calls)
    rc = cli.main(ARGS)
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["all_correct"] is True
    res = out["copy_sfa"]
    separate, fused = res["runs"]
    assert (separate["run"], separate["fused_copy_sfa"], fused["run"], fused["fused_copy_sfa"]) == (
        "separate",
        False,
        "fused",
        True,
    )
    assert res["fused_backend"] == "CPU functional model" and "only the correctness" in res["note"]
    # every fused layer step ran the fused operator, the separate run never did
    assert fused["layer_steps"] == separate["layer_steps"] == len(calls) > 0
    assert fused["copy_ms_per_layer_step"] == 0.0 and separate["copy_ms_per_layer_step"] > 0
    assert separate["verified"] and fused["verified"] and res["same_traffic"]
    assert fused["misses"] == separate["misses"] > 0
    assert res["separate_over_fused"] == pytest.approx(
        separate["copy_attention_ms_per_layer_step"] / fused["copy_attention_ms_per_layer_step"]
    )
    assert res["shape"]["top_k"] == 128 and res["shape"]["heads"] == 8


@needs_cxx
def test_a_wrong_fused_output_fails_the_command(capsys, monkeypatch, model_ops_removed_after):
    _counting_fused(monkeypatch, [], corrupt=True)
    rc = cli.main(ARGS)
    out = json.loads(capsys.readouterr().out)
    fused = out["copy_sfa"]["runs"][1]
    assert rc == 1 and out["all_correct"] is False
    assert not fused["verified"] and "fused attention output off the full-KV reference" in fused["failures"][0]


def test_bad_arguments_are_all_listed(capsys):
    assert cli.main(["bench", "kernels", "--copy-sfa", "--heads", "0", "--layers", "0", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert all(f"--{name} must be >= 1" in err for name in ("heads", "layers", "steps")), err


#: steps of the npu run on the stand-in: its fused Copy-SFA is the functional model (the CPU tests
#: above run the command on it); the stand-in's point is the command's device path
STANDIN_STEPS = 4


@pytest.mark.npu
@pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN, torch_npu and the built extension")
def test_copy_sfa_side_by_side_on_the_npu(capsys):
    require_npu()
    require_npu_extension("npu_fused_scatter_copy_sparse_flash_attention")
    args, steps = ["bench", "kernels", "--copy-sfa", "--json"], 32  # 32: the command's default on a device
    if npu_standin.installed():
        args, steps = args + ["--steps", str(STANDIN_STEPS)], STANDIN_STEPS
    rc = cli.main(args)
    out = json.loads(capsys.readouterr().out)
    res = out["copy_sfa"]
    print(f"NPU Copy-SFA separate / fused: {res['separate_over_fused']} (reference design: 1.15-1.24 on A3)")
    assert rc == 0 and out["all_correct"] is True
    assert res["fused_backend"] == "AscendC extension" and res["same_traffic"]
    assert res["shape"] == {
        "rows": 4,
        "top_k": 128,
        "hot_tokens": 256,
        "heads": 16,
        "layers": 2,
        "steps": steps,
        "latent_dim": 512,
        "rope_dim": 64,
        "dtype": "bfloat16",
    }
    assert res["separate_over_fused"] is not None and res["separate_over_fused"] > 0
    assert torch.npu.is_available()
