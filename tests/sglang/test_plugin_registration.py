"""The plugin loads through SGLang's entry point and registers through SGLang's extension points."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import logging

import pytest

from sglang_ascend_offload.sglang_plugin import compat, entry
from sglang_ascend_offload.sglang_plugin.args import flags


def test_entry_point_is_listed():
    eps = md.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "ascend_offload"]
    assert len(ours) == 1
    assert ours[0].value == "sglang_ascend_offload.sglang_plugin.entry:register"
    assert ours[0].load() is entry.register


def test_sglang_load_plugins_runs_it(caplog):
    from sglang.srt import plugins

    with caplog.at_level(logging.INFO):
        plugins.load_plugins()
    assert entry.is_registered()
    failures = [r for r in caplog.records if "Failed to execute general plugin" in r.getMessage()]
    assert not failures, failures[0].getMessage()


def test_registered_through_sglang_extension_points(plugins_loaded):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from sglang_ascend_offload.sglang_plugin.attention.dsa_backend import BACKEND_NAME, create_backend

    assert ATTENTION_BACKENDS[BACKEND_NAME] is create_backend
    assert ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    handler = AttentionBackendRegistry.get_handler(BACKEND_NAME)
    assert handler is not AttentionBackendRegistry.get_handler("no-such-backend")  # not the triton fallback
    assert handler(object(), object()) == AttnForwardMethod.MLA
    for target in (
        compat.TARGET_ADD_CLI,
        compat.TARGET_FROM_CLI,
        compat.TARGET_POOL,
        compat.TARGET_INDEXER,
        compat.TARGET_CAPABILITY,
    ):
        assert target in HookRegistry._patched, target


def test_register_is_idempotent(plugins_loaded):
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = len(HookRegistry._hooks[compat.TARGET_ADD_CLI])
    entry.register()
    assert len(HookRegistry._hooks[compat.TARGET_ADD_CLI]) == before


def test_flags_reach_the_parser_and_survive_from_cli_args(plugins_loaded):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    help_text = parser.format_help()
    for feat in flags.FEATURES:
        assert feat.enable_flag in help_text and feat.config_flag in help_text
    ns = parser.parse_args(
        ["--model-path", "x", "--enable-sparse-decode-offload", "--sparse-decode-offload-config", '{"hot_tokens": 64}']
    )
    flags.forget()
    ServerArgs.from_cli_args(ns)
    raw = flags.pending()
    flags.forget()
    assert raw is not None
    assert raw.enabled == {feat.section: feat.section == "sparse_decode" for feat in flags.FEATURES}
    assert raw.configs["sparse_decode"] == '{"hot_tokens": 64}'


def test_version_policy_messages():
    assert entry.version_problem("0.5.23") == ""
    assert "0.5.22" in entry.version_problem("0.5.22") and "0.5.23" in entry.version_problem("0.5.22")
    assert "not installed" in entry.version_problem(None)


def test_unsupported_version_refuses_the_flags_but_not_sglang():
    refuse = flags.refusing_from_cli_args("SGLang 9.9 is installed")
    calls = []

    def original(cls, args):
        calls.append(args)
        return "server-args"

    plain = argparse.Namespace(enable_sparse_decode_offload=False, sparse_decode_offload_config=None)
    assert refuse(original, object, plain) == "server-args"
    used = argparse.Namespace(enable_sparse_decode_offload=True, sparse_decode_offload_config=None)
    with pytest.raises(flags.UnsupportedSGLangVersion, match="SGLang 9.9"):
        refuse(original, object, used)
    assert calls == [plain]
