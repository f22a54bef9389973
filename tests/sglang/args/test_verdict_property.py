"""``check-config --launch`` refuses exactly the launch commands the server refuses, with
the same rule ids.

For generated launch commands (hypothesis: bounded, derandomized, no shrinking), two
verdicts are computed in this process, each through its own entry point:

* the server's: what ``python -m sglang.launch_server ARGS`` runs (``sglang/launch_server.py``:
  SGLang's ``load_plugins()``, ``prepare_server_args(ARGS)``, ``run_server``), stopped
  where ``run_server`` hands the resolved arguments to the HTTP server's
  ``launch_server``, which would start the scheduler processes (where the first
  allocation happens). An accepted launch gets there; a refused one raises first: the
  plugin's ``ConfigError`` (its rule ids), or SGLang's own error (``sglang.server_args``);
* ``check-config``'s: ``python -m sglang_ascend_offload check-config --launch
  "python -m sglang.launch_server ARGS" --json`` through the command's entry point
  (``cli.main``): its ``ok``, its violations' rule ids, its exit status.

They must agree on accept / refuse and on the rule ids, in order; an accepted launch's
``undecided`` names only rules the running server decides after the launch
(``rules.DECIDED_AFTER_LAUNCH``). The negative control drops one rule from check-config's
side only (``config.violations`` filtered while check-config runs) and the same property
fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shlex
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
from conftest import TINY_DSA
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from sglang_ascend_offload import cli
from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.rules import DECIDED_AFTER_LAUNCH, RULES

FIXTURES = Path(TINY_DSA).parent
MODELS = ("tiny_dsa", "tiny_dsa", "tiny_dsa", "tiny_dsa_fused", "tiny_dsa_4l")
EXAMPLES = 40
SPARSE = ("--load-format", "dummy", "--skip-tokenizer-init", "--device", "cpu", "--enable-sparse-decode-offload")
# the negative control's dropped rule, and a launch that breaks it
DROPPED = "sparse_decode.hot_tokens_page"
BREAKS_DROPPED = ("tiny_dsa", (*SPARSE, "--sparse-decode-offload-config", '{"hot_tokens": 40}'), {})
# the case: top-k 16, which the fused Copy-SFA cannot serve; and a launch that serves
FUSED_TOP_K_16 = ("tiny_dsa", (*SPARSE, "--sparse-decode-offload-config", '{"ops": "fused"}'), {})
SERVES = ("tiny_dsa", (*SPARSE, "--disable-cuda-graph", "--max-total-tokens", "4096"), {})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Dict[str, str]:
    """The DSA fixtures, and an MLA model without the indexer (DeepSeek-V3 style)."""
    mla = tmp_path_factory.mktemp("mla")
    shutil.copy(FIXTURES / "tiny_dsa" / "config.json", mla / "config.json")
    data = json.loads((mla / "config.json").read_text())
    for key in ("index_topk", "index_head_dim", "index_n_heads"):
        data.pop(key)
    data.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (mla / "config.json").write_text(json.dumps(data))
    out = {name: str(FIXTURES / name) for name in MODELS if name != "mla"}
    out["mla"] = str(mla)
    return out


# ------------------------------------------------------------------ generated launches
# A launch is a serving base (a model, SGLang's CPU arguments, at most one offload feature
# with settings it serves) and 0-2 perturbations, each a change that some rule (the
# plugin's or SGLang's) may refuse alone or together with the base.
def _base(draw) -> dict:
    launch: dict = {"model": draw(st.sampled_from(MODELS)), "env": {}, "sd": None, "lw": None, "pd": None}
    args = ["--load-format", "dummy", "--skip-tokenizer-init", "--device", "cpu"]
    for flag, p in (("--disable-cuda-graph", 0.8), ("--disable-overlap-schedule", 0.5)):
        args += [flag] if draw(st.floats(0, 1)) < p else []
    for flag, values in (
        ("--max-total-tokens", [None, "4096"]),
        ("--max-running-requests", [None, "4"]),
        ("--page-size", [None, None, "64"]),
    ):
        value = draw(st.sampled_from(values))
        args += [flag, value] if value is not None else []
    launch["args"] = args
    feature = draw(st.sampled_from(["sparse_decode"] * 4 + ["layerwise", "kvpp", "none"]))
    if feature == "sparse_decode":
        sd = {}
        for key, values in (
            ("hot_tokens", [None, 64, 128, 256]),
            ("ops", [None, "reference", "auto"]),
            ("indexer_dtype", [None, "int8"]),
            ("residency", [None, "adaptive"]),
            ("record_trace", [None, None, "/tmp/sao_property_trace.npz"]),
            ("verify_sample_rate", [None, None, 1e-3]),
            ("host_pool_tokens", [None, None, 65536]),
        ):
            value = draw(st.sampled_from(values))
            sd.update({key: value} if value is not None else {})
        launch["sd"] = sd
    elif feature == "layerwise":
        launch["lw"] = {"shared_buffers": 1, "store_backend": "local"}
    elif feature == "kvpp":
        launch["kvpp"] = True
        launch["args"] += ["--tp-size", "2"]
    return launch


BACKENDS = ["ascend_offload", "mooncake"]  # --disaggregation-transfer-backend
#: perturbation -> the flags it adds (a value drawn from each list)
FLAG_PERTURBATIONS = {
    "npu": [],  # --device npu: SGLang refuses without torch_npu, on both sides
    "fp8": [("--kv-cache-dtype", ["fp8_e4m3"])],
    "backend": [("--attention-backend", ["torch_native", "fa3"])],
    "pp": [("--pp-size", ["2"])],
    "hicache": [("--enable-hierarchical-cache", [None])],
    "compile": [("--enable-torch-compile", [None])],
    "tp2": [("--tp-size", ["2"])],
    "speculative": [
        ("--speculative-algorithm", ["NEXTN", "STANDALONE"]),
        ("--speculative-num-steps", ["1"]),
        ("--speculative-eagle-topk", ["1", "2"]),
        ("--speculative-num-draft-tokens", ["2", "3"]),
    ],
    "pd": [("--disaggregation-mode", ["prefill", "decode"]), ("--disaggregation-transfer-backend", BACKENDS)],
    "config_only": [("--layerwise-prefill-offload-config", ["{}"])],  # without its enable flag
    "budget": [("--device-kv-budget", ["0", "64MiB"])],
}
#: perturbation -> the sparse decode settings it changes (a value drawn from each list)
SETTING_PERTURBATIONS = {
    "hot_tokens": {"hot_tokens": [8, 40, 4096 * 1024]},
    "ops": {"ops": ["npu", "triton", "fused"]},
    "fused_lim": {"fused_lim": [True, False]},
    "fused_copy_sfa": {"fused_copy_sfa": [True, False]},
    "score": {"policy": ["score_rank"], "rank_depth": [8, 256]},
    "host_pool": {"host_pool_tokens": [1024]},
}
OTHER_PERTURBATIONS = ("pd_transfer", "layerwise", "kvpp", "npu_offload_env", "mla")


def _perturb(draw, name: str, spec: dict) -> None:
    """Apply perturbation ``name`` to the launch ``spec``."""
    if name == "npu":
        spec["args"][spec["args"].index("--device") + 1] = "npu"
    for flag, values in FLAG_PERTURBATIONS.get(name, []):
        value = draw(st.sampled_from(values))
        spec["args"] += [flag] if value is None else [flag, value]
    for key, values in SETTING_PERTURBATIONS.get(name, {}).items():
        spec["sd"] = spec["sd"] if spec["sd"] is not None else {}
        spec["sd"][key] = draw(st.sampled_from(values))
    if name == "pd_transfer":
        spec["pd"] = {"engine": draw(st.sampled_from(["mooncake", "memfabric"])), "peer_tp": 1}
    elif name == "layerwise":
        spec["lw"] = {"shared_buffers": 1, "store_backend": draw(st.sampled_from(["local", "memcache"]))}
    elif name == "kvpp":
        spec["kvpp"] = True
    elif name == "npu_offload_env":
        spec["env"]["SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD"] = "1"
    elif name == "mla":
        spec["model"] = "mla"  # an MLA model without the indexer


PERTURBATIONS = sorted([*FLAG_PERTURBATIONS, *SETTING_PERTURBATIONS, *OTHER_PERTURBATIONS])


@st.composite
def launches(draw) -> tuple:
    """``(model, ARGS after --model-path, environment)`` of one launch command."""
    launch = _base(draw)
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2]))):
        _perturb(draw, draw(st.sampled_from(PERTURBATIONS)), launch)
    args = list(launch["args"])
    for enable, flag, section in (
        ("--enable-sparse-decode-offload", "--sparse-decode-offload-config", launch["sd"]),
        ("--enable-layerwise-prefill-offload", "--layerwise-prefill-offload-config", launch["lw"]),
        ("--enable-pd-transfer", "--pd-transfer-config", launch["pd"]),
    ):
        args += [enable, flag, json.dumps(section)] if section is not None else []
    args += ["--enable-kvpp"] if launch.get("kvpp") else []
    return launch["model"], tuple(args), dict(launch["env"])


# ------------------------------------------------------------------ the two verdicts
class _WouldSpawn(Exception):
    """``run_server`` reached the HTTP server's ``launch_server``: the launch is accepted."""


@contextlib.contextmanager
def _environment(env: Dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _process_state() -> Iterator[None]:
    """Flags, the published config and the root logger as they were (SGLang's parser
    configures logging; the validation step publishes an accepted config)."""
    from sglang_ascend_offload.sglang_plugin.args import carrier, flags

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    flags.forget()
    carrier.clear()
    try:
        yield
    finally:
        flags.forget()
        carrier.clear()
        root.handlers[:] = handlers
        root.setLevel(level)


def server_rules(argv: List[str], monkeypatch) -> Optional[List[str]]:
    """The rule ids the server's launcher refuses ``argv`` with (``[]``: it would start
    its processes)."""
    import sglang.launch_server as launcher
    from sglang.srt.entrypoints import http_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    def would_spawn(server_args):
        raise _WouldSpawn

    monkeypatch.setattr(http_server, "launch_server", would_spawn)
    with _process_state(), contextlib.redirect_stdout(io.StringIO()):
        try:
            load_plugins()
            launcher.run_server(prepare_server_args(argv))
        except _WouldSpawn:
            return []
        except cfg.ConfigError as exc:
            return [v.rule for v in exc.violations]
        except Exception:  # noqa: BLE001 - SGLang's own refusal
            return ["sglang.server_args"]
    raise AssertionError("run_server returned without starting the server")


def check_config(argv: List[str], env: Dict[str, str]) -> dict:
    """``check-config --launch "ENV python -m sglang.launch_server ARGS" --json``: its JSON
    document (and its exit status agrees with ``ok``)."""
    command = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "python -m sglang.launch_server"])
    out = io.StringIO()
    with _process_state(), contextlib.redirect_stdout(out):
        code = cli.main(["check-config", "--launch", f"{command} {shlex.join(argv)}", "--json"])
    answer = json.loads(out.getvalue())
    assert code == (0 if answer["ok"] else 1), answer
    return answer


def _agree(models: Dict[str, str], launch: tuple, monkeypatch, seen: Optional[dict] = None) -> None:
    model, args, env = launch
    argv = ["--model-path", models[model], *args]
    with _environment(env):
        server = server_rules(argv, monkeypatch)
    answer = check_config(argv, env)
    context = f"launch {shlex.join(argv)} env {env}"
    assert [v["rule"] for v in answer["violations"]] == server, context
    assert answer["ok"] == (server == []), context
    assert all(u["rule"] in DECIDED_AFTER_LAUNCH for u in answer["undecided"]), context
    if seen is not None:
        seen.setdefault("rules", set()).update(server)
        seen["accepted"] = seen.get("accepted", 0) + (server == [])
        seen["refused"] = seen.get("refused", 0) + (server != [])


PROPERTY = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure names its launch
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
_SEEN: dict = {}


@pytest.mark.usefixtures("plugins_loaded")
@PROPERTY
@given(launch=launches())
@example(launch=BREAKS_DROPPED)
@example(launch=FUSED_TOP_K_16)
@example(launch=SERVES)
def test_check_config_refuses_what_the_server_refuses_with_the_same_rule_ids(models, monkeypatch, launch):
    _agree(models, launch, monkeypatch, _SEEN)


def test_the_generated_launches_reach_both_verdicts_and_many_rules():
    """(after the property) the generator is not vacuous: it accepts and refuses, with
    rules of several scopes."""
    if not _SEEN:
        pytest.skip("the property test did not run in this session")
    assert _SEEN["accepted"] >= 3 and _SEEN["refused"] >= EXAMPLES // 3, _SEEN
    scopes = {RULES[r].scope for r in _SEEN["rules"] if r in RULES}
    assert {"deployment", "server"} <= scopes and len(_SEEN["rules"]) >= 8, sorted(_SEEN["rules"])


@pytest.mark.usefixtures("plugins_loaded")
def test_negative_control_one_rule_dropped_from_check_config_fails_the_property(models, monkeypatch):
    """``config.violations`` without :data:`DROPPED` while check-config runs (the server
    keeps it): the property fails on a launch that breaks it."""
    real = cfg.violations
    real_main = cli.main

    def without_dropped(config, deployment):
        return [v for v in real(config, deployment) if v.rule != DROPPED]

    def check_config_main(argv):
        with monkeypatch.context() as m:
            m.setattr(cfg, "violations", without_dropped)
            return real_main(argv)

    monkeypatch.setattr(cli, "main", check_config_main)

    @PROPERTY
    @given(launch=launches())
    @example(launch=BREAKS_DROPPED)
    def faulty(launch):
        _agree(models, launch, monkeypatch)

    with pytest.raises(AssertionError, match="launch "):
        faulty()
