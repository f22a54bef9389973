"""``check-config`` and the server's startup give the same verdict.

Over generated launches (server arguments, model and offload config, seeded), the
server's startup verdict is computed as ``resolution.check`` computes it, and
``check-config`` is run on the deployment facts the server read, as JSON, through its
command's entry point. Every rule the facts decide (scope ``deployment`` in
``rules.py``) must appear in both, in the same order; every other rule the server
reports must be a ``server``-scope rule (SGLang arguments the facts do not describe,
the model files, this machine's packages).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import pytest
from startup_verdict import dsa_hf_config, server_deployment, server_verdict

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload import config_cli
from sglang_ascend_offload.rules import RULES, ids_in_scope
from sglang_ascend_offload.testing.sglang_args import server_args_stub

CASES = 300


def _graph_config(rng: random.Random) -> Any:
    if rng.random() < 0.4:
        return None
    backend = lambda: rng.choice(["disabled", "full", "piecewise"])  # noqa: E731
    return SimpleNamespace(prefill=SimpleNamespace(backend=backend()), decode=SimpleNamespace(backend=backend()))


def _server_args(rng: random.Random) -> Dict[str, Any]:
    role = rng.choice(["null", "null", "prefill", "decode"])
    args: Dict[str, Any] = dict(
        device=rng.choice(["cpu", "cpu", "npu", "cuda"]),
        tp_size=rng.choice([1, 2, 4]),
        dp_size=rng.choice([1, 1, 2]),
        enable_dp_attention=rng.random() < 0.3,
        pp_size=rng.choice([1, 1, 1, 2]),
        dcp_size=rng.choice([1, 1, 1, 2]),
        attn_cp_size=rng.choice([1, 1, 1, 2]),
        disaggregation_mode=role,
        page_size=rng.choice([16, 64]),
        kv_cache_dtype=rng.choice(["auto", "auto", "fp8_e4m3"]),
        disable_cuda_graph=rng.random() < 0.5,
        cuda_graph_config=_graph_config(rng),
        enable_torch_compile=rng.random() < 0.3,
        disable_overlap_schedule=rng.random() < 0.7,
        attention_backend=rng.choice([None, "ascend_offload", "ascend_offload", "torch_native"]),
        enable_hierarchical_cache=rng.random() < 0.05,
        enable_hisparse=rng.random() < 0.05,
    )
    if role != "null":
        args["disaggregation_transfer_backend"] = rng.choice(["ascend_offload", "ascend_offload", "mooncake"])
        args["disaggregation_decode_retraction_backup"] = rng.choice(["cpu_tensor", "cpu_tensor", None])
    if rng.random() < 0.4:
        steps = rng.choice([1, 2, 3])
        args.update(
            speculative_algorithm=rng.choice(["NEXTN", "NEXTN", "EAGLE", "EAGLE3", "STANDALONE"]),
            speculative_num_steps=steps,
            speculative_eagle_topk=rng.choice([1, 1, 1, 2]),
            speculative_num_draft_tokens=steps + rng.choice([1, 1, 1, 2]),
            speculative_adaptive=rng.random() < 0.15,
        )
    return args


def _model(rng: random.Random) -> Any:
    kind = rng.choice(["dsa", "dsa", "dsa", "mla", "hybrid"])
    if kind == "mla":
        return dsa_hf_config(architectures=["DeepseekV3ForCausalLM"], index_topk=None)
    if kind == "hybrid":
        return dsa_hf_config(layer_types=["sliding_attention", "full_attention"])
    return dsa_hf_config(num_hidden_layers=rng.choice([2, 4]))


def _config(rng: random.Random) -> cfg.OffloadConfig:
    sections: Dict[str, Any] = {}
    if rng.random() < 0.6:
        sections["sparse_decode"] = cfg.SparseDecodeOffloadConfig(
            hot_tokens=rng.choice([None, 8, 32, 64, 100, 256]),
            ops=rng.choice(["auto", "auto", "reference", "npu"]),
            indexer_dtype=rng.choice(["bf16", "bf16", "bf16", "int8"]),
            fused_lim=rng.choice([None, None, True]),
            record_trace=rng.choice([None, None, None, "/tmp/trace.npz"]),
            verify_sample_rate=rng.choice([0.0, 0.0, 1e-3]),
        )
    if rng.random() < 0.35:
        sections["layerwise_prefill"] = cfg.LayerwisePrefillOffloadConfig(
            shared_buffers=rng.choice([None, 1]),
            store_backend=rng.choice([None, "local", "memcache"]),
            store_block_tokens=rng.choice([None, None, 16]),
        )
    if rng.random() < 0.35:
        sections["pd_transfer"] = cfg.PDTransferConfig(
            engine=rng.choice(["memfabric", "mooncake"]), peer_tp=rng.choice([None, 1, 2, 3])
        )
    if rng.random() < 0.25:
        sections["kvpp"] = cfg.KVPPConfig()
    return cfg.OffloadConfig(**sections)


def _check_config_ids(config: cfg.OffloadConfig, deployment: cfg.Deployment) -> List[str]:
    """``python -m sglang_ascend_offload check-config --json`` on these two documents."""
    parser = argparse.ArgumentParser()
    config_cli.add_arguments(parser)
    args = parser.parse_args(["--config", cfg.to_json(config), "--deployment", cfg.to_json(deployment), "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = config_cli.main(args)
    answer = json.loads(out.getvalue())
    assert (code == 0) == answer["ok"]
    return [v["rule"] for v in answer["violations"]]


def _generated() -> List[Tuple[Dict[str, Any], Any, cfg.OffloadConfig, Any]]:
    rng = random.Random(20261204)
    cases = []
    for _ in range(CASES):
        args = _server_args(rng)
        soc = rng.choice(["Ascend910_9391", "Ascend950DT"]) if args["device"] == "npu" else None
        cases.append((args, _model(rng), _config(rng), soc))
    return cases


def test_check_config_and_the_server_agree_on_every_generated_launch(monkeypatch):
    monkeypatch.delenv("SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD", raising=False)
    deployment_scope = set(ids_in_scope("deployment"))
    seen = set()
    refused = accepted = 0
    for args, hf, config, soc in _generated():
        server = [v.rule for v in server_verdict(config, hf_config=hf, soc=soc, **args)]
        deployment = server_deployment(config, server_args_stub(**args), hf, soc)
        assert cfg.parse_deployment(cfg.to_json(deployment)) == deployment  # the facts survive JSON
        cli = _check_config_ids(config, deployment)
        context = f"server args {args}, model {vars(hf)}, config {cfg.to_json(config)}"
        assert [r for r in server if r in deployment_scope] == cli, context
        assert all(RULES[r].scope == "server" for r in server if r not in deployment_scope), context
        seen |= set(cli)
        refused += bool(cli)
        accepted += not server
    # the generator reaches both verdicts and most of the rules the facts decide
    assert refused > CASES // 4 and accepted > CASES // 20, (refused, accepted)
    assert len(seen) >= 30, sorted(deployment_scope - seen)


def test_kvpp_with_layerwise_prefill_is_refused_by_both_with_one_rule_id():
    """On one colocated node: ``check-config`` and the server refuse it with
    ``kvpp.layerwise_prefill``, and the server's reason is that same violation."""
    config = cfg.OffloadConfig(
        kvpp=cfg.KVPPConfig(), layerwise_prefill=cfg.LayerwisePrefillOffloadConfig(store_backend="local")
    )
    args = dict(device="cpu", tp_size=2, attention_backend="ascend_offload", page_size=64)
    server = server_verdict(config, **args)
    deployment = server_deployment(config, server_args_stub(**args))
    assert [v.rule for v in server] == _check_config_ids(config, deployment) == ["kvpp.layerwise_prefill"]


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_every_registered_rule_states_what_it_requires_and_its_fix(rule_id):
    rule = RULES[rule_id]
    assert rule.requires and rule.fix and rule.scope in ("input", "deployment", "server")
