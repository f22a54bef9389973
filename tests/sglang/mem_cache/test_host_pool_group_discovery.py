"""Which ranks share a host pool: ``pool_host.shared.sglang_group`` against SGLang's
published parallel state (no process groups are started: the group handles and ranks
are SGLang's own ``get_parallel().override``).

* nothing published, or attention TP 1 without built groups (component tests): no group,
  a private pool, the reason logged;
* attention TP > 1 and the group cannot be read: startup stops with the reason (never a
  private pool per rank, the host memory times the TP);
* the group ids are distinct over DP replicas and attention-DP ranks; a replica whose DP
  rank cannot be read stops startup (its id would collide).
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest

from sglang_ascend_offload.sglang_plugin.mem_cache.pool_host import shared
from sglang_ascend_offload.sparse_decode.host_pool import HostPoolShape

LOGGER = "sglang_ascend_offload.sglang_plugin.mem_cache.pool_host.shared"


@contextlib.contextmanager
def published(**server_args):
    """SGLang's runtime context of one rank with these server args (no process groups)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu", **server_args), role="test", ranks=SpawnRanks(world_rank=0))
    try:
        yield
    finally:
        reset_context()


def tp_group(rank: int, size: int):
    return SimpleNamespace(rank_in_group=rank, world_size=size)


def test_no_parallel_configuration_is_a_private_pool_with_the_reason(caplog):
    from sglang.srt.runtime_context import reset_context

    reset_context()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert shared.sglang_group() is None
    assert "no SGLang parallel configuration in this process" in caplog.text
    assert "this rank's host pool is private" in caplog.text


def test_attention_tp_1_without_groups_is_a_private_pool_with_the_reason(caplog):
    with published(), caplog.at_level(logging.INFO, logger=LOGGER):
        assert shared.sglang_group() is None
    assert "attention-TP group is not built in this process" in caplog.text and "attention TP is 1" in caplog.text


def test_an_unreadable_group_with_attention_tp_2_stops_startup():
    shape = HostPoolShape(layers=2, tokens=64, latent_dim=8, rope_dim=4)
    with published(tp_size=2):
        with pytest.raises(shared.GroupDiscoveryError, match=r"attention TP is 2, so the 2 ranks .* share one host"):
            shared.sglang_group()
        # what the served pool calls: no private pool is allocated either
        with pytest.raises(shared.GroupDiscoveryError, match=r"refusing to allocate a private pool per rank \(2 x"):
            shared.allocate_rank_pool(shape, "pinned")


def test_group_ids_are_distinct_over_dp_replicas():
    """``--tp 2 --dp 2`` without DP attention: two replicas, one pool each, ids 0 and 1."""
    from sglang.srt.runtime_context import get_parallel

    seen = set()
    for replica in (0, 1):
        with published(tp_size=2, dp_size=2), get_parallel().override(attn_tp_group=tp_group(1, 2), dp_rank=replica):
            view = shared.sglang_group()
        assert (view.rank, view.size, view.groups, view.groups_per_node) == (1, 2, 2, 2)
        seen.add(view.group)
    assert seen == {0, 1}


def test_group_ids_are_the_attention_dp_ranks_with_dp_attention():
    """``--tp 4 --dp 2 --enable-dp-attention``: one replica, two attention-DP groups of 2."""
    from sglang.srt.runtime_context import get_parallel

    seen = set()
    for dp_rank in (0, 1):
        with (
            published(tp_size=4, dp_size=2, enable_dp_attention=True),
            get_parallel().override(
                attn_tp_group=tp_group(1, 2), tp_rank=2 * dp_rank + 1, attn_dp_rank=dp_rank, attn_tp_rank=1
            ),
        ):
            view = shared.sglang_group()
        assert (view.size, view.groups) == (2, 2)
        seen.add(view.group)
    assert seen == {0, 1}


def test_a_replica_without_a_readable_dp_rank_stops_startup():
    """Two replicas, this one's DP rank unset: a default of 0 would give both replicas the
    same group id."""
    from sglang.srt.runtime_context import get_parallel

    with published(tp_size=2, dp_size=2), get_parallel().override(attn_tp_group=tp_group(0, 2)):
        with pytest.raises(shared.GroupDiscoveryError, match="this replica's DP rank cannot be read.*would collide"):
            shared.sglang_group()


def test_the_npu_device_fallback_is_logged(caplog):
    view = shared.GroupView(rank=1, size=2, group=0, groups=1, broadcast_object=None, barrier=None)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert shared._npu_device_index(view) == 1
    assert "torch.npu.current_device() failed" in caplog.text and "uses device 1" in caplog.text


@pytest.mark.npu
def test_on_an_npu_the_group_pool_uses_the_current_device_without_a_fallback(caplog):
    """On an NPU (a runner, or the stand-in) ``torch.npu.current_device()`` answers: the
    MemFabric group pool registers that device and nothing is logged."""
    import torch
    from npu_requirements import require_npu

    require_npu()
    torch.npu.set_device(1)
    try:
        view = shared.GroupView(rank=0, size=2, group=0, groups=1, broadcast_object=None, barrier=None)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert shared._npu_device_index(view) == 1
        assert "current_device() failed" not in caplog.text
    finally:
        torch.npu.set_device(0)
