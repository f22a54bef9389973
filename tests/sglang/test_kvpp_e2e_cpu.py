"""End to end on CPU: KVPP through SGLang (``--tp-size 2``) gives the same greedy tokens
and logprobs as the replicated KV pool, with less KV per rank.

Model: ``tests/fixtures/tiny_dsa_8l`` (8 DSA layers: rank 0 owns layers 0-3, rank 1
layers 4-7). Two TP-2 servers started together, KVPP off and on (active-block
broadcast), one core per rank (``SGLANG_CPU_OMP_THREADS_BIND``), without
``--max-total-tokens`` so SGLang sizes the slot space from a KV byte budget, and with
``--chunked-prefill-size 64`` so longer prompts run as several chunks.

Workload: a short prompt, a prompt of three chunks (later chunks read the earlier
ones through the broadcast), a prefix cached by the radix cache then hit by four
concurrent requests of different lengths and output lengths (requests join and leave
the decode batch: churn). Checked:

* tokens and logprobs equal, cache hits really happened;
* each rank's allocation, measured by the pool from its tensors' storages (logged),
  equals its owned bundles + two 2 MiB-aligned scratch buffers computed here from the
  model config and SGLang's slot count -- and agrees with the capacity planner's row;
* both ranks saw forwards with history (they broadcast);
* ``max_total_num_tokens`` with KVPP vs without, from the same fixed KV byte budget
  per rank (``SGLANG_ASCEND_OFFLOAD_KV_BUDGET_BYTES``: on a CPU SGLang would size from
  free host memory, which other processes move): SGLang's per-token cost of 8 layers
  vs KVPP's 4 owned + 2 scratch, so the factor is ``8 / 6`` (to the token).

``--tp-size 3`` is not served: the tiny model's 4 attention heads do not split over 3
ranks (SGLang requires heads % tp == 0); odd groups are covered by
``test_kvpp_pool.py`` (3 processes over gloo with the real backend and pool).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import CPU_SERVER_ARGS, IDLE_SLEEP, REPO, ServerProcess, stop_all

pytestmark = pytest.mark.slow

VOCAB = 1024
TINY_DSA_8L = REPO / "tests" / "fixtures" / "tiny_dsa_8l"
PAGE = 64  # SGLang's page size for DSA models off NPU


BUDGET = 64 * 2**20  # KV bytes per rank (fixed: SGLang would size from free host memory, which others move)
ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_ASCEND_OFFLOAD_KV_BUDGET_BYTES": str(BUDGET)}


def _base_args() -> list:
    args, skip = [], False
    for a in CPU_SERVER_ARGS:
        if skip:
            skip = False
            continue
        if a == "--max-total-tokens":
            skip = True
            continue
        args.append(str(TINY_DSA_8L) if a.endswith("tiny_dsa") else a)
    return args + ["--tp-size", "2", "--chunked-prefill-size", "64", "--max-running-requests", "6"] + IDLE_SLEEP


def prompt(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 8) + 4 for i in range(n)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvpp_servers")
    off = ServerProcess(log_path=root / "off.log", base_args=_base_args(), env=ENV)
    on = ServerProcess(["--enable-kvpp", "--kvpp-config", json.dumps({"broadcast": "active"})],
                       log_path=root / "on.log", base_args=_base_args(), env=ENV)
    with ThreadPoolExecutor(2) as pool:
        errors = [f.exception() for f in [pool.submit(s.start) for s in (off, on)]]
    try:
        if any(errors):
            raise next(e for e in errors if e)
        yield off, on, root
    finally:
        stop_all(off, on)


def run_workload(srv: ServerProcess) -> dict:
    out = {"short": srv.generate(prompt(40, 1), max_new_tokens=8, return_logprob=True),
           "chunked": srv.generate(prompt(150, 2), max_new_tokens=8, return_logprob=True)}
    prefix = prompt(130, 3)
    srv.generate(prefix, max_new_tokens=1)  # two pages of the prefix are now in the radix cache
    jobs = [(prefix + prompt(5 + 9 * i, 10 + i), 4 + 3 * i) for i in range(4)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        out["shared"] = list(ex.map(lambda j: srv.generate(j[0], max_new_tokens=j[1], return_logprob=True), jobs))
    return out


def answers(result):
    items = result if isinstance(result, list) else [result]
    return [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in items]


def test_kvpp_equals_replicated_pool_and_allocates_owned_plus_scratch(pair):
    from sglang_ascend_offload.capacity import CapacityInputs, footprints
    from sglang_ascend_offload.model_specs import load_hf_config

    off, on, root = pair
    with ThreadPoolExecutor(2) as ex:
        f_off, f_on = ex.submit(run_workload, off), ex.submit(run_workload, on)
        results = {"off": f_off.result(), "on": f_on.result()}
    for name in results["off"]:
        assert answers(results["on"][name]) == answers(results["off"][name]), f"{name} differs with KVPP"
    assert all(r["meta_info"]["cached_tokens"] >= 128 for r in results["on"]["shared"])
    assert [len(r["output_ids"]) for r in results["on"]["shared"]] == [4, 7, 10, 13]

    log = (root / "on.log").read_text(errors="replace")
    assert "Traceback" not in log
    tokens = {k: json.loads(s.get("/get_server_info"))["max_total_num_tokens"] for k, s in (("off", off), ("on", on))}
    slot_rows = (tokens["on"] // PAGE + 1) * PAGE
    cfg = json.loads((TINY_DSA_8L / "config.json").read_text())
    row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg["index_head_dim"]) * 2  # bf16 bytes / token / layer
    align = 2 * 1024 * 1024
    scratch = -(-row * slot_rows // align) * align
    model = load_hf_config(str(TINY_DSA_8L))
    planner = footprints(model, CapacityInputs(hbm_bytes=2**34, host_bytes=2**34, tp=2, page_size=PAGE))[0]["kvpp"][0]
    for rank, owned in ((0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])):
        m = re.search(rf"KVPP rank {rank}/2: owns layers \[([0-9, ]*)\] of 8; allocated (\d+) bytes.*slot rows (\d+)",
                      log)
        assert m, f"rank {rank} did not log its KVPP allocation"
        assert [int(x) for x in m.group(1).split(",")] == owned
        assert int(m.group(3)) == slot_rows
        measured = int(m.group(2))
        assert measured == len(owned) * row * slot_rows + 2 * scratch, (rank, measured)
        # capacity planner's KVPP row (rank 0 owns the most): per token x slots + fixed alignment allowance
        planned = planner.device_per_token * slot_rows + planner.device_fixed
        assert measured <= planned < measured + 2 * align
        assert re.search(rf"KVPP rank {rank} stats: forwards=\d+ with_history=[1-9]", log), \
            f"rank {rank} never ran a forward with history"
    ratio = tokens["on"] / tokens["off"]
    print(f"\nmax_total_num_tokens from {BUDGET} B per rank: off {tokens['off']}, KVPP {tokens['on']} "
          f"(x{ratio:.4f}; plan formula 8 / (4 + 2) = x{8 / 6:.4f})")
    cell_off = int(re.search(r"KVPP: device KV per token \d+ B instead of (\d+) B", log).group(1))
    assert cell_off % 8 == 0  # SGLang's cost of 8 uniform layers
    page_floor = lambda n: n // PAGE * PAGE  # noqa: E731 - SGLang keeps whole pages
    assert tokens["off"] == page_floor(BUDGET // cell_off)
    assert tokens["on"] == page_floor(BUDGET // (cell_off // 8 * 6))
    assert abs(ratio - 8 / 6) < 0.01
