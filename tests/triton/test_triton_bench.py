"""``bench kernels``: runs both rungs side by side and reports a real correctness check."""

import json

import pytest

pytest.importorskip("triton")

from sglang_ascend_offload import cli  # noqa: E402


def test_bench_kernels_json_reports_both_kernels_correct(capsys):
    rc = cli.main(
        [
            "bench",
            "kernels",
            "--rows",
            "2",
            "--top-k",
            "8",
            "--hot-tokens",
            "12",
            "--dim",
            "10",
            "--repeat",
            "1",
            "--warmup-steps",
            "3",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["all_correct"] is True
    assert [k["name"] for k in out["kernels"]] == ["residency_manage", "copy_miss_rows"]
    assert out["shape"] == {"rows": 2, "top_k": 8, "hot_tokens": 12, "dim": 10, "dtype": "bfloat16"}
    assert out["workload"]["hits"] > 0 and out["workload"]["misses"] > 0
    for k in out["kernels"]:
        assert k["reference_ms"] > 0 and k["triton_ms"] > 0
    if out["device"] == "cpu":
        assert out["triton_mode"] == "interpreter" and "only the correctness" in out["note"]


def test_bench_kernels_table_and_argument_errors(capsys):
    assert cli.main(["bench", "kernels", "--rows", "1", "--top-k", "4", "--dim", "3", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    assert "residency_manage" in text and "copy_miss_rows" in text and "NO" not in text
    assert cli.main(["bench", "kernels", "--top-k", "8", "--hot-tokens", "4"]) == 2
    assert "--hot-tokens must be >= --top-k" in capsys.readouterr().err
