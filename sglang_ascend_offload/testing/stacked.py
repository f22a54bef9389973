"""A deeper checkpoint built from a trained one's layers, for served tests on real weights.

Some served equality tests need more layers than the trained checkpoints have (2): the
layerwise prefill pool shares a few layer buffers among 4 layers, KVPP owns 4 layers per
rank at TP 2. On ``--load-format dummy`` weights those tests cannot see a misplaced KV
(SGLang draws every weight in +-1e-3, so attention barely moves the logits;
``docs/testing.md``). :func:`stacked_checkpoint` writes a checkpoint whose layer ``j`` is
the trained layer ``j % n`` (``n`` trained layers): its attention weights are trained, so
every layer's output depends on the KV it reads, and a row from the wrong page or block
changes the tokens or logprobs. It is not a trained model of its depth (the text it
writes means little); the tests compare two servers of it, never its text with a corpus.

The trained NextN layer is left out (the stacked model has none), every layer is dense as
in the source (``first_k_dense_replace`` covers all layers), and the tokenizer files are
copied, so the servers take the trained checkpoint's arguments
(``servers.TRAINED_SERVER_ARGS``) with the new path.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

__all__ = ["stacked_checkpoint"]

#: files of the source checkpoint that describe the trained model, not the stacked one
_NOT_COPIED = {"model.safetensors", "config.json", "heldout_eval.json", "training.json", "README.md"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def stacked_checkpoint(source: Path, layers: int, dest: Path) -> Path:
    """Write ``dest`` (a checkpoint folder) with ``layers`` decoder layers, layer ``j`` a copy
    of ``source``'s layer ``j % n``; returns ``dest``. Reuses ``dest`` when it already holds
    this stacking of this source (``stacked.json``)."""
    from safetensors.torch import load_file, save_file

    source, dest = Path(source), Path(dest)
    config = json.loads((source / "config.json").read_text())
    trained = int(config["num_hidden_layers"])
    if layers < trained:
        raise ValueError(f"stacking {layers} layers from {trained}: ask for at least {trained}")
    if int(config.get("first_k_dense_replace") or 0) < trained:
        raise ValueError(f"{source}: only all-dense checkpoints can be stacked (first_k_dense_replace < {trained})")
    stamp = {
        "source": str(source.resolve()),
        "layers": layers,
        "source_bytes": (source / "model.safetensors").stat().st_size,
    }
    marker = dest / "stacked.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(source / "model.safetensors"))
    out = {}
    for name, tensor in weights.items():
        m = _LAYER.match(name)
        if m is None:
            out[name] = tensor
            continue
        layer = int(m.group(1))
        if layer >= trained:  # the NextN layer(s): not part of the stacked model
            continue
        for j in range(layer, layers, trained):
            out[f"model.layers.{j}.{m.group(2)}"] = tensor.clone() if j != layer else tensor
    save_file({k: v.contiguous() for k, v in out.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config.update(num_hidden_layers=layers, first_k_dense_replace=layers)
    config.pop("num_nextn_predict_layers", None)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in source.iterdir():
        if f.is_file() and f.name not in _NOT_COPIED:
            shutil.copy2(f, dest / f.name)
    marker.write_text(json.dumps(stamp))
    return dest
