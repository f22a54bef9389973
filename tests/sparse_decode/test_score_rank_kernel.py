"""The CPU kernel of ``score_rank`` / ``score_rank_guarded`` (``sparse_decode/score_kernel.py``,
``csrc/score_rank_cpu.cpp``) against the torch managers, bit for bit: outputs (hits, slots,
miss lists in top-k order, so the i-th miss takes the i-th victim) and every state tensor
(the table, the ghost LRU table, the guard's counters) after every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_ascend_offload.sparse_decode import score_kernel
from sglang_ascend_offload.sparse_decode.policies import make_manager, uses_cpu_kernel
from sglang_ascend_offload.sparse_decode.replay import simulate_policy
from sglang_ascend_offload.sparse_decode.trace import SyntheticTraceSpec, synthesize

from .test_score_rank import HYP, adversarial, ranked_scenarios

KERNEL_POLICIES = ("score_rank", "score_rank_guarded")


@pytest.fixture(scope="module", autouse=True)
def _built():
    """What ``scripts/setup_cpu_env.sh`` does (idempotent: a no-op when current)."""
    score_kernel.build()


def _pair(policy, rows, hot, slack_shift=None, seed=None):
    """Torch and kernel managers; for the guarded policy optionally another guard seed /
    proportional slack (a small seed makes the guard bind often)."""
    ref = make_manager(policy, rows, hot, manage_impl="torch")
    ker = make_manager(policy, rows, hot, manage_impl="kernel")
    assert ker.impl == "kernel" and ref.impl == "torch" and type(ker) is type(ref)
    if slack_shift is not None:
        ref.slack_shift = ker.slack_shift = slack_shift
    if seed is not None:
        ref.seed = ker.seed = seed
    return ref, ker


def _same(ref, ker, a, b, where=""):
    for name in ("hit_mask", "slots", "miss_count", "miss_tokens", "miss_slots"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{where}: {name} differs\n{x}\n{y}"
    sa, sb = ref.state(), ker.state()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{where}: state {name} differs\n{sa[name]}\n{sb[name]}"


def _drive(ref, ker, steps, rows_subsets=None):
    """Step both managers; ``rows_subsets[i]``: the rows form with those state rows (in
    that order) at step ``i``, else every row."""
    for i, (topk, req, stable, ranked) in enumerate(steps):
        t, q, s, r = (torch.from_numpy(topk), torch.from_numpy(req), torch.from_numpy(stable), torch.from_numpy(ranked))
        if rows_subsets is None:
            for m in (ref, ker):
                m.set_ranked(r)
            a, b = ref.step(t, q, s, i), ker.step(t, q, s, i)
        else:
            sel = torch.tensor(rows_subsets[i], dtype=torch.int64)
            for m in (ref, ker):
                m.set_ranked(r[sel])
            a = ref.step_rows(sel, t[sel], q[sel], s[sel], 3 * i)
            b = ker.step_rows(sel, t[sel], q[sel], s[sel], 3 * i)
        _same(ref, ker, a, b, f"step {i}")


# ------------------------------------------------------------------ property tests
@pytest.mark.parametrize("policy", KERNEL_POLICIES)
@HYP
@given(scn=adversarial(), seed=st.sampled_from([0, 1, 2, 16]))
def test_kernel_equals_torch_on_drawn_scenarios(policy, scn, seed):
    """Churn, idle rows, speculative suffixes (stable_len below selected positions),
    short selections, misleading rankings; every row each step; guard seeds that bind."""
    hot, steps = scn
    ref, ker = _pair(policy, steps[0][0].shape[0], hot, seed=seed if policy == "score_rank_guarded" else None)
    _drive(ref, ker, steps)


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
@HYP
@given(scn=ranked_scenarios(), data=st.data())
def test_kernel_equals_torch_in_rows_form(policy, scn, data):
    """Rows form: a drawn subset of the state rows per step, in a drawn order; rows left
    out keep their state; guarded with a drawn proportional slack too."""
    hot, steps = scn
    rows = steps[0][0].shape[0]
    guarded = policy == "score_rank_guarded"
    shift = data.draw(st.sampled_from([None, 0, 1, 3])) if guarded else None
    ref, ker = _pair(policy, rows, hot, shift, data.draw(st.sampled_from([0, 1, 3])) if guarded else None)
    subsets = [data.draw(st.permutations(list(range(rows))))[: data.draw(st.integers(1, rows))] for _ in steps]
    _drive(ref, ker, steps, subsets)


# ------------------------------------------------------------------ randomized, larger
def _random_steps(rng, rows, k, depth, steps, universe, huge=0):
    """Locality-ish selections over a growing context with churn, idle rows, and a
    speculative suffix; ``huge`` offsets every position (the kernel's hash-map path)."""
    reqs = rng.integers(0, 3, rows)
    lens = rng.integers(k, universe // 2, rows)
    out = []
    for _ in range(steps):
        topk = np.full((rows, k), -1, np.int32)
        ranked = np.full((rows, depth), -1, np.int32)
        stable = np.zeros(rows, np.int32)
        for r in range(rows):
            if rng.random() < 0.06:
                reqs[r] = rng.integers(-1, 6)
                lens[r] = rng.integers(1, universe // 2)
            if reqs[r] == -1:
                continue
            lens[r] = min(lens[r] + 1, universe)
            stable[r] = huge + max(0, lens[r] - rng.integers(0, 3))  # up to 2 speculative positions
            n = min(k, int(lens[r])) if rng.random() > 0.1 else int(rng.integers(0, min(k, lens[r]) + 1))
            # half near the end, half spread: ranking = a noisy score order
            score = rng.random(lens[r]) + np.exp(-(lens[r] - np.arange(lens[r])) / 30.0)
            order = np.argsort(-score, kind="stable")
            pos = order[:n]
            topk[r, :n] = rng.permutation(pos) + huge
            tail = order[n:depth] if n == min(k, lens[r]) else order[:0]
            ranked[r, :n] = pos + huge
            ranked[r, n : n + len(tail)] = tail + huge
        out.append((topk, reqs.astype(np.int64).copy(), stable, ranked))
    return out


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
@pytest.mark.parametrize("huge", [0, (1 << 30)])
def test_kernel_equals_torch_randomized(policy, huge):
    rng = np.random.default_rng(17 + (huge > 0))
    rows, k, hot, depth = 5, 24, 56, 112
    steps = _random_steps(rng, rows, k, depth, 24 if huge else 40, 300, huge)
    guard = dict(slack_shift=2, seed=1) if policy == "score_rank_guarded" else {}
    ref, ker = _pair(policy, rows, hot, **guard)
    _drive(ref, ker, steps)
    # the rows form over the same kind of traffic, random subsets
    ref, ker = _pair(policy, rows + 1, hot, **guard)
    subsets = [list(rng.permutation(rows + 1)[: rng.integers(1, rows + 2)]) for _ in steps]
    pad = [
        (
            np.vstack([t, np.full((1, k), -1, np.int32)]),
            np.append(q, -1),
            np.append(s, 0),
            np.vstack([r, np.full((1, depth), -1, np.int32)]),
        )
        for t, q, s, r in steps
    ]
    _drive(ref, ker, pad, subsets)


def test_guarded_kernel_equals_torch_where_the_allowance_binds():
    """Small buffers, small contexts and guard seeds 0..3: the allowance is reached often,
    so which protected slot is the last one allowed decides victims (catches an
    off-by-one in the guard that the larger scenarios miss)."""
    for trial in range(5):
        rng = np.random.default_rng(trial)
        k = int(rng.integers(2, 8))
        hot, depth = k + int(rng.integers(0, 6)), k + int(rng.integers(0, 12))
        steps = _random_steps(rng, 3, k, depth, 24, int(rng.integers(2 * k + 4, 60)))
        ref, ker = _pair("score_rank_guarded", 3, hot, seed=int(rng.integers(0, 4)))
        _drive(ref, ker, steps)


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
def test_replay_misses_equal_torch_on_a_latent_trace(policy):
    """The replay path (``simulate_policy``) with ``manage_impl`` kernel vs torch."""
    trace = synthesize(
        SyntheticTraceSpec(
            steps=30,
            layers=1,
            rows=4,
            top_k=32,
            rank_depth=128,
            seed=3,
            min_prompt=200,
            max_prompt=600,
            min_decode=10,
            max_decode=40,
        )
    )
    a = simulate_policy(trace, policy, 64, manage_impl="torch")
    b = simulate_policy(trace, policy, 64, manage_impl="kernel")
    assert a.misses == b.misses and a.misses > 0


# ------------------------------------------------------------------ selection and errors
def test_auto_picks_the_kernel_on_cpu_reference_only():
    from sglang_ascend_offload.ops import registry

    ref_op = registry.select("residency_manage", "reference")
    for policy in KERNEL_POLICIES:
        assert uses_cpu_kernel(policy, "auto", "cpu", ref_op)
        assert not uses_cpu_kernel(policy, "torch", "cpu", ref_op)
        assert make_manager(policy, 2, 8, "cpu", ref_op, manage_impl="auto").impl == "kernel"
    assert not uses_cpu_kernel("score_rank_smooth", "auto", "cpu", ref_op)
    with pytest.raises(ValueError, match="score_rank_smooth"):
        make_manager("score_rank_smooth", 2, 8, manage_impl="kernel")


def test_missing_library_is_a_clear_error_never_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_ASCEND_OFFLOAD_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(score_kernel, "_LIB", None)
    for policy in KERNEL_POLICIES:
        with pytest.raises(score_kernel.ScoreKernelUnavailable, match="setup_cpu_env.sh"):
            make_manager(policy, 2, 8, manage_impl="kernel")
        with pytest.raises(score_kernel.ScoreKernelUnavailable, match="setup_cpu_env.sh"):
            make_manager(policy, 2, 8, manage_impl="auto")
    assert not list(tmp_path.iterdir())  # nothing was built behind the caller's back


def test_kernel_needs_the_ranking_and_checks_its_inputs():
    from sglang_ascend_offload.sparse_decode.policies import RankedInputError

    ker = make_manager("score_rank", 2, 4, manage_impl="kernel")
    args = (torch.zeros((2, 2), dtype=torch.int32), torch.tensor([1, 2]), torch.tensor([5, 5], dtype=torch.int32))
    with pytest.raises(RankedInputError, match="record_trace_rank_depth"):
        ker.step(*args, 0)
    ker.set_ranked(torch.zeros((2, 2), dtype=torch.int32))
    with pytest.raises(ValueError, match="out of range"):
        ker.step(*args, -1)
    with pytest.raises(IndexError, match="state rows"):
        ker.step_rows(torch.tensor([0, 7]), *args, 0)


def test_profile_shape_reports_the_score_kernels(capsys):
    """``bench decode --profile-shape`` (tiny shape): with a score policy the engine's
    manager is the kernel and equals the torch reference; the score kernel keys exist,
    and are null for a trace without a ranking."""
    import argparse
    import json

    from sglang_ascend_offload.bench import decode

    def main(argv):
        parser = argparse.ArgumentParser()
        decode.add_arguments(parser)
        return decode.main(parser.parse_args(argv))

    base = [
        "--profile-shape",
        "--rows",
        "3",
        "--top-k",
        "16",
        "--layers",
        "2",
        "--heads",
        "2",
        "--profile-context",
        "300",
        "--profile-steps",
        "4",
        "--profile-compile",
        "off",
        "--json",
    ]
    assert main(base + ["--policy", "score_rank_guarded"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["manage_impl"] == "kernel" and r["misses_equal_contract"] is True
    keys = ("score_rank_manage_ms_per_layer", "score_rank_guarded_manage_ms_per_layer")
    assert all(r[key] > 0 for key in keys)
    none = decode._profile_score_kernels(lambda *a: None, None, None, 1, 1, 1, 1)  # a trace without ranking
    assert all(none[key] is None for key in keys)
