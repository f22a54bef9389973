"""``scripts/train_tiny_dsa.py`` end to end at a smoke scale (a few steps of each phase).

The committed checkpoints take ~25 minutes each; this run (both shapes: ``--shape k64``
and ``k128``) takes about a minute per shape and checks
what the full run relies on: the corpus split, the tokenizer with its chat template,
the export in the DeepSeek checkpoint layout SGLang reads (NextN layer as
``model.layers.2.*``, experts unfused), and that ``heldout_eval.json`` holds the
evaluation of the exported weights (re-evaluated here, it must agree exactly).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_tiny_dsa.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["k64", "k128"])
def smoke_checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny_dsa_smoke_{request.param}")
    smoke = ["--scale", "0.01", "--max-corpus-mb", "0.5", "--threads", "1", "--shape", request.param]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *smoke],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""  # progress goes to stderr
    return out


def test_smoke_run_writes_a_loadable_fixture(smoke_checkpoint):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    files = {p.name for p in smoke_checkpoint.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training.json",
        "heldout_eval.json",
    } <= files
    cfg = json.loads((smoke_checkpoint / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    # the shapes: k64 (tiny_dsa_trained) and the fused kernels' k128 (tiny_dsa_trained_k128)
    shape = "k128" if smoke_checkpoint.name.startswith("tiny_dsa_smoke_k128") else "k64"
    want = {"k64": (64, 4), "k128": (128, 8)}[shape]
    assert (cfg["index_topk"], cfg["index_n_heads"]) == want
    assert json.loads((smoke_checkpoint / "heldout_eval.json").read_text())["index_topk"] == want[0]
    with safe_open(str(smoke_checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        nextn = f"model.layers.{cfg['num_hidden_layers']}"
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "self_attn.indexer.wk.weight",
            "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias",
            "mlp.shared_experts.down_proj.weight",
        ):
            assert f"{nextn}.{name}" in names, name
        for e in range(cfg["n_routed_experts"]):
            assert f"{nextn}.mlp.experts.{e}.gate_proj.weight" in names
        assert not any("gate_up_proj" in n for n in names)
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"
    tok = AutoTokenizer.from_pretrained(str(smoke_checkpoint))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nhi\n<|assistant|>\n"
    ids = tok("def f(x):\n    return x\n")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x\n"


def test_heldout_eval_is_the_exported_weights_evaluation(smoke_checkpoint):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_tiny_dsa
    finally:
        sys.path.remove(str(SCRIPT.parent))
    held = json.loads((smoke_checkpoint / "heldout_eval.json").read_text())
    mean, per_window = train_tiny_dsa.evaluate(smoke_checkpoint, held["windows"])
    assert per_window == held["nll"]
    meta = json.loads((smoke_checkpoint / "training.json").read_text())
    assert meta["heldout"]["nll"] == round(mean, 4)
    assert [r["phase"] for r in meta["curve"]][0] == "lm" and meta["curve"][-1]["phase"] == "sparse"
