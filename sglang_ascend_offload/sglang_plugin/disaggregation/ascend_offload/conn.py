"""SGLang's manager / sender / receiver / bootstrap-server classes of the ``ascend_offload`` backend.

They subclass SGLang's Mooncake classes (as SGLang's own Ascend backend does) to
keep SGLang's control plane for everything that is not KV: the HTTP bootstrap
server, prefill DP-rank queries, decode -> prefill request metadata (destination
pages, aux slot), the first-token aux data (sent over TCP, ``send_aux_tcp``), terminal
status messages and abort notifications. The KV path is replaced:

* no SGLang transfer engine is created (:meth:`AscendOffloadKVManager.init_engine`
  starts the project's engine from ``pd_transfer``); SGLang's per-chunk KV and state
  writes are no-ops (:meth:`~AscendOffloadKVManager.send_kvcache`,
  :meth:`~AscendOffloadKVManager.maybe_send_extra`);
* prefill: the manager holds one
  :class:`~sglang_ascend_offload.transfer.publisher.PrefillPublisher`; when a
  request's last chunk is sent its pages go to it (``last_chunk_sent``). On the
  device pool that is :class:`~sglang_ascend_offload.transfer.prefill_links.PrefillLinks`
  (publish layer by layer, gates, deadlines, verdicts); with the layerwise prefill
  offload pool the request was already published during the forward by
  :class:`~sglang_ascend_offload.transfer.layerwise_publisher.LayerwisePublisher`
  (announced by the ``Scheduler.run_batch`` hook of :mod:`.install`), and the send
  only checks its pages;
* decode: ``send_metadata`` registers the request's pages with
  :class:`~sglang_ascend_offload.transfer.decode_sink.DecodeSink` (the rank's
  ``DecodeReceiver``), which pulls each layer;
* both sides' ``poll`` combine SGLang's status with the protocol's: ``Success`` only
  when SGLang's aux/status path *and* the protocol say done; ``Failed`` as soon as
  either failed — on decode only once no read is still writing into the pages
  (until then the request waits), and ``clear`` waits (bounded) for that as well,
  so SGLang never frees pages an engine may still write.

The manager gets its KV pool from an AFTER hook on the prefill / decode queue's
``_init_kv_manager`` (:func:`attach_pool`), because SGLang hands managers pointers only.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List, Optional

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll, StateType
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from .... import config as cfg
from ....transfer import pool_layouts as layouts
from ....transfer.advert import ADVERT_FRAME_INDEX, advert_from_registration, encode_advert
from ....transfer.decode_sink import DecodeSink
from ....transfer.engine import create_engine
from ....transfer.errors import ProtocolError
from ....transfer.layerwise_publisher import LayerwisePublisher
from ....transfer.prefill_links import PrefillLinks
from ....transfer.publisher import PrefillPublisher
from ....transfer.status import TransferState
from ... import compat
from ...args import carrier
from ...args.rules import pd_transfer as rules
from ...mem_cache.pool.device import DeviceDSAPool

logger = logging.getLogger(__name__)

# SGLang classes whose fields the manager reads (compat.OBJECT_FIELDS).
_KV_ARGS = "sglang.srt.disaggregation.base.conn.KVArgs"
_PREFILL_INFO = "sglang.srt.disaggregation.common.conn.PrefillServerInfo"


class _EngineHandle:
    """What SGLang's Mooncake manager calls on ``self.engine`` (session id only)."""

    def __init__(self, engine):
        self.project_engine = engine

    def get_session_id(self) -> str:
        return self.project_engine.session_id

    def batch_register(self, ptrs, lens) -> int:  # SGLang paths that register are overridden
        return 0

    def batch_deregister(self, ptrs) -> int:
        return 0


def active_pd_config() -> Optional[cfg.PDTransferConfig]:
    """The validated P/D config published by the launcher (``None`` when P/D is off)."""
    return carrier.active_config().pd_transfer


class AscendOffloadKVManager(MooncakeKVManager):
    """KV manager of both roles (see module doc). ``pd_config`` is the validated ``pd_transfer``."""

    sender_trace_module = None
    supports_role_switch = False
    supports_deferred_decode_kv_release = False
    supports_host_destination = False

    def __init__(
        self, args, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False, **_ascend_kwargs: Any
    ):
        # SGLang's prefill bootstrap queue passes ``dcp_remote_decode_layout`` to every
        # TransferBackend.ASCEND manager; DCP is rejected at startup, so it is empty.
        pd = active_pd_config()
        if pd is None:
            raise RuntimeError(
                "the ascend_offload P/D backend is selected but no validated pd_transfer "
                "config is published (start the server with --enable-pd-transfer)"
            )
        unsupported = [st for st in (compat.field(args, _KV_ARGS, "state_types") or []) if st != StateType.DSA]
        if unsupported:
            raise RuntimeError(
                f"the ascend_offload P/D backend moves main KV and the DSA indexer only; "
                f"this pool also has state {[str(s) for s in unsupported]}"
            )
        self.pd_config = pd
        self.publisher: Optional[PrefillPublisher] = None
        self.sink: Optional[DecodeSink] = None
        self.pd_engine = None
        self._room_pages: Dict[int, List[np.ndarray]] = {}
        self._pair_problems: Dict[str, List[str]] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)

    # ------------------------------------------------------------------ engine / memory
    def init_engine(self):
        role = "prefill" if self.disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        gpu_id = compat.field(self.kv_args, _KV_ARGS, "gpu_id")
        self.pd_engine = create_engine(self.pd_config, role, device_id=int(gpu_id or 0))
        self.engine = _EngineHandle(self.pd_engine)

    def register_buffer_to_engine(self):
        """Registration happens in :meth:`attach_pool` (from the pool's tensors)."""

    def deregister_buffer_to_engine(self):
        """The project engine unregisters everything when it closes."""

    def attach_pool(self, pool: Any, context_len: Optional[int] = None, draft_pool: Any = None) -> None:
        """Start this rank's P/D side on ``pool`` (called right after the manager is built).

        draft_pool: the speculative draft (NextN) model's pool, moved with every request
        after the base layers (``None`` without speculation)."""
        for what, p in (("KV", pool), ("draft KV", draft_pool)):
            if p is not None and not isinstance(p, DeviceDSAPool):
                raise layouts.LayoutError(
                    f"P/D transfer backend ascend_offload moves the ascend_offload attention "
                    f"backend's DSA pools; got {type(p).__name__} as the {what} pool (serve "
                    "a DeepSeek-V3.2-style model with --attention-backend ascend_offload)"
                )
        layerwise = layouts.is_layerwise_pool(pool)
        layouts.check_pool(pool, allow_layerwise=layerwise and self.disaggregation_mode == DisaggregationMode.PREFILL)
        max_blocks = math.ceil(context_len / pool.page_size) + 1 if context_len else None
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            kind = LayerwisePublisher if layerwise else PrefillLinks
            self.publisher = kind(
                self.pd_config,
                p_tp=self.attn_tp_size,
                p_rank=self.attn_tp_rank,
                pool=pool,
                engine=self.pd_engine,
                max_blocks=max_blocks,
                draft_pool=draft_pool,
            )
        else:
            self.sink = DecodeSink(
                self.pd_config,
                d_tp=self.attn_tp_size,
                d_rank=self.attn_tp_rank,
                dp_rank=self.attn_dp_rank,
                pool=pool,
                engine=self.pd_engine,
                draft_pool=draft_pool,
            )

    def close_pd(self) -> None:
        """Stop the P/D side and the engine (tests; SGLang kills its processes)."""
        if self.publisher is not None:
            self.publisher.close()
        if self.sink is not None:
            self.sink.close()
        if self.pd_engine is not None:
            self.pd_engine.close()

    # ------------------------------------------------------------------ registration (SGLang control plane)
    def build_receiver_registration_message(self) -> List[bytes]:
        frames = super().build_receiver_registration_message()
        if len(frames) != ADVERT_FRAME_INDEX:
            raise RuntimeError(
                f"SGLang's registration message has {len(frames)} frames, the backend expects "
                f"{ADVERT_FRAME_INDEX} (SGLang 0.5.23)"
            )
        if self.sink is None:
            raise RuntimeError("decode P/D side not attached to a KV pool")
        return frames + [encode_advert(self.sink.advert())]

    def _make_worker_recv(self, socket, timeout_ms: int = 500):
        recv = super()._make_worker_recv(socket, timeout_ms)
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            return recv

        def recv_noting_adverts():
            msg = recv()
            if msg and msg[0] == b"None" and len(msg) > 3:
                self._note_registration(msg)
            return msg

        return recv_noting_adverts

    def _note_registration(self, frames) -> None:
        try:
            session = bytes(frames[3]).decode("ascii")
        except UnicodeDecodeError:
            return
        if self.publisher is None:
            logger.error("P/D registration from %s before the prefill side was attached", session)
            return
        try:
            advert = advert_from_registration(frames)
        except ProtocolError as exc:
            self.publisher.note_peer(session, None, f"invalid decode advert from {session}: {exc}")
            return
        self.publisher.note_peer(session, advert)

    def announce_last_chunk(self, row: int, room: int) -> None:
        """Layerwise pool: the next forward computes ``room``'s last chunk in ``req_to_token``
        row ``row`` (called by the ``Scheduler.run_batch`` hook before the forward)."""
        sessions = list(self.transfer_infos.get(room, {}).keys())
        if len(sessions) != 1:
            self.fail_prefill_room(
                room,
                f"{len(sessions)} decode ranks target prefill rank {self.attn_tp_rank} "
                "for this request; the P/D protocol pairs each prefill rank with one "
                "decode rank (p_tp >= d_tp)",
            )
            return
        self.publisher.expect(row, room, sessions[0])

    # ------------------------------------------------------------------ prefill: KV path
    def add_transfer_request(
        self,
        bootstrap_room,
        kv_indices,
        index_slice,
        is_last_chunk,
        aux_index=None,
        state_indices=None,
        num_kv_tokens=None,
        **kwargs,
    ):
        if (
            self.publisher is not None
            and bootstrap_room in self.request_status
            and self.check_status(bootstrap_room) != KVPoll.Failed
        ):
            # SGLang hands the pages as a host tensor or an ndarray (supports_host_tensor_indices=False)
            pages = np.asarray(kv_indices.numpy() if hasattr(kv_indices, "numpy") else kv_indices, dtype=np.int64)
            self._room_pages.setdefault(bootstrap_room, []).append(pages.copy())
            if is_last_chunk:
                chunks = np.concatenate(self._room_pages.pop(bootstrap_room)).tolist()
                sessions = list(self.transfer_infos.get(bootstrap_room, {}).keys())
                self.publisher.last_chunk_sent(bootstrap_room, sessions, chunks, wait_event=kwargs.get("wait_event"))
        super().add_transfer_request(
            bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index, state_indices, num_kv_tokens, **kwargs
        )

    def send_kvcache(self, *args, **kwargs) -> int:
        """SGLang's per-chunk KV write: the protocol moves the KV (see module doc)."""
        return 0

    def maybe_send_extra(self, *args, **kwargs) -> int:
        """SGLang's state write (the DSA indexer): the protocol moves it with the KV."""
        return 0

    def send_aux(self, req, prefill_aux_index, dst_aux_ptrs):
        return self.send_aux_tcp(req, prefill_aux_index, dst_aux_ptrs)

    def prefill_status(self, room: int):
        return None if self.publisher is None else self.publisher.status(room)

    def cancel_prefill_room(self, room: int, reason: str) -> None:
        if self.publisher is not None:
            self.publisher.cancel(room, reason)

    def fail_prefill_room(self, room: int, reason: str) -> None:
        """Record the protocol's failure in SGLang's room state and tell decode."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        if room in self.request_status and self.request_status.get(room) != KVPoll.Failed:
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)

    def forget_prefill_room(self, room: int) -> None:
        self._room_pages.pop(room, None)
        if self.publisher is not None:
            self.publisher.forget(room)

    # ------------------------------------------------------------------ decode: pair check
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        known = bootstrap_addr in self.prefill_info_table
        ok = super().try_ensure_parallel_info(bootstrap_addr)
        if ok and not known:
            info = self.prefill_info_table[bootstrap_addr]
            problems = rules.pair_problems(
                self.pd_config,
                role="decode",
                own_tp=self.attn_tp_size,
                peer_tp=int(info.attn_tp_size),
                device=str(compat.arg(self.server_args, "device")),
                dp=int(self.attn_dp_size or 1),
                peer_cp=int(compat.field(info, _PREFILL_INFO, "attn_cp_size") or 1),
                peer_pp=int(compat.field(info, _PREFILL_INFO, "pp_size") or 1),
            )
            self._pair_problems[bootstrap_addr] = problems
            if problems:
                logger.error(
                    "P/D: prefill %s cannot pair with this decode server (every request to it fails): %s",
                    bootstrap_addr,
                    "; ".join(problems),
                )
        return ok

    def pair_problems(self, bootstrap_addr: str) -> List[str]:
        return self._pair_problems.get(bootstrap_addr, [])


class AscendOffloadKVSender(MooncakeKVSender):
    """Prefill sender: SGLang's bootstrap / aux / status plus the protocol's state."""

    # False keeps SGLang's prefill send (disaggregation/prefill.py) off its pinned-memory +
    # device-event path for the page indices (a CPU has neither); the pages arrive as a
    # host array.
    supports_host_tensor_indices = False

    def poll(self) -> KVPoll:
        base = super().poll()
        ours = self.kv_mgr.prefill_status(self.bootstrap_room)
        if ours is None:
            return base
        if ours.state is TransferState.FAILED:
            self.kv_mgr.fail_prefill_room(self.bootstrap_room, ours.reason)
            return KVPoll.Failed
        if base == KVPoll.Success:
            return KVPoll.Success if ours.state is TransferState.DONE else KVPoll.Transferring
        return base

    def failure_exception(self):
        ours = self.kv_mgr.prefill_status(self.bootstrap_room)
        if ours is not None and ours.state is TransferState.FAILED:
            self.conclude_state = KVPoll.Failed
            self.clear()
            with self.kv_mgr.failure_lock:
                self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
            raise KVTransferError(self.bootstrap_room, f"P/D transfer failed: {ours.reason}")
        return super().failure_exception()

    def abort(self):
        super().abort()
        self.kv_mgr.cancel_prefill_room(self.bootstrap_room, "aborted by the prefill scheduler")

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_prefill_room(self.bootstrap_room)


class AscendOffloadKVReceiver(MooncakeKVReceiver):
    """Decode receiver: SGLang's bootstrap / metadata / aux plus the protocol's pulls."""

    def init(self, prefill_dp_rank: int):
        problems = self.kv_mgr.pair_problems(self.bootstrap_addr)
        if problems:
            self._fail(f"prefill {self.bootstrap_addr} cannot pair with this decode server: " + "; ".join(problems))
            return
        super().init(prefill_dp_rank)

    def _fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kwargs):
        if self.conclude_state == KVPoll.Failed or self.kv_mgr.sink is None:
            return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, **kwargs)
        if decode_prefix_len:
            self._fail(
                f"decode prefix reuse ({decode_prefix_len} tokens) is not supported by the ascend_offload P/D backend"
            )
            return None
        try:
            self.kv_mgr.sink.expect(self.bootstrap_room, np.asarray(kv_indices).tolist())
        except (ValueError, RuntimeError) as exc:
            self._fail(f"P/D destination rejected: {exc}")
            return None
        return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, **kwargs)

    def poll(self) -> KVPoll:
        base = super().poll()
        sink = self.kv_mgr.sink
        if sink is None:
            return base
        room = self.bootstrap_room
        ours = sink.status(room)
        if ours is None:
            return base
        hold = KVPoll.Transferring if base in (KVPoll.Transferring, KVPoll.Success, KVPoll.Failed) else base
        if ours.state is TransferState.FAILED:
            return KVPoll.Failed if sink.released(room) else hold
        if base == KVPoll.Failed:
            sink.fail(room, f"SGLang failed the request: {self.kv_mgr.failure_records.get(room, 'unknown')}")
            return KVPoll.Failed if sink.released(room) else hold
        if base != KVPoll.Success:
            return base
        if ours.state is TransferState.DONE:
            sink.claim(room)
            return KVPoll.Success
        since = sink.note_prefill_done(room)
        limit = self.kv_mgr.pd_config.handshake_timeout_s + self.kv_mgr.pd_config.layer_timeout_s
        if time.monotonic() - since > limit:
            sink.fail(room, f"prefill reported the request finished but its KV did not arrive within {limit:.0f}s")
        return KVPoll.Transferring

    def failure_exception(self):
        sink = self.kv_mgr.sink
        reason = sink.failure_reason(self.bootstrap_room) if sink is not None else None
        if reason is not None:
            self.conclude_state = KVPoll.Failed
            self.clear()
            with self.kv_mgr.failure_lock:
                self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
            raise KVTransferError(self.bootstrap_room, f"P/D transfer failed: {reason}")
        return super().failure_exception()

    def abort(self):
        super().abort()
        if self.kv_mgr.sink is not None:
            self.kv_mgr.sink.fail(self.bootstrap_room, "aborted by the decode scheduler")

    def clear(self) -> None:
        if self.kv_mgr.sink is not None:
            self.kv_mgr.sink.forget(self.bootstrap_room, "released by the decode scheduler")
        super().clear()


class AscendOffloadKVBootstrapServer(MooncakeKVBootstrapServer):
    """SGLang's HTTP bootstrap server, unchanged (registration, DP-rank queries)."""
