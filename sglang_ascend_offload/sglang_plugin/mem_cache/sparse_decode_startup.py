"""The sparse decode offload pool's startup, as a node operator follows it.

:func:`build_offload_pool` is the sparse decode feature's pool builder
(``features.FEATURES``). Inside one startup log (``startup_phases.startup_log``) it

1. builds the pool (:func:`.pool.sparse_decode.build_offload_pool`): the host pool's
   allocation, population and registration and the attention-TP group's rendezvous are
   logged phases there, with progress for a large pool;
2. qualifies the fused kernels the engine's operator plan selects, at the served shapes
   (``ops/qualify.py``: each fused op against the separate operators on a small
   deterministic problem), before the server accepts requests: a difference stops
   startup with the op, the shape, the first differing element and the fix
   (``"qualify_kernels": false`` skips it, with a warning);
3. logs one summary line of the phases and their times.

The draft worker's pool (NextN / MTP: device KV, no engine) only gets step 1.
"""

from __future__ import annotations

from typing import Any

from ... import config as cfg
from ...ops.qualify import fused_ops_of, qualify_at_startup
from ...ops.qualify_problem import ServedShape
from ...startup_phases import phase, startup_log

__all__ = ["build_offload_pool", "served_shape", "STARTUP"]

#: What the summary line calls this startup.
STARTUP = "sparse decode offload startup"
QUALIFY_FIX = (
    '"fused_lim": false / "fused_copy_sfa": false for the separate operators, or rebuild the extension: '
    "bash ascendc_ops/build.sh --install"
)


def build_offload_pool(configurator: Any, offload: cfg.SparseDecodeOffloadConfig, **kwargs) -> Any:
    """The sparse decode pool for SGLang's configurator (arguments as
    :func:`.pool.sparse_decode.build_offload_pool`), its startup logged in phases and its
    fused kernels qualified (module docstring)."""
    from .pool import sparse_decode as pool_module

    with startup_log(STARTUP):
        pool = pool_module.build_offload_pool(configurator, offload, **kwargs)
        engine = getattr(pool, "engine", None)
        if engine is not None and fused_ops_of(engine.plan):
            _qualify(engine, served_shape(configurator, pool), offload.qualify_kernels)
    return pool


def _qualify(engine: Any, shape: ServedShape, enabled: bool) -> None:
    """The kernel qualification phase (with ``enabled`` false: only the warning, no phase)."""
    if not enabled:
        qualify_at_startup(engine.plan, shape, device=engine.device, enabled=False)
        return
    with phase("kernel qualification", fix=QUALIFY_FIX):
        qualify_at_startup(engine.plan, shape, device=engine.device)


def served_shape(configurator: Any, pool: Any) -> ServedShape:
    """The shapes this server runs its fused ops at: the engine's residency shape and row
    widths, the pool's page size, the model's indexer heads and dim, and the attention
    heads of one attention-TP rank."""
    engine = pool.engine.config
    hf = configurator.model_config.hf_config
    return ServedShape(
        hot_tokens=engine.hot_tokens,
        top_k=engine.top_k,
        rows_per_request=engine.rows_per_request,
        indexer_dtype=engine.indexer_dtype,
        page_size=int(pool.page_size),
        index_heads=int(hf.index_n_heads),
        index_dim=int(hf.index_head_dim),
        heads=max(1, int(hf.num_attention_heads) // _attention_tp_size()),
        latent_dim=engine.latent_dim,
        rope_dim=engine.rope_dim,
    )


def _attention_tp_size() -> int:
    """Attention-TP ranks that split the heads (1 outside a server's published parallel state)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_tp_size)
    except RuntimeError:  # no published parallel context: not a server process
        return 1
