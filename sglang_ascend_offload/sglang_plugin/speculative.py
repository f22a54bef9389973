"""Speculative decoding (EAGLE / NextN-MTP) with the ``ascend_offload`` backend.

SGLang 0.5.23 serves DeepSeek-V3.2's NextN (MTP) layer with its EAGLE worker
(``--speculative-algorithm EAGLE``, alias ``NEXTN``): per decode round the draft
(NextN) model proposes ``speculative_num_steps`` tokens, the target model verifies
``speculative_num_draft_tokens`` = steps + 1 query rows per request
(``ForwardMode.TARGET_VERIFY``), and the draft model re-extends over the accepted
tokens (``ForwardMode.DRAFT_EXTEND``).

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
========================================================  ==================================
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

_TARGET_SYNC = "torch.cuda.synchronize"
_TARGET_EMBED_HEAD = "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head"
_TARGET_LAST_LOC = "sglang.srt.mem_cache.allocation.get_last_loc"
_TARGET_DRAFT_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"

_no_cuda_sync: contextvars.ContextVar[bool] = contextvars.ContextVar("sao_no_cuda_sync", default=False)


@contextlib.contextmanager
def no_cuda_sync() -> Iterator[None]:
    """Inside: ``torch.cuda.synchronize()`` returns at once when CUDA is unavailable."""
    token = _no_cuda_sync.set(True)
    try:
        yield
    finally:
        _no_cuda_sync.reset(token)


def synchronize_around(original: Callable, *args, **kwargs):
    """HookRegistry AROUND hook for ``torch.cuda.synchronize``."""
    if _no_cuda_sync.get() and not torch.cuda.is_available():
        return None
    return original(*args, **kwargs)


def set_embed_and_head_around(original: Callable, self, embed, head):
    """The draft model takes the target's embedding and LM head (same tensors)."""
    with no_cuda_sync():
        return original(self, embed, head)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET_SYNC, synchronize_around, HookType.AROUND)
    HookRegistry.register(_TARGET_EMBED_HEAD, set_embed_and_head_around, HookType.AROUND)
    HookRegistry.register(_TARGET_DRAFT_FACTORY, create_backend_around, HookType.AROUND)
    HookRegistry.register(_TARGET_LAST_LOC, get_last_loc_around, HookType.AROUND)


# ------------------------------------------------------------------ metadata
def speculative_lens(forward_batch, draft_step: Optional[int] = None
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
    :class:`~.backend.AscendOffloadAttnBackend` per draft step (``speculative_step_id``
    = its index), over the draft model's device pool. SGLang's EAGLE worker sets up the
    first ``steps - 1`` (the last step only samples) and runs step ``i`` with
    ``attn_backends[i]``."""

    def __init__(self, draft_model_runner: Any, topk: int, speculative_num_steps: int):
        from .backend import AscendOffloadAttnBackend

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


def create_backend_around(original: Callable, self, backend_name: str, backend_map: dict, error_template: str,
                          stamps_children: bool = False):
    """HookRegistry AROUND hook for ``DraftBackendFactory._create_backend``: SGLang's
    table of draft backends has no entry for plugin backends; this adds
    ``ascend_offload`` (draft extend: one backend; draft decode: :class:`MultiStepDraftBackend`).
    The draft (NextN) model always runs the device-KV backend (its KV placement is
    ``device``, see :func:`build_draft_pool`)."""
    from .backend import BACKEND_NAME, AscendOffloadAttnBackend

    runner = self.draft_model_runner
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

    from .backend import BACKEND_NAME

    if BACKEND_NAME in attention_backends():
        return get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
