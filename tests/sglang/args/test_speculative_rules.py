"""Startup limits of speculative decoding with sparse decode offload (rule
``sglang.sparse_decode_speculative``, decided by the deployment facts in
``config.violations``) and
what SGLang's resolution leaves for it: the NextN / MTP chain is accepted, everything
outside it is refused with its reason.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import TINY_DSA
from startup_verdict import server_deployment, server_verdict

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.rules import RULES
from sglang_ascend_offload.sglang_plugin.args import carrier, flags
from sglang_ascend_offload.testing.sglang_args import server_args_stub

TINY_DSA_MTP = TINY_DSA.parent / "tiny_dsa_mtp"
RULE = "sglang.sparse_decode_speculative"


def view(**kw):
    base = dict(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
        disable_overlap_schedule=True,
        device="cpu",
        disable_cuda_graph=True,
        cuda_graph_config=None,
        enable_torch_compile=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "args, expect",
    [
        (dict(), None),
        (dict(speculative_algorithm="NEXTN", speculative_num_steps=1, speculative_num_draft_tokens=2), None),
        (dict(speculative_algorithm="EAGLE3"), "only the NextN / MTP draft"),
        (dict(speculative_algorithm="NGRAM"), "only the NextN / MTP draft"),
        (dict(speculative_eagle_topk=4), "--speculative-eagle-topk 4"),
        (dict(speculative_num_draft_tokens=6), "exactly steps + 1 verify rows"),
        (dict(disable_overlap_schedule=False), "overlap scheduling"),
        (
            dict(
                device="npu",
                disable_cuda_graph=False,
                cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")),
            ),
            "decode graphs",
        ),
        (
            dict(
                device="cuda",
                disable_cuda_graph=False,
                cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")),
            ),
            "decode graphs",
        ),
        # CPU + torch.compile: the plugin's CPU verify graph runner serves it (cpu_spec_graph.py)
        (
            dict(
                disable_cuda_graph=False,
                enable_torch_compile=True,
                cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")),
            ),
            None,
        ),
        (
            dict(
                disable_cuda_graph=False,
                enable_torch_compile=False,  # CPU without torch.compile: eager decode
                cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")),
            ),
            None,
        ),
    ],
)
def test_speculative_limits(args, expect):
    """The server's whole startup verdict on these arguments, and ``check-config``'s on the
    deployment facts the server read, both hold exactly this rule."""
    sd = cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(hot_tokens=64 * 6))
    server = dict(vars(view(**args)), page_size=64, attention_backend="ascend_offload")
    # this machine has no fused AscendC extension: on "npu" that server-scope rule is reported too
    problems = [v for v in server_verdict(sd, **server) if RULES[v.rule].scope != "server"]
    deployment = server_deployment(sd, server_args_stub(**server))
    assert [v.rule for v in cfg.violations(sd, deployment)] == [v.rule for v in problems]
    if expect is None:
        assert problems == []
    else:
        assert [p.rule for p in problems] == [RULE]
        assert expect in problems[0].problem and problems[0].fix


def test_the_nextn_chain_with_offload_resolves_and_is_published(plugins_loaded, clean_state):
    """SGLang's resolution of a NextN chain (4 draft steps, 5 verify rows) with sparse
    decode offload: the plugin's backend, the deployment facts the rules decide on, and
    the published config with the hot buffer default sized for the verify rows."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.server_args import ServerArgs

    from sglang_ascend_offload.sglang_plugin.args.deployment import deployment_from_server_args
    from sglang_ascend_offload.sglang_plugin.names import BACKEND_NAME

    steps, top_k = 4, 16  # top_k: the fixture's index_topk
    flags.remember(
        flags.RawFlags(
            enabled={"sparse_decode": True, "layerwise_prefill": False},
            configs={"sparse_decode": "{}", "layerwise_prefill": None},
        )
    )
    server_args = ServerArgs(
        model_path=str(TINY_DSA_MTP),
        device="cpu",
        load_format="dummy",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        speculative_algorithm="NEXTN",
        speculative_num_steps=steps,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=steps + 1,
        page_size=16,
    )
    server_args.resolve_once()
    resolved = resolving_view(server_args)
    assert resolved.attention_backend == BACKEND_NAME  # selected by the plugin, not given
    assert resolved.speculative_algorithm == "EAGLE"  # SGLang's NEXTN alias
    assert resolved.disable_overlap_schedule  # the chain is set up on the host each round
    # The facts the speculative rules and the hot_tokens default are decided on.
    facts = deployment_from_server_args(server_args)
    assert (
        facts.speculative_method,
        facts.speculative_steps,
        facts.speculative_rows,
        facts.speculative_topk,
        facts.speculative_fixed,
        facts.overlap_schedule,
        facts.decode_graph_mode,
    ) == ("mtp", steps, steps + 1, 1, True, False, "eager")
    assert facts.index_topk == top_k
    # SGLang resolves the page size of a DeepSeek-family model itself (page_size=16 given).
    page = resolved.page_size
    assert facts.page_size == page

    published = carrier.active_config()  # what every scheduler process will build its pools from
    # The default made explicit: plain decode's 2 x 16 = 32 rounded up to the page size, with
    # or without the verify rows (a round whose union exceeds it overflows); the old worst-case
    # size, 5 verify rows x 16 = 80 rounded up, differs (the guard keeps the case able to tell).
    hot = -(-2 * top_k // page) * page
    assert hot != -(-(steps + 1) * top_k // page) * page
    # Everything else stays at its default: no other field is changed by the resolution.
    assert published == cfg.OffloadConfig(sparse_decode=cfg.SparseDecodeOffloadConfig(hot_tokens=hot))


def test_the_nextn_chain_with_a_hot_buffer_below_top_k_is_refused(plugins_loaded, clean_state):
    """4 verify rows x top-k 16 share one hot buffer: hot_tokens 8 < top-k 16 cannot hold
    one row's top-k, so the launch stops with the rule (and nothing is published); any
    size from top-k up serves (a round whose union exceeds it overflows)."""
    from sglang.srt.server_args import ServerArgs

    flags.remember(
        flags.RawFlags(
            enabled={"sparse_decode": True, "layerwise_prefill": False},
            configs={"sparse_decode": '{"hot_tokens": 8}', "layerwise_prefill": None},
        )
    )
    with pytest.raises(cfg.ConfigError) as info:
        ServerArgs(
            model_path=str(TINY_DSA_MTP),
            device="cpu",
            load_format="dummy",
            skip_tokenizer_init=True,
            disable_cuda_graph=True,
            speculative_algorithm="NEXTN",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            page_size=16,
        ).resolve_once()
    assert "sparse_decode.hot_tokens_topk" in [v.rule for v in info.value.violations]
    assert carrier.published_text() is None


def test_adaptive_draft_counts_with_offload_are_refused(plugins_loaded, clean_state):
    from sglang.srt.server_args import ServerArgs

    flags.remember(
        flags.RawFlags(
            enabled={"sparse_decode": True, "layerwise_prefill": False},
            configs={"sparse_decode": "{}", "layerwise_prefill": None},
        )
    )
    with pytest.raises(cfg.ConfigError) as info:
        ServerArgs(
            model_path=str(TINY_DSA_MTP),
            device="cpu",
            load_format="dummy",
            skip_tokenizer_init=True,
            disable_cuda_graph=True,
            speculative_algorithm="NEXTN",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            speculative_adaptive=True,
        ).resolve_once()
    assert "sparse_decode.speculative" in [v.rule for v in info.value.violations]


def test_mtp_fixture_is_tiny_dsa_plus_one_nextn_layer():
    """The NextN fixture's target layers are the plain fixture's (same dummy weights,
    so served tokens of the two fixtures are comparable); it adds one NextN layer."""
    import json

    plain = json.loads((TINY_DSA / "config.json").read_text())
    mtp = json.loads((TINY_DSA_MTP / "config.json").read_text())
    assert mtp == {**plain, "num_nextn_predict_layers": 1}
