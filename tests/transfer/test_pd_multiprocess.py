"""Real separate processes (spawn), Mooncake over TCP on 127.0.0.1: every valid TP pair.

Each scenario: p_tp prefill processes write 4 layers into 2 reusable slots and
publish them; d_tp decode processes pull main KV into one host pool shared by the
decode TP ranks (a shared-memory file) and indexer + LIC8 scale into rank-local
buffers. Requests of 1, 3 and 5 blocks cover empty shares (1 block over 4
contributors). The parent checks every byte with torch.equal.
"""

import pytest

from sglang_ascend_offload.testing.pd_harness import ScenarioSpec, run_scenario, valid_pairs
from sglang_ascend_offload.transfer.errors import TopologyError

pytestmark = pytest.mark.timeout(120)

PAIRS = valid_pairs(p_sizes=(1, 2, 4), d_sizes=(1, 2))

# The success-path scenarios test bit-exact movement, not timing: generous deadlines so a
# CPU shared with a loaded CI job (a 10 s handshake was missed once at load ~20) cannot
# fail them. The deadline behaviour itself is tested by the fault scenarios.
PATIENT = dict(handshake_timeout_s=30.0, layer_timeout_s=10.0)


def test_valid_pairs_are_exactly_the_divisible_ones():
    assert PAIRS == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]


@pytest.mark.parametrize("p_tp,d_tp", PAIRS, ids=[f"p{p}d{d}" for p, d in PAIRS])
def test_every_layer_moves_bit_exactly(pd_pool, p_tp, d_tp):
    r = run_scenario(
        pd_pool,
        ScenarioSpec(name=f"p{p_tp}d{d_tp}", p_tp=p_tp, d_tp=d_tp, seed=p_tp * 10 + d_tp, **PATIENT),
        timeout_s=100,
    )
    assert r.problems == []
    assert r.outcome == "done" and r.verified
    assert not r.hung and r.leaked_slots == 0
    ratio = p_tp // d_tp
    for d, rep in r.decode.items():
        assert all(c == "claimed" for c in rep["claims"].values())
        # every contributor sent one batch per layer, all read, nothing rejected
        assert rep["stats"]["batches"] == ratio * 4
        assert rep["stats"]["reads"] == ratio * 4
        assert rep["rejected"] == 0 and rep["handler_errors"] == 0
    for p, rep in r.prefill.items():
        assert rep["stats"]["read_done"] == 4 and rep["stats"]["timeouts"] == 0
        assert all(s == "done" for s, _ in rep["statuses"].values())


def test_no_indexer_model_moves_main_only(pd_pool):
    r = run_scenario(
        pd_pool, ScenarioSpec(name="mla_only", p_tp=2, d_tp=1, indexer_bytes=0, scale_bytes=0, **PATIENT), timeout_s=100
    )
    assert r.outcome == "done" and r.verified and r.problems == []
    assert all(rep["local"] == {} for rep in r.decode.values())


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 4), (3, 2), (4, 3)])
def test_invalid_pairs_rejected_before_any_process_work(pd_pool, p_tp, d_tp):
    with pytest.raises(TopologyError, match="invalid P/D topology"):
        run_scenario(pd_pool, ScenarioSpec(name="bad", p_tp=p_tp, d_tp=d_tp))
