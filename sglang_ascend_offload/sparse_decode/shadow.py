"""Shadow verification: recompute sampled rows' attention over the host pool and compare.

Silent corruption of the served KV (a miss copied to the wrong slot, a stale slot
taken for a hit, a host row overwritten by another layer) changes outputs without
failing anything. At ``rate`` (the sparse decode config's ``verify_sample_rate``), after a
layer's step the engine picks one of the step's query rows and recomputes its
attention with the same attention op over the *host pool*, with the row's logical
top-k mapped through the token table: what the served output over the hot buffer
must equal.

* **Where it recomputes: on the device, with the engine's own attention op.** The
  row's ``top_k`` host rows are gathered on the host (the pool lives there) and copied
  to the device of the served row, and the op the engine attends with (the plan's
  ``sparse_mla_attention`` rung: torch_npu on an NPU, the reference on a CPU) runs
  there on the row's query. Not on the host: on an NPU the engine's op is the torch_npu
  kernel, which takes device tensors only, and the host-side reference op would
  compare two different kernels' arithmetic, so a check could only hold a tolerance
  (which hides a small corruption) where the same op over the same rows gives a
  bit-exact answer.
* **What is compared.** The served ``[N, latent]`` output row against the
  recomputation. Where the served output came from the same op over copied rows (the
  torch, CPU-kernel and Triton residency paths all end in the engine's attention op),
  the two read the same values in the same order: they must be bit-identical
  (``exact``). A fused copy-and-attention kernel computes differently: then within
  ``atol + rtol * |reference|`` (bf16 inputs: :data:`FUSED_ATOL` / :data:`FUSED_RTOL`).
* **Cost.** One row's gather of ``top_k`` host rows, one host->device copy of them and
  one row's attention, on the sampled (layer, step) only: the sampling is a host random
  draw, so unsampled steps read nothing from the device. A sampled check reads the
  row's top-k and token table back (a device sync) and the comparison's verdict.
* **On a mismatch** the counters record it, the log names the layer, batch row,
  engine row and request, and with ``action="fail"`` the forward raises
  :class:`ShadowMismatch` with the same facts.

The engine draws (:meth:`ShadowVerifier.sample`) and checks (:meth:`ShadowVerifier.check`)
from its eager layer step; a device-graph step has no host code between layers, so the
served backends refuse a sample rate with decode graphs (rule ``sglang.sparse_decode_graph``).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .verify import logical_to_host

__all__ = ["ShadowMismatch", "ShadowResult", "ShadowVerifier", "FUSED_ATOL", "FUSED_RTOL", "ACTIONS"]

logger = logging.getLogger("sglang_ascend_offload.sparse_decode")

ACTIONS = ("log", "fail")
#: Tolerance against a fused kernel's output (bf16 KV, float32 accumulation in both).
FUSED_ATOL = 2e-2
FUSED_RTOL = 2e-2


class ShadowMismatch(RuntimeError):
    """A served attention row differs from its recomputation over the host pool."""


@dataclass(frozen=True)
class ShadowResult:
    """One check: where, and by how much the served row differs (0.0 = identical)."""

    layer: int
    batch_row: int
    engine_row: int
    owner: int
    max_abs_diff: float
    exact: bool
    ok: bool
    seconds: float = 0.0  # what the check cost (gather, attention, comparison)

    def describe(self) -> str:
        how = "bit-exact comparison" if self.exact else f"tolerance atol {FUSED_ATOL} rtol {FUSED_RTOL}"
        return (
            f"layer {self.layer}, batch row {self.batch_row} (engine row {self.engine_row}, request "
            f"{self.owner}): served attention differs from the host-pool recomputation by up to "
            f"{self.max_abs_diff:.3g} ({how})"
        )


class ShadowVerifier:
    """Samples and runs the checks of one engine (see module doc).

    rate: probability that a layer step gets one row checked (``0 < rate <= 1``);
    action: ``log`` or ``fail``; seed: the host RNG's seed (reproducible sampling).
    """

    def __init__(self, rate: float, action: str = "log", seed: int = 0):
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"verify_sample_rate must be in (0, 1], got {rate}")
        if action not in ACTIONS:
            raise ValueError(f"verify_action must be one of {ACTIONS}, got {action!r}")
        self.rate = float(rate)
        self.action = action
        self._rng = random.Random(seed)
        self.checks = 0
        self.mismatches = 0
        self.seconds = 0.0
        self.last: Optional[ShadowResult] = None

    def sample(self, query_rows: int) -> Optional[int]:
        """The batch row to check after this layer step, or ``None`` (host draw only)."""
        if query_rows <= 0 or self._rng.random() >= self.rate:
            return None
        return self._rng.randrange(query_rows)

    def check(
        self,
        *,
        layer: int,
        batch_row: int,
        engine_row: int,
        owner: int,
        attention_op: Callable,
        read_rows: Callable[[torch.Tensor], torch.Tensor],
        latent_dim: int,
        topk_row: torch.Tensor,
        token_row: torch.Tensor,
        query: torch.Tensor,
        query_rope: torch.Tensor,
        scale: float,
        served: torch.Tensor,
        exact: bool,
    ) -> ShadowResult:
        """Recompute one row on ``served``'s device and compare it with ``served`` ``[N, latent]``.

        read_rows(host slots int64 ``[K]``) -> ``[K, latent + rope]`` host rows of the
        layer; topk_row int32 ``[K]`` logical positions (``-1`` = none); token_row int32
        ``[max_ctx]`` the row's token table; query ``[N, latent]`` / query_rope
        ``[N, rope]`` the row's query, on the engine's device; attention_op: the op the
        engine attends with (it receives device tensors only).
        """
        t0 = time.perf_counter()
        device = served.device
        slots = logical_to_host(topk_row.reshape(1, -1).cpu(), token_row.reshape(1, -1).cpu())[0]
        valid = slots >= 0
        k = slots.numel()
        staged = read_rows(slots.clamp(min=0).to(torch.int64)).to(device)
        indices = torch.where(valid, torch.arange(k, dtype=torch.int32), torch.full((k,), -1, dtype=torch.int32))
        ref = attention_op(
            query.unsqueeze(0),
            staged[:, :latent_dim],
            None,
            indices.view(1, 1, k).to(device),
            scale,
            query_rope=query_rope.unsqueeze(0),
            key_rope=staged[:, latent_dim:],
            layout_query="TND",
            layout_kv="flat",
        )[0]
        if exact:
            ok = torch.equal(served, ref)
        else:
            ok = torch.allclose(served.float(), ref.float(), atol=FUSED_ATOL, rtol=FUSED_RTOL)
        diff = float((served.float() - ref.float()).abs().max()) if served.numel() else 0.0
        result = ShadowResult(layer, batch_row, engine_row, owner, diff, exact, bool(ok), time.perf_counter() - t0)
        self.checks += 1
        self.seconds += result.seconds
        self.last = result
        if not result.ok:
            self.mismatches += 1
            logger.error("sparse decode offload: shadow verification mismatch: %s", result.describe())
            if self.action == "fail":
                raise ShadowMismatch(f"sparse decode offload: {result.describe()} (verify_action 'fail')")
        return result
