"""The shared host pool between independently started processes (no SGLang server).

``sglang_plugin.mem_cache.pool_host.shared``: rank 0 creates a named mapping with a header,
others attach only what rank 0 announced; the append order (per-layer published
counters under a process-shared semaphore) holds between processes that share no
parent-made objects; a missing append fails with a deadline naming the rank and
layer; stale pools of dead owners are reclaimed, live ones never touched.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from typing import Optional

import pytest
import torch

from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp
from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape

SHAPE = HostPoolShape(layers=3, tokens=64, latent_dim=8, rope_dim=4)

# A reader started as its own interpreter: it maps the announced file and, per
# (round, layer), waits for rank 0's append then checks the rows bit for bit. On the
# steps ``ahead(r, layer)`` rank 0 appends only after the reader has said, having seen
# the counter not yet there, that it is about to wait ("ahead r layer"); once its wait
# returned it says "through r layer".
READER = textwrap.dedent("""
    import sys, torch
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp
    from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape
    path, session, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    shape = HostPoolShape(layers=3, tokens=64, latent_dim=8, rope_dim=4)
    sp = shp.attach_pool(shape, path, session, rank=1, timeout_s=30)
    print("attached", flush=True)
    for r in range(rounds):
        for layer in range(3):
            sp.order.appended(layer)          # this rank's set_kv_buffer (a skip)
            ahead = (r + layer) % 7 == 0
            if ahead:
                if sp.order.published(layer) > r:
                    print(f"PUBLISHED EARLY round {r} layer {layer}", flush=True)
                    sys.exit(4)
                print(f"ahead {r} {layer}", flush=True)
            sp.order.wait_readable(layer, r)  # then its read
            if ahead:
                print(f"through {r} {layer}", flush=True)
            g = torch.Generator().manual_seed(r * 10 + layer)
            want = torch.randn((4, 12), generator=g).to(torch.bfloat16)
            slots = torch.arange(4) + 4 * (r % 16)
            got = sp.pool.read_rows(layer, slots)
            if not torch.equal(got, want):
                print(f"MISMATCH round {r} layer {layer}", flush=True)
                sys.exit(3)
    print(f"ok waits={sp.order.waits}", flush=True)
""")


def _rows(r: int, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(r * 10 + layer)
    return torch.randn((4, 12), generator=g).to(torch.bfloat16)


class _Lines:
    """Lines of a child's unbuffered stdout, each waited for with a deadline (select)."""

    def __init__(self, stream):
        self.fd, self.buf = stream.fileno(), b""

    def next(self, timeout_s: float) -> Optional[str]:
        """The next line; ``None`` if none came within ``timeout_s``; ``""`` at EOF."""
        end = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().strip()


def test_reader_process_sees_exactly_rank0s_appends(tmp_path):
    """Rank 0 (this process) appends; an independently started reader must never read a
    row before its append is published (bit-exact every round). On every seventh step
    rank 0 appends only once the reader is ahead of it: the reader saw the rows not yet
    published and is about to wait; it must not get through its wait until the append."""
    rounds = 40
    sp = shp.create_pool(SHAPE, directory=tmp_path, timeout_s=30)
    reader = None
    try:
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(sp.path), sp.session, str(rounds)], stdout=subprocess.PIPE, bufsize=0
        )
        lines = _Lines(reader.stdout)
        assert lines.next(120) == "attached"
        sp.pool.unlink()  # the name can go once every rank mapped it
        assert not sp.path.exists()
        for r in range(rounds):
            for layer in range(3):
                ahead = (r + layer) % 7 == 0
                # The event: the reader is ahead of this append. Waiting for it also keeps rank 0
                # within 7 steps of the reader, so it never rewrites a slot (a 16-round ring)
                # the reader has yet to read, however slow the reader is.
                if ahead:
                    assert lines.next(60) == f"ahead {r} {layer}"
                    # A correct wait never returns before the append; a wait that does is seen here.
                    assert lines.next(0.05) is None, "the reader got through before rank 0 appended"
                sp.pool.write_rows(layer, torch.arange(4) + 4 * (r % 16), _rows(r, layer))
                sp.order.appended(layer)
                if ahead:
                    assert lines.next(60) == f"through {r} {layer}"
        rest = []
        while (line := lines.next(60)) not in ("", None):
            rest.append(line)
        assert reader.wait(60) == 0, rest
        assert len(rest) == 1 and rest[0].startswith("ok waits="), rest
        assert all(sp.order.published(layer) == rounds for layer in range(3))
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait()
        sp.pool.close()


def test_missing_append_fails_with_rank_and_layer_after_the_deadline(tmp_path):
    owner = shp.create_pool(SHAPE, directory=tmp_path, group=3, timeout_s=5)
    reader = shp.attach_pool(SHAPE, owner.path, owner.session, rank=1, group=3, timeout_s=0.2)
    owner.order.appended(0)
    reader.order.appended(0)
    reader.order.wait_readable(0, step=0)  # published: no wait
    reader.order.appended(2)
    t0 = time.monotonic()
    with pytest.raises(
        shp.AppendTimeout,
        match=r"rank 1 of attention-DP group 3 .* append #1 of layer 2 "
        r"\(decode step 7, rank 0 has published 0",
    ):
        reader.order.wait_readable(2, step=7)
    assert time.monotonic() - t0 >= 0.2  # waited out the reader's deadline (the message names the append)
    owner.pool.close()


def test_attach_refuses_a_pool_it_was_not_told_about(tmp_path):
    owner = shp.create_pool(SHAPE, directory=tmp_path, group=1)
    with pytest.raises(RuntimeError, match="session"):
        shp.attach_pool(SHAPE, owner.path, "0" * 32, rank=1, group=1)
    with pytest.raises(RuntimeError, match="geometry"):
        shp.attach_pool(HostPoolShape(3, 65, 8, 4), owner.path, owner.session, rank=1, group=1)
    with pytest.raises(RuntimeError, match="group 1 != 0"):
        shp.attach_pool(SHAPE, owner.path, owner.session, rank=1, group=0)
    owner.pool.close()
    assert not owner.path.exists()


KILLED_OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared as shp
    from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape
    sp = shp.create_pool(HostPoolShape(layers=3, tokens=64, latent_dim=8, rope_dim=4), directory=Path(sys.argv[1]))
    print(sp.path, flush=True)
    time.sleep(600)
""")


def test_stale_pool_of_a_killed_owner_is_reclaimed_live_ones_are_kept(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        stale = tmp_path / proc.stdout.readline().strip()
        assert stale.exists()
        live = shp.create_pool(SHAPE, directory=tmp_path)  # the owner is alive: its pool stays
        assert stale.exists()
        header = shp.read_header(stale)
        assert header is not None and header.owner_pid == proc.pid and header.owner_alive()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not header.owner_alive()
    with pytest.raises(RuntimeError, match="owner pid .* is gone"):
        shp.attach_pool(SHAPE, stale, header.session, rank=1)  # never attached by mistake
    # a file cut short while its creator died, named after a dead pid
    (tmp_path / f"{shp.PREFIX}.{proc.pid}.deadbeef.g0").write_bytes(b"SAO")
    # the next creation reclaims both dead owners' files and keeps the live one
    fresh = shp.create_pool(SHAPE, directory=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([live.path.name, fresh.path.name])
    live.pool.close()
    fresh.pool.close()
    assert list(tmp_path.iterdir()) == []


def test_header_identity_and_layout(tmp_path):
    sp = shp.create_pool(SHAPE, directory=tmp_path, group=2, group_size=4)
    h = shp.read_header(sp.path)
    assert (h.owner_pid, h.group, h.group_size, h.layers, h.tokens, h.row_dim, h.element_size) == (
        os.getpid(),
        2,
        4,
        3,
        64,
        12,
        2,
    )
    assert h.session == sp.session and h.owner_alive() and h.matches(SHAPE)
    assert sp.path.stat().st_size == shp.header_bytes_for(3) + SHAPE.nbytes
    assert sp.pool.data.data_ptr() % 4096 == 0  # rows start page-aligned after the header
    sp.pool.close()


def test_planner_states_host_bytes_per_node_one_pool_per_dp_rank():
    from sglang_ascend_offload.capacity import GIB, CapacityInputs, host_pool_bytes_per_node, plan
    from sglang_ascend_offload.model_specs import preset

    model = preset("deepseek-v3.2")
    base = dict(hbm_bytes=20 * GIB, host_bytes=512 * GIB, context=131072)
    tp8 = plan(model, CapacityInputs(tp=8, **base)).mode("sparse-decode")
    tp1 = plan(model, CapacityInputs(tp=1, **base)).mode("sparse-decode")
    dp2 = plan(model, CapacityInputs(tp=4, dp=2, **base)).mode("sparse-decode")
    # one pool per DP rank: the TP size does not multiply the host bytes
    assert tp8.host_bytes_per_node == tp1.host_bytes_per_node == tp8.tokens * 61 * 1152
    assert dp2.host_bytes_per_node == 2 * dp2.tokens_per_dp_rank * 61 * 1152
    assert dp2.host_bytes_per_node == host_pool_bytes_per_node(61 * 1152, dp2.tokens_per_dp_rank, 2)
    assert tp8.host_bytes_per_node <= 512 * GIB
