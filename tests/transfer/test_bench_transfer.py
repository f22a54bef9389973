"""``bench transfer --json`` runs end to end (tiny sizes) and reports the agreed keys."""

import importlib.util
import json

import pytest

from sglang_ascend_offload import cli

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                 reason="needs mooncake-transfer-engine-non-cuda"),
              pytest.mark.timeout(180)]


def test_bench_transfer_json(capsys):
    rc = cli.main(["bench", "transfer", "--json", "--layers", "2", "--tokens", "256", "--block-tokens", "64",
                   "--overhead-layers", "4", "--layer-timeout", "0.3"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("engine_bytes_per_s", "memcpy_bytes_per_s", "per_layer_overhead_us", "verified", "scenarios"):
        assert key in out
    assert out["verified"] is True
    assert out["engine_bytes_per_s"] > 0 and out["memcpy_bytes_per_s"] > 0
    # 2 layers x 4 blocks x 64 tokens x (1024 + 128 + 256) bytes
    assert out["bytes_moved"] == 2 * 4 * 64 * (1024 + 128 + 256)
    names = {s["name"] for s in out["scenarios"]}
    assert {"read_failure", "dropped_answer", "dead_decode", "decode_slower_than_deadline",
            "malformed_ready"} <= names
    for s in out["scenarios"]:
        assert set(s) >= {"name", "outcome", "hung", "destination_used_after_failure", "leaked_slots"}
        assert s["hung"] is False and s["leaked_slots"] == 0 and s["destination_used_after_failure"] is False
        assert s["outcome"] == "done" if s["name"] == "read_retry_recovers" else s["outcome"].startswith("failed")
