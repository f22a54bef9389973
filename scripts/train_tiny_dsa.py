"""Train the tiny DeepSeek-V3.2-style checkpoint in ``tests/fixtures/tiny_dsa_trained``.

Run from the repository root with the CPU environment::

    .venv/bin/python scripts/train_tiny_dsa.py            # about 25 min on 2 CPU cores
    .venv/bin/python scripts/train_tiny_dsa.py --shape k128   # tests/fixtures/tiny_dsa_trained_k128

``--shape`` picks the architecture (see :data:`SHAPES`): ``k64`` (the default) is
``tests/fixtures/tiny_dsa_trained``; ``k128`` is the shape the fused kernels serve
(index top-k 128, 8 index heads), ``tests/fixtures/tiny_dsa_trained_k128``. Both use
the same corpus, tokenizer, schedule, seed and threads.

What it builds, in order:

1. **Corpus**: the Python standard library's own source (``*.py`` under
   ``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and the test
   suites), licensed under the PSF License 2.0. Files are read in sorted order; one
   in 20 (by CRC32 of its relative path) is held out for evaluation.
2. **Tokenizer**: a byte-level BPE (``tokenizers``) with 4,096 tokens, trained on the
   training files, with a chat template in ``tokenizer_config.json``.
3. **Model**: transformers' own ``DeepseekV32ForCausalLM`` with the architecture of
   the shape's base config (``k64``: ``tests/fixtures/tiny_dsa_mtp``, 2 MLA layers,
   kv_lora 512, rope 64, lightning indexer with 4 heads of 128, at index top-k 64;
   ``k128``: ``tests/fixtures/tiny_dsa_fused_mtp``, 8 index heads, top-k 128), plus one NextN (MTP) layer built
   from transformers' ``DeepseekV32DecoderLayer`` (a MoE layer, as SGLang's NextN
   loader expects), trained to predict token t+2 from the target's final hidden
   state at t and the embedding of token t+1.
4. **Training**, in DeepSeek's order for the indexer:
   - ``lm``: dense attention (top-k = context), language-model + MTP loss, 512-token
     windows;
   - ``warmup``: main model frozen, indexer trained by KL divergence to the dense
     attention distribution (summed over heads), 2,048-token windows;
   - ``sparse``: top-k sparse attention (the shape's top-k), LM + MTP loss, and the indexer trained by
     KL to the attention over its selected set (its inputs detached, so it never
     moves the main model).
5. **Evaluation and export**: bf16 safetensors in the DeepSeek checkpoint layout
   (the NextN layer as ``model.layers.2.*``), the held-out NLL of the exported
   weights on fixed 1,024-token windows (kept with their token ids in
   ``heldout_eval.json`` so a served model can be checked against it), a unigram
   baseline, and the loss curve in ``training.json``.

Everything is seeded (``--seed``) and runs on ``--threads`` CPU threads; with the same
seed, threads, Python build and library versions, the run repeats bit for bit.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HELDOUT_MODULUS = 20
EVAL_WINDOW = 1024
EVAL_WINDOWS = 4
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Shape:
    """An architecture the script trains: its base config, index top-k and default output.

    The base config supplies every dimension (the index heads included); the script
    overrides only the vocabulary, positions, RoPE spelling and ``index_topk``.
    """

    name: str
    base_config: Path
    index_topk: int
    default_out: Path


SHAPES = {
    # The first trained checkpoint: top-k 64, 4 index heads (the reference and npu rungs).
    "k64": Shape("k64", FIXTURES / "tiny_dsa_mtp" / "config.json", 64, FIXTURES / "tiny_dsa_trained"),
    # The shape LIM / LIM-C8 / Copy-SFA accept: top-k a multiple of 128, index heads a
    # multiple of 8 (the base config has 8).
    "k128": Shape("k128", FIXTURES / "tiny_dsa_fused_mtp" / "config.json", 128, FIXTURES / "tiny_dsa_trained_k128"),
}
DEFAULT_SHAPE = "k64"


def shape_of(out_dir: Path) -> Shape:
    """The shape a written fixture was trained at (matched by its ``index_topk``)."""
    topk = json.loads((Path(out_dir) / "config.json").read_text())["index_topk"]
    found = [s for s in SHAPES.values() if s.index_topk == topk]
    if len(found) != 1:
        raise ValueError(f"{out_dir}: index_topk {topk} matches no single shape of {sorted(SHAPES)}")
    return found[0]


@dataclass(frozen=True)
class Phase:
    """One training phase: ``steps`` optimizer steps on ``batch`` windows of ``seq`` tokens."""

    name: str
    steps: int
    seq: int
    batch: int
    lr: float
    topk: Optional[int]  # None: dense attention (top-k = context)


@dataclass
class Plan:
    seed: int = 0
    threads: int = 2
    phases: List[Phase] = field(default_factory=list)
    max_corpus_bytes: int = 0  # 0: the whole corpus


def default_phases(scale: float = 1.0, topk: int = SHAPES[DEFAULT_SHAPE].index_topk) -> List[Phase]:
    """The committed checkpoints' schedule; ``scale`` shrinks the step counts (smoke runs)."""

    def steps(n: int) -> int:
        return max(1, int(round(n * scale)))

    return [
        Phase("lm", steps(360), 512, 8, 2e-3, None),
        Phase("warmup", steps(30), 2048, 1, 1e-3, None),
        Phase("sparse", steps(100), 2048, 1, 5e-4, topk),
    ]


# ----------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Corpus:
    train: List[str]
    heldout: List[str]
    files: int
    sha256: str
    root: str


def read_corpus(max_bytes: int = 0) -> Corpus:
    """The standard library's source files, split into train / held-out by path hash.

    ``max_bytes`` caps the training text only (smoke runs); the held-out set and the
    digest always cover every file.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not (EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])))
    digest = hashlib.sha256()
    train, heldout, total = [], [], 0
    for path in paths:
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        digest.update(rel.encode() + b"\0" + text.encode("utf-8", errors="replace"))
        if zlib.crc32(rel.encode()) % HELDOUT_MODULUS == 0:
            heldout.append(text)
        elif not max_bytes or total < max_bytes:
            train.append(text)
            total += len(text)
    return Corpus(train, heldout, len(paths), digest.hexdigest(), str(root))


def train_tokenizer(texts: List[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: List[str]):
    """One int64 tensor: ``<|bos|> file <|eos|>`` for every file, in order."""
    import torch

    ids: List[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def model_config(shape: Shape = SHAPES[DEFAULT_SHAPE]):
    from transformers import DeepseekV32Config

    raw = json.loads(shape.base_config.read_text())
    # YaRN at factor 1 is plain RoPE (no interpolation, mscale 1); it is spelled out
    # because SGLang's CPU rope factory requires a rope_scaling entry.
    raw["rope_scaling"] = {
        "type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    raw.update(
        vocab_size=VOCAB_SIZE,
        index_topk=shape.index_topk,
        max_position_embeddings=4096,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    cfg = DeepseekV32Config(**raw)
    cfg._attn_implementation = "eager"
    return cfg, raw


def build_nextn(cfg):
    """The NextN layer: ``eh_proj(cat(enorm(embed(t+1)), hnorm(h_t)))`` -> MoE decoder layer -> norm.

    The decoder layer is transformers' ``DeepseekV32DecoderLayer`` at layer index
    ``num_hidden_layers`` of a config extended by one sparse (MoE) layer; embeddings
    and the LM head are shared with the target model.
    """
    import torch.nn as nn
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer, DeepseekV32RMSNorm

    ext = copy.deepcopy(cfg)
    ext.num_hidden_layers = cfg.num_hidden_layers + 1
    ext.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
    hidden = cfg.hidden_size

    class NextN(nn.Module):
        def __init__(self):
            super().__init__()
            self.enorm = DeepseekV32RMSNorm(hidden, cfg.rms_norm_eps)
            self.hnorm = DeepseekV32RMSNorm(hidden, cfg.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            self.decoder = DeepseekV32DecoderLayer(ext, cfg.num_hidden_layers)
            self.norm = DeepseekV32RMSNorm(hidden, cfg.rms_norm_eps)

    return NextN()


def init_nextn(nextn, std: float) -> None:
    import torch

    with torch.no_grad():
        for name, p in nextn.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("k_norm.bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)


def causal_mask(seq: int, dtype):
    import torch

    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask[None, None]  # [1, 1, S, S]: 0 where key <= query


def set_topk(modules, topk: int) -> None:
    for m in modules:
        m.index_topk = topk


# ----------------------------------------------------------------------------- indexer loss


class IndexerKL:
    """Captures each attention's inputs and probabilities and forms the indexer's KL loss.

    Per attention module: the lightning-indexer scores are recomputed *with* gradients
    from detached inputs (so the loss trains only the indexer), and compared with the
    attention distribution the forward actually used (eager attention returns its
    probabilities), averaged over heads: ``sum_t KL(p_t || softmax(I_t))`` restricted
    to causally visible keys, and in sparse mode to the indexer's own top-k.
    """

    def __init__(self, attentions, sparse_topk: Optional[int]):
        self.attentions = attentions
        self.sparse_topk = sparse_topk
        self.losses: List = []
        self.enabled = False
        self._inputs: Dict[int, tuple] = {}
        self._handles = []
        for attn in attentions:
            self._handles.append(attn.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(attn.register_forward_hook(self._post))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, module, args, kwargs):
        if self.enabled:
            self._inputs[id(module)] = (
                kwargs["hidden_states"],
                kwargs["position_embeddings"],
                kwargs["attention_mask"],
            )

    def _post(self, module, args, output):
        if not self.enabled:
            return
        import torch

        hidden, (cos, sin), mask = self._inputs.pop(id(module))
        with torch.enable_grad():
            self.losses.append(self._kl(module, hidden, cos, sin, mask, output[1]))

    def _kl(self, module, hidden, cos, sin, mask, attn_probs):
        import torch
        import torch.nn.functional as F
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

        probs = attn_probs.detach().float().mean(dim=1)  # [B, S, T]
        idx = module.indexer
        x = hidden.detach()
        with torch.no_grad():
            q_resid = module.q_a_layernorm(module.q_a_proj(x))
        b, s, _ = x.shape
        q = idx.wq_b(q_resid).view(b, s, idx.n_heads, idx.head_dim)
        q_rot, q_pass = torch.split(q, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], -1)
        k = idx.k_norm(idx.wk(x)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], -1)
        q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], -1)
        k = torch.cat([k_rot, k_pass], -1).squeeze(2)
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * idx.softmax_scale)
        weights = idx.weights_proj(x).float() * (idx.n_heads**-0.5)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
        visible = mask[:, 0] == 0  # [B or 1, S, T]
        visible = visible.expand_as(index_scores)
        if self.sparse_topk is not None and self.sparse_topk < s:
            top = index_scores.detach().masked_fill(~visible, float("-inf")).topk(self.sparse_topk, -1).indices
            chosen = torch.zeros_like(visible).scatter(-1, top, True)
            visible = visible & chosen
            probs = probs * visible
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
        log_q = index_scores.masked_fill(~visible, float("-inf")).log_softmax(-1)
        log_q = log_q.masked_fill(~visible, 0.0)
        log_p = probs.clamp_min(1e-12).log().masked_fill(~visible, 0.0)
        return (probs * (log_p - log_q)).sum(-1).mean()

    def take(self):
        out, self.losses = self.losses, []
        return sum(out) / max(1, len(out)) if out else None


# ----------------------------------------------------------------------------- training


def forward_losses(model, nextn, ids, mask):
    """LM and MTP cross-entropy for a batch ``ids [B, S]``."""
    import torch
    import torch.nn.functional as F

    b, s = ids.shape
    pos = torch.arange(s)[None].expand(b, s)
    out = model.model(input_ids=ids, attention_mask=None, position_ids=pos)
    hidden = out.last_hidden_state  # post-norm, what SGLang hands the draft
    logits = model.lm_head(hidden)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    # MTP: position t sees h_t and token t+1, predicts token t+2.
    emb = model.model.embed_tokens(ids[:, 1:])
    h = hidden[:, :-1].detach()
    x = nextn.eh_proj(torch.cat([nextn.enorm(emb), nextn.hnorm(h)], -1))
    pos1 = pos[:, :-1]
    pe = model.model.rotary_emb(x, position_ids=pos1)
    x = nextn.decoder(x, attention_mask=mask[..., : s - 1, : s - 1], position_ids=pos1, position_embeddings=pe)
    mtp_logits = model.lm_head(nextn.norm(x))
    mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, VOCAB_SIZE), ids[:, 2:].reshape(-1))
    return lm, mtp


def sample_batch(stream, seq: int, batch: int, gen):
    import torch

    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[i : i + seq] for i in starts.tolist()])


def run_phase(phase: Phase, model, nextn, stream, gen, curve: List[dict], log) -> None:
    import torch

    attentions = [l.self_attn for l in model.model.layers] + [nextn.decoder.self_attn]
    indexers = [a.indexer for a in attentions]
    set_topk(indexers, phase.topk if phase.topk is not None else phase.seq)
    indexer_params = [p for ix in indexers for p in ix.parameters()]
    indexer_ids = {id(p) for p in indexer_params}
    main_params = [p for p in list(model.parameters()) + list(nextn.parameters()) if id(p) not in indexer_ids]
    train_main = phase.name != "warmup"
    train_indexer = phase.name != "lm"
    for p in main_params:
        p.requires_grad_(train_main)
    params = (main_params if train_main else []) + (indexer_params if train_indexer else [])
    opt = torch.optim.AdamW(params, lr=phase.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, phase.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, phase.steps) / phase.steps)))
        ),
    )
    kl_hook = IndexerKL(attentions, phase.topk) if train_indexer else None
    mask = causal_mask(phase.seq, torch.float32)
    t0 = time.monotonic()
    for step in range(phase.steps):
        ids = sample_batch(stream, phase.seq, phase.batch, gen)
        if kl_hook:
            kl_hook.enabled = True
        ctx = torch.enable_grad() if train_main else torch.no_grad()
        with ctx:
            lm, mtp = forward_losses(model, nextn, ids, mask)
        kl = kl_hook.take() if kl_hook else None
        loss = (lm + 0.3 * mtp if train_main else 0.0) + (kl if kl is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        row = {"phase": phase.name, "step": step + 1, "lm": round(lm.item(), 4), "mtp": round(mtp.item(), 4)}
        if kl is not None:
            row["indexer_kl"] = round(kl.item(), 4)
        curve.append(row)
        if step == 0 or (step + 1) % 10 == 0 or step + 1 == phase.steps:
            rate = (step + 1) / (time.monotonic() - t0)
            eta = (phase.steps - step - 1) / rate
            log(
                f"[{phase.name}] {step + 1}/{phase.steps}  lm {row['lm']:.3f}  mtp {row['mtp']:.3f}"
                + (f"  indexer_kl {row['indexer_kl']:.3f}" if kl is not None else "")
                + f"  ({rate:.2f} steps/s, {eta:.0f} s left)"
            )
    if kl_hook:
        kl_hook.remove()
    for p in main_params:
        p.requires_grad_(True)


# ----------------------------------------------------------------------------- export + eval


def export_state(model, nextn) -> Dict[str, "torch.Tensor"]:  # noqa: F821 - torch is imported lazily
    """The DeepSeek checkpoint layout SGLang reads (bf16; the router bias stays fp32)."""
    import torch

    out = {}
    for name, t in model.state_dict().items():
        out[name] = t
    layer = f"model.layers.{model.config.num_hidden_layers}"
    sd = nextn.state_dict()
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
        out[f"{layer}.{name}"] = sd[name]
    out[f"{layer}.shared_head.norm.weight"] = sd["norm.weight"]
    out[f"{layer}.embed_tokens.weight"] = model.model.embed_tokens.weight
    out[f"{layer}.shared_head.head.weight"] = model.lm_head.weight
    for name, t in sd.items():
        if not name.startswith("decoder."):
            continue
        rest = name[len("decoder.") :]
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{layer}.mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{layer}.mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[f"{layer}.{rest}"] = t
    return {
        k: (v.detach().float() if k.endswith("e_score_correction_bias") else v.detach().to(torch.bfloat16)).contiguous()
        for k, v in out.items()
    }


def heldout_windows(stream, count: int, length: int) -> List[List[int]]:
    """``count`` evenly spaced, non-overlapping windows of the held-out stream."""
    stride = max(length, (stream.numel() - length) // max(1, count))
    return [
        stream[i * stride : i * stride + length].tolist() for i in range(count) if i * stride + length <= stream.numel()
    ]


def evaluate(out_dir: Path, windows: List[List[int]]) -> Tuple[float, List[float]]:
    """Mean NLL (nats/token) of the exported bf16 weights on ``windows``, sparse top-k attention.

    The weights are read back from ``model.safetensors`` and upcast to fp32, so this is
    the model a server loads; each window is scored from its second token on.
    """
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import DeepseekV32ForCausalLM

    cfg, _ = model_config(shape_of(out_dir))
    model = DeepseekV32ForCausalLM(cfg).eval()
    state = load_file(str(out_dir / "model.safetensors"))
    missing, _ = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing:
        raise RuntimeError(f"exported checkpoint lacks {missing}")
    per_window = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(input_ids=ids).logits[0, :-1]
            per_window.append(F.cross_entropy(logits.float(), ids[0, 1:]).item())
    return sum(per_window) / len(per_window), per_window


def unigram_nll(train, heldout) -> float:
    """Cross-entropy of the held-out tokens under the training unigram (add-one smoothed)."""
    import torch

    counts = torch.bincount(train, minlength=VOCAB_SIZE).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout].mean())


def write_fixture(out_dir: Path, tok, raw_cfg: dict, state, meta: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = dict(raw_cfg)
    cfg["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "add_bos_token": True,
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2) + "\n"
    )
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2) + "\n"
    )
    (out_dir / "training.json").write_text(json.dumps(meta, indent=1) + "\n")


# glibc hands every large block back to the kernel and faults it in again on the next
# step; keeping freed memory in the process halves the step time here (same numbers).
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 34),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 30),
}


def reexec_with_malloc_env() -> None:
    """Restart this script once with :data:`MALLOC_ENV` (glibc reads it only at startup)."""
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return
    env = dict(os.environ, **MALLOC_ENV)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=DEFAULT_SHAPE,
        help="architecture: k64 (tiny_dsa_trained) or k128 (tiny_dsa_trained_k128, the fused kernels' shape)",
    )
    ap.add_argument("--out", type=Path, default=None, help="fixture directory to write (default: the shape's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the result depends on it)")
    ap.add_argument(
        "--scale", type=float, default=1.0, help="multiply every phase's step count (e.g. 0.01 for a smoke run)"
    )
    ap.add_argument(
        "--max-corpus-mb",
        type=float,
        default=0.0,
        help="train on only this much of the corpus (0: all of it); for smoke runs",
    )
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.out is None:
        args.out = shape.default_out

    import torch

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.monotonic()
    corpus = read_corpus(int(args.max_corpus_mb * 1e6))
    log(f"corpus: {len(corpus.train)} training + {len(corpus.heldout)} held-out files from {corpus.root}")
    tok = train_tokenizer(corpus.train)
    train_stream = encode_stream(tok, corpus.train)
    heldout_stream = encode_stream(tok, corpus.heldout)
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens; {train_stream.numel():,} training and "
        f"{heldout_stream.numel():,} held-out tokens ({time.monotonic() - start:.0f} s)"
    )

    from transformers import DeepseekV32ForCausalLM

    cfg, raw_cfg = model_config(shape)
    model = DeepseekV32ForCausalLM(cfg)
    model.train()
    nextn = build_nextn(cfg)
    init_nextn(nextn, cfg.initializer_range)
    nextn.train()
    log(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters + "
        f"{sum(p.numel() for p in nextn.parameters()):,} in the NextN layer"
    )

    phases = default_phases(args.scale, shape.index_topk)
    curve: List[dict] = []
    for phase in phases:
        run_phase(phase, model, nextn, train_stream, gen, curve, log)
    train_s = time.monotonic() - start

    state = export_state(model, nextn)
    windows = heldout_windows(heldout_stream, EVAL_WINDOWS, EVAL_WINDOW)
    meta = {
        "command": "python scripts/train_tiny_dsa.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed,
        "threads": args.threads,
        "phases": [asdict(p) for p in phases],
        "corpus": {
            "name": "Python standard library source (*.py, without site-packages and test suites)",
            "licence": "PSF-2.0",
            "python": sys.version.split()[0],
            "files": corpus.files,
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
            "sha256": corpus.sha256,
            "train_tokens": int(train_stream.numel()),
            "heldout_tokens": int(heldout_stream.numel()),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
        "train_seconds": round(train_s, 1),
        "curve": curve,
    }
    write_fixture(args.out, tok, raw_cfg, state, meta)
    nll, per_window = evaluate(args.out, windows)
    uni = unigram_nll(train_stream, heldout_stream)
    meta["heldout"] = {
        "window": EVAL_WINDOW,
        "windows": len(windows),
        "nll": round(nll, 4),
        "perplexity": round(math.exp(nll), 3),
        "unigram_nll": round(uni, 4),
        "unigram_perplexity": round(math.exp(uni), 3),
        "per_window_nll": [round(x, 4) for x in per_window],
    }
    (args.out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    (args.out / "heldout_eval.json").write_text(
        json.dumps({"index_topk": shape.index_topk, "nll": per_window, "windows": windows}) + "\n"
    )
    size_mb = sum(f.stat().st_size for f in args.out.iterdir()) / 1e6
    log(
        f"held-out NLL {nll:.3f} nats/token (perplexity {math.exp(nll):.1f}) vs unigram {uni:.3f} "
        f"({math.exp(uni):.1f}); fixture {size_mb:.1f} MB in {args.out}; {time.monotonic() - start:.0f} s in all"
    )
    return 0


if __name__ == "__main__":
    reexec_with_malloc_env()
    raise SystemExit(main())
