"""Speculative decoding (EAGLE / NextN-MTP) with the ``ascend_offload`` backend.

SGLang 0.5.23 serves DeepSeek-V3.2's NextN (MTP) layer with its EAGLE worker
(``--speculative-algorithm EAGLE``, alias ``NEXTN``): per decode round the draft
(NextN) model proposes ``speculative_num_steps`` tokens, the target model verifies
``speculative_num_draft_tokens`` = steps + 1 query rows per request
(``ForwardMode.TARGET_VERIFY``), and the draft model re-extends over the accepted
tokens (``ForwardMode.DRAFT_EXTEND_V2``). Only chains are served
(``--speculative-eagle-topk 1``): verify row ``j`` of a request sits at position
``L + j`` over its committed length ``L`` and attends causally.

With sparse decode offload (:func:`begin_verify`): a request's ``n`` verify rows share
its engine row (its ``req_to_token`` row), one hot buffer and one residency state per
layer, looked up with the union of the rows' top-k (``ops/request_union.py``);
the stable prefix is the committed length, so draft positions are never hits, accepted
ones hit in later rounds and rejected ones are dropped; the draft (NextN) layer keeps its KV on the device
(:data:`DRAFT_KV_PLACEMENT`, :func:`build_draft_pool`). Startup limits: rule
``sglang.sparse_decode_speculative`` (``launch_checks.py``).

What the plugin registers for it (HookRegistry, no SGLang file changed):

========================================================  ==================================
target                                                    why
========================================================  ==================================
AROUND ``torch.cuda.synchronize``                         the EAGLE worker shares embed / head
                                                          with the draft model through
                                                          ``set_embed_and_head``, which syncs
                                                          CUDA unconditionally; a no-op inside
                                                          that call when CUDA is unavailable
AROUND ``DeepseekV2ForCausalLM.set_embed_and_head``       enters that no-CUDA scope
AROUND ``DraftBackendFactory._create_backend``            SGLang's draft backend table has no
                                                          plugin entries: draft extend and
                                                          multi-step draft decode backends of
                                                          ``ascend_offload``
AROUND ``mem_cache.allocation.get_last_loc``              SGLang's torch version with
                                                          ``ascend_offload`` (it picks Triton
                                                          for every backend but ``ascend``)
========================================================  ==================================
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..cpu_capability import NoCudaScope

logger = logging.getLogger(__name__)

_NO_CUDA_SYNC = NoCudaScope("sao_no_cuda_sync", None)  # helper shared with cpu_capability.py

#: Inside: ``torch.cuda.synchronize()`` returns at once when CUDA is unavailable.
no_cuda_sync = _NO_CUDA_SYNC.active
#: HookRegistry AROUND hook for ``torch.cuda.synchronize``.
synchronize_around = _NO_CUDA_SYNC.around


def set_embed_and_head_around(original: Callable, self, embed, head):
    """The draft model takes the target's embedding and LM head (same tensors)."""
    with no_cuda_sync():
        return original(self, embed, head)


# ------------------------------------------------------------------ metadata
def speculative_lens(
    forward_batch, draft_step: Optional[int] = None
) -> Optional[Tuple[Optional[List[int]], torch.Tensor]]:
    """``(query rows per request or None for one, KV length per request after the
    forward)`` of a speculative batch, else ``None``.

    ``TARGET_VERIFY``: see below. A draft decode step (``DECODE`` with ``spec_info``,
    run by the draft model's per-step backend number ``draft_step``) has one row per
    request (``--speculative-eagle-topk 1``) at position ``L + draft_step`` over the
    committed length ``L``, so its KV length is ``L + draft_step + 1``.

    SGLang 0.5.23 gives a verify batch ``seq_lens`` = the committed length ``L`` of
    each request (the KV before this forward) and ``spec_info.draft_token_num`` = ``n``
    query rows per request (the last accepted token and ``n - 1`` drafts, a chain for
    ``--speculative-eagle-topk 1``) at positions ``L .. L + n - 1``; the rows attend
    causally, so the KV length after the forward is ``L + n`` (int32 ``[B]``, host).
    ``DRAFT_EXTEND_V2`` batches already carry post-write ``seq_lens`` and
    ``extend_seq_lens_cpu`` and need nothing here.
    """
    mode = forward_batch.forward_mode
    if draft_step is not None and mode.is_decode() and forward_batch.spec_info is not None:
        return None, forward_batch.seq_lens_cpu.to(torch.int32) + (draft_step + 1)
    if not mode.is_target_verify():
        return None
    n = int(forward_batch.spec_info.draft_token_num)
    bs = int(forward_batch.batch_size)
    return [n] * bs, forward_batch.seq_lens_cpu.to(torch.int32) + n


# ------------------------------------------------------------------ draft backends
class MultiStepDraftBackend:
    """The EAGLE draft decode backend for ``speculative_num_steps > 1``: one
    :class:`~..attention.dsa_backend.AscendOffloadAttnBackend` per draft step (``speculative_step_id``
    = its index), over the draft model's device pool. SGLang's EAGLE worker sets up the
    first ``steps - 1`` (the last step only samples) and runs step ``i`` with
    ``attn_backends[i]``."""

    def __init__(self, draft_model_runner: Any, topk: int, speculative_num_steps: int):
        from ..attention.dsa_backend import AscendOffloadAttnBackend

        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = []
        for step in range(speculative_num_steps):
            backend = AscendOffloadAttnBackend(draft_model_runner)
            backend.speculative_step_id = step
            self.attn_backends.append(backend)

    def init_forward_metadata(self, forward_batch) -> None:
        for backend in self.attn_backends[: self.speculative_num_steps - 1]:
            backend.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        for backend in self.attn_backends[: self.speculative_num_steps - 1]:
            backend.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        for backend in self.attn_backends[: self.speculative_num_steps - 1]:
            backend.init_forward_metadata_in_graph(forward_batch)


def _attention_backends():
    from sglang.srt.runtime_context import attention_backends

    return attention_backends()


def create_backend_around(
    original: Callable, self, backend_name: str, backend_map: dict, error_template: str, stamps_children: bool = False
):
    """HookRegistry AROUND hook for ``DraftBackendFactory._create_backend``: SGLang's
    table of draft backends has no entry for plugin backends; this adds
    ``ascend_offload`` (draft extend: one backend; draft decode: :class:`MultiStepDraftBackend`).
    The draft (NextN) model always runs the device-KV backend (its KV placement is
    ``device``, see :func:`build_draft_pool`)."""
    from ..attention.dsa_backend import AscendOffloadAttnBackend
    from ..names import BACKEND_NAME

    runner = self.draft_model_runner
    prefill, decode = _attention_backends()
    if BACKEND_NAME in (self.draft_attn_backend, prefill, decode) and int(self.topk) != 1:
        raise ValueError(
            f"attention backend {BACKEND_NAME} verifies EAGLE chains only (causal verify rows): "
            f"--speculative-eagle-topk {self.topk} builds a draft tree; use --speculative-eagle-topk 1"
        )
    if stamps_children:
        factory = lambda: (BACKEND_NAME, MultiStepDraftBackend(runner, self.topk, self.speculative_num_steps))
    else:
        factory = lambda: (BACKEND_NAME, AscendOffloadAttnBackend(runner))
    return original(self, backend_name, {**backend_map, BACKEND_NAME: factory}, error_template, stamps_children)


def get_last_loc_around(original: Callable, req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
    """HookRegistry AROUND hook for ``mem_cache.allocation.get_last_loc`` (the slot of
    each request's last committed position, used when EAGLE allocates draft slots).
    SGLang picks a Triton kernel for every backend except ``ascend`` / ``torch_native``;
    with ``ascend_offload`` (CPU or NPU: no Triton GPU driver) its torch version runs."""
    from sglang.srt.mem_cache.allocation import get_last_loc_torch
    from sglang.srt.runtime_context import attention_backends

    from ..names import BACKEND_NAME

    if BACKEND_NAME in attention_backends():
        return get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)


# ------------------------------------------------------------------ sparse decode offload
DRAFT_KV_PLACEMENT = "device"


def verify_rows_per_request() -> int:
    """Decode query rows per request of the target model in this process:
    ``speculative_num_draft_tokens`` (``n``) with a speculative algorithm, else 1
    (``sparse_decode.sizing.verify_rows``, the rule the launcher's deployment facts use
    too). The rows of a request share its hot row; the hot-buffer plan sizes it."""
    from sglang.srt.runtime_context import get_spec

    from ...sparse_decode.sizing import verify_rows

    spec = get_spec()
    return verify_rows(spec.speculative_algorithm, spec.speculative_num_draft_tokens)


def build_draft_pool(
    configurator: Any, *, max_total_num_tokens: int, is_dsa_model: bool, feature: str = "sparse decode offload"
):
    """The draft (NextN / MTP) model's KV pool with an offload feature on (``feature``:
    sparse decode offload, or layerwise prefill offload, whose plan takes the draft
    layer as an independent layer).

    Placement ``device`` (:data:`DRAFT_KV_PLACEMENT`): the draft layer keeps its whole
    main KV and index K on the device in SGLang's slot space (the plain
    :class:`~..mem_cache.pool.device.DeviceDSAPool`, as without offload); only the target model's layers
    are offloaded. Counted by ``capacity --mtp`` (``capacity.py``: one draft layer of
    device KV per token). Its decode attention reads the device pool, so the draft
    steps do not touch the host pool or the engine's residency.
    """
    from ..mem_cache.pool.device import build_device_pool

    pool = build_device_pool(configurator, max_total_num_tokens=max_total_num_tokens, is_dsa_model=is_dsa_model)
    layers = configurator.layer_info.num_effective_layers
    logger.info(
        "%s: draft (NextN) KV placement %s: %d layer(s) x %d tokens on %s (the target's layers are offloaded)",
        feature,
        DRAFT_KV_PLACEMENT,
        layers,
        max_total_num_tokens,
        configurator.device,
    )
    return pool


def is_draft_runner(model_runner: Any) -> bool:
    return bool(getattr(model_runner, "is_draft_worker", False))


def begin_verify(backend: Any, forward_batch) -> torch.Tensor:
    """Start the sparse decode engine's step for a ``TARGET_VERIFY`` batch; returns the
    engine rows (int64 ``[B]``, the requests' ``req_to_token`` rows, batch order).

    The ``n`` verify rows of a request (its query tokens, request-major in the batch)
    share its engine row: one residency lookup per layer over the union of their top-k,
    a position several rows select copied once. The stable prefix is the request's
    **committed length** ``L`` (``seq_lens``): positions ``L .. L + n - 1`` hold this
    step's candidate tokens (written to the host pool by this forward before the
    attention) and are never hits, since they may be rejected and rewritten. Once
    accepted, a position lies below the next step's committed length and its resident
    row is a hit like any other; a rejected position is at or beyond the next committed
    length, so the engine drops it from the hot buffer before the next lookup. The
    token table is ``req_to_token`` itself (it holds the draft slots).
    """
    from ..attention.dsa_metadata import free_request_rows, real_batch_size

    n = int(forward_batch.spec_info.draft_token_num)
    per = backend.verify_rows_per_request
    if n != per:
        raise RuntimeError(
            f"verify batch with {n} draft tokens per request; the sparse decode engine was sized "
            f"for a fixed {per} (--speculative-num-draft-tokens): variable draft counts are not "
            "supported with sparse decode offload"
        )
    real = real_batch_size(forward_batch)
    reqs = [int(r) for r in forward_batch.req_pool_indices[:real].tolist()]
    if len(set(reqs)) != len(reqs):
        raise RuntimeError(f"verify batch names req_to_token rows {reqs} more than once")
    rids = getattr(forward_batch, "rids", None)
    rids = list(rids[:real]) if rids is not None else []
    req_ids = backend.rows.ids_for(reqs, rids if rids and rids[0] is not None else None)
    stable = forward_batch.seq_lens_cpu[:real].to(torch.int32)
    batch_rows = torch.tensor(reqs, dtype=torch.int64)
    backend.engine.begin_step(
        req_ids,
        backend.req_to_token_pool.req_to_token,
        stable,
        rows=batch_rows,
        rows_per_request=n,
        free_rows=free_request_rows(backend.engine, backend.req_to_token_pool),
    )
    recorder = getattr(backend, "recorder", None)
    if recorder is not None:  # a speculative trace: the round's rows of each request
        recorder.begin_step(stable, req_ids, batch_rows)
    return batch_rows


def attach(backend: Any) -> None:
    """Speculative state of a :class:`~..attention.sparse_decode.SparseDecodeOffloadBackend`:
    ``verify_rows_per_request`` (1 without speculation)."""
    backend.verify_rows_per_request = verify_rows_per_request()


def note_forward(backend: Any, forward_batch) -> bool:
    """Whether this forward of the target model is a ``TARGET_VERIFY`` batch served by
    the engine."""
    return forward_batch.forward_mode.is_target_verify() and backend.forward_metadata is not None
