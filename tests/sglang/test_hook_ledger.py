"""The hook ledger (``install.HOOKS``): every registration says why and how it could go,
private targets are recognised, and the generated page is current."""

from __future__ import annotations

import importlib.util

from sglang_ascend_offload.sglang_plugin import install
from sglang_ascend_offload.testing.servers import REPO


def _ledger_script():
    spec = importlib.util.spec_from_file_location("gen_hook_ledger", REPO / "scripts" / "gen_hook_ledger.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_hook_names_why_and_the_upstream_change_that_removes_it():
    missing = [h.target for h in install.FLAG_HOOKS + install.HOOKS if not h.why.strip() or not h.upstream.strip()]
    assert missing == []


def test_private_targets_are_those_with_an_underscore_in_their_path():
    private = {h.target.rsplit(".", 1)[-1] for h in install.HOOKS if h.private}
    assert private == {
        "_build_token_to_kv_pool",
        "_init_kv_manager",
        "_compute_cell_size",
        "_profile_available_bytes",
        "_resolve_memory_pool_config",
        "_create_backend",
    }
    assert not install.Hook("sglang.srt.a.B.c", "AROUND", "x:y", "why").private
    assert install.Hook("sglang.srt.a._B.c", "AROUND", "x:y", "why").private


def test_the_ledger_page_is_generated_from_the_hooks(monkeypatch):
    script = _ledger_script()
    page = script.DOC.read_text()
    assert script.render(page) == page, "docs/sglang_integration.md is stale: run scripts/gen_hook_ledger.py"
    # negative control: a changed row makes the page stale
    first = install.HOOKS[0]
    changed = install.Hook(first.target, first.kind, first.handler, first.why, upstream="something else")
    monkeypatch.setattr(install, "HOOKS", (changed,) + install.HOOKS[1:])
    assert script.render(page) != page
