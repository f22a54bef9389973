"""NPU: one attention-DP group's host KV pool in MemFabric big-memory (BM) host memory,
allocated by attention-TP rank 0 and reached by every rank of the group through
MemFabric's global virtual addresses (GVA). Needs an Ascend NPU, CANN and
``memfabric_hybrid``; the served engine uses it for attention TP > 1 on an NPU
(``shared_host_pool.allocate_rank_pool``).

MemFabric calls used (``memfabric_hybrid`` and its ``bm`` module):
``memfabric_hybrid.initialize()`` / ``uninitialize()`` / ``get_last_err_msg()``;
``bm.BmConfig()`` (``rank_id`` with ``auto_ranking = False``, ``start_store``,
``set_nic(url)``); ``bm.initialize(store_url, world_size, device_id, config)`` and
``bm.uninitialize(flags)``; ``bm.create2(id=, local_dram_size=, max_dram_size=,
data_op_type=)`` returning a handle with ``join()``, ``peer_rank_ptr(rank,
bm.BmMemType.HOST)`` (a GVA), ``copy_data(src, dst, size, type, flags)``,
``copy_data_batch(src_addrs, dst_addrs, sizes, count, type, flags)``, ``wait()``,
``leave()`` and ``destroy()``; copy types ``L2G`` / ``G2L`` (device <-> global) and
``H2G`` / ``G2H`` (host <-> global).

Geometry: the same ``[layers, tokens, D]`` rows as :class:`~....sparse_decode.host_pool.HostKVPool`,
at ``gva(layer, slot) = base + ((layer * tokens) + slot) * row_bytes`` where ``base`` is
rank 0's host GVA; only rank 0 contributes memory (``local_dram_size`` = the pool's
bytes rounded up to 2 MiB, others 0), so the group holds one copy.

The pool implements the engine's host-rows interface
(:class:`~....sparse_decode.host_rows.HostRows`) without a tensor view:

* :meth:`write_rows` (rank 0's append): the rows ``[n, D]`` go to their slots, one
  ``copy_data`` per run of consecutive slots (``L2G`` from the NPU, ``H2G`` from the
  host), after a device synchronize (the rows may still be in flight on the compute
  stream) and followed by ``wait()``: the bytes are in host memory when it returns, so
  the :class:`~.shared.AppendOrder` publish that follows covers them;
* :meth:`gather_into` (every rank's miss copy, extend gather): ``dst_flat[dst_rows[i]] =
  pool[layer, slots[i]]`` as one ``copy_data_batch`` (``G2L`` into a device tensor,
  ``G2H`` into a host one), runs of consecutive source and destination rows merged.

Both read their slot lists on the host (a device -> host sync per layer) and call
MemFabric from Python: the GVA path is eager only, neither graph-capturable nor
sync-free (decode graphs are refused at attention TP > 1 anyway).

Setup and teardown go through the group's control block (:mod:`.group_rendezvous`):
each step (``bm initialized``, ``joined``, ``addressed``) is a rendezvous with a
deadline, so a rank that fails (e.g. its ``join`` returns an error) or dies makes every
rank raise :class:`~.group_rendezvous.GroupSetupError` naming it, and every rank checks
that it sees rank 0's pool at the same GVA. :meth:`close` tears down in order: ranks > 0
leave and destroy first and report ``left``; rank 0 waits for them (dead or failed ranks
count as gone) before it frees the memory.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .... import platform
from ....sparse_decode.host_pool import HostPoolShape
from ....startup_phases import phase as startup_phase
from .group_rendezvous import GroupRendezvous, GroupSetupError

logger = logging.getLogger(__name__)

__all__ = ["MemfabricGroupPool", "MemfabricPoolConfig", "free_store_url"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def free_store_url(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` for rank 0's BM config store (a port free now)."""
    return f"tcp://{host}:{_free_port()}"


@dataclass(frozen=True)
class MemfabricPoolConfig:
    """Where the BM store listens and how data moves (``data_op_type`` names a
    ``bm.BmDataOpType`` member; ``DEVICE_RDMA`` is what MemFabric's single-node
    multi-device DRAM example uses)."""

    device_id: int
    host: str = "127.0.0.1"
    data_op_type: str = "DEVICE_RDMA"
    entity_id: int = 0


class MemfabricGroupPool:
    """See the module docstring.

    ``rank`` / ``size``: attention-TP rank and group size; ``store_url``: rank 0's BM
    config store (the same string on every rank, broadcast by the caller);
    ``rendezvous``: the group's status table. ``shape`` / ``kind`` / ``tensor_backed``
    as for a :class:`~....sparse_decode.host_pool.HostKVPool`.
    """

    kind = "memfabric_gva"
    tensor_backed = False

    def __init__(
        self,
        shape: HostPoolShape,
        rank: int,
        size: int,
        config: MemfabricPoolConfig,
        store_url: str,
        rendezvous: GroupRendezvous,
    ):
        try:
            import memfabric_hybrid as mf  # noqa: PLC0415 - NPU only
            from memfabric_hybrid import bm  # noqa: PLC0415
        except ImportError as exc:
            raise RuntimeError(
                "the MemFabric shared host pool needs memfabric_hybrid: pip install "
                "'sglang-ascend-offload[npu]' on an Ascend machine"
            ) from exc
        self.shape, self.rank, self.size = shape, rank, size
        self.store_url = store_url
        self._mf, self._bm, self._rv = mf, bm, rendezvous
        self._handle = None
        self._bm_up = self._mf_up = self._joined = False
        self.base = 0
        with startup_phase(
            "host-pool allocation",
            total_bytes=shape.nbytes if rank == 0 else None,
            detail=f"MemFabric BM host memory of attention-TP rank 0, rank {rank} of {size}, device {config.device_id}",
            fix="the MemFabric error above (run mfcli kernel install; env --npu-check: memfabric); lower "
            "host_pool_tokens / --max-total-tokens or free host memory",
        ):
            self._set_up(config, store_url)

    def _set_up(self, config: MemfabricPoolConfig, store_url: str) -> None:
        """Initialise MemFabric and BM, create and join the group's segment (rank 0 backs
        it), and agree on rank 0's host GVA; each step a rendezvous of the group."""
        mf, bm, rendezvous, shape, rank, size = self._mf, self._bm, self._rv, self.shape, self.rank, self.size
        phase = "bm initialized"
        try:
            self._check(mf.initialize(), "memfabric_hybrid.initialize")
            self._mf_up = True
            cfg = bm.BmConfig()
            cfg.auto_ranking = False  # rank_id is only honoured without auto ranking
            cfg.rank_id = rank
            cfg.start_store = rank == 0
            cfg.set_nic(f"tcp://{config.host}:{_free_port()}")
            self._check(bm.initialize(store_url, size, config.device_id, cfg), f"bm.initialize({store_url})")
            self._bm_up = True
            rendezvous.reach(phase)
            phase = "joined"
            reserve = _aligned(shape.nbytes)
            nbytes = reserve if rank == 0 else 0  # only rank 0 backs the pool
            self._handle = bm.create2(
                id=config.entity_id,
                local_dram_size=nbytes,
                max_dram_size=reserve,
                data_op_type=getattr(bm.BmDataOpType, config.data_op_type),
            )
            self._check(self._handle.join(), "bm join")
            self._joined = True
            rendezvous.reach(phase)
            phase = "addressed"
            self.base = int(self._handle.peer_rank_ptr(0, bm.BmMemType.HOST))
            if self.base == 0:
                raise RuntimeError(f"MemFabric returned no host GVA for rank 0: {mf.get_last_err_msg()}")
            rendezvous.reach(phase, self.base)
            theirs = rendezvous.value(0)
            if theirs != self.base:
                raise RuntimeError(f"this rank sees rank 0's host pool at GVA {self.base:#x}, rank 0 at {theirs:#x}")
        except BaseException as exc:
            if isinstance(exc, GroupSetupError):
                self._release()
                raise
            # A rank that failed or died first (its store or segment gone) is often why this
            # step failed here: name the group's first cause, with this rank's error chained.
            cause = rendezvous.first_failure(phase)
            rendezvous.fail(phase, f"{type(exc).__name__}: {exc}")
            self._release()
            if cause is not None:
                raise cause from exc
            raise

    def _check(self, ret: int, what: str) -> None:
        if ret != 0:
            raise RuntimeError(f"{what} returned {ret}: {self._mf.get_last_err_msg()}")

    # ------------------------------------------------------------------ addresses
    def gva(self, layer: int, slot: int) -> int:
        return self.base + (layer * self.shape.tokens + slot) * self.shape.row_bytes

    def layer(self, layer: int) -> torch.Tensor:
        raise RuntimeError(
            "the MemFabric group host pool has no tensor view (its rows are reached through "
            "global addresses): use write_rows / gather_into / read_rows"
        )

    def _copy_type(self, tensor: torch.Tensor, to_global: bool):
        on_device = tensor.device.type != "cpu"
        t = self._bm.BmCopyType
        if to_global:
            return t.L2G if on_device else t.H2G
        return t.G2L if on_device else t.G2H

    # ------------------------------------------------------------------ HostRows
    def write_rows(self, layer: int, host_slots: torch.Tensor, rows: torch.Tensor) -> int:
        """Rank 0: ``pool[layer, host_slots[i]] = rows[i]`` (rows ``[n, D]`` of the pool
        dtype on the NPU or the host); returns bytes moved. Complete on return."""
        if self.rank != 0:
            raise RuntimeError("only attention-TP rank 0 writes the group's host pool")
        _check_rows(self.shape, host_slots, rows)
        rows = rows.contiguous()
        if rows.device.type != "cpu":
            platform.synchronize()  # rows computed on the compute stream; MemFabric copies on its own
        rb = self.shape.row_bytes
        slots = _host_index(host_slots)
        if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < self.shape.tokens):
            raise ValueError(f"write_rows: slots outside the pool's {self.shape.tokens} tokens")
        if not slots.numel():
            return 0
        first, at, count = _runs(slots, torch.arange(slots.numel(), dtype=torch.int64))
        self._batch(
            rows.data_ptr() + at * rb,
            self.gva(layer, 0) + first * rb,
            count * rb,
            self._copy_type(rows, to_global=True),
            f"append to layer {layer}",
        )
        return slots.numel() * rb

    def gather_into(
        self, layer: int, host_slots: torch.Tensor, dst: torch.Tensor, dst_rows: Optional[torch.Tensor] = None
    ) -> int:
        """``dst[dst_rows[i]] = pool[layer, host_slots[i]]`` (``dst`` contiguous ``[M, D]``
        of the pool dtype, on the NPU or the host; ``dst_rows`` default ``0..n-1``);
        returns bytes moved. Complete on return."""
        if (
            dst.dim() != 2
            or dst.shape[1] != self.shape.row_dim
            or dst.dtype != self.shape.dtype
            or not dst.is_contiguous()
        ):
            raise ValueError(
                f"gather_into: dst {tuple(dst.shape)} {dst.dtype} must be a contiguous "
                f"[M, {self.shape.row_dim}] {self.shape.dtype} tensor"
            )
        slots = _host_index(host_slots)
        rows = _host_index(dst_rows) if dst_rows is not None else torch.arange(slots.numel(), dtype=torch.int64)
        n = slots.numel()
        if rows.numel() != n or (n and not (0 <= int(rows.min()) and int(rows.max()) < dst.shape[0])):
            raise ValueError(
                f"gather_into: {n} slots / {rows.numel()} destination rows do not fit "
                f"dst [{dst.shape[0]}, {self.shape.row_dim}]"
            )
        if n and not (0 <= int(slots.min()) and int(slots.max()) < self.shape.tokens):
            raise ValueError(f"gather_into: slots outside the pool's {self.shape.tokens} tokens")
        if not n:
            return 0
        if dst.device.type != "cpu":
            platform.synchronize()  # earlier kernels on the compute stream may still read dst
        rb = self.shape.row_bytes
        first, at, count = _runs(slots, rows)
        self._batch(
            self.gva(layer, 0) + first * rb,
            dst.data_ptr() + at * rb,
            count * rb,
            self._copy_type(dst, to_global=False),
            f"read of layer {layer}",
        )
        return n * rb

    def read_rows(self, layer: int, host_slots: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[n, D]`` copy of rows ``host_slots`` of ``layer`` (host memory, or ``device``)."""
        out = torch.empty((host_slots.numel(), self.shape.row_dim), dtype=self.shape.dtype, device=device or "cpu")
        self.gather_into(layer, host_slots, out)
        return out

    def _batch(self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, kind, what: str) -> None:
        """One ``copy_data_batch`` of int64 ``[runs]`` addresses / byte counts, then ``wait()``."""
        if self._handle is None or not self._joined:
            raise RuntimeError(f"MemFabric group host pool {what}: the pool is closed")
        self._check(
            self._handle.copy_data_batch(src.tolist(), dst.tolist(), sizes.tolist(), sizes.numel(), kind, 0),
            f"copy_data_batch ({what})",
        )
        self._check(self._handle.wait(), f"wait after {what}")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Ordered teardown (module docstring); idempotent. Ranks > 0 report ``left``;
        rank 0 waits for them (at most the group's deadline) before freeing the memory."""
        if self._handle is None and not self._bm_up and not self._mf_up:
            return
        if self.rank == 0:
            try:
                gone = self._rv.wait_all("left", others_only=True, tolerate_gone=True)
                for r, why in gone.items():
                    logger.warning(
                        "sparse decode offload: TP rank %d %s before the MemFabric group pool closed", r, why
                    )
            except GroupSetupError as exc:
                logger.warning("%s; freeing the MemFabric group pool anyway", exc)
        self._release()
        if self.rank != 0:
            self._rv.report("left")

    def _release(self) -> None:
        """Leave, destroy, shut MemFabric down (each step once, errors logged)."""
        if self._joined:
            self._joined = False
            ret = self._handle.leave()
            if ret != 0:
                logger.warning("MemFabric bm leave returned %s: %s", ret, self._mf.get_last_err_msg())
        if self._handle is not None:
            self._handle.destroy()
            self._handle = None
        if self._bm_up:
            self._bm.uninitialize(0)
            self._bm_up = False
        if self._mf_up:
            self._mf.uninitialize()
            self._mf_up = False


BM_ALIGN = 2 << 20  # BM segments are reserved in 2 MiB pages


def _aligned(nbytes: int) -> int:
    return -(-nbytes // BM_ALIGN) * BM_ALIGN


def _check_rows(shape: HostPoolShape, host_slots: torch.Tensor, rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.shape[0] != host_slots.numel() or rows.shape[1] != shape.row_dim:
        raise ValueError(
            f"write_rows: rows {tuple(rows.shape)} / slots {tuple(host_slots.shape)} do not fit [n, {shape.row_dim}]"
        )
    if rows.dtype != shape.dtype:
        raise ValueError(f"write_rows: rows dtype {rows.dtype} != pool dtype {shape.dtype}")


def _host_index(index: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]`` on the host (a device -> host copy when ``index`` is on a device)."""
    return index.to(device="cpu", dtype=torch.int64).reshape(-1)


def _runs(src: torch.Tensor, dst: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(first_src, first_dst, count)`` int64 ``[runs]`` of the maximal runs where both
    indices advance by one (vectorised: no Python loop over the rows)."""
    if src.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    cont = (src[1:] - src[:-1] == 1) & (dst[1:] - dst[:-1] == 1)
    starts = torch.cat((torch.ones(1, dtype=torch.bool), ~cont)).nonzero().reshape(-1)
    ends = torch.cat((starts[1:], torch.tensor([src.numel()])))
    return src[starts], dst[starts], ends - starts
