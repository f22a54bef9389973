"""Local host KV store: bit-exact round trip, content keys, eviction with leases."""

import pytest
import torch

from sglang_ascend_offload.layerwise_prefill.store import StoreError, block_keys, object_key
from sglang_ascend_offload.layerwise_prefill.store_local import LocalHostKVStore


def _parts(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 8, generator=g).to(torch.bfloat16), torch.randn(n, 2, generator=g)]


def test_block_keys_chain_and_partial_tail():
    a = block_keys(list(range(10)), 4)
    assert [(k.start, k.tokens) for k in a] == [(0, 4), (4, 4), (8, 2)]
    b = block_keys(list(range(8)) + [99, 98, 97], 4)
    assert a[0] == b[0] and a[1] == b[1] and a[2].digest != b[2].digest
    # same block tokens after a different prefix -> different key (chained)
    c = block_keys([7] + list(range(1, 10)), 4)
    assert c[1].digest != a[1].digest
    # a partial block never aliases a full one
    assert object_key(block_keys([1, 2], 4)[0], 0) != object_key(block_keys([1, 2, 3, 4], 4)[0], 0)
    assert block_keys([1, 2], 4, namespace="x")[0] != block_keys([1, 2], 4, namespace="y")[0]


def test_round_trip_bit_exact_and_skip_existing():
    s = LocalHostKVStore()
    src = _parts(1)
    s.put(["k"], [src])
    src_copy = [t.clone() for t in src]
    for t in src:  # the store copied: overwriting the source does not change it
        t.fill_(0)
    out = [torch.empty_like(t) for t in src]
    s.get_into(["k"], [out])
    assert all(torch.equal(o, c) for o, c in zip(out, src_copy))
    s.put(["k"], [_parts(2)])  # same key -> kept
    s.get_into(["k"], [out])
    assert all(torch.equal(o, c) for o, c in zip(out, src_copy))
    assert s.stats().skipped_existing == 1 and s.exists(["k", "x"]) == [True, False]
    with pytest.raises(StoreError, match="missing"):
        s.get_into(["x"], [out])
    with pytest.raises(StoreError, match="match"):
        s.get_into(["k"], [[torch.empty(3, 8, dtype=torch.bfloat16), out[1]]])


def test_capacity_evicts_lru_but_not_leased():
    one = sum(t.numel() * t.element_size() for t in _parts(0))
    s = LocalHostKVStore(capacity_bytes=2 * one)
    s.put(["a"], [_parts(1)])
    s.put(["b"], [_parts(2)])
    s.add_lease(["a"], 1000)
    s.put(["c"], [_parts(3)])  # evicts b (a is leased)
    assert s.exists(["a", "b", "c"]) == [True, False, True]
    s.add_lease(["c"], 1000)
    with pytest.raises(StoreError, match="full"):
        s.put(["d"], [_parts(4)])
    s.remove_lease(["a"])
    s.put(["d"], [_parts(4)])
    assert s.exists(["a", "c", "d"]) == [False, True, True]
    assert s.stats().evictions == 2
