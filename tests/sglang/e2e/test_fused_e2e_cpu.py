"""Served: sparse decode offload through the fused AscendC operators on CPU.

``ops: "fused"`` on CPU runs the fused rung (LIM or LIM-C8, then Copy-SFA) as the real
kernel sources on the AscendC functional model (``ops/ascendc_cpu_ops.py``). The tiny
DSA fixture at shapes those kernels take (``tests/fixtures/tiny_dsa_fused``: top-k 128,
8 index heads; 256 hot slots, page 64) serves the same greedy requests with
``ops: "fused"`` and with ``ops: "reference"``, for each index-K dtype (bf16 with LIM,
int8 with LIM-C8). The bf16 fused server decodes eagerly; the int8 one on SGLang's CPU
graph runner (``--enable-torch-compile``, one bucket of 3 replayed exactly and with
padding entries: the fused ops inside the captured step, reading the static row buffers). The
reference servers decode eagerly. Each pair must give the same tokens:

* a prompt longer than two hot buffers (the residency evicts every step),
* a concurrent batch (several rows in one fused call, rows finishing and being reused:
  churn),
* a radix-cache hit equal to its cold request,

and the fused server's log must show its operator plan chose the fused operators, and that
they qualified (``ops/qualify.py``: each fused op against the separate operators at the
served shapes) before the server accepted requests; the reference server has nothing to
qualify.

Speculative decoding (NextN through SGLang's EAGLE worker, two verify rows per request,
``tests/fixtures/tiny_dsa_fused_mtp``): the verify rows of a request share its hot buffer
of 128 slots (one top-k), and the fused LIM steps that row once on the union of the two
rows' top-k, capped at the buffer (the positions past it overflow: copied into the
overflow area beside the kernels and read by Copy-SFA as its ``overflow`` operand), then
Copy-SFA copies its misses once and attends both rows. ``ops: "fused"`` and ``ops: "reference"``
servers run SGLang's acceptance simulation (the first draft accepted, so committed and
rejected rows both occur) and must give the same tokens. The
residency state and copies are compared bit for bit in process
(``test_fused_indexer_components.py``); outside a server only tokens can be seen. The
logprobs of the two rungs differ within the fused attention's tolerance (the kernel's
summation order), which the in-process test bounds.

This is a correctness path: the functional model executes every vector instruction on
the host, so it is far slower than the reference rung (``docs/fused_ops.md`` has the
measured cost per token).
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all

from sglang_ascend_offload.testing.servers import TINY_DSA_FUSED, TINY_DSA_FUSED_MTP, fixture_args

pytestmark = pytest.mark.slow

VOCAB = 1024


# the reference server's attention stage as its operator plan logs it
REFERENCE_ATTENTION_PLAN = r"sparse decode engine attention: copy_miss_rows\[reference[^]]*\] \+ sparse_mla_attention\["


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


#: SGLang's CPU graph runner (``--enable-torch-compile``): one decode bucket of 3 (SGLang
#: captures no bucket above ``--max-running-requests``), so batches of 3 replay it exactly
#: and batches of 1-2 with padding entries
GRAPHS = ["--enable-torch-compile", "--cuda-graph-bs-decode", "3", "--torch-compile-max-bs", "3"]
GRAPH_STARTUP_S = 900.0  # torch.compile on a loaded 2-core machine


def _server(root, ops: str, indexer_dtype: str, graphs: bool = False) -> ServerProcess:
    offload = {"hot_tokens": 256, "ops": ops, "indexer_dtype": indexer_dtype}
    base = fixture_args(TINY_DSA_FUSED)
    extra = [
        "--max-running-requests",
        "3",
        "--enable-sparse-decode-offload",
        "--sparse-decode-offload-config",
        json.dumps(offload),
    ] + IDLE_SLEEP
    if not graphs:
        return ServerProcess(extra, log_path=root / f"{ops}_{indexer_dtype}.log", base_args=base)
    return ServerProcess(
        extra + GRAPHS,
        log_path=root / f"{ops}_{indexer_dtype}_graphs.log",
        base_args=[a for a in base if a != "--disable-cuda-graph"],
        startup_timeout_s=GRAPH_STARTUP_S,
    )


def _requests(server) -> dict:
    long_prompt = prompt(600, seed=1)  # > 2 x 256 hot slots
    batch = [prompt(n, seed=s) for s, n in ((2, 150), (3, 300), (4, 40), (5, 200))]
    shared = prompt(330, seed=6)  # > 5 pages of 64: the radix cache matches them
    out = {
        "long": server.generate(long_prompt, max_new_tokens=16)["output_ids"],
        "batch": [o["output_ids"] for o in server.generate(batch, max_new_tokens=10)],
    }
    cold = server.generate(shared, max_new_tokens=10)
    warm = server.generate(shared, max_new_tokens=10)
    assert warm["meta_info"]["cached_tokens"] >= 320
    assert warm["output_ids"] == cold["output_ids"], "radix hit != cold request"
    out["radix"] = warm["output_ids"]
    return out


@pytest.mark.parametrize("indexer_dtype,graphs", [("bf16", False), ("int8", True)])
def test_fused_rung_serves_the_reference_rung_tokens(tmp_path, indexer_dtype, graphs):
    fused = _server(tmp_path, "fused", indexer_dtype, graphs)
    reference = _server(tmp_path, "reference", indexer_dtype)
    start_all(fused, reference)
    try:
        got, want = _requests(fused), _requests(reference)
    finally:
        stop_all(fused, reference)
    assert got == want
    assert len(got["long"]) == 16 and [len(t) for t in got["batch"]] == [10] * 4
    lim = "quant_lightning_indexer_manage" if indexer_dtype == "int8" else "lightning_indexer_manage"
    log = fused.log_path.read_text(errors="replace")
    assert f"sparse decode engine indexer: {lim}[fused] (ops=fused)" in log, (
        "the fused server did not plan the fused indexer"
    )
    assert "sparse decode engine attention: copy_sparse_flash_attention[fused] (ops=fused)" in log
    assert f"decode steps select and manage residency with the fused {lim}" in log
    # before serving, the fused kernels qualified against the separate operators at the served shapes
    label = "LIM-C8" if indexer_dtype == "int8" else "LIM"
    assert f"kernel qualification: {label}, Copy-SFA qualified in" in log
    assert re.search(r"sparse decode offload startup: [\d.]+ s: host-pool allocation .* kernel qualification", log)
    assert "Traceback" not in log
    if graphs:  # the decode steps ran as captured graphs, replayed with padding entries
        assert re.search(r"Capture target decode CPU graph end\. bs=\[3\]", log), "no decode graph was captured"
        assert "decode graph bucket 3 stepped with 3 live rows\n" in log, "no exact replay of the decode graph"
        assert re.search(r"decode graph bucket 3 stepped with [12] live rows \(padding entries", log), (
            "no padded replay of the decode graph"
        )
    ref_log = reference.log_path.read_text(errors="replace")
    assert re.search(
        r"sparse decode engine attention: copy_miss_rows\[reference[^]]*\] \+ sparse_mla_attention\[", ref_log
    )
    assert "kernel qualification" not in ref_log  # no fused op, nothing to qualify
    assert re.search(r"sparse decode offload startup: [\d.]+ s: host-pool allocation", ref_log)


SPEC = [
    "--speculative-algorithm",
    "NEXTN",
    "--speculative-num-steps",
    "1",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "2",
]
SIMULATED_ACCEPT = {"SGLANG_SIMULATE_ACC_LEN": "2", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}


def _spec_server(root, ops: str) -> ServerProcess:
    offload = {"hot_tokens": 128, "ops": ops}  # 2 verify rows x top-k 128 over 128 slots: unions overflow
    extra = (
        [
            "--max-running-requests",
            "3",
            "--enable-sparse-decode-offload",
            "--sparse-decode-offload-config",
            json.dumps(offload),
        ]
        + SPEC
        + IDLE_SLEEP
    )
    return ServerProcess(
        extra, log_path=root / f"spec_{ops}.log", base_args=fixture_args(TINY_DSA_FUSED_MTP), env=SIMULATED_ACCEPT
    )


def test_fused_rung_serves_nextn_verify_rows_with_the_reference_rung_tokens(tmp_path):
    fused = _spec_server(tmp_path, "fused")
    reference = _spec_server(tmp_path, "reference")
    start_all(fused, reference)
    try:
        got, want = _requests(fused), _requests(reference)
    finally:
        stop_all(fused, reference)
    assert got == want
    assert len(got["long"]) == 16 and [len(t) for t in got["batch"]] == [10] * 4
    log = fused.log_path.read_text(errors="replace")
    assert "sparse decode engine indexer: lightning_indexer_manage[fused] (ops=fused)" in log, log[-3000:]
    assert "sparse decode engine attention: copy_sparse_flash_attention[fused] (ops=fused)" in log
    # every target decode step of a speculative server is a verify step: the fused LIM ran them
    assert "decode steps select and manage residency with the fused lightning_indexer_manage" in log
    assert "kernel qualification: LIM, Copy-SFA qualified in" in log
    assert "2 verify rows per request" in log  # qualified at the served verify-row shape
    assert "Traceback" not in log
    ref_log = reference.log_path.read_text(errors="replace")
    assert re.search(
        r"sparse decode engine attention: copy_miss_rows\[reference[^]]*\] \+ sparse_mla_attention\[", ref_log
    )
