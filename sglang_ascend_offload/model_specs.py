"""KV-relevant shapes of DSA models (MLA latent KV + lightning indexer + top-k).

Only what sizes the KV cache is kept: layers, the latent and rope widths of the
main KV, the indexer key width and its on-device dtype, top-k, and the MTP (NextN)
layers. Two sources:

* :data:`PRESETS`, keyed by a short name (``deepseek-v3.2``, ``glm-5``, ``glm-5.1``),
  each carrying where its numbers come from;
* :func:`load_hf_config`, a HuggingFace ``config.json`` (the keys in
  :data:`HF_KEYS`), with every missing or malformed key reported in one error.

Byte sizes per token and per layer (the only arithmetic here):

* main KV: ``(kv_lora_rank + qk_rope_head_dim) * 2`` (bf16 only: the offload modes
  reject packed C8/TQ4 main caches), e.g. 576 * 2 = 1152 B;
* indexer key: ``index_head_dim * 2`` in bf16 (256 B for 128 dims), or
  ``index_head_dim + 2`` in int8 (LIM-C8: one int8 per dim + one fp16 scale per
  token, 130 B). The indexer *key* cache has one head whatever ``index_n_heads``
  is (the heads are on the query side), so ``index_n_heads`` does not size it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Literal, Mapping, Tuple

from .errors import ConfigError, Violation

IndexerDtype = Literal["bf16", "int8"]
INDEXER_DTYPES: Tuple[str, ...] = ("bf16", "int8")
MAIN_KV_ELEMENT_BYTES = 2  # bf16: the only main-KV dtype the offload modes accept
INT8_SCALE_BYTES = 2  # LIM-C8: one fp16 dequantisation scale per token


@dataclass(frozen=True)
class ModelShape:
    """KV-sizing facts of one DSA model.

    num_layers: target (non-MTP) decoder layers, every one cache-bearing with an indexer.
    kv_lora_rank / qk_rope_head_dim: widths of the latent and rope parts of the main KV.
    index_head_dim / index_n_heads / index_topk: the lightning indexer.
    mtp_layers: NextN (MTP) layers (``num_nextn_predict_layers``); cache-bearing when
        speculative decoding with MTP is on.
    indexer_dtype: the indexer key dtype the model is served with on Ascend.
    source: where the numbers come from; notes: what could not be verified.
    """

    name: str
    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    index_n_heads: int
    index_topk: int
    mtp_layers: int
    indexer_dtype: IndexerDtype = "bf16"
    source: str = ""
    notes: str = ""

    @property
    def main_kv_dim(self) -> int:
        """Elements of one token's main KV in one layer (latent + rope), e.g. 576."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def main_bytes_per_layer(self) -> int:
        """Bytes of one token's bf16 main KV in one layer, e.g. 1152."""
        return self.main_kv_dim * MAIN_KV_ELEMENT_BYTES

    def indexer_bytes_per_layer(self, dtype: str = "") -> int:
        """Bytes of one token's indexer key in one layer (``dtype`` defaults to the model's)."""
        dtype = dtype or self.indexer_dtype
        if dtype == "bf16":
            return self.index_head_dim * 2
        if dtype == "int8":
            return self.index_head_dim + INT8_SCALE_BYTES
        raise ValueError(f"indexer dtype {dtype!r} is not one of {', '.join(INDEXER_DTYPES)}")

    def cache_layers(self, with_mtp: bool) -> int:
        """Cache-bearing layers: the target layers, plus the MTP layers when MTP runs."""
        return self.num_layers + (self.mtp_layers if with_mtp else 0)

    def with_indexer_dtype(self, dtype: str) -> "ModelShape":
        return replace(self, indexer_dtype=dtype)  # type: ignore[arg-type]


_DSV32_SOURCE = (
    "deepseek-ai/DeepSeek-V3.2 config.json (DeepseekV32ForCausalLM): num_hidden_layers 61, "
    "kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128, index_n_heads 64, "
    "index_topk 2048, num_nextn_predict_layers 1; indexer cache bf16 in SGLang's NPU MLA pool"
)
_GLM5_SOURCE = (
    "zai-org/GLM-5 config.json (GlmMoeDsaForCausalLM, model_type glm_moe_dsa) as mirrored by "
    "transformers' GlmMoeDsaConfig defaults: num_hidden_layers 78, kv_lora_rank 512, "
    "qk_rope_head_dim 64, index_head_dim 128, index_n_heads 32, index_topk 2048, "
    "num_nextn_predict_layers 1"
)

PRESETS: Dict[str, ModelShape] = {
    "deepseek-v3.2": ModelShape(
        name="deepseek-v3.2",
        num_layers=61,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        index_head_dim=128,
        index_n_heads=64,
        index_topk=2048,
        mtp_layers=1,
        indexer_dtype="bf16",
        source=_DSV32_SOURCE,
    ),
    "glm-5": ModelShape(
        name="glm-5",
        num_layers=78,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        index_head_dim=128,
        index_n_heads=32,
        index_topk=2048,
        mtp_layers=1,
        indexer_dtype="bf16",
        source=_GLM5_SOURCE,
        notes="indexer dtype on Ascend assumed bf16 (as SGLang's NPU MLA pool stores it); not checked "
        "against a GLM-5 Ascend deployment",
    ),
    "glm-5.1": ModelShape(
        name="glm-5.1",
        num_layers=78,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        index_head_dim=128,
        index_n_heads=32,
        index_topk=2048,
        mtp_layers=1,
        indexer_dtype="bf16",
        source="zai-org/GLM-5.1: same glm_moe_dsa architecture and shapes as GLM-5 (NVIDIA NeMo model "
        "coverage: 78 layers, kv_lora_rank 512; indexer 32 x 128, top-k 2048)",
        notes="index_topk and num_nextn_predict_layers taken from GLM-5 (same architecture), not read "
        "from the GLM-5.1 config.json itself; pass --model-config to be exact",
    ),
}
ALIASES: Dict[str, str] = {
    "deepseek-v32": "deepseek-v3.2",
    "dsv32": "deepseek-v3.2",
    "deepseek-v3.2-exp": "deepseek-v3.2",
    "glm5": "glm-5",
    "glm5.1": "glm-5.1",
}

# HuggingFace config.json key -> ModelShape field, and the smallest valid value.
HF_KEYS: Tuple[Tuple[str, str, int], ...] = (
    ("num_hidden_layers", "num_layers", 1),
    ("kv_lora_rank", "kv_lora_rank", 1),
    ("qk_rope_head_dim", "qk_rope_head_dim", 1),
    ("index_head_dim", "index_head_dim", 1),
    ("index_n_heads", "index_n_heads", 1),
    ("index_topk", "index_topk", 1),
    ("num_nextn_predict_layers", "mtp_layers", 0),
)


# Keys HuggingFace's DeepSeek-V3 config class defaults when config.json omits them.
OPTIONAL_HF_KEYS: Dict[str, int] = {"num_nextn_predict_layers": 0}


def preset(name: str) -> ModelShape:
    """The preset called ``name`` (case-insensitive, aliases accepted); ConfigError otherwise."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ConfigError(
            [
                Violation(
                    "capacity.model",
                    f"unknown model preset {name!r}",
                    f"use one of {', '.join(sorted(PRESETS))}, or --model-config path/config.json",
                )
            ],
            "model",
        )
    return PRESETS[key]


def shape_from_hf_dict(
    config: Mapping[str, Any], name: str = "model-config", indexer_dtype: IndexerDtype = "bf16"
) -> ModelShape:
    """A :class:`ModelShape` from a parsed HuggingFace config; every bad key in one error.

    Keys read: those of :data:`HF_KEYS` (integers; all required but those of
    :data:`OPTIONAL_HF_KEYS`, which default as in HuggingFace's DeepSeek configs). A multimodal config
    with the language model under ``text_config`` is read from there.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(
            [Violation("capacity.model_config", f"{name} is not a JSON object", "pass a HuggingFace config.json")],
            "model config",
        )
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    problems: List[Violation] = []
    values: Dict[str, int] = {}
    if OPTIONAL_HF_KEYS.keys() - config.keys():  # absent optional keys take HuggingFace's default
        config = {**OPTIONAL_HF_KEYS, **config}
    missing = [key for key, _, _ in HF_KEYS if key not in config]
    if missing:
        problems.append(
            Violation(
                "capacity.model_config",
                f"{name} lacks {', '.join(missing)}",
                "the capacity planner needs a DSA (MLA + lightning indexer) config with every key of: "
                + ", ".join(k for k, _, _ in HF_KEYS),
            )
        )
    for key, field_name, minimum in HF_KEYS:
        if key not in config:
            continue
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            problems.append(
                Violation(
                    "capacity.model_config",
                    f"{name}: {key}={json.dumps(value)}",
                    f"{key} must be an integer >= {minimum}",
                )
            )
        else:
            values[field_name] = value
    if problems:
        raise ConfigError(problems, "model config")
    return ModelShape(name=name, indexer_dtype=indexer_dtype, source=f"HuggingFace config {name}", **values)


def load_hf_config(path: str, indexer_dtype: IndexerDtype = "bf16") -> ModelShape:
    """Read ``path`` (a ``config.json``, or a model directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(
            [
                Violation(
                    "capacity.model_config",
                    f"cannot read {path}: {exc.strerror}",
                    "pass the path of a HuggingFace config.json",
                )
            ],
            "model config",
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [Violation("capacity.model_config", f"{path} is not valid JSON: {exc}", "pass a HuggingFace config.json")],
            "model config",
        ) from exc
    return shape_from_hf_dict(data, name=path, indexer_dtype=indexer_dtype)
