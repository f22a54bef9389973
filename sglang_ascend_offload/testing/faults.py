"""Planted faults: corruption of the kinds users hit, installed from outside the runtime.

Each :class:`Fault` is one or more HookRegistry ``AROUND`` hooks on the plugin's own code
(never a switch in a runtime module). They reach a process two ways:

* **a served process**: the test harness's ``fault`` seam (:mod:`.harness`); the test
  launcher adds it to every server it starts while :data:`PLANTED_FAULT_ENV` names a fault
  (:func:`seams_from_environment`), so one environment variable plants a fault in every
  server of a pytest run;
* **the pytest process** (component tests): :mod:`.fault_plugin`, a pytest plugin that
  installs the same hooks at start-up when :data:`PLANTED_FAULT_ENV` is set.

``scripts/plant_faults.py`` applies them one at a time and runs :attr:`Fault.tests` (the
tests that should catch it) and :attr:`Fault.shadow_tests` (whether shadow verification,
``verify_sample_rate: 1.0``, flags it).

A fault is either always on or, given a flag file, on only while the file exists (the
served negative controls of the suite toggle one on a running server). The catalogue:

=============================  ===================================================================
fault                          what it breaks
=============================  ===================================================================
``cross_layer_miss_copy``      a miss is copied from the next layer's host rows (vllm#57019)
``graph_append_skipped``       the new token's host append is left out of the captured decode
                               graph, so every replay skips it (vllm#56158)
``stale_slot_after_eviction``  the first miss of each layer step that evicts a row keeps the
                               evicted row: the table says resident, the slot holds another row
``remap_off_by_one``           the remap of one position per layer step points one slot over
``pd_draft_kv_to_scratch``     P/D: the draft (NextN) layer's KV lands in a scratch buffer, not
                               the decode's draft pool
``pd_main_block_shift``        P/D: each request's main-KV source blocks shifted by one block
``int8_scale_page_dropped``    the fp16 scales of the first page of each int8 index-K write are
                               not written (the page keeps its old scales)
``copy_sfa_before_copy``       the fused Copy-SFA kernel attends before its row's misses are
                               copied (a mutated kernel on the functional model: a token reads
                               the slot's old row)
``retraction_wrong_slots``     a retracted request's backup is restored one slot off
``shadow_reads_hot_rows``      shadow verification recomputes over the hot rows the served step
                               read instead of the host pool (a stale hot row goes unreported)
=============================  ===================================================================
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

#: Names a fault of :data:`FAULTS`: every server the test launcher starts, and the pytest
#: process (with :mod:`.fault_plugin`), run with it planted.
PLANTED_FAULT_ENV = "SGLANG_ASCEND_OFFLOAD_PLANTED_FAULT"

Active = Callable[[], bool]
#: ``(target, factory)``: ``factory(active)`` returns the AROUND hook ``(original, *args, **kwargs)``
Hook = Tuple[str, Callable[[Active], Callable]]

_ENGINE = "sglang_ascend_offload.sparse_decode.engine.SparseDecodeEngine"
_BACKEND = "sglang_ascend_offload.sglang_plugin.attention.sparse_decode.SparseDecodeOffloadBackend"
_POOL = "sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode.HostMainKVPool"
_PAGE_BOOK = "sglang_ascend_offload.sglang_plugin.mem_cache.pool.layerwise_pages.PageBook"


@dataclass(frozen=True)
class Fault:
    """One planted fault.

    name / fault_class / description: what it is (``fault_class`` names the bug class users
    hit). hooks: where it is installed. tests: pytest node ids that should catch it (fail
    while it is planted, pass without it). shadow_tests: node ids that fail iff shadow
    verification flagged it (empty where it cannot run: ``shadow_note`` says why).
    """

    name: str
    fault_class: str
    description: str
    hooks: Tuple[Hook, ...]
    tests: Tuple[str, ...]
    shadow_tests: Tuple[str, ...] = ()
    shadow_note: str = ""


# ----------------------------------------------------------------------------- hooks


def _cross_layer(active: Active):
    def copy_misses(original, engine, layer, res):
        layers = engine.config.layers
        if not active() or layers < 2:
            return original(engine, layer, res)
        real = engine.pool.layer
        wrong = (layer + 1) % layers
        engine.pool.layer = lambda lid: real(wrong if lid == layer else lid)
        try:
            return original(engine, layer, res)
        finally:
            del engine.pool.layer

    return copy_misses


def _stale_slot(active: Active):
    def copy_misses(original, engine, layer, res):
        if not active():
            return original(engine, layer, res)
        import torch

        count = res.miss_count.to("cpu")
        entries = torch.nonzero(count > 0).flatten()
        hot = engine.hot.storage(layer)
        kept = None
        for b in entries.tolist():  # the first miss whose slot held a row: an eviction
            row, slot = int(engine.batch_rows[b]), int(res.miss_slots[b, 0])
            if bool(hot[row, slot].any()):
                kept = (row, slot, hot[row, slot].clone())
                break
        out = original(engine, layer, res)
        if kept is not None:
            hot[kept[0], kept[1]] = kept[2]  # the copy into it never landed
        return out

    return copy_misses


def _remap_off_by_one(active: Active):
    def flat_indices(original, buffers, slots, rows=None):
        flat = original(buffers, slots, rows)
        if not active():
            return flat
        import torch

        valid = torch.nonzero(flat[0, 0] >= 0).flatten()
        if valid.numel():
            j = int(valid[0])
            h = buffers.hot_tokens
            here = int(flat[0, 0, j])
            flat = flat.clone()
            flat[0, 0, j] = here + 1 if (here + 1) % h else here - 1  # the neighbouring slot of the same row
        return flat

    return flat_indices


def _graph_append_skipped(active: Active):
    def store_kv(original, backend, layer, forward_batch, k_nope, k_pe):
        if backend._graph_batch is not None and active():
            return None  # traced into the captured step: every replay skips the append
        return original(backend, layer, forward_batch, k_nope, k_pe)

    return store_kv


_SCRATCH: List = []  # keeps the scratch tensors alive as long as the transfer layout


def _draft_to_scratch(active: Active):
    def host_rows_tensors(original, pool, draft_pool=None):
        tensors = original(pool, draft_pool)
        if draft_pool is None or not active():
            return tensors
        import dataclasses

        import torch

        out = []
        for t in tensors:
            if t.role == "main" and t.layers is not None and min(t.layers) >= pool.layer_num:  # the draft layers
                scratch = [torch.zeros_like(x) for x in t.per_layer]
                _SCRATCH.append(scratch)
                t = dataclasses.replace(t, per_layer=scratch)
            out.append(t)
        logger.warning("planted fault: the draft layer's KV is pulled into a scratch buffer, not the draft pool")
        return out

    return host_rows_tensors


def _block_shift(active: Active):
    def plan(original, receiver, peer, track, rr, *args, **kwargs):
        blocks = list(rr.main_src_blocks)
        if active() and len(blocks) > 1:
            import msgspec

            rr = msgspec.structs.replace(rr, main_src_blocks=blocks[1:] + blocks[:1])
        return original(receiver, peer, track, rr, *args, **kwargs)

    return plan


def _scale_page_dropped(active: Active):
    def store_index_k(original, pool, layer_id, loc, key):
        if pool.index_k_scale_buffer is None or not active():
            return original(pool, layer_id, loc, key)
        import torch

        scales = pool.index_k_scale_buffer[pool._get_indexer_slot(layer_id)]
        flat = scales.view(-1)
        slots = loc.to(flat.device, torch.int64).reshape(-1)
        page = int(slots.min()) // pool.page_size
        first = slots[slots // pool.page_size == page]
        before = flat[first].clone()
        out = original(pool, layer_id, loc, key)
        flat[first] = before  # the page's new scales were never written
        return out

    return store_index_k


def _retraction_wrong_slots(active: Active):
    def load_cpu_copy(original, pool, kv_cache_cpu, indices, *args, **kwargs):
        if not active():
            return original(pool, kv_cache_cpu, indices, *args, **kwargs)
        import torch

        slots = torch.as_tensor(indices).reshape(-1)
        return original(pool, kv_cache_cpu, torch.roll(slots, 1), *args, **kwargs)

    return load_cpu_copy


def _shadow_reads_hot_rows(active: Active):
    def shadow_check(original, engine, layer, topk, query, query_rope, scale, out):
        if not active():
            return original(engine, layer, topk, query, query_rope, scale, out)
        real = engine.shadow.check

        def check(**kw):
            table = engine.managers[layer].table.slot_token[kw["engine_row"]].to("cpu").long()  # [H] positions
            hot = engine.hot.storage(layer)[kw["engine_row"]]
            positions = kw["topk_row"].to("cpu").long()

            def hot_rows(_host_slots):  # the slot holding each position, as the served step read it
                slot = (table[None, :] == positions[:, None]).int().argmax(dim=1)
                return hot[slot.to(hot.device)].to("cpu")

            return real(**{**kw, "read_rows": hot_rows})

        engine.shadow.check = check
        try:
            return original(engine, layer, topk, query, query_rope, scale, out)
        finally:
            del engine.shadow.check

    return shadow_check


def _layerwise_page_swap(active: Active):
    def cached_key(original, book, page, rows, req, rewritten_to=0):
        key = original(book, page, rows, req, rewritten_to)
        if not active():
            return key
        # another page's host object of the same size: a cached prefix page is loaded from it
        other = next((p for p, (gen, n) in sorted(book._state.items()) if p != page and n == key.tokens), None)
        if other is None:
            return key
        return type(key)(book.digest(other, book._state[other][0]), key.start, key.tokens)

    return cached_key


def _kvpp_block_swap(active: Active):
    def broadcast(original, transport, layer, cache_ready=None):
        out = original(transport, layer, cache_ready)
        owner = transport.storage.plan.ownership.owner_of[layer]
        if not active() or owner == transport.storage.plan.rank:
            return out
        import torch

        blocks = transport.active_blocks
        blocks = torch.arange(transport.storage.num_blocks) if blocks is None else blocks.to("cpu")
        if blocks.numel() >= 2:  # the received copy of two blocks lands in each other's place
            a, b = int(blocks[0]), int(blocks[1])
            for view in transport._block_views(layer):
                view[[a, b]] = view[[b, a]]
        return out

    return broadcast


#: the Copy-SFA mutation: the row's misses are copied after its first token attended
_COPY_SFA_SOURCE = "scatter_copy_sparse_flash_attention.cpp"
_COPY_SFA_FROM = (
    "                CopyMisses(static_cast<uint32_t>(row));\n"
    "                AscendC::PipeBarrier<PIPE_ALL>();  // the misses have landed before the gather reads them\n"
    "            }\n"
    "            Attend(token);\n"
)
_COPY_SFA_TO = (
    "            }\n"
    "            Attend(token);  // planted fault: before the row's misses are copied\n"
    "            if (row >= 0) {\n"
    "                CopyMisses(static_cast<uint32_t>(row));\n"
    "                AscendC::PipeBarrier<PIPE_ALL>();\n"
    "            }\n"
)


def mutated_copy_sfa_kernels(root: Optional[Path] = None) -> Path:
    """A copy of the AscendC kernel sources with Copy-SFA attending before its row's copy
    (the mutation technique of ``tests/ascendc/test_check_kernels.py``); returns its folder
    (default: a fixed folder beside the model library cache, so every process shares one build)."""
    from ..ops import ascendc_model as am

    dst = Path(root) if root is not None else am.OUT_DIR.parent / "planted_faults" / "copy_sfa_before_copy"
    text = (am.KERNELS / _COPY_SFA_SOURCE).read_text()
    if text.count(_COPY_SFA_FROM) != 1:
        raise RuntimeError(f"the Copy-SFA kernel changed: {_COPY_SFA_SOURCE} no longer holds the copy-then-attend step")
    dst.mkdir(parents=True, exist_ok=True)
    for src in am.KERNELS.iterdir():
        if src.is_file():
            body = src.read_text()
            if src.name == _COPY_SFA_SOURCE:
                body = body.replace(_COPY_SFA_FROM, _COPY_SFA_TO)
            target = dst / src.name
            if not target.exists() or target.read_text() != body:
                target.write_text(body)
    return dst


def mutated_copy_sfa_library() -> Path:
    """The functional-model library built from :func:`mutated_copy_sfa_kernels` (cached by
    source hash; built once however many processes ask at the same time)."""
    import fcntl

    from ..ops import ascendc_model as am

    lock = am.OUT_DIR.parent / "planted_faults" / "copy_sfa_before_copy.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return am.build(kernels=mutated_copy_sfa_kernels())


_MUTATED_MODEL: List = []


def _mutated_model():
    """The mutated functional model, loaded once per process."""
    if not _MUTATED_MODEL:
        from ..ops import ascendc_model as am

        _MUTATED_MODEL.append(am.KernelModel(mutated_copy_sfa_library()))
    return _MUTATED_MODEL[0]


def _copy_sfa_before_copy(active: Active):
    def copy_sfa(original, *args, **kwargs):
        if not active():
            return original(*args, **kwargs)
        from ..ops import ascendc_cpu_ops

        state = ascendc_cpu_ops._STATE
        real, state.model = state.model, _mutated_model()
        try:
            return original(*args, **kwargs)
        finally:
            state.model = real

    return copy_sfa


# ----------------------------------------------------------------------------- the catalogue

_E2E = "tests/sglang/e2e/"
_TRAINED_TEXT = _E2E + "test_trained_text_e2e_cpu.py::test_text_completions_offload_on_equals_off"
_FUSED = _E2E + "test_fused_trained_e2e_cpu.py"
_SHADOW = _FUSED + "::test_shadow_verification_saw_no_mismatch_on_the_reference_rung"
_SHADOW_FUSED = _FUSED + "::test_shadow_verification_saw_no_mismatch_on_the_fused_rung"
_SHADOW_INT8 = _FUSED + "::test_shadow_verification_saw_no_mismatch_on_the_int8_reference_rung"
_ENGINE_EQ = "tests/sparse_decode/test_engine_equivalence.py::test_engine_equals_full_kv_attention"
_OFFLOAD_COMPONENTS = "tests/sglang/mem_cache/test_offload_components.py::test_decode_output_equals_full_kv_reference"
_PD = _E2E + "test_pd_e2e_cpu.py"
_PD_SHADOW = _PD + "::test_shadow_verification_on_the_pd_decode_saw_no_mismatch"
_NOT_ATTENTION = (
    "the host pool itself holds the wrong rows: the recomputation over it agrees with the served "
    "attention (shadow verification checks the hot buffer against the host pool, not the host pool)"
)

FAULTS: Dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "cross_layer_miss_copy",
            "cross-layer offset (vllm#57019)",
            "a miss is copied from the next layer's host rows",
            ((f"{_ENGINE}.copy_misses", _cross_layer),),
            (
                _ENGINE_EQ,
                _OFFLOAD_COMPONENTS,
                _TRAINED_TEXT,
                _E2E + "test_e2e_dsa_cpu.py::test_offload_on_and_off_are_token_identical",
                _FUSED + "::test_fused_bf16_serves_the_reference_tokens",
            ),
            (_SHADOW,),
        ),
        Fault(
            "graph_append_skipped",
            "host-mirror write skipped under graph replay (vllm#56158)",
            "the new token's host append is left out of the captured decode step",
            ((f"{_BACKEND}.store_kv", _graph_append_skipped),),
            (
                "tests/sglang/attention/test_graph_decode_components.py::"
                "test_graph_decode_equals_eager_with_padding_and_churn",
                _E2E + "test_offload_graphs_e2e.py::test_graph_offload_eager_offload_and_no_offload_agree",
                _E2E + "test_graph_speculative_e2e_cpu.py::"
                "test_verify_graphs_with_offload_agree_with_eager_speculation_without_offload",
            ),
            (),
            "shadow verification does not run in decode graphs (rule sglang.sparse_decode_graph); and the "
            "host pool itself holds the stale row, so a recomputation over it would agree",
        ),
        Fault(
            "stale_slot_after_eviction",
            "stale resident slot (residency table and buffer disagree)",
            "the first miss of each layer step that evicts a row keeps the evicted row",
            ((f"{_ENGINE}.copy_misses", _stale_slot),),
            (
                _ENGINE_EQ,
                _OFFLOAD_COMPONENTS,
                _TRAINED_TEXT,
                _E2E + "test_e2e_dsa_adaptive_cpu.py::test_adaptive_residency_is_token_identical_to_no_offload",
                _E2E + "test_speculative_offload_e2e_cpu.py::test_speculative_offload_on_and_off_are_token_identical",
                _E2E + "test_shared_host_pool_e2e_cpu.py::"
                "test_tp2_offload_matches_offload_off_with_churn_and_a_radix_hit",
            ),
            (_SHADOW,),
        ),
        Fault(
            "remap_off_by_one",
            "remap off by one",
            "one position per layer step is remapped to the neighbouring hot slot",
            (("sglang_ascend_offload.sparse_decode.hot_buffer.HotBuffers.flat_indices", _remap_off_by_one),),
            (
                _ENGINE_EQ,
                _OFFLOAD_COMPONENTS,
                _TRAINED_TEXT,
                _E2E + "test_score_policy_serving.py::test_served_score_policy_same_tokens_and_the_replayed_misses",
                _E2E + "test_dp_attention_e2e_cpu.py::"
                "test_dp_attention_offload_matches_device_pool_with_padded_decode_batches",
            ),
            (_SHADOW,),
        ),
        Fault(
            "pd_draft_kv_to_scratch",
            "P/D draft KV misplaced (sglang#31482 class)",
            "the P/D draft layer's KV lands in a scratch buffer instead of the decode's draft pool",
            (("sglang_ascend_offload.transfer.pool_layouts.host_rows_tensors", _draft_to_scratch),),
            (
                "tests/sglang/disaggregation/test_pd_backend_components.py::"
                "test_the_draft_layer_arrives_bit_exact_on_the_device",
                _E2E + "test_pd_speculative_e2e_cpu.py::test_speculative_pd_decode_with_offload_matches_colocated",
            ),
            (),
            "the draft layer is not offloaded: its KV stays in the device draft pool, which shadow "
            "verification (a check of the target's hot buffers) never reads",
        ),
        Fault(
            "pd_main_block_shift",
            "P/D block range shifted (sglang#31482 class)",
            "each request's main-KV source blocks are shifted by one block",
            (("sglang_ascend_offload.transfer.decode_side.DecodeReceiver._plan", _block_shift),),
            (
                "tests/sglang/disaggregation/test_pd_backend_components.py",
                _PD + "::test_router_pd_with_offload_decode_matches_colocated",
                _E2E + "test_pd_decode_tp_e2e_cpu.py",  # dummy weights: its negative control
            ),
            (_PD_SHADOW,),
            _NOT_ATTENTION,
        ),
        Fault(
            "int8_scale_page_dropped",
            "int8 indexer scale dropped",
            "the fp16 scales of the first page of each int8 index-K write are not written",
            ((f"{_POOL}.store_index_k", _scale_page_dropped),),
            (
                "tests/sglang/attention/test_int8_indexer_components.py::"
                "test_served_int8_indexer_equals_reference_c8_composition",
                _FUSED + "::test_int8_indexer_nll_stays_near_the_bf16_indexer",
            ),
            (_SHADOW_INT8,),
            "the indexer selects other positions; attention over them is still what the host pool gives",
        ),
        Fault(
            "copy_sfa_before_copy",
            "fused kernel ordering (reads before the copy landed)",
            "the fused Copy-SFA attends before its row's misses are copied (mutated kernel, functional model)",
            (("sglang_ascend_offload.ops.ascendc_cpu_ops._copy_sfa", _copy_sfa_before_copy),),
            (
                _FUSED + "::test_fused_bf16_serves_the_reference_tokens",
                _FUSED + "::test_fused_bf16_heldout_nll_equals_the_reference",
            ),
            (_SHADOW_FUSED,),
        ),
        Fault(
            "retraction_wrong_slots",
            "retraction restore misplaced",
            "a retracted request's backup is restored one slot off",
            ((f"{_POOL}.load_cpu_copy", _retraction_wrong_slots),),
            (
                "tests/sglang/mem_cache/test_retraction_backup.py",
                _PD + "::test_retracted_requests_on_an_offload_decode_resume_token_identical",
            ),
            (_PD_SHADOW,),
            _NOT_ATTENTION,
        ),
        Fault(
            "layerwise_page_swap",
            "prefix cache key collision (a cached block loaded from another block's object)",
            "layerwise prefill loads a cached prefix page from another page's host object of the same size",
            ((f"{_PAGE_BOOK}._cached_key", _layerwise_page_swap),),
            (
                _E2E + "test_layerwise_e2e_cpu.py",  # dummy weights: its negative control
                _E2E + "test_speculative_offload_e2e_cpu.py::test_layerwise_speculative_is_token_identical",
            ),
            (),
            "layerwise prefill offload has no shadow verification (it checks sparse decode's hot buffers)",
        ),
        Fault(
            "kvpp_block_swap",
            "KV scattered into the wrong blocks after a collective",
            "a KVPP non-owner rank's received copy of two active blocks lands in each other's place",
            (("sglang_ascend_offload.kvpp.runtime.BroadcastTransport.broadcast", _kvpp_block_swap),),
            (_E2E + "test_kvpp_e2e_cpu.py",),  # dummy weights: its negative control
            (),
            "KVPP has no shadow verification (it checks sparse decode's hot buffers)",
        ),
        Fault(
            "shadow_reads_hot_rows",
            "silent verifier (shadow verification reads a stale hot row)",
            "shadow verification recomputes over the hot rows the served step read, not the host pool",
            ((f"{_ENGINE}._shadow_check", _shadow_reads_hot_rows),),
            (
                "tests/sparse_decode/test_shadow_verify.py::test_a_corrupted_resident_slot_is_caught_and_named",
                _FUSED + "::test_shadow_verification_reports_a_stale_hot_row",
            ),
            (),
            "the fault is in shadow verification itself",
        ),
    )
}


def get(name: str) -> Fault:
    if name not in FAULTS:
        raise ValueError(f"unknown planted fault {name!r}; known: {sorted(FAULTS)}")
    return FAULTS[name]


def flag_active(flag: Optional[str]) -> Active:
    """Always on (``flag`` ``None``), or on while the file ``flag`` exists."""
    if flag is None:
        return lambda: True
    return lambda: os.path.exists(flag)


def register(name: str, flag: Optional[str] = None) -> Fault:
    """Register the fault's hooks with SGLang's HookRegistry (applied by SGLang's plugin
    loader in a server, by :func:`install_in_process` here)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    fault = get(name)
    active = flag_active(flag)
    for target, factory in fault.hooks:  # two faults on one target compose (each wraps the other)
        HookRegistry.register(target, factory(active), HookType.AROUND)
    when = "always" if flag is None else f"while {flag} exists"
    logger.warning("planted fault %s (%s): %s", name, when, fault.description)
    return fault


def install_in_process(name: str) -> Fault:
    """Plant ``name`` in this process now (the pytest process of a planted run)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    fault = register(name)
    HookRegistry.apply_hooks()
    missing = [target for target, _ in fault.hooks if target not in HookRegistry._patched]
    if missing:
        raise RuntimeError(f"planted fault {name}: could not hook {missing} (see the log)")
    return fault


def seam_value(name: str, flag: Optional[str] = None) -> object:
    """The ``fault`` seam's value (:mod:`.harness`): the name, or ``{"name", "flag"}``."""
    get(name)
    return name if flag is None else {"name": name, "flag": str(flag)}


def seams_from_environment(environ=None) -> Dict[str, object]:
    """The seams a test server gets from :data:`PLANTED_FAULT_ENV` (none when unset)."""
    name = (environ if environ is not None else os.environ).get(PLANTED_FAULT_ENV)
    return {"fault": seam_value(name)} if name else {}


@dataclass
class Outcome:
    """A planted run's verdict on one fault (``scripts/plant_faults.py``'s JSON row)."""

    name: str
    fault_class: str
    caught: bool
    caught_by: List[str] = field(default_factory=list)
    shadow_caught: bool = False
    missed_by: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict:
        return json.loads(json.dumps(self.__dict__))
