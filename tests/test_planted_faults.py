"""The planted-fault machinery (``testing/faults.py``, ``scripts/plant_faults.py``).

* Every fault's hook targets exist in the plugin's code (a renamed function would make a
  planted run report "caught" for the wrong reason: the run would not even start).
* The ``fault`` seam reaches a process started with the launcher's environment and changes
  what the hooked code returns; behind a flag file only while the file exists; the planted
  run's variable becomes the seam (:func:`harness.merge`), and a test's own seams are kept.
* Negative control: without the launcher's environment the same variable plants nothing.
* ``plant_faults.py`` maps collected node ids onto the listed test ids, and reads a run's
  outcomes (setup errors, failures, passes) from the plugin's report.
* The Copy-SFA mutation changes exactly the copy-then-attend step.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ascend_offload.testing import faults, harness
from sglang_ascend_offload.testing.servers import REPO, server_env

sys.path.insert(0, str(REPO / "scripts"))
import plant_faults  # noqa: E402

PROBE = r"""
import json, sys
import torch
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang_ascend_offload.sparse_decode.hot_buffer import HotBuffers
hot = HotBuffers(1, 2, 4, 8)
slots = torch.tensor([[0, 1, -1]], dtype=torch.int32)
out = [hot.flat_indices(slots, torch.tensor([1])).flatten().tolist()]
if len(sys.argv) > 1:
    open(sys.argv[1], "w").close()
    out.append(hot.flat_indices(slots, torch.tensor([1])).flatten().tolist())
print(json.dumps(out))
"""


def _probe(env, *args):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_fault_hooks_code_that_exists():
    assert len(faults.FAULTS) >= 10
    for fault in faults.FAULTS.values():
        assert fault.tests and fault.fault_class and fault.description
        assert fault.shadow_tests or fault.shadow_note, fault.name
        for target, _ in fault.hooks:
            owner, attr = target.rsplit(".", 1)
            assert hasattr(pkgutil.resolve_name(owner), attr), target


def test_the_fault_seam_changes_the_hooked_code_in_a_launched_process(tmp_path):
    env = {**server_env(), **harness.environment({"fault": "remap_off_by_one"})}
    assert _probe(env) == [[5, 5, -1]]  # row 1 of 4 slots: 4 + 0 -> 4 + 1 (the neighbouring slot)
    flag = tmp_path / "on"
    env = {**server_env(), **harness.environment({"fault": faults.seam_value("remap_off_by_one", flag)})}
    assert _probe(env, flag) == [[4, 5, -1], [5, 5, -1]]  # off until the flag file exists


def test_the_planted_run_variable_becomes_the_seam_and_keeps_a_tests_own_seams(tmp_path, monkeypatch):
    monkeypatch.delenv(harness.FORKSERVER_ENV, raising=False)  # only the fault seams here
    monkeypatch.setenv(faults.PLANTED_FAULT_ENV, "remap_off_by_one")
    env = harness.merge(server_env(), harness.environment({"hold_appends": str(tmp_path / "hold")}))
    seams = json.loads(env[harness.HARNESS_ENV])
    assert seams == {"fault": "remap_off_by_one", "hold_appends": str(tmp_path / "hold")}
    assert _probe(env) == [[5, 5, -1]]
    # a test's own (flag-gated) fault and the planted one: both are planted
    own = faults.seam_value("stale_slot_after_eviction", tmp_path / "flag")
    env = harness.merge(server_env(), harness.environment({"fault": own}))
    assert json.loads(env[harness.HARNESS_ENV]) == {"fault": ["remap_off_by_one", own]}
    assert _probe(env) == [[5, 5, -1]]
    monkeypatch.delenv(faults.PLANTED_FAULT_ENV)
    assert harness.HARNESS_ENV not in harness.merge(server_env(), {})


def test_without_the_launcher_nothing_is_planted():
    """Negative control: the seam variable without the launcher's PYTHONPATH plants nothing."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SGLANG_USE_CPU_ENGINE="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.update(harness.environment({"fault": "remap_off_by_one"}))
    assert _probe(env) == [[4, 5, -1]]


def test_unknown_faults_are_refused():
    with pytest.raises(ValueError, match="unknown planted fault"):
        faults.seam_value("remap_off_by_two")


def test_node_ids_belong_to_the_listed_test_ids():
    listed = "tests/a.py::test_x"
    assert plant_faults.belongs("tests/a.py::test_x", listed)
    assert plant_faults.belongs("tests/a.py::test_x[bf16]", listed)
    assert not plant_faults.belongs("tests/a.py::test_xy", listed)
    assert plant_faults.belongs("tests/a.py::test_xy", "tests/a.py")


def test_a_runs_outcomes_come_from_the_plugins_report(tmp_path):
    test = tmp_path / "test_sample.py"
    test.write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n    raise RuntimeError('server refused to start')\n"
        "def test_ok():\n    pass\n"
        "def test_fails():\n    assert False\n"
        "def test_errors(broken):\n    pass\n"
    )
    got = plant_faults.run_tests([str(test)], "", timeout_s=300)
    by_name = {n.rsplit("::", 1)[1]: o for n, o in got.items()}
    assert by_name == {"test_ok": "passed", "test_fails": "failed", "test_errors": "error"}


def test_the_copy_sfa_mutation_moves_only_the_copy_after_the_first_attend(tmp_path):
    from sglang_ascend_offload.ops import ascendc_model as am

    dst = faults.mutated_copy_sfa_kernels(tmp_path / "k")
    names = sorted(p.name for p in am.KERNELS.iterdir() if p.is_file())
    assert sorted(p.name for p in dst.iterdir()) == names
    for name in names:
        same = (dst / name).read_text() == (am.KERNELS / name).read_text()
        assert same == (name != "scatter_copy_sparse_flash_attention.cpp"), name
    text = (dst / "scatter_copy_sparse_flash_attention.cpp").read_text()
    assert text.index("Attend(token);  // planted fault") < text.index("CopyMisses(static_cast<uint32_t>(row));")


def test_fault_rows_are_the_public_json_shape():
    row = faults.Outcome("x", "cls", caught=True, caught_by=["t"], shadow_caught=False).as_json()
    assert {"name", "fault_class", "caught", "caught_by", "shadow_caught"} <= set(row)
    assert Path(plant_faults.__file__).name == "plant_faults.py"
