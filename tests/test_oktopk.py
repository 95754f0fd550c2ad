"""Ok-Topk on real MPI ranks (P = 1, 2, 4): exact semantics, reuse rules, volume, degenerate inputs.

The per-rank cases live in tests/cases/oktopk_cases.py; each compares with a
dense reference computed from all ranks' data. Here we launch them (one
mpirun per world size) and check what they return: agreement across ranks
and the measured bytes against the paper's bound 6k(P-1)/P words (Table 1).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from horovod_compress.mpi_collectives.oktopk import radix_bits_for, radix_rounds
from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "oktopk_cases.py"
ALL = ["case_exact_every_step", "case_reused_thresholds", "case_guards_reselect_exactly",
       "case_degenerate", "case_checkpoint_resume", "case_split_and_reduce", "case_balance",
       "case_bisection_and_boundaries", "case_volume", "case_round_trips"]
WORD = 4  # bytes per word (float32 value or int32 index)

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_cases(request.param, CASES, ALL)


def test_single_rank_is_exact_and_does_not_hang():
    res = run_cases(1, CASES, ["case_exact_every_step", "case_degenerate",
                               "case_checkpoint_resume", "case_split_and_reduce"])
    assert res["case_split_and_reduce"][0]["sent"] == 0


def test_exact_thresholds_give_topk_of_sum_of_topk(results):
    p, res = results
    # the case asserted Topk(sum Topk(acc_i)) and the residual on every rank; thresholds agree:
    gths = {r["global_th"] for r in res["case_exact_every_step"].values()}
    assert len(gths) == 1


def test_reused_thresholds_follow_the_reference_rules(results):
    p, res = results
    assert all(r["reused_steps"] == 6 for r in res["case_reused_thresholds"].values())


def test_guards_keep_the_volume_bound_after_a_scale_jump(results):
    p, res = results
    for r in res["case_guards_reselect_exactly"].values():
        bound = 6 * r["k"] * (p - 1) / p * WORD
        assert r["sent"] < bound and r["received"] < bound, (r, bound)


def test_degenerate_inputs(results):
    p, res = results
    b = res["case_degenerate"][0]["boundaries"]
    assert all(x == b for x in (r["boundaries"] for r in res["case_degenerate"].values()))


def test_balancing_triggers_only_on_skew(results):
    p, res = results
    assert res["case_balance"][0]["balanced"] == [True, False, True]


def test_volume_below_6k_and_topka_above(results):
    p, res = results
    bound = 6 * res["case_volume"][0]["k"] * (p - 1) / p * WORD
    topka = 2 * res["case_volume"][0]["k"] * (p - 1) * WORD
    for rank, r in res["case_volume"].items():
        ok = r["oktopk"]
        sent, recv = np.array(ok["sent"]), np.array(ok["received"])
        exact = np.array(ok["exact"])
        # averaged over all sparse steps (exact-threshold steps included): below the bound
        assert sent.mean() < bound and recv.mean() < bound, (rank, sent.mean(), recv.mean(), bound)
        # a step that reuses thresholds selects at most 2k local and 2k global entries (the
        # guards), so it moves below 8k(P-1)/P words
        cap = bound * 8 / 6
        assert sent[~exact].max() < cap and recv[~exact].max() < cap, (rank, cap)
        # TopkA moves exactly 2k(P-1) words per step
        assert set(r["topk"]["sent"]) == {topka} and set(r["topk"]["received"]) == {topka}
    if p >= 4:
        assert topka > bound  # TopkA's 2k(P-1) overtakes Ok-Topk's bound from P = 4 on


COLLECTIVES = ("allreduce", "allgather", "allgatherv", "alltoall", "alltoallv", "broadcast")


def test_collective_calls_per_step(results):
    """Latency: the number of collective calls per step (each a round trip on the network).

    A step that reuses both thresholds makes 2 collective calls (one allgather of
    counts, one allgatherv of the global top-k) plus the split's P-1 point-to-point
    messages each way (no size alltoall); a scheduled exact step the same 2; the
    first step one more (the boundaries' allreduce); a guard step adds the rounds
    of the histogram select (ceil(31 / bits) at most for float32 with 2**bits <= k/4
    buckets: 5 at k = 1000, 3 at k = 40,000; the last round also replaces the
    count exchange) -- against 31 + 1 with bisection.
    """
    p, res = results
    rows = res["case_round_trips"][0]["rows"]
    max_rounds = -(-31 // radix_bits_for(res["case_round_trips"][0]["k"]))
    guards = 0
    for r in rows:
        calls = r["calls"]
        coll = sum(calls.get(op, 0) for op in COLLECTIVES)
        assert "alltoall" not in calls, r
        assert calls.get("p2p", 0) >= 2 * (p - 1), r      # the split: one message each way per peer
        if r["step"] == 1:
            assert coll == 3 and calls["allreduce"] == 1, r
        elif r["guard"]:
            guards += 1
            assert 3 <= coll <= 2 + max_rounds and calls["allgatherv"] == 1, r
        else:
            assert coll == 2 and calls == {"allgather": 1, "allgatherv": 1,
                                           "p2p": calls["p2p"]}, r
    assert guards >= 1, "the jump should have tripped the global guard"
    mean = np.mean([sum(r["calls"].get(op, 0) for op in COLLECTIVES) for r in rows])
    assert mean <= 2.5, mean     # bisection: >= 4 per step and 36 on a guard step
    # every rank made the same collective calls
    for rank, other in res["case_round_trips"].items():
        for a, b in zip(rows, other["rows"]):
            assert {k: v for k, v in a["calls"].items() if k != "p2p"} == \
                   {k: v for k, v in b["calls"].items() if k != "p2p"}, (rank, a, b)


def test_radix_rounds_for_a_2000x2000_gradient():
    """k = 40,000 (1% of 4M): 8192-bucket int32 histograms, 2 rounds over 8 binades of keys."""
    k = 40_000
    assert radix_bits_for(k) == 13
    assert len(radix_rounds(8 * 2**23, radix_bits_for(k))) == 2
    assert len(radix_rounds(2**31, radix_bits_for(k))) == 3     # the whole float32 range
    assert len(radix_rounds(2**31, 1)) == 31                    # = the old bisection
    assert radix_rounds(2**31, 11) == [20, 9, 0]
