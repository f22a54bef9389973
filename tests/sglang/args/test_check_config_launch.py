"""``check-config --launch``: the launcher's verdict on a launch command, before the server
starts (``sglang_plugin/args/launch_command.py``, ``config_cli.py``).

The README's NPU example is decided on an Ascend node as the launcher reads one
(``tests/sglang/npu_node.py``, in a process of its own): refused with
``sglang.fused_unavailable`` without the AscendC extension, accepted once it is installed.
That the launcher refuses the same launches with the same rule ids is
``test_verdict_property.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY_DSA

from sglang_ascend_offload import cann_install, cli, platform
from sglang_ascend_offload.rules import DECIDED_AFTER_LAUNCH, RULES, ids_in_scope, violation
from sglang_ascend_offload.sglang_plugin.args import launch_command

NODE = Path(__file__).resolve().parent.parent / "npu_node.py"
CANN = Path(REPO) / "tests" / "fixtures" / "cann"
KEYS = {"ok", "violations", "hot_buffer", "undecided"}
CPU_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--device", "cpu", "--disable-cuda-graph"]


def cpu_launch(offload: str, *extra: str):
    """The words of a CPU launch of the tiny DSA model with sparse decode offload ``offload``."""
    sparse = ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", offload]
    return ["--model-path", str(TINY_DSA), *CPU_ARGS, *extra, *sparse]


def _check_config(*argv: str):
    """``python -m sglang_ascend_offload check-config ARGV`` in this process: (exit status, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["check-config", *argv])
    return code, out.getvalue()


def readme_npu_example() -> str:
    """The launch command of the README's ``check-config --launch`` NPU example."""
    text = (Path(REPO) / "README.md").read_text()
    block = text.split("<!-- check-config: npu-launch -->", 1)[1].split("```", 2)[1]
    command = re.search(r'check-config --launch "(.*?)"', block.replace("\\\n", " "), re.S).group(1)
    return " ".join(command.split())


# ------------------------------------------------------------------ the README's NPU example
@pytest.mark.slow
def test_the_readme_npu_example_is_refused_without_the_extension_and_accepted_with_it(tmp_path):
    """On an A3 node (its CANN build) with torch_npu: no ``_C_ascend`` -> ``sglang.fused_unavailable``
    naming the op and the build command, and nothing else; the extension installed -> ``ok``
    with the hot buffers and the undecided rules; the same flags after ``--`` agree."""
    command = readme_npu_example()
    assert "--device npu" in command and "/models/DeepSeek-V3.2" in command
    command = command.replace("/models/DeepSeek-V3.2", str(Path(REPO) / "tests/fixtures/tiny_dsa_fused"))
    words = command.split()[3:]  # after "python -m sglang.launch_server"
    runs = [
        {"argv": ["check-config", "--launch", command, "--json"], "extension": False},
        {"argv": ["check-config", "--launch", command, "--json"], "extension": True},
        {"argv": ["check-config", "--json", "--", *words], "extension": True},
        {"argv": ["check-config", "--launch", command], "extension": True},
    ]
    env = dict(
        __import__("os").environ,
        SGLANG_ASCEND_OFFLOAD_DEVICE="npu",
        ASCEND_HOME_PATH=str(CANN / "a3"),
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=str(REPO),
    )
    result = subprocess.run(
        [sys.executable, str(NODE), json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    without, with_ext, dashes, text = json.loads(result.stdout.splitlines()[-1])
    refused = json.loads(without["stdout"])
    assert without["code"] == 1 and set(refused) == KEYS and refused["ok"] is False
    assert [v["rule"] for v in refused["violations"]] == ["sglang.fused_unavailable"], refused["violations"]
    problem = refused["violations"][0]
    assert "npu_fused_lightning_indexer_manage" in problem["problem"] and "build.sh --install" in problem["fix"]
    accepted = json.loads(with_ext["stdout"])
    assert with_ext["code"] == 0 and accepted["ok"] is True and accepted["violations"] == []
    assert accepted["hot_buffer"]["hot_tokens"] == 256  # 2 x top-k 128 of tiny_dsa_fused
    undecided = {u["rule"] for u in accepted["undecided"]}
    assert {"memory.device_budget", "sparse_decode.kernel_qualification", "sparse_decode.soc_unknown"} <= undecided
    assert json.loads(dashes["stdout"]) == accepted
    lines = text["stdout"].splitlines()
    assert text["code"] == 0 and lines[0] == "ok" and lines[1].startswith("hot buffers and residency tables: ")
    assert any(line.startswith("undecided: sparse_decode.kernel_qualification: decided by running") for line in lines)


# ------------------------------------------------------------------ on this machine (CPU)
@pytest.mark.usefixtures("plugins_loaded")
def test_a_cpu_launch_is_decided_with_its_hot_buffers_and_what_the_server_decides_later():
    """The two forms give one answer; ``ok`` comes with the hot buffers and names what it did
    not check, each rule with what decides it."""
    words = cpu_launch('{"hot_tokens": 64}', "--max-total-tokens", "4096")
    launch = f"SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server {shlex.join(words)}"
    code, out = _check_config("--launch", launch, "--json")
    answer = json.loads(out)
    assert code == 0 and set(answer) == KEYS and answer["ok"] is True, answer
    assert answer["hot_buffer"]["hot_tokens"] == 64 and answer["hot_buffer"]["hot_rows"] == 3
    assert json.loads(_check_config("--json", "--", *words)[1]) == answer
    open_rules = {u["rule"]: u for u in answer["undecided"]}
    assert set(open_rules) == {"memory.device_budget", "memory.insufficient"}  # --max-total-tokens given, no fused op
    for rule, entry in open_rules.items():
        assert entry["decided_by"] == DECIDED_AFTER_LAUNCH[rule] and entry["requires"] == RULES[rule].requires

    # host_pool_tokens is decided here with --max-total-tokens, by the pool without it
    def verdict(offload, *extra):
        return json.loads(_check_config("--json", "--", *cpu_launch(offload, *extra))[1])

    decided = verdict('{"host_pool_tokens": 65536}', "--max-total-tokens", "4096")
    assert decided["ok"] and "sparse_decode.host_pool_tokens" not in {u["rule"] for u in decided["undecided"]}
    small = verdict('{"host_pool_tokens": 1024}', "--max-total-tokens", "4096")
    assert [v["rule"] for v in small["violations"]] == ["sparse_decode.host_pool_tokens"]
    assert "4160 = 4096 tokens in pages of 64 + one padding page" in small["violations"][0]["problem"]
    unknown = verdict('{"host_pool_tokens": 1024}')  # SGLang's KV-pool sizing decides its capacity
    assert unknown["ok"] and "sparse_decode.host_pool_tokens" in {u["rule"] for u in unknown["undecided"]}


@pytest.mark.usefixtures("plugins_loaded")
def test_what_is_not_a_launch_command_is_refused_with_check_config_launch():
    def rules(*argv):
        code, out = _check_config(*argv, "--json")
        answer = json.loads(out)
        assert code == 1 and answer["ok"] is False
        return [v["rule"] for v in answer["violations"]], answer

    assert rules("--launch", "python -m vllm.entrypoints.openai.api_server --model x")[0] == ["check_config.launch"]
    found, answer = rules("--launch", f"sglang serve {TINY_DSA} --no-such-flag 1")
    assert found == ["check_config.launch"] and "--no-such-flag" in answer["violations"][0]["problem"]
    both, _ = rules("--launch", f"--model-path {TINY_DSA} --device cpu", "--config", "{}")
    assert both[0] == "check_config.launch"
    assert rules("--launch", "python -m sglang.launch_server --model-path 'unclosed")[0] == ["check_config.launch"]


def test_the_deployment_form_lists_every_server_rule_as_undecided():
    """Given facts, not a launch: ``ok`` covers the deployment-scope rules only, and the
    README's old NPU example (``sglang.fused_unavailable`` decided by the launch) says so."""
    deployment = '{"device": "npu", "soc": "A3", "tp": 8, "index_topk": 2048, "page_size": 128}'
    config = '{"sparse_decode": {"hot_tokens": 4096}}'
    code, out = _check_config("--config", config, "--deployment", deployment, "--json")
    answer = json.loads(out)
    assert code == 0 and set(answer) == KEYS and answer["ok"] is True
    open_rules = {u["rule"]: u["decided_by"] for u in answer["undecided"]}
    assert set(ids_in_scope("server")) <= set(open_rules)
    assert "check-config --launch decides it" in open_rules["sglang.fused_unavailable"]
    assert open_rules["memory.device_budget"] == DECIDED_AFTER_LAUNCH["memory.device_budget"]
    assert "sparse_decode.kernel_qualification" in open_rules  # the NPU default selects fused ops
    code, text = _check_config("--config", config, "--deployment", deployment)
    lines = text.splitlines()
    by_launch = [r for r in ids_in_scope("server") if r not in DECIDED_AFTER_LAUNCH]
    assert lines[0] == "ok" and lines[1].startswith(f"undecided: {len(by_launch)} server rules, decided by the launch")
    assert any(line.startswith("undecided: memory.device_budget: decided by SGLang's KV-pool sizing") for line in lines)
    nothing = json.loads(_check_config("--config", "{}", "--deployment", deployment, "--json")[1])
    assert nothing["undecided"] == []  # no feature on: nothing to decide


# ------------------------------------------------------------------ without the device
def test_the_launch_is_decided_without_asking_the_device(monkeypatch):
    """SGLang's NPU capacity query and the SoC cross-check are answered without the device
    inside :func:`launch_command.without_device` (the capacity only after ``import
    torch_npu``, as SGLang's query does), and restored after it."""
    import types

    from sglang.srt.hardware_backend.npu import utils as npu_utils
    from sglang.srt.utils import common

    originals = (common.get_npu_memory_capacity, npu_utils.get_npu_memory_capacity)
    monkeypatch.setattr(platform, "device_kind", lambda: "npu")
    monkeypatch.setattr(platform, "soc_name", lambda: pytest.fail("the device was asked for its SoC name"))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(CANN / "a3"))
    with launch_command.without_device():
        with pytest.raises(ImportError, match="torch_npu is required"):
            npu_utils.get_npu_memory_capacity()  # a machine without torch_npu: refused as SGLang refuses it
        monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
        assert common.get_npu_memory_capacity() == launch_command.UNQUERIED_NPU_CAPACITY_MB
        assert platform.installed_soc() == ("Ascend910_93", None)
    assert (common.get_npu_memory_capacity, npu_utils.get_npu_memory_capacity) == originals
    with pytest.raises(pytest.fail.Exception, match="asked for its SoC name"):
        platform.installed_soc()  # outside, the server's cross-check asks (negative control)


@pytest.mark.parametrize("build, undecided", [("a2_a3", True), ("a3", False), ("no_version", False)])
def test_an_soc_only_the_device_can_decide_is_undecided_not_refused(monkeypatch, build, undecided):
    """A build carrying the A2 and A3 operators: the server's cross-check with the device's
    SoC name decides, so check-config does not refuse it (the server might accept)."""
    monkeypatch.setenv("ASCEND_HOME_PATH", str(CANN / build))
    soc = violation("sparse_decode.soc_unknown", "the SoC is undecided")
    other = violation("sglang.hisparse", "--enable-hisparse is on as well")
    kept, open_rules = launch_command.soc_left_to_the_device([soc, other])
    assert (open_rules == ("sparse_decode.soc_unknown",)) is undecided
    assert kept == ([other] if undecided else [soc, other])
    assert len(cann_install.detect().installed_families) == (2 if undecided else 1)


def test_the_pool_applies_the_host_pool_tokens_rule_where_sglang_sized_its_capacity():
    """Without ``--max-total-tokens`` the launch leaves ``sparse_decode.host_pool_tokens``
    undecided (above); the pool applies the same rule to the capacity SGLang sized."""
    from sglang_ascend_offload import config as cfg
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import _host_pool_slots

    sd = cfg.SparseDecodeOffloadConfig
    with pytest.raises(cfg.ConfigError) as info:
        _host_pool_slots(sd(host_pool_tokens=4159), 4096, 64, 1152, "cpu", 1)
    assert [v.rule for v in info.value.violations] == ["sparse_decode.host_pool_tokens"]
    assert _host_pool_slots(sd(host_pool_tokens=4160), 4096, 64, 1152, "cpu", 1) == 4160
    assert _host_pool_slots(sd(), 4100, 64, 1152, "cpu", 1) == 4160  # 64 pages + the padding page


def test_the_p_d_rules_the_handshake_decides_are_undecided_until_the_facts_are_given():
    decode = '{"device": "npu", "soc": "A3", "pd_role": "decode", "tp": 1}'

    def open_rules(pd):
        code, out = _check_config("--config", json.dumps({"pd_transfer": pd}), "--deployment", decode, "--json")
        assert code == 0, out
        return {u["rule"] for u in json.loads(out)["undecided"]}

    handshake = {"pd_transfer.tp_ratio", "sglang.pd_parallel", "sglang.pd_engine_device"}
    assert handshake <= open_rules({"engine": "memfabric"})
    given = open_rules({"engine": "memfabric", "peer_tp": 1, "store_url": "tcp://10.0.0.1:7000"})
    assert "pd_transfer.tp_ratio" not in given and "sglang.pd_engine_device" not in given
    assert "sglang.pd_parallel" in given  # the peer's CP / PP are never given: the handshake decides them
