"""Served: NextN speculation at plain decode's hot buffer, and rounds beyond it (issue 50).

Three servers of the trained checkpoint ``tests/fixtures/tiny_dsa_trained`` (real weights,
its own trained NextN layer as the draft, real acceptance; top-k 64, page 64) with
DeepSeek-V3.2's MTP-3 chain (``--speculative-num-steps 3 --speculative-num-draft-tokens
4``), started together:

* ``plain``: no offload (the reference): the session's shared ``mtp_reference`` server
  (``test_speculative_offload_e2e_cpu.py``'s settings, launched once, its cache flushed);
* ``default``: sparse decode offload with the default hot buffer, ``2 x top-k`` = 128
  slots per request for its 4 verify rows (the old rule asked for 4 x 64 = 256): a round
  whose union exceeds 128 is served from the overflow area (``sparse_decode/overflow.py``);
* ``tight``: offload with ``hot_tokens`` 64 = top-k, the least the rule allows: nearly
  every round overflows.

Greedy requests of held-out source text (a prompt of 900 tokens, several hot buffers
long, then a concurrent batch of three) must be token-identical on the three servers,
with real drafts accepted (``spec_accept_length > 1``). The offload servers run shadow
verification on every layer step (``verify_sample_rate`` 1.0: one sampled verify row's
attention recomputed over the host pool, bit-exact on this reference path) and must report
no mismatch; ``tight`` must count overflow rounds (``overflow_rounds > 0`` in its
Prometheus counters, per layer, with their positions). The overflow exactness itself is
held op by op in ``tests/sparse_decode/test_overflow.py``; this module holds it served.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import IDLE_SLEEP, ServerProcess

from sglang_ascend_offload.testing import pd_servers
from sglang_ascend_offload.testing import teacher_forcing as tf
from sglang_ascend_offload.testing.servers import TINY_DSA_TRAINED, trained_args

pytestmark = pytest.mark.slow

MODEL = TINY_DSA_TRAINED
TOP_K = 64
SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"]
SPEC += ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
COMMON = pd_servers.COMMON + SPEC + IDLE_SLEEP  # the shared mtp_reference server's settings
SHARED_SERVERS = ("mtp_reference",)


def _offload(hot_tokens=None) -> list:
    cfg = {"verify_sample_rate": 1.0, "verify_action": "log", "metrics_export_interval_s": 0}
    if hot_tokens is not None:
        cfg["hot_tokens"] = hot_tokens
    return ["--enable-metrics", "--enable-sparse-decode-offload", "--sparse-decode-offload-config", json.dumps(cfg)]


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, shared_servers):
    root = tmp_path_factory.mktemp("spec_overflow")
    base = trained_args(MODEL)
    made = {
        "plain": shared_servers.get("mtp_reference", COMMON, base_args=base),
        "default": ServerProcess(COMMON + _offload(), base_args=base, log_path=root / "default.log"),
        "tight": ServerProcess(COMMON + _offload(TOP_K), base_args=base, log_path=root / "tight.log"),
    }
    try:
        shared_servers.start_all(*made.values())
        yield made
    finally:
        shared_servers.stop_all(request.module.__name__, *made.values())


def counter(server, name: str) -> float:
    """Sum over layers and ranks of ``sglang:ascend_offload_<name>_total``."""
    text = server.get("/metrics")
    found = re.findall(rf"^sglang:ascend_offload_{name}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def _requests(server) -> list:
    """The long prompt alone, then the batch of three together: (output ids, accept length)."""
    w = tf.heldout_windows(MODEL)
    out = [server.generate(w[0][:900], max_new_tokens=40, timeout=600)]
    batch = [w[1][:300], w[2][:520], w[3][:160]]
    out += server.generate(batch, max_new_tokens=[32, 24, 28], timeout=600)
    return [(o["output_ids"], o["meta_info"].get("spec_accept_length")) for o in out]


def test_the_default_and_the_least_hot_buffer_serve_nextn_token_identical(servers):
    got = {name: _requests(srv) for name, srv in servers.items()}
    plain = [ids for ids, _ in got["plain"]]
    for name in ("default", "tight"):
        assert [ids for ids, _ in got[name]] == plain, f"{name}: tokens differ from the server without offload"
    accept = [a for _, a in got["plain"]]
    assert all(a is not None and a > 1.0 for a in accept), f"real drafts accepted: {accept}"
    for name in ("default", "tight"):
        srv = servers[name]
        checks, mismatches = counter(srv, "shadow_checks"), counter(srv, "shadow_mismatches")
        rounds, positions = counter(srv, "overflow_rounds"), counter(srv, "overflow_positions")
        print(
            f"{name}: shadow checks {checks:.0f} mismatches {mismatches:.0f}; overflow {rounds:.0f} rounds, "
            f"{positions:.0f} positions; accept lengths {[a for _, a in got[name]]}"
        )
        assert checks > 0 and mismatches == 0, name
        assert positions >= rounds
    assert counter(servers["tight"], "overflow_rounds") > 0, "hot_tokens = top-k: verify rounds must overflow"
    assert counter(servers["tight"], "overflow_positions") > counter(servers["default"], "overflow_positions")
