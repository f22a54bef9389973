"""Registration of the ``ascend_offload`` P/D transfer backend with SGLang 0.5.23.

SGLang converts ``--disaggregation-transfer-backend`` into the closed Enum
``disaggregation/utils.py::TransferBackend`` in several places (the scheduler, the
multi-tokenizer mixin, the disaggregation service), and ``get_kv_class`` maps the
Enum to classes with an if/elif, so a new backend name cannot be added to it. The
plugin therefore uses SGLang's extension points as follows (modelled on SGLang's own
``mooncake_tcp`` alias in ``arg_groups/pd_disaggregation_hook.py``; see
docs/design/sglang_hooks.md for the source locations):

=============================================================  ======================================
extension point                                                what is registered
=============================================================  ======================================
``arg_groups/choices.py::add_disagg_transfer_backend_choices``  ``ascend_offload`` as a CLI choice
resolution step ``handle_pd_disaggregation``                   ``ascend_offload`` is declared as
                                                               ``ascend`` (so every ``TransferBackend``
                                                               conversion works); without
                                                               ``--enable-pd-transfer`` startup stops
HookRegistry AROUND ``disaggregation.utils.get_kv_class``      ``TransferBackend.ASCEND`` -> the classes
                                                               of :mod:`.conn` in processes where the
                                                               launcher published a ``pd_transfer``
                                                               config; otherwise SGLang's own classes
HookRegistry AROUND ``managers.disagg_service.                 with the plugin's P/D: the MemFabric
maybe_create_ascend_config_store``                             store from ``pd_transfer.store_url``
                                                               (prefill node 0), nothing for mooncake
HookRegistry AFTER ``PrefillBootstrapQueue._init_kv_manager``  hand the queue's KV pool to the manager
/ ``DecodePreallocQueue._init_kv_manager``                     (SGLang passes managers pointers only)
HookRegistry BEFORE ``managers.scheduler.Scheduler.run_batch``  layerwise prefill offload pool only:
                                                               announce the requests whose last chunk
                                                               this forward computes (they are
                                                               published layer by layer during it)
=============================================================  ======================================

A server that selects SGLang's own ``ascend`` backend (without the plugin's P/D
config) keeps SGLang's Ascend classes: every hook checks the published config.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .... import config as cfg
from ... import compat
from ...args.rules.pd_transfer import BACKEND_NAME, SGLANG_BACKEND, missing_config_violation

logger = logging.getLogger(__name__)

# SGLang classes whose fields the hooks read (strictly, through compat.field; each
# field is listed with its reason in compat.OBJECT_FIELDS).
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_PREFILL_QUEUE = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue"
_DECODE_QUEUE = "sglang.srt.disaggregation.decode.DecodePreallocQueue"
_MODEL_CONFIG = "sglang.srt.configs.model_config.ModelConfig"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_REQ = "sglang.srt.managers.schedule_batch.Req"
_REQ_KV = "sglang.srt.managers.schedule_batch.ReqKvInfo"


def pd_active() -> bool:
    from .conn import active_pd_config

    return active_pd_config() is not None


def _pd_step(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution step: ``ascend_offload`` -> SGLang's ``ascend`` (needs ``--enable-pd-transfer``)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    from ...args.resolution import requested_config

    view = resolving_view(server_args)
    if view.disaggregation_transfer_backend == BACKEND_NAME:
        config, _ = requested_config()
        if config.pd_transfer is None and view.disaggregation_mode in ("prefill", "decode"):
            raise cfg.ConfigError([missing_config_violation()], "sglang-ascend-offload configuration")
        declare_resolution(server_args, "sglang_ascend_offload", disaggregation_transfer_backend=SGLANG_BACKEND)
        logger.info("sglang-ascend-offload: P/D transfer backend %s (SGLang sees %r)", BACKEND_NAME, SGLANG_BACKEND)
    previous(server_args)


def get_kv_class_around(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if transfer_backend == TransferBackend.ASCEND and class_type != KVClassType.KVARGS and pd_active():
        from . import conn

        return {
            KVClassType.MANAGER: conn.AscendOffloadKVManager,
            KVClassType.SENDER: conn.AscendOffloadKVSender,
            KVClassType.RECEIVER: conn.AscendOffloadKVReceiver,
            KVClassType.BOOTSTRAP_SERVER: conn.AscendOffloadKVBootstrapServer,
        }.get(class_type)
    return original(transfer_backend, class_type)


def config_store_around(original, transfer_backend):
    from sglang.srt.disaggregation.utils import TransferBackend

    if transfer_backend != TransferBackend.ASCEND or not pd_active():
        return original(transfer_backend)
    from sglang.srt.runtime_context import get_parallel

    from .conn import active_pd_config

    pd = active_pd_config()
    if pd.engine == "memfabric" and get_parallel().node_rank == 0:
        if not pd.store_url:
            raise cfg.ConfigError(
                [
                    cfg.Violation(
                        "sglang.pd_engine_device",
                        "engine 'memfabric' without store_url",
                        'set "store_url": "tcp://HOST:PORT" in --pd-transfer-config',
                    )
                ],
                "sglang-ascend-offload configuration",
            )
        from ....transfer.engine_memfabric import create_config_store

        create_config_store(pd.store_url)
    return None


def _attach_pool(manager, queue, queue_cls: str):
    """Give our manager (built by ``queue``, an instance of ``queue_cls``) the queue's KV pool."""
    from .conn import AscendOffloadKVManager

    if isinstance(manager, AscendOffloadKVManager):
        draft_pool = compat.field(queue, queue_cls, "draft_token_to_kv_pool")
        scheduler = compat.field(queue, queue_cls, "scheduler")
        model_config = compat.field(scheduler, _SCHEDULER, "model_config")
        context_len = compat.field(model_config, _MODEL_CONFIG, "context_len")
        manager.attach_pool(queue.token_to_kv_pool, context_len=context_len, draft_pool=draft_pool)
    return manager


def attach_pool_after_prefill(manager, queue, *args, **kwargs):
    """AFTER ``PrefillBootstrapQueue._init_kv_manager``: give our manager the queue's KV pool."""
    return _attach_pool(manager, queue, _PREFILL_QUEUE)


def attach_pool_after_decode(manager, queue, *args, **kwargs):
    """AFTER ``DecodePreallocQueue._init_kv_manager``: give our manager the queue's KV pool."""
    return _attach_pool(manager, queue, _DECODE_QUEUE)


def last_chunk_rows(batch: Any):
    """``[(req_to_token row, bootstrap room)]`` of the requests whose last chunk ``batch`` computes.

    A request's last chunk is the extend that reaches the end of its input
    (``extend_end >= len(origin_input_ids)``; SGLang's own test in
    ``disaggregation/prefill.py``, valid with and without overlap scheduling). A request
    still bootstrapping (optimistic prefill) is skipped: it has no decode peer yet.
    """
    if batch is None:  # Scheduler.run_batch always gets a batch in SGLang 0.5.23; none runs nothing
        return []
    mode = compat.field(batch, _BATCH, "forward_mode")
    if mode is None or not mode.is_extend():
        return []
    reqs = list(compat.field(batch, _BATCH, "reqs") or ())
    rows = compat.field(batch, _BATCH, "req_pool_indices_cpu")  # the rows, in the order of batch.reqs
    rows = [int(r) for r in rows.tolist()] if rows is not None else [_row_of(req) for req in reqs]
    if len(rows) != len(reqs):
        raise RuntimeError(f"batch has {len(reqs)} requests but {len(rows)} req_to_token rows")
    out = []
    for req, row in zip(reqs, rows):
        end = compat.field(req, _REQ, "extend_end")
        room = compat.field(req, _REQ, "bootstrap_room")
        if end is None or room is None or row is None or compat.field(req, _REQ, "pending_bootstrap"):
            continue
        if compat.field(req, _REQ, "disagg_kv_sender") is None:
            continue
        if end >= len(req.origin_input_ids):
            out.append((int(row), int(room)))
    return out


def _row_of(req: Any):
    """``req``'s ``req_to_token`` row (SGLang 0.5.23 keeps it in ``req.kv``)."""
    return compat.field(compat.field(req, _REQ, "kv"), _REQ_KV, "req_pool_idx")


def _layerwise_publisher(scheduler: Any):
    """``(publisher, kv manager)`` of a P/D prefill server with layerwise prefill offload,
    ``(None, None)`` on every other server.

    On a server whose validated config has both features, a missing scheduler queue,
    KV manager or publisher is an error naming what is missing (an SGLang change or a
    wiring bug), never a silent skip: without the announcements decode would wait for
    layers that are never published.
    """
    from ...args import carrier

    config = carrier.active_config()
    if config.layerwise_prefill is None or config.pd_transfer is None:
        return None, None
    queue = compat.field(scheduler, _SCHEDULER, "disagg_prefill_bootstrap_queue")
    manager = None if queue is None else compat.field(queue, _PREFILL_QUEUE, "kv_manager")
    # The manager is the plugin's own AscendOffloadKVManager (not an SGLang object) when the
    # wiring is right; any other manager has no publisher, which is the error raised below.
    publisher = getattr(manager, "publisher", None)
    if publisher is None or not publisher.publishes_during_forward:
        what = (
            "Scheduler.disagg_prefill_bootstrap_queue"
            if queue is None
            else "PrefillBootstrapQueue.kv_manager"
            if manager is None
            else "the layerwise P/D publisher"
        )
        raise compat.SGLangIncompatible(
            f"P/D prefill with layerwise prefill offload: {what} is missing when the scheduler runs a batch "
            f"(SGLang {compat.installed_version()}; the plugin was written against "
            f"SGLang {compat.SUPPORTED_SGLANG_VERSION})"
        )
    return publisher, manager


def announce_last_chunks_before(scheduler, *args, **kwargs):
    """BEFORE ``Scheduler.run_batch(batch, ...)``: tell the layerwise publisher what this
    forward finishes (a no-op on every server without the layerwise P/D publisher)."""
    batch = args[0] if args else kwargs.get("batch")
    publisher, manager = _layerwise_publisher(scheduler)
    if publisher is None:
        return None
    publisher.begin_batch()
    for row, room in last_chunk_rows(batch):
        try:
            manager.announce_last_chunk(row, room)
        except Exception as exc:  # noqa: BLE001 - fail the request, never the prefill forward
            logger.exception("P/D layerwise: announcing request %s failed", room)
            manager.fail_prefill_room(room, f"P/D layerwise announcement failed: {exc}")
    return None


_installed = False


def install() -> None:
    """Register the transfer-backend choice and the resolution step (once per process);
    the module table's HookRegistry hooks are registered by ``sglang_plugin/install.py``."""
    global _installed
    if _installed:
        return
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    register_resolution_hook("handle_pd_disaggregation")(_pd_step)
    _installed = True
