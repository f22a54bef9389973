"""The plugin's assumptions about SGLang hold on the installed SGLang, and each check
fails when its assumption is broken on purpose (the negative controls below)."""

from __future__ import annotations

import inspect
import textwrap
from types import SimpleNamespace

import pytest
from conftest import TINY_DSA

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.sglang_plugin import compat
from sglang_ascend_offload.sglang_plugin.args import flags
from sglang_ascend_offload.testing.sglang_args import server_args_stub


def test_installed_sglang_matches_every_assumption():
    assert compat.problems() == []
    assert compat.last_resolution_step() == compat.VALIDATION_STEP
    assert compat.pool_attributes_not_set() == []


def test_each_hook_target_resolves_with_its_parameters():
    for target in compat.HOOKED:
        obj = compat.resolve_path(target.path)
        assert callable(obj), target.path


def test_renamed_server_argument_is_reported(monkeypatch):
    monkeypatch.setitem(compat.SERVER_ARGS, "attn_dp_size_renamed", "negative control")
    assert any("attn_dp_size_renamed" in p for p in compat.problems())


def test_moved_hook_target_and_lost_parameter_are_reported(monkeypatch):
    real = compat.HOOKED
    moved = compat.Hooked(real[2].path.replace("_build_token_to_kv_pool", "_build_pool_v2"), (), "negative control")
    lost = compat.Hooked(real[2].path, real[2].params + ("is_dsv5_model",), "negative control")
    monkeypatch.setattr(compat, "HOOKED", (moved, lost))
    found = compat.problems()
    assert any("_build_pool_v2 not found" in p for p in found), found
    assert any("lost parameter(s) ['is_dsv5_model']" in p for p in found), found


def test_validation_step_must_stay_last(monkeypatch):
    from sglang.srt.arg_groups import pipeline

    real = pipeline.run_resolution_pipeline

    def run_resolution_pipeline(server_args):  # the real steps, plus one SGLang might add later
        real(server_args)
        run_hook(handle_something_new, server_args)  # noqa: F821 - parsed, never run

    monkeypatch.setattr(pipeline, "run_resolution_pipeline", run_resolution_pipeline)
    monkeypatch.setattr(
        inspect,
        "getsource",
        lambda fn, _orig=inspect.getsource: (
            textwrap.dedent(_orig(real)).rstrip() + "\n    run_hook(handle_something_new, server_args)\n"
            if fn is run_resolution_pipeline
            else _orig(fn)
        ),
    )
    assert compat.last_resolution_step() == "handle_something_new"
    assert any("not 'validate_deepep_v2_dispatch_token_budget'" in p for p in compat.problems())


def test_pool_attribute_added_by_sglang_is_reported():
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool

    source = textwrap.dedent(inspect.getsource(DeviceDSAPool._init_without_buffers))
    assert "self.indexer_hadamard_128 = None" in source
    namespace: dict = {}
    exec(
        compile(
            "from typing import Optional\nimport torch\nfrom sglang.srt.mem_cache.memory_pool import KVCache\n"
            + source.replace("self.indexer_hadamard_128 = None", "pass"),
            "<mutated>",
            "exec",
        ),
        namespace,
    )
    mutated = namespace["_init_without_buffers"]
    mutated.__source__ = source
    original_getsource = inspect.getsource
    try:
        inspect.getsource = lambda fn: (
            source.replace("self.indexer_hadamard_128 = None", "pass") if fn is mutated else original_getsource(fn)
        )
        assert compat.pool_attributes_not_set(mutated) == ["indexer_hadamard_128"]
    finally:
        inspect.getsource = original_getsource


def test_object_field_reader_and_its_table(monkeypatch):
    kv_args = "sglang.srt.disaggregation.base.conn.KVArgs"
    assert compat.field(SimpleNamespace(gpu_id=3), kv_args, "gpu_id") == 3
    with pytest.raises(compat.SGLangIncompatible, match=r"KVArgs has no 'gpu_id'.*SGLang 0\.5\.23"):
        compat.field(SimpleNamespace(), kv_args, "gpu_id")
    with pytest.raises(KeyError, match="add it to compat.OBJECT_FIELDS"):
        compat.field(SimpleNamespace(device_id=0), kv_args, "device_id")
    # every listed field exists in the installed SGLang (none reported); a renamed one is
    monkeypatch.setitem(compat.OBJECT_FIELDS, kv_args, {**compat.OBJECT_FIELDS[kv_args], "gpu_index": "renamed"})
    monkeypatch.setitem(
        compat.OBJECT_FIELDS,
        "sglang.srt.configs.model_config.ModelConfig",
        {"model_path": "x", "model_path_renamed": "negative control"},
    )
    found = [p for p in compat.problems() if "has no field" in p and "ServerArgs" not in p]
    assert sorted(found) == sorted(
        [
            "sglang.srt.configs.model_config.ModelConfig has no field 'model_path_renamed' "
            "(read for: negative control)",
            "sglang.srt.disaggregation.base.conn.KVArgs has no field 'gpu_index' (read for: renamed)",
        ]
    ), found


def test_strict_reader_names_the_field_and_version():
    assert compat.arg(server_args_stub(tp_size=4), "tp_size") == 4
    with pytest.raises(compat.SGLangIncompatible, match=r"no 'attn_dp_size'.*SGLang 0\.5\.23"):
        compat.arg(SimpleNamespace(tp_size=4), "attn_dp_size")
    with pytest.raises(KeyError, match="add 'not_listed' to compat.SERVER_ARGS"):
        compat.arg(server_args_stub(), "not_listed")
    with pytest.raises(TypeError, match="not SGLang server arguments"):
        server_args_stub(tp_sise=2)


def test_incompatibility_stops_startup_with_every_problem(plugins_loaded, clean_state, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setitem(compat.SERVER_ARGS, "renamed_one", "negative control")
    monkeypatch.setitem(compat.SERVER_ARGS, "renamed_two", "negative control")
    flags.remember(flags.RawFlags(enabled={"sparse_decode": True}, configs={"sparse_decode": "{}"}))
    sa = ServerArgs(
        model_path=str(TINY_DSA),
        device="cpu",
        load_format="dummy",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        max_running_requests=4,
    )
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    compat_problems = [v.problem for v in info.value.violations if v.rule == "sglang.compat"]
    assert any("renamed_one" in p for p in compat_problems) and any("renamed_two" in p for p in compat_problems)


def test_layerwise_pd_prefill_without_its_publisher_fails_loudly(clean_state):
    """The run_batch hook skips servers without the layerwise P/D publisher, but on a server
    configured for it a missing queue / manager / publisher is an error naming it."""
    from sglang_ascend_offload.sglang_plugin.args import carrier
    from sglang_ascend_offload.sglang_plugin.disaggregation.ascend_offload.install import _layerwise_publisher

    scheduler = SimpleNamespace()  # SGLang renamed disagg_prefill_bootstrap_queue, say
    assert _layerwise_publisher(scheduler) == (None, None)  # nothing configured: not our server
    carrier.publish(
        cfg.OffloadConfig(
            layerwise_prefill=cfg.LayerwisePrefillOffloadConfig(store_backend="local"),
            pd_transfer=cfg.PDTransferConfig(),
        )
    )
    with pytest.raises(compat.SGLangIncompatible, match=r"Scheduler has no 'disagg_prefill_bootstrap_queue'"):
        _layerwise_publisher(scheduler)
    with pytest.raises(compat.SGLangIncompatible, match="disagg_prefill_bootstrap_queue is missing"):
        _layerwise_publisher(SimpleNamespace(disagg_prefill_bootstrap_queue=None))
    with pytest.raises(compat.SGLangIncompatible, match=r"PrefillBootstrapQueue has no 'kv_manager'"):
        _layerwise_publisher(SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace()))
    with pytest.raises(compat.SGLangIncompatible, match="publisher is missing"):
        _layerwise_publisher(
            SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=SimpleNamespace(publisher=None)))
        )
    with pytest.raises(compat.SGLangIncompatible, match="publisher is missing"):  # the after-forward one
        _layerwise_publisher(
            SimpleNamespace(
                disagg_prefill_bootstrap_queue=SimpleNamespace(
                    kv_manager=SimpleNamespace(publisher=SimpleNamespace(publishes_during_forward=False))
                )
            )
        )
    publisher = SimpleNamespace(publishes_during_forward=True)
    manager = SimpleNamespace(publisher=publisher)
    assert _layerwise_publisher(
        SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=manager))
    ) == (publisher, manager)


def test_fields_set_outside_init_are_found_and_renamed_ones_reported(monkeypatch):
    """Scheduler.model_config / disagg_prefill_bootstrap_queue and ModelConfig.context_len
    are set by helpers ``__init__`` calls, not in ``__init__`` itself: still declared; a
    renamed one is not."""
    from sglang.srt.managers.scheduler import Scheduler

    scheduler = "sglang.srt.managers.scheduler.Scheduler"
    assert "model_config" not in compat.assigned_self_attributes(Scheduler.__init__)
    assert {"model_config", "disagg_prefill_bootstrap_queue"} <= compat._declared_fields(
        Scheduler, ["model_config", "disagg_prefill_bootstrap_queue"]
    )
    monkeypatch.setitem(
        compat.OBJECT_FIELDS, scheduler, {**compat.OBJECT_FIELDS[scheduler], "disagg_prefill_queue": "negative control"}
    )
    found = [p for p in compat.problems() if "has no field" in p and "ServerArgs" not in p]
    assert found == [f"{scheduler} has no field 'disagg_prefill_queue' (read for: negative control)"], found


def test_pd_hooks_read_sglang_objects_strictly(monkeypatch):
    """The P/D hooks' reads of SGLang's queues, scheduler, batch and requests go through
    compat.field: a renamed field is an error naming it, never a default."""
    from sglang_ascend_offload.sglang_plugin.disaggregation.ascend_offload import conn, install

    got = {}
    monkeypatch.setattr(
        conn.AscendOffloadKVManager,
        "attach_pool",
        lambda self, pool, context_len=None, draft_pool=None: got.update(
            pool=pool, context_len=context_len, draft_pool=draft_pool
        ),
    )
    manager = conn.AscendOffloadKVManager.__new__(conn.AscendOffloadKVManager)

    def queue(**kw):
        return SimpleNamespace(
            **{
                "token_to_kv_pool": "pool",
                "draft_token_to_kv_pool": None,
                "scheduler": SimpleNamespace(model_config=SimpleNamespace(context_len=4096)),
                **kw,
            }
        )

    assert install.attach_pool_after_decode(manager, queue()) is manager
    assert got == {"pool": "pool", "context_len": 4096, "draft_pool": None}
    other = object()  # another backend's manager: untouched, nothing read
    assert install.attach_pool_after_prefill(other, SimpleNamespace()) is other
    install.attach_pool_after_prefill(manager, queue(draft_token_to_kv_pool="draft pool"))
    assert got["draft_pool"] == "draft pool"  # the speculative draft model's pool moves with the request
    with pytest.raises(compat.SGLangIncompatible, match=r"Scheduler has no 'model_config'"):
        install.attach_pool_after_prefill(manager, queue(scheduler=SimpleNamespace()))
    with pytest.raises(compat.SGLangIncompatible, match=r"DecodePreallocQueue has no 'scheduler'"):
        install.attach_pool_after_decode(manager, SimpleNamespace(draft_token_to_kv_pool=None))
    with pytest.raises(compat.SGLangIncompatible, match=r"ModelConfig has no 'context_len'"):
        install.attach_pool_after_decode(manager, queue(scheduler=SimpleNamespace(model_config=SimpleNamespace())))

    extend = SimpleNamespace(is_extend=lambda: True)
    req = dict(
        kv=SimpleNamespace(req_pool_idx=3),
        bootstrap_room=7,
        extend_end=4,
        origin_input_ids=[0] * 4,
        pending_bootstrap=False,
        disagg_kv_sender=object(),
    )
    batch = SimpleNamespace(forward_mode=extend, req_pool_indices_cpu=None, reqs=[SimpleNamespace(**req)])
    assert install.last_chunk_rows(batch) == [(3, 7)]
    renamed = {k: v for k, v in req.items() if k != "pending_bootstrap"}  # would read as "not pending"
    with pytest.raises(compat.SGLangIncompatible, match=r"Req has no 'pending_bootstrap'"):
        install.last_chunk_rows(
            SimpleNamespace(forward_mode=extend, req_pool_indices_cpu=None, reqs=[SimpleNamespace(**renamed)])
        )
    with pytest.raises(compat.SGLangIncompatible, match=r"ScheduleBatch has no 'req_pool_indices_cpu'"):
        install.last_chunk_rows(SimpleNamespace(forward_mode=extend, reqs=[SimpleNamespace(**req)]))
    with pytest.raises(compat.SGLangIncompatible, match=r"ReqKvInfo has no 'req_pool_idx'"):
        install.last_chunk_rows(
            SimpleNamespace(
                forward_mode=extend,
                req_pool_indices_cpu=None,
                reqs=[SimpleNamespace(**{**req, "kv": SimpleNamespace()})],
            )
        )


def test_every_sglang_symbol_the_plugin_hooks_is_in_the_table(plugins_loaded):
    """compat.HOOKED is the one table of hooked SGLang callables: every HookRegistry
    target the plugin registered (its install ran in this process) is listed there."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    ours = {
        target
        for target, hooks in HookRegistry._hooks.items()
        if any(getattr(fn, "__module__", "").startswith("sglang_ascend_offload") for _, fn, *_ in hooks)
    }
    sglang_targets = {t for t in ours if t.startswith("sglang.")}
    assert len(sglang_targets) >= 10 and ours - sglang_targets <= {
        "torch.cuda.get_device_capability",
        "torch.cuda.synchronize",
    }, ours
    assert {compat.TARGET_RUN_BATCH, compat.TARGET_CELL_SIZE, compat.TARGET_POOL} <= sglang_targets  # found them
    assert sglang_targets - {h.path for h in compat.HOOKED} == set()


def test_every_graph_runner_field_the_plugin_sets_is_in_the_table():
    """``speculative/cpu_graph.py`` sets SGLang's ``CPUGraphRunner`` fields by hand; each
    one it assigns is listed in ``compat.CPU_GRAPH_RUNNER_FIELDS`` (checked against the
    installed SGLang by ``compat.problems``) or is one of the plugin's own two."""
    import ast

    from sglang_ascend_offload.sglang_plugin.speculative import cpu_graph

    tree = ast.parse(open(cpu_graph.__file__).read())
    assigned = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", "") == "runner"
    }
    assert len(assigned) > 30
    assert assigned - set(compat.CPU_GRAPH_RUNNER_FIELDS) == {"replay_kinds_seen", "verify_width"}
    assert not [p for p in compat.problems() if "CPUGraphRunner" in p]
