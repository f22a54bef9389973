"""Test seams of the served plugin: fault injection and resource pins, installed from outside.

Runtime modules read no test switches. A test that needs a server to misbehave (a request
demoted, TP rank 0 stuck, less memory than the machine has) asks the test launcher for a
*seam*; the launcher (:class:`~sglang_ascend_offload.testing.servers.ServerProcess`) puts
this module's SGLang plugin on the server's path and passes the seams as JSON in
:data:`HARNESS_ENV`. SGLang's ``load_plugins()`` runs :func:`register` in every server
process (launcher, schedulers, detokenizer); it turns each seam into a HookRegistry hook on
the plugin's own code. A server started any other way never sees this plugin: its entry
point lives in ``harness_plugin/`` (a ``.dist-info`` only the launcher adds to
``PYTHONPATH``), not in the package's metadata.

==================  ==========================  ===========================================
seam                value                       effect
==================  ==========================  ===========================================
``force_demote``    path of a flag file         adaptive residency: while the file exists no
                                                request is direct (each is demoted in place
                                                at its next step)
``hold_appends``    path of a flag file         TP rank 0 of a shared host pool writes its
                                                rows but stops publishing them while the
                                                file exists (a stuck rank 0, seen by readers)
``available_bytes`` ``{"host": n, "device": m}``  the launch memory check sees these free bytes
                                                instead of probing the machine
``fault``           a fault name, or            a planted fault of :mod:`.faults` (always on,
                    ``{"name": n, "flag": p}``  or only while the flag file exists); a list
                    (or a list of them)         plants each
``forkserver``      ``true`` or ``false``       the launcher starts its schedulers and
                                                detokenizer through a multiprocessing
                                                forkserver that imported SGLang's modules
                                                once (:data:`FORKSERVER_PRELOAD`), instead of
                                                SGLang's spawn: each child skips ~6 s of
                                                imports and still loads every plugin itself
==================  ==========================  ===========================================

While ``SGLANG_ASCEND_OFFLOAD_PLANTED_FAULT`` names a fault (``scripts/plant_faults.py``),
the launcher adds the ``fault`` seam to every server it starts (:func:`merge`), beside any
fault the test itself asked for. While :data:`FORKSERVER_ENV` is ``1`` (the test session sets
it on a machine without an NPU: ``tests/conftest.py``) it adds ``forkserver: true`` unless
the test asked for ``forkserver: false`` (SGLang's own spawn, as users run it).

Why the forkserver is faithful enough for tests: a spawned child imports SGLang (~6 s of the
~19 CPU-s a tiny CPU server costs to start) and then loads the plugins; a forkserver child
starts from a process that imported the same SGLang modules from the same environment and
never loaded a plugin, so it loads the plugins exactly as a spawned child does; its process
object still crosses by pickle, and its environment is the launcher's at the moment it starts
(:mod:`.forkserver_env`). What differs: SGLang's modules were imported before the child
started. The README demo's servers (``tests/sglang/e2e/test_trained_text_e2e_cpu.py``) keep
SGLang's spawn. A server with the seam may also have its launcher forked from the test
zygote (:mod:`.zygote`), which then provides the forkserver too.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Dict

logger = logging.getLogger(__name__)

#: JSON object ``{seam: value}`` set by the test launcher for one server.
HARNESS_ENV = "SGLANG_ASCEND_OFFLOAD_TEST_HARNESS"
#: The folder holding the harness plugin's entry point (added to a test server's PYTHONPATH).
PLUGIN_PATH = Path(__file__).resolve().with_name("harness_plugin")

_POOL = "sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode.HostMainKVPool.__init__"
_APPEND_ORDER = "sglang_ascend_offload.sglang_plugin.mem_cache.pool_host.append_order.AppendOrder.__init__"
_AVAILABLE = "sglang_ascend_offload.memory_budget.available_bytes"
#: SGLang's launch step that sets its children's start method (``spawn``); the seam runs after it.
SET_START_METHOD = "sglang.srt.entrypoints.engine._set_envs_and_config"
#: What a server's forkserver imports once: the launcher's environment for each child, then
#: SGLang's launcher, scheduler, detokenizer, model runner and the DeepSeek models. Never a
#: plugin module (each child loads the plugins).
FORKSERVER_PRELOAD = (
    "sglang_ascend_offload.testing.forkserver_env",
    "sglang.launch_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.deepseek_nextn",
)
#: ``1``: every server the launcher starts gets ``forkserver: true`` unless its test says otherwise.
FORKSERVER_ENV = "SGLANG_ASCEND_OFFLOAD_TEST_FORKSERVER"


def _flag(path: str) -> Callable[[], bool]:
    return lambda: os.path.exists(path)


def _force_demote(path: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_pool_init(_result, pool, *args, **kwargs):
        if pool.engine.direct is not None:
            pool.engine.direct.hold = _flag(path)
            logger.warning("test harness: while %s exists no request is direct", path)

    HookRegistry.register(_POOL, after_pool_init, HookType.AFTER)


def _hold_appends(path: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_order_init(_result, order, *args, **kwargs):
        if order.rank == 0:
            order.hold = _flag(path)
            logger.warning("test harness: TP rank 0 stops publishing appends while %s exists", path)

    HookRegistry.register(_APPEND_ORDER, after_order_init, HookType.AFTER)


def _available_bytes(pinned: Dict[str, int]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def pinned_bytes(_original, *args, **kwargs):
        return {"host": int(pinned["host"]), "device": pinned.get("device")}

    HookRegistry.register(_AVAILABLE, pinned_bytes, HookType.AROUND)
    logger.warning("test harness: the launch memory check sees %s free bytes", pinned)


def _fault(value) -> None:
    from . import faults

    for one in value if isinstance(value, list) else [value]:
        if isinstance(one, str):
            faults.register(one)
        else:
            faults.register(one["name"], one.get("flag"))


def _forkserver(enabled: bool) -> None:
    if not enabled:
        return
    import multiprocessing

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_set_envs(_result, *args, **kwargs):
        from . import forkserver_env  # noqa: F401 - each child gets the environment of its start

        multiprocessing.set_start_method("forkserver", force=True)
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        logger.warning("test harness: children start from a forkserver that imported %s", ", ".join(FORKSERVER_PRELOAD))

    HookRegistry.register(SET_START_METHOD, after_set_envs, HookType.AFTER)


SEAMS: Dict[str, Callable] = {
    "force_demote": _force_demote,
    "hold_appends": _hold_appends,
    "available_bytes": _available_bytes,
    "fault": _fault,
    "forkserver": _forkserver,
}


def environment(seams: Dict[str, object]) -> Dict[str, str]:
    """The environment a test server needs for ``seams`` (unknown names are an error)."""
    unknown = sorted(set(seams) - set(SEAMS))
    if unknown:
        raise ValueError(f"unknown test seams {unknown}; known: {sorted(SEAMS)}")
    return {HARNESS_ENV: json.dumps(seams)}


def fast_start(env: Dict[str, str]) -> bool:
    """Whether a server with ``env`` takes the ``forkserver`` seam (and may then fork from the
    test zygote: :mod:`.zygote`)."""
    text = env.get(HARNESS_ENV)
    return bool(text) and json.loads(text).get("forkserver") is True


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def merge(env: Dict[str, str], extra: Dict[str, str]) -> Dict[str, str]:
    """``{**env, **extra}`` with the seams of both (and of a planted run's fault, from
    ``env``) in one :data:`HARNESS_ENV`: a test's own seams win over the planted fault's."""
    from . import faults

    seams = {**faults.seams_from_environment(env)}
    if env.get(FORKSERVER_ENV) == "1":
        seams["forkserver"] = True
    for source in (env, extra):
        if source.get(HARNESS_ENV):
            for name, value in json.loads(source[HARNESS_ENV]).items():
                if name == "fault" and "fault" in seams:  # a planted run's fault and a test's own: both
                    value = _as_list(seams["fault"]) + [v for v in _as_list(value) if v not in _as_list(seams["fault"])]
                seams[name] = value
    if seams.get("forkserver") is False:
        del seams["forkserver"]  # SGLang's own spawn: no seam at all
    out = {**env, **extra}
    out.pop(HARNESS_ENV, None)
    if seams:
        out.update(environment(seams))
    return out


def register() -> None:
    """SGLang general-plugin entry point: install the seams named in :data:`HARNESS_ENV`."""
    text = os.environ.get(HARNESS_ENV)
    if not text:
        return
    seams = json.loads(text)
    for name, value in seams.items():
        SEAMS[name](value)
    logger.warning("test harness installed: %s", ", ".join(sorted(seams)))
