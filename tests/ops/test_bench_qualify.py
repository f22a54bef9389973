"""``python -m sglang_ascend_offload bench kernels --qualify [--json]`` on CPU (the kernels on
their functional model): one JSON document with one entry per fused op (``qualified``,
``seconds``, the first difference when it fails), exit status 0 when all qualified; with a
planted faulty Copy-SFA the same command's entry fails with its difference and the exit
status is 1 (negative control)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
from kernel_mutations import COPY_SFA_ROPE_OFFSET, fused_ops_from, mutated_library, registration_left_as_found

from sglang_ascend_offload.bench import kernels as bench_kernels

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the AscendC functional model")

SMALL = ["--top-k", "128", "--hot-tokens", "256", "--index-heads", "8", "--page-size", "64", "--heads", "4"]
KEYS = {"op", "label", "kernel", "qualified", "seconds", "steps", "against", "max_abs_err", "coverage", "difference"}


@pytest.fixture(autouse=True, scope="module")
def _fused_ops_left_as_found():
    with registration_left_as_found():
        yield


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_kernels.add_arguments(parser)
    return parser.parse_args(["--qualify", "--json", *SMALL, *extra])


def test_the_command_prints_one_document_with_an_entry_per_fused_op():
    run = subprocess.run(
        [sys.executable, "-m", "sglang_ascend_offload", "bench", "kernels", "--qualify", "--json", *SMALL],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout)  # exactly one JSON document
    assert doc["device"] == "cpu" and doc["fused_backend"] == "CPU functional model" and doc["all_qualified"]
    assert [e["label"] for e in doc["ops"]] == ["LIM", "Copy-SFA", "LIM-C8"]
    for e in doc["ops"]:
        assert set(e) == KEYS and e["qualified"] and e["difference"] is None and e["seconds"] > 0, e
    assert doc["shape"]["top_k"] == 128 and doc["shape"]["hot_tokens"] == 256


def test_a_faulty_kernel_fails_its_entry_and_the_exit_status(tmp_path, capsys):
    with fused_ops_from(mutated_library(tmp_path, COPY_SFA_ROPE_OFFSET)):
        rc = bench_kernels.main(_args("--indexer-dtype", "bf16"))
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["all_qualified"] is False
    lim, sfa = doc["ops"]
    assert lim["qualified"] and not sfa["qualified"]
    d = sfa["difference"]
    assert d["tensor"] == "attention output" and d["index"] and d["fused"] != d["separate"], d


def test_a_shape_the_kernels_do_not_take_is_refused(capsys):
    rc = bench_kernels.main(_args("--top-k", "96"))  # Copy-SFA needs a multiple of 128
    assert rc == 2 and "cannot be qualified here" in capsys.readouterr().err
