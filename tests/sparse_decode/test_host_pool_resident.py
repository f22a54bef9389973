"""A shared host pool is resident from its allocation, as a pinned pool is: the
mapping is populated at map time, so RSS does not grow as the pool fills (what
``bench soak`` measures after warm-up)."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from sglang_ascend_offload.sparse_decode.host_pool import HostKVPool, HostPoolShape

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MAP_POPULATE"),
    reason="MAP_POPULATE and /proc/self/smaps are Linux-only",
)


def _mapping_rss_kib(path) -> int:
    """Rss of this process's mapping(s) of ``path`` (smaps names a deleted file '... (deleted)')."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and head[5] == str(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_shared_pool_is_resident_at_creation_and_attach(tmp_path):
    shape = HostPoolShape(layers=2, tokens=2048)  # 4.5 MiB
    pool = HostKVPool.create_shared(shape, tmp_path / "pool", header_bytes=4096)
    other = HostKVPool.attach_shared(shape, tmp_path / "pool", header_bytes=4096)
    try:
        expect_kib = (shape.nbytes + 4096) // 1024
        # Both mappings of this process are resident before any row is written.
        assert _mapping_rss_kib(tmp_path / "pool") >= 2 * expect_kib
        assert int(pool.data.abs().sum()) == 0  # still the zero-filled file
    finally:
        other.close()
        pool.close()
    assert not os.path.exists(tmp_path / "pool")
