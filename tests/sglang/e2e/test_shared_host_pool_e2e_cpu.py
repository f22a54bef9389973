"""End to end on CPU: one host KV pool per attention-DP group, shared by its TP ranks.

Servers (tiny DSA fixture, ranks bound to the two cores), started together:

* ``off``: ``--tp-size 2``, offload off (device KV pool);
* ``on``: ``--tp-size 2`` with sparse decode offload and a 144 MiB host pool
  (``host_pool_tokens`` 65536) so that a second copy would stand out of the noise;
* ``dp``: ``--tp-size 2 --dp-size 2 --enable-dp-attention`` with offload (attention TP 1
  per group: two groups, two pools). Tokens / logprobs under DP attention are compared
  with offload off by ``test_dp_attention_e2e_cpu.py``.

Checked: greedy tokens and logprobs equal with offload on and off under churn (requests
of different lengths join and leave the decode batch, hot buffers smaller than the
context) and a radix-cache hit; the pool exists once: each TP rank maps the same
(deleted: no file left) mapping, the mapping's Pss summed over the ranks is one pool,
and each rank's private anonymous memory is not larger than with offload off by
anything near the pool's size (``/proc/<pid>/smaps``, ``smaps_rollup``); the startup
log states the pool and the host bytes per node with the planner's formula; killing
TP rank 0 (the pool's owner) makes the server exit with an error instead of hanging.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from conftest import IDLE_SLEEP, ServerProcess, start_all, stop_all

from sglang_ascend_offload.testing import harness
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args
from sglang_ascend_offload.testing.teacher_forcing import heldout_prompt

pytestmark = pytest.mark.slow

POOL_TOKENS = 65536
LAYERS, ROW_BYTES = 2, 1152  # tiny_dsa_trained: 2 layers, 512 latent + 64 rope bf16
BASE = trained_args(TINY_DSA_TRAINED)  # real weights: a rank reading another's rows moves the argmax
POOL_BYTES = LAYERS * POOL_TOKENS * ROW_BYTES
OFFLOAD = [
    "--enable-sparse-decode-offload",
    "--sparse-decode-offload-config",
    json.dumps({"hot_tokens": 64, "host_pool_tokens": POOL_TOKENS}),
]
TP2 = ["--tp-size", "2", "--max-running-requests", "4"] + IDLE_SLEEP
DP2 = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--max-running-requests", "4"] + IDLE_SLEEP
# The stuck-rank test waits for this deadline; only the server it destroys gets it. It must
# exceed the lag between TP ranks while three TP-2 servers warm up at once on two loaded
# cores: at 10 s, a fresh-clone run at load 16 lost the server (exit -9) during warm-up.
DEADLINE_S = 30
ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def prompt(n: int, seed: int) -> list:
    return heldout_prompt(TINY_DSA_TRAINED, n, seed)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_pool")
    hold = root / "hold_appends"  # created by the stuck-rank test
    off = ServerProcess(TP2, log_path=root / "off.log", env=ENV, base_args=BASE)
    on = ServerProcess(
        TP2 + OFFLOAD,
        log_path=root / "on.log",
        env={
            **ENV,
            **harness.environment({"hold_appends": str(hold)}),
            "SGLANG_ASCEND_OFFLOAD_APPEND_TIMEOUT_S": str(DEADLINE_S),
        },
        base_args=BASE,
    )
    dp = ServerProcess(DP2 + OFFLOAD, log_path=root / "dp.log", env=ENV, base_args=BASE)
    start_all(off, on, dp)
    try:
        yield {"off": off, "on": on, "dp": dp, "root": root, "hold": hold}
    finally:
        stop_all(off, on, dp)


def schedulers(srv: ServerProcess) -> Dict[str, int]:
    """``{"scheduler_TP0": pid, ...}`` from the process titles SGLang sets."""
    out = {}
    for pid in srv.pids():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        m = re.search(r"scheduler_\S+", title)
        if m:
            out[m.group(0)] = pid
    return out


def pool_mappings(pid: int) -> List[Tuple[str, int, int, int, int]]:
    """``(path, inode, size, rss, pss)`` of each shared host pool mapping of ``pid`` (bytes)."""
    maps, cur = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ (\d+)\s*(.*)$", line)
        if head:
            cur = None
            if "sao_hostpool" in head.group(4):
                cur = [head.group(4), int(head.group(3)), int(head.group(2), 16) - int(head.group(1), 16), 0, 0]
                maps.append(cur)
            continue
        if cur is not None and line.startswith(("Rss:", "Pss:")):
            cur[3 if line.startswith("Rss") else 4] = int(line.split()[1]) * 1024
    return [tuple(m) for m in maps]


def anonymous_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no Anonymous line in /proc/{pid}/smaps_rollup")


def test_tp2_offload_matches_offload_off_with_churn_and_a_radix_hit(servers):
    shared = prompt(80, seed=1)
    jobs = [(shared + prompt(n, seed), out) for seed, n, out in ((2, 10, 6), (3, 60, 14), (4, 30, 3), (5, 5, 10))]
    answers = {}
    for name in ("off", "on"):
        srv = servers[name]
        first = srv.generate(shared, max_new_tokens=4, return_logprob=True)  # fills the radix cache
        with ThreadPoolExecutor(len(jobs)) as ex:
            rest = list(ex.map(lambda j: srv.generate(j[0], max_new_tokens=j[1], return_logprob=True), jobs))
        answers[name] = [first] + rest
    for i, (a, b) in enumerate(zip(answers["off"], answers["on"])):
        assert a["output_ids"] == b["output_ids"], f"request {i}"
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"], f"request {i}"
    assert max(r["meta_info"]["cached_tokens"] for r in answers["on"][1:]) >= 64  # the shared prefix was a hit
    log = (servers["root"] / "on.log").read_text(errors="replace")
    assert "Traceback" not in log


def test_the_pool_exists_once_and_ranks_do_not_hold_private_copies(servers):
    on, off = schedulers(servers["on"]), schedulers(servers["off"])
    assert sorted(on) == ["scheduler_TP0", "scheduler_TP1"], on
    maps = {name: pool_mappings(pid) for name, pid in on.items()}
    for name, m in maps.items():
        assert len(m) == 1, f"{name} maps {len(m)} host pools"
    (p0, ino0, size0, rss0, pss0), (p1, ino1, size1, rss1, pss1) = maps["scheduler_TP0"][0], maps["scheduler_TP1"][0]
    assert ino0 == ino1 and p0 == p1  # one mapping, the same file
    assert p0.endswith("(deleted)") and not Path(p0.split(" (deleted)")[0]).exists()  # no name left behind
    assert POOL_BYTES <= size0 == size1 <= POOL_BYTES + 64 * 1024
    assert min(rss0, rss1) >= 0.95 * POOL_BYTES  # populated in both ranks ...
    assert abs((pss0 + pss1) - POOL_BYTES) <= 0.05 * POOL_BYTES  # ... but resident once
    for rank in ("scheduler_TP0", "scheduler_TP1"):
        grown = anonymous_bytes(on[rank]) - anonymous_bytes(off[rank])
        # a private pool would add POOL_BYTES (144 MiB) of anonymous memory to every rank
        assert grown < POOL_BYTES / 2, f"{rank}: {grown / 2**20:.1f} MiB more private memory than offload off"
    assert pool_mappings(off["scheduler_TP0"]) == []


def _node_line(log: str, group: int) -> Tuple[int, int, int]:
    m = re.search(
        rf"host pool of attention-DP group {group}: (\d+) B = .* host bytes per node: (\d+) B "
        rf"\([\d.]+ MiB\) = (\d+) pool",
        log,
    )
    assert m, f"no startup line for group {group}"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def test_startup_log_states_pool_and_host_bytes_per_node_with_the_planner_formula(servers):
    from sglang_ascend_offload.capacity import GIB, CapacityInputs, host_pool_bytes_per_node, plan
    from sglang_ascend_offload.model_specs import load_hf_config

    model = load_hf_config(TINY_DSA_TRAINED)
    per_token = (
        plan(model, CapacityInputs(hbm_bytes=GIB, host_bytes=GIB, context=256, page_size=64, hot_tokens=64))
        .mode("sparse-decode")
        .host_bytes_per_token
    )
    assert per_token == LAYERS * ROW_BYTES
    tp_log = (servers["root"] / "on.log").read_text(errors="replace")
    assert _node_line(tp_log, 0) == (POOL_BYTES, host_pool_bytes_per_node(per_token, POOL_TOKENS, 1), 1)
    assert len(re.findall(r"host pool of attention-DP group", tp_log)) == 1  # logged once, by TP rank 0
    dp_log = (servers["root"] / "dp.log").read_text(errors="replace")
    for group in (0, 1):
        assert _node_line(dp_log, group) == (POOL_BYTES, host_pool_bytes_per_node(per_token, POOL_TOKENS, 2), 2)


def test_dp_attention_one_pool_per_attention_dp_group(servers):
    dp = servers["dp"]
    with ThreadPoolExecutor(4) as ex:  # spread over both DP groups
        outs = list(ex.map(lambda s: dp.generate(prompt(40 + 20 * s, s), max_new_tokens=6), range(4)))
    assert all(len(o["output_ids"]) == 6 for o in outs)
    ranks = schedulers(dp)
    assert len(ranks) == 2, ranks
    maps = [pool_mappings(pid) for pid in ranks.values()]
    assert all(len(m) == 1 for m in maps), maps
    assert maps[0][0][1] != maps[1][0][1]  # two groups, two pools
    assert all(m[0][3] >= 0.95 * POOL_BYTES for m in maps)
    assert "Traceback" not in (servers["root"] / "dp.log").read_text(errors="replace")


def _request_then_wait_for_exit(srv: ServerProcess, disrupt) -> Tuple[Dict[str, object], float]:
    """Start a long request, ``disrupt()`` the server while it decodes, then wait for the
    request to end and the server to exit; returns the request's outcome and the wait."""
    result: Dict[str, object] = {}

    def long_request():
        try:
            result["answer"] = srv.generate(prompt(100, seed=7), max_new_tokens=400, timeout=120)
        except Exception as exc:  # noqa: BLE001 - the failure is what is expected
            result["error"] = exc

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(2.0)  # decoding
    disrupt()
    t0 = time.monotonic()
    t.join(timeout=120)
    assert not t.is_alive(), "the request hung"
    deadline = time.monotonic() + 90
    while srv.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    waited = time.monotonic() - t0
    assert srv.proc.poll() is not None, f"server still up {waited:.0f} s later"
    assert "answer" not in result, "the request completed although the server failed"
    return result, waited


def test_stuck_tp_rank0_fails_the_step_at_the_deadline_naming_rank_and_layer(servers):
    """TP rank 0 alive but no longer publishing (fault injection): rank 1 must not read the
    unpublished rows; it fails at the deadline, and the server exits. Destroys ``on``."""
    on, hold = servers["on"], servers["hold"]
    _, waited = _request_then_wait_for_exit(on, hold.touch)
    assert waited >= DEADLINE_S
    log = (servers["root"] / "on.log").read_text(errors="replace")
    assert re.search(
        rf"AppendTimeout: sparse decode offload: attention-TP rank 1 of attention-DP group 0 waited "
        rf"{DEADLINE_S} s for TP rank 0's append #\d+ of layer [01] \(decode step \d+, rank 0 has "
        rf"published \d+",
        log,
    ), log[-4000:]


def test_killing_a_tp_rank_fails_the_server_and_leaves_no_pool_file(servers):
    """SIGKILL of a pool owner (DP attention: every rank owns its group's pool): the server
    exits with an error, no mapping file is left. Destroys ``dp``."""
    dp = servers["dp"]
    ranks = schedulers(dp)
    victim = ranks[sorted(ranks)[0]]  # the first rank (TP rank 0, attention-DP group 0)
    _request_then_wait_for_exit(dp, lambda: os.kill(victim, signal.SIGKILL))
    log = (servers["root"] / "dp.log").read_text(errors="replace")
    assert re.search(r"Connection reset by peer|crashed|Scheduler hit an exception", log), log[-3000:]
    assert not list(Path("/dev/shm").glob(f"sao_hostpool.{victim}.*"))  # nothing left behind
