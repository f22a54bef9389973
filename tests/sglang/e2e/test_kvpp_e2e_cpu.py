"""End to end on CPU: KVPP through SGLang (``--tp-size 2`` and ``--tp-size 3``) gives the
same greedy tokens and logprobs as the replicated KV pool, with less KV per rank.

Models: for TP 2, 8 DSA layers on real weights, the trained checkpoint's two layers
stacked four times (``testing/stacked.py``: on ``tests/fixtures/tiny_dsa_8l``'s dummy
weights two swapped blocks went unseen, ``scripts/plant_faults.py`` fault
``kvpp_block_swap``; rank 0 owns layers 0-3, rank 1 layers 4-7);
``tests/fixtures/tiny_dsa_8l_h6`` (dummy weights, 6 heads and a 384-wide MLP, so it splits
over 3 ranks; SGLang needs heads % tp == 0) for TP 3 (owners ``[0, 0, 0, 1, 1, 1, 2, 2]``;
opt-in with ``SGLANG_TEST_KVPP_TP3=1``:
six ranks on two cores start too slowly for the default suite's budget). Per TP size
two servers started together (KVPP off and on with active-block broadcast), ranks
bound to the two cores (``SGLANG_CPU_OMP_THREADS_BIND``), without
``--max-total-tokens`` so SGLang sizes the slot space from a KV byte budget, and with
``--chunked-prefill-size 64`` so longer prompts run as several chunks.

Workload: a short prompt, a prompt of three chunks (later chunks read the earlier
ones through the broadcast), a prefix cached by the radix cache then hit by
concurrent requests of different lengths and output lengths (requests join and leave
the decode batch: churn). Checked:

* tokens and logprobs equal, cache hits really happened;
* each rank's allocation, measured by the pool from its tensors' storages (logged),
  equals its owned bundles + two 2 MiB-aligned scratch buffers computed here from the
  model config and SGLang's slot count -- and agrees with the capacity planner's row;
* every rank broadcast every layer of its forwards with history, and only active pages
  (the bytes logged by the pool are below whole layers);
* ``max_total_num_tokens`` with KVPP vs without, from the same fixed KV byte budget
  per rank (``SGLANG_ASCEND_OFFLOAD_KV_BUDGET_BYTES``: on a CPU SGLang would size from
  free host memory, which other processes move): SGLang's per-token cost of 8 layers
  vs KVPP's most-owned + 2 scratch, so the factor is ``8 / 6`` for TP 2 and ``8 / 5``
  for TP 3 (to the page).
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import CPU_SERVER_ARGS, IDLE_SLEEP, REPO, ServerProcess, start_all, stop_all

from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.stacked import stacked_checkpoint

pytestmark = pytest.mark.slow

VOCAB = 1024
TP3_MODEL = REPO / "tests" / "fixtures" / "tiny_dsa_8l_h6"
OWNED = {2: ([0, 1, 2, 3], [4, 5, 6, 7]), 3: ([0, 1, 2], [3, 4, 5], [6, 7])}
PAGE = 64  # SGLang's page size for DSA models off NPU
BUDGET = 64 * 2**20  # KV bytes per rank (fixed: SGLang would size from free host memory, which others move)


def _env(tp: int) -> dict:
    return {
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % 2) for r in range(tp)),
        "SGLANG_ASCEND_OFFLOAD_KV_BUDGET_BYTES": str(BUDGET),
    }


def _model(tp: int, root) -> Path:
    """TP 2: the trained layers stacked to 8; TP 3: the 6-head dummy-weight fixture."""
    return stacked_checkpoint(TINY_DSA_TRAINED, 8, root / "trained_8l") if tp == 2 else TP3_MODEL


def _base_args(tp: int, model: Path) -> list:
    launch = trained_args(model) if tp == 2 else [str(model) if a.endswith("tiny_dsa") else a for a in CPU_SERVER_ARGS]
    args, skip = [], False
    for a in launch:
        if skip:
            skip = False
            continue
        if a == "--max-total-tokens":
            skip = True
            continue
        args.append(a)
    return args + ["--tp-size", str(tp), "--chunked-prefill-size", "64", "--max-running-requests", "6"] + IDLE_SLEEP


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


TP3_ENV = "SGLANG_TEST_KVPP_TP3"


def _start_pair(tp: int, root):
    model = _model(tp, root)
    off = ServerProcess(log_path=root / f"tp{tp}_off.log", base_args=_base_args(tp, model), env=_env(tp))
    on = ServerProcess(
        ["--enable-kvpp", "--kvpp-config", json.dumps({"broadcast": "active"})],
        log_path=root / f"tp{tp}_on.log",
        base_args=_base_args(tp, model),
        env=_env(tp),
    )
    start_all(off, on)
    print(f"\nstartup tp {tp} (2 servers launched together): off {off.startup_s:.1f} s, on {on.startup_s:.1f} s")
    return off, on, model


@pytest.fixture(scope="module")
def pair2(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvpp_tp2")
    off, on, model = _start_pair(2, root)
    yield off, on, root, model
    stop_all(off, on)


@pytest.fixture(scope="module")
def pair3(tmp_path_factory):
    if os.environ.get(TP3_ENV) != "1":
        pytest.skip(
            f"TP 3 servers (6 ranks on this machine's 2 cores) start in ~1.5-4 min, beyond the default "
            f"suite's time budget for KVPP; run with {TP3_ENV}=1 (odd groups are covered by "
            "test_kvpp_pool.py in every run)"
        )
    root = tmp_path_factory.mktemp("kvpp_tp3")
    off, on, model = _start_pair(3, root)
    yield off, on, root, model
    stop_all(off, on)


def run_workload(srv: ServerProcess) -> dict:
    out = {
        "short": srv.generate(prompt(40, 1), max_new_tokens=8, return_logprob=True),
        "chunked": srv.generate(prompt(150, 2), max_new_tokens=8, return_logprob=True),
    }
    prefix = prompt(130, 3)
    srv.generate(prefix, max_new_tokens=1)  # two pages of the prefix are now in the radix cache
    jobs = [(prefix + prompt(5 + 9 * i, 10 + i), 4 + 3 * i) for i in range(4)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        out["shared"] = list(ex.map(lambda j: srv.generate(j[0], max_new_tokens=j[1], return_logprob=True), jobs))
    return out


def answers(result):
    items = result if isinstance(result, list) else [result]
    return [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in items]


@pytest.mark.parametrize("tp", [2, 3])
def test_kvpp_equals_replicated_pool_and_allocates_owned_plus_scratch(request, tp):
    from sglang_ascend_offload.capacity import CapacityInputs, footprints
    from sglang_ascend_offload.model_specs import load_hf_config

    off, on, root, model_path = request.getfixturevalue(f"pair{tp}")
    with ThreadPoolExecutor(2) as ex:
        f_off, f_on = ex.submit(run_workload, off), ex.submit(run_workload, on)
        results = {"off": f_off.result(), "on": f_on.result()}
    for name in results["off"]:
        assert answers(results["on"][name]) == answers(results["off"][name]), f"tp {tp}: {name} differs with KVPP"
    assert all(r["meta_info"]["cached_tokens"] >= 128 for r in results["on"]["shared"])
    assert [len(r["output_ids"]) for r in results["on"]["shared"]] == [4, 7, 10, 13]

    log = (root / f"tp{tp}_on.log").read_text(errors="replace")
    assert "Traceback" not in log
    tokens = {k: json.loads(s.get("/get_server_info"))["max_total_num_tokens"] for k, s in (("off", off), ("on", on))}
    slot_rows = (tokens["on"] // PAGE + 1) * PAGE
    cfg = json.loads((model_path / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg["index_head_dim"]) * 2  # bf16 bytes / token / layer
    align = 2 * 1024 * 1024
    scratch = -(-row * slot_rows // align) * align
    model = load_hf_config(str(model_path))
    planner = footprints(model, CapacityInputs(hbm_bytes=2**34, host_bytes=2**34, tp=tp, page_size=PAGE))[0]
    planned = planner["kvpp"][0].device_per_token * slot_rows + planner["kvpp"][0].device_fixed
    allocations = []
    for rank, owned in enumerate(OWNED[tp]):
        m = re.search(
            rf"KVPP rank {rank}/{tp}: owns layers \[([0-9, ]*)\] of {layers}; allocated (\d+) bytes.*"
            r"slot rows (\d+)",
            log,
        )
        assert m, f"rank {rank} did not log its KVPP allocation"
        assert [int(x) for x in m.group(1).split(",")] == owned
        assert int(m.group(3)) == slot_rows
        measured = int(m.group(2))
        assert measured == len(owned) * row * slot_rows + 2 * scratch, (rank, measured)
        allocations.append(measured)
        stats = re.findall(
            rf"KVPP rank {rank} stats: forwards=\d+ with_history=(\d+) active_pages=\d+ of \d+ "
            r"broadcasts=(\d+) broadcast_bytes=(\d+) received_bytes=(\d+)",
            log,
        )
        assert stats, f"rank {rank} logged no KVPP stats"
        _, broadcasts, sent, received = (int(v) for v in stats[-1])
        assert broadcasts >= layers and broadcasts % layers == 0, (rank, broadcasts)  # every layer, per forward
        assert 0 < received < sent  # it received the layers it does not own, and sent its own
        assert sent < broadcasts * row * slot_rows  # only active pages travel, never whole layers
    # the capacity planner's KVPP row is the fullest rank (rank 0): per token x slots + alignment allowance
    assert max(allocations) == allocations[0] <= planned < allocations[0] + 2 * align
    ratio = tokens["on"] / tokens["off"]
    fullest = len(OWNED[tp][0])
    print(
        f"\ntp {tp}: max_total_num_tokens from {BUDGET} B per rank: off {tokens['off']}, KVPP {tokens['on']} "
        f"(x{ratio:.4f}; plan formula {layers} / ({fullest} + 2) = x{layers / (fullest + 2):.4f}); "
        f"per-rank KVPP allocation {allocations} B"
    )
    cell_off = int(re.search(r"KVPP: device KV per token \d+ B instead of (\d+) B", log).group(1))
    assert cell_off % layers == 0  # SGLang's cost of uniform layers
    page_floor = lambda n: n // PAGE * PAGE  # noqa: E731 - SGLang keeps whole pages
    assert tokens["off"] == page_floor(BUDGET // cell_off)
    assert tokens["on"] == page_floor(BUDGET // (cell_off // layers * (fullest + 2)))
    assert abs(ratio - layers / (fullest + 2)) < 0.02
