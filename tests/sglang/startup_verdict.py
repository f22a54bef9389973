"""The server's startup verdict on stand-in server arguments, for rule tests.

:func:`server_verdict` runs what ``resolution.check`` runs at startup (the deployment
facts read from the arguments, then :func:`resolution.startup_violations`) on a
``server_args_stub`` and a DSA model config, without SGLang's resolution pipeline.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Optional

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.sglang_plugin.args import resolution
from sglang_ascend_offload.sglang_plugin.args.deployment import build_deployment
from sglang_ascend_offload.sglang_plugin.args.rules.pd_transfer import with_pd_facts
from sglang_ascend_offload.testing.sglang_args import server_args_stub


def dsa_hf_config(**overrides: Any) -> SimpleNamespace:
    """The HF config fields of the tiny DSA fixture (``tests/fixtures/tiny_dsa``)."""
    fields = dict(
        architectures=["DeepseekV32ForCausalLM"],
        num_hidden_layers=2,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        index_topk=16,
        index_head_dim=128,
        index_n_heads=4,
        torch_dtype="bfloat16",
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def server_deployment(
    config: cfg.OffloadConfig, view: Any, hf_config: Any = None, soc: Optional[str] = None
) -> cfg.Deployment:
    """The deployment facts the server reads from ``view`` (P/D facts included)."""
    return with_pd_facts(build_deployment(view, hf_config or dsa_hf_config(), soc), config, view)


def server_verdict(
    config: cfg.OffloadConfig, hf_config: Any = None, soc: Optional[str] = None, **server_args: Any
) -> List[cfg.Violation]:
    """Every violation the server's startup reports for ``config`` with these arguments
    (each other argument at SGLang's default)."""
    view = server_args_stub(**server_args)
    hf = hf_config or dsa_hf_config()
    return resolution.startup_violations(config, server_deployment(config, view, hf, soc), view, view, hf)


def server_rule_ids(config: cfg.OffloadConfig, **server_args: Any) -> List[str]:
    return [v.rule for v in server_verdict(config, **server_args)]
