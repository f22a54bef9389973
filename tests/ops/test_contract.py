"""The operator contract (``ops/contract.py``): one signature per op that every rung
takes, and explicit registration without import side effects."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sglang_ascend_offload.ops import contract, registry


def test_every_registered_rung_takes_its_ops_contract_signature():
    registry.ensure_registered()
    assert set(registry.ops()) == set(contract.OP_SIGNATURES)
    checked = 0
    for op in registry.ops():
        impls = registry.implementations(op)
        assert "reference" in impls, f"op {op} has no reference rung"
        for rung, impl in impls.items():
            assert impl.op == op and impl.rung == rung
            assert contract.signature_mismatch(op, impl.fn) is None, (op, rung)
            checked += 1
    assert checked >= 2 * len(contract.OP_SIGNATURES)  # every op has at least two rungs


def _copy(host, hot, miss_tokens, miss_slots, miss_count, token_table):
    return None


def _copy_renamed(host, hot, miss_tokens, miss_slots, miss_count, table):
    return None


def _copy_extra(host, hot, miss_tokens, miss_slots, miss_count, token_table, stream=None):
    return None


def _indexer_wrong_default(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query,
    actual_seq_lengths_key,
    block_table,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=1024,
    sparse_mode=3,
):
    return None


def _indexer_positional(
    query,
    key,
    weights,
    actual_seq_lengths_query,
    actual_seq_lengths_key,
    block_table,
    layout_query="TND",
    layout_key="PA_BSND",
    sparse_count=2048,
    sparse_mode=3,
):
    return None


def test_implements_checks_the_signature_and_marks_without_registering():
    before = dict(registry._REGISTRY.impls)
    fn = contract.implements("copy_miss_rows", "triton")(_copy)
    impl = getattr(fn, contract.IMPL_ATTR)
    assert (impl.op, impl.rung, impl.fn) == ("copy_miss_rows", "triton", _copy)
    assert registry._REGISTRY.impls == before  # marking changes no global state

    for bad, word in ((_copy_renamed, "token_table"), (_copy_extra, "stream")):
        with pytest.raises(TypeError, match=word):
            contract.implements("copy_miss_rows", "reference")(bad)
    with pytest.raises(TypeError, match="sparse_count"):
        contract.implements("lightning_indexer", "npu")(_indexer_wrong_default)
    with pytest.raises(TypeError, match="keyword"):
        contract.implements("lightning_indexer", "npu")(_indexer_positional)
    with pytest.raises(TypeError, match="unknown op"):
        contract.implements("no_such_op", "reference")(_copy)
    with pytest.raises(ValueError, match="unknown rung"):
        contract.implements("copy_miss_rows", "cuda")


def test_importing_implementations_registers_nothing_until_ensure_registered():
    """In a fresh interpreter: importing every implementation module (in the order that
    used to matter) leaves the registry empty; the first query fills it completely."""
    code = textwrap.dedent("""
        import importlib
        from sglang_ascend_offload.ops import registry
        for name in reversed(registry.IMPL_MODULES):
            importlib.import_module(name)
        assert registry._REGISTRY.impls == {} and not registry._REGISTRY.loaded, registry._REGISTRY
        impl = registry.select("residency_manage", "reference")
        from sglang_ascend_offload.ops.residency import residency_manage
        assert impl.fn is residency_manage
        print(len(registry._REGISTRY.impls))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    registry.ensure_registered()
    assert int(out.stdout.split()[-1]) == len(registry._REGISTRY.impls)
