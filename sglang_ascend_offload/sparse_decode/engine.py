"""The per-step sparse decode engine (engine-agnostic: tensors, layer ids, rows).

One decode step, per layer ``l``:

1. new-token rows are appended device -> host into the host pool
   (:meth:`SparseDecodeEngine.append`; TP rank 0 only, the others wait on the
   :class:`~.host_pool.AppendGate` before they read);
2. the residency manager classifies the row's logical top-k into hits and misses
   and assigns victim slots (op ``residency_manage`` for LRU, or another policy);
3. only the miss rows are copied host -> device (op ``copy_miss_rows``);
4. the top-k is remapped to hot-buffer rows ``r*H + slot`` in the same order;
5. sparse attention (op ``sparse_mla_attention``, ``layout_kv="flat"``) runs over
   the hot buffer.

Ops are resolved once through the operator ladder (``ops`` = ``auto | reference |
triton | npu | fused``), so ``ops=triton`` swaps in the Triton residency and copy
kernels without touching this file. When ``copy_sparse_flash_attention`` resolves to
the ``fused`` rung (the AscendC Copy-SFA operator), steps 3-5 run as that one op.

Inputs of a step (:meth:`begin_step`): ``req_ids`` int64 ``[R]`` (``-1`` idle),
``token_table`` int32 ``[R, max_ctx]`` (logical position -> host slot of each row;
in SGLang ``req_to_token[req_pool_indices]``), ``stable_len`` int32 ``[R]``
(positions ``>= stable_len`` may be rewritten and are never hits). Per layer
(:meth:`run_layer`): ``topk`` int32 ``[R, K]`` logical positions (``-1`` padding),
``query`` ``[R, N, latent]``, ``query_rope`` ``[R, N, rope]``.

Rows must be stable per request across steps (in SGLang: index rows by
``req_pool_idx``, not by batch position, or every batch reshuffle resets residency).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import platform
from ..ops import registry
from .host_pool import AppendGate, HostKVPool
from .hot_buffer import HotBuffers
from .policies import DEFAULT_POLICY, ResidencyManager, make_manager
from .residency import ResidencyStep, register_reference_ops
from .stats import DecodeStats, StatsAccumulator

__all__ = ["EngineConfig", "LayerResult", "PhaseTimes", "SparseDecodeEngine"]


@dataclass(frozen=True)
class EngineConfig:
    """Shape and choices of one engine (one DP rank's TP rank).

    rows: decode rows ``R`` (one query token each). hot_tokens: slots per row and
    layer (``>= top_k``). policy: residency policy name (``policies.POLICIES``).
    ops: operator-ladder choice.
    """

    layers: int
    rows: int
    hot_tokens: int
    top_k: int
    latent_dim: int = 512
    rope_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    policy: str = DEFAULT_POLICY
    ops: str = "auto"

    def __post_init__(self):
        problems = []
        for name in ("layers", "rows", "hot_tokens", "top_k", "latent_dim"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.hot_tokens < self.top_k:
            problems.append(f"hot_tokens {self.hot_tokens} must be >= top_k {self.top_k}")
        if problems:
            raise ValueError("invalid sparse decode engine config: " + "; ".join(problems))

    @property
    def row_dim(self) -> int:
        return self.latent_dim + self.rope_dim


@dataclass
class LayerResult:
    """Output of one layer step: attention output ``[R, N, latent]``, the residency
    step, and the remapped indices int32 ``[R, 1, K]`` into the flat hot buffer."""

    output: torch.Tensor
    residency: ResidencyStep
    flat_indices: torch.Tensor


@dataclass
class PhaseTimes:
    """Wall seconds spent per phase (only measured when ``timing=True``)."""

    seconds: Dict[str, float] = field(default_factory=lambda: {"append": 0.0, "manage": 0.0,
                                                                "copy": 0.0, "attention": 0.0})

    def add(self, phase: str, dt: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + dt


class SparseDecodeEngine:
    """Hot buffers + residency managers + statistics for all layers of one rank.

    ``pool``: the DP rank's :class:`HostKVPool`. ``tp_rank``: 0 writes new rows and
    publishes them on ``gate``; other ranks wait on ``gate`` (required when
    ``tp_rank > 0``) before reading the host pool.
    """

    def __init__(self, config: EngineConfig, pool: HostKVPool, device=None, *, tp_rank: int = 0,
                 gate: Optional[AppendGate] = None, gate_timeout_s: float = 30.0, timing: bool = False):
        if pool.shape.layers != config.layers or pool.shape.row_dim != config.row_dim:
            raise ValueError(f"host pool {pool.shape} does not match engine config {config}")
        if pool.shape.dtype != config.dtype:
            raise ValueError(f"host pool dtype {pool.shape.dtype} != engine dtype {config.dtype}")
        if tp_rank > 0 and gate is None:
            raise ValueError("TP ranks > 0 read rows that TP rank 0 appends: pass the shared AppendGate")
        self.config = config
        self.pool = pool
        self.device = torch.device(device) if device is not None else platform.default_device()
        self.tp_rank = tp_rank
        self.gate = gate
        self.gate_timeout_s = gate_timeout_s
        self.timing = timing
        self.times = PhaseTimes()

        register_reference_ops()
        self._manage_op = registry.select("residency_manage", config.ops)
        self._copy_op = registry.select("copy_miss_rows", config.ops)
        self._attention_op = registry.select("sparse_mla_attention", config.ops)
        copy_sfa = registry.select("copy_sparse_flash_attention", config.ops)
        self._copy_sfa_op = copy_sfa if copy_sfa.rung == "fused" else None

        self.hot = HotBuffers(config.layers, config.rows, config.hot_tokens, config.row_dim,
                              config.dtype, self.device)
        self.managers: List[ResidencyManager] = [
            make_manager(config.policy, config.rows, config.hot_tokens, self.device, self._manage_op)
            for _ in range(config.layers)
        ]
        self.stats_acc = StatsAccumulator(config.layers, pool.shape.row_bytes, self.device)
        self.step_index = -1
        self._req_ids: Optional[torch.Tensor] = None
        self._stable_len: Optional[torch.Tensor] = None
        self._token_table: Optional[torch.Tensor] = None

    # ---------------------------------------------------------------------- a step
    def begin_step(self, req_ids: torch.Tensor, token_table: torch.Tensor, stable_len: torch.Tensor,
                   step: Optional[int] = None) -> int:
        """Set the row metadata of the next decode step; returns its step number."""
        r = self.config.rows
        if tuple(req_ids.shape) != (r,) or tuple(stable_len.shape) != (r,):
            raise ValueError(f"req_ids {tuple(req_ids.shape)} / stable_len {tuple(stable_len.shape)} must be [{r}]")
        if token_table.dim() != 2 or token_table.shape[0] != r:
            raise ValueError(f"token_table must be [{r}, max_ctx], got {tuple(token_table.shape)}")
        step = self.step_index + 1 if step is None else int(step)
        if step <= self.step_index:
            raise ValueError(f"step {step} is not after the previous step {self.step_index}")
        self.step_index = step
        self._req_ids = req_ids.to(self.device, torch.int64)
        self._stable_len = stable_len.to(self.device, torch.int32)
        self._token_table = token_table.to(torch.int32)
        self.stats_acc.record_step()
        return step

    def append(self, layer: int, host_slots: torch.Tensor, rows: torch.Tensor) -> None:
        """New-token rows ``[n, D]`` of ``layer`` -> host slots ``[n]`` (TP rank 0 only;
        a no-op on other ranks, whose copy of the rows is TP rank 0's)."""
        if self.tp_rank != 0:
            return
        t0 = time.perf_counter()
        nbytes = self.pool.write_rows(layer, host_slots, rows)
        self.stats_acc.record_d2h(layer, nbytes)
        if self.timing:
            self.times.add("append", time.perf_counter() - t0)

    def run_layer(self, layer: int, topk: torch.Tensor, query: torch.Tensor, query_rope: torch.Tensor,
                  scale: float) -> LayerResult:
        """Residency, miss copy, remap and sparse attention of ``layer`` in this step."""
        if self._req_ids is None:
            raise RuntimeError("begin_step() must be called before run_layer()")
        cfg = self.config
        if tuple(topk.shape) != (cfg.rows, cfg.top_k):
            raise ValueError(f"topk must be [{cfg.rows}, {cfg.top_k}], got {tuple(topk.shape)}")
        self._sync_with_writer(layer)

        t0 = self._tick()
        topk_dev = topk.to(self.device, torch.int32)
        res = self.managers[layer].step(topk_dev, self._req_ids, self._stable_len, self.step_index)
        t1 = self._tick()
        flat = self.hot.flat_indices(res.slots)
        if self._copy_sfa_op is not None:  # fused Copy-SFA: copy + attention in one op
            token_rows = torch.where(self._req_ids >= 0,
                                     torch.arange(cfg.rows, device=self.device, dtype=torch.int64),
                                     torch.full_like(self._req_ids, -1)).to(torch.int32)
            out = self._copy_sfa_op(query, self.pool.layer(layer), self.hot.layer(layer), flat, scale,
                                    query_rope=query_rope, token_rows=token_rows, miss_tokens=res.miss_tokens,
                                    miss_slots=res.miss_slots, miss_count=res.miss_count,
                                    token_table=self._token_table)
            t2 = t1
        else:
            self._copy_op(self.pool.layer(layer), self.hot.layer(layer), res.miss_tokens, res.miss_slots,
                          res.miss_count, self._token_table)
            t2 = self._tick()
            latent, rope = self.hot.split_flat(layer, cfg.latent_dim)
            out = self._attention_op(query, latent, None, flat, scale, query_rope=query_rope, key_rope=rope,
                                     layout_query="TND", layout_kv="flat")
        t3 = self._tick()
        if self.timing:
            self.times.add("manage", t1 - t0)
            self.times.add("copy", t2 - t1)
            self.times.add("attention", t3 - t2)

        hits = res.hit_mask.sum()
        misses = res.miss_count.sum(dtype=torch.int64)
        self.stats_acc.record_residency(layer, hits + misses, hits, misses)
        return LayerResult(output=out, residency=res, flat_indices=flat)

    def _sync_with_writer(self, layer: int) -> None:
        if self.gate is None:
            return
        if self.tp_rank == 0:
            platform.synchronize()  # the D2H appends of this layer have landed
            self.gate.publish(self.step_index, layer)
        else:
            self.gate.wait(self.step_index, layer, self.gate_timeout_s)

    def _tick(self) -> float:
        if self.timing:
            platform.synchronize()
        return time.perf_counter()

    # ---------------------------------------------------------------------- views
    @property
    def token_table(self) -> torch.Tensor:
        return self._token_table

    def stats(self) -> DecodeStats:
        return self.stats_acc.snapshot()
