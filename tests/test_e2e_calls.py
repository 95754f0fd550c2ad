"""The per-call log the e2e cost model reads (``bench/e2e_calls.py``), on 2 real MPI ranks.

The model charges every call a wait for peers that grows with the CPU work
before it (``cost_model.Network.call_wait``). Every ``Method.allreduce``
starts with a 1-byte agreement that the benchmark times apart (its *wait*
column), so the work before the agreement -- the forward and backward pass --
must not be logged as the gap of the bucket's first call.
"""
import time

import pytest

from horovod_compress.tools.testing import run_cases

#: CPU seconds the forward pass burns on top of the tiny model's own. A gap that wrongly held the
#: pass would be at least this long (CPU time never exceeds wall time); a right one holds only the
#: method's own few milliseconds. The bounds below sit at half of it: wide margins both ways on a
#: shared, oversubscribed machine.
BURN_S = 0.3


def _burn(seconds: float) -> None:
    c0 = time.thread_time()
    while time.thread_time() - c0 < seconds:
        sum(range(1000))


def case_gap_of_a_bucket_starts_at_its_agreement(comm):
    """Dense (one allreduce right after the agreement) and PowerSGD (its first call after its
    own work): the first gap holds only the method's work, not the pass's 300 ms before it."""
    from horovod_compress.tools.bench import e2e_calls, e2e_models
    build = e2e_models.build_model

    def slow_model(name):
        model = build(name)
        plain_loss = model.loss

        def loss(x, y):
            _burn(BURN_S)
            return plain_loss(x, y)
        model.loss = loss
        return model
    e2e_models.build_model = slow_model
    try:
        calls = e2e_calls.call_sizes(["none", "powersgd", "greedylore"], "tiny", comm, steps=2)
    finally:
        e2e_models.build_model = build
    dense_gaps = calls["none"]["allreduce" + e2e_calls.GAP_SUFFIX]
    assert len(dense_gaps) == 1 and dense_gaps[0] < 0.5 * BURN_S, dense_gaps
    psgd_gaps = calls["powersgd"]["allreduce" + e2e_calls.GAP_SUFFIX]
    assert len(psgd_gaps) == len(calls["powersgd"]["allreduce"]) >= 2
    assert max(psgd_gaps) < 0.5 * BURN_S, psgd_gaps
    # the links rest from call to call, through the agreements: the rest is never below the gap
    for label in ("none", "powersgd"):
        gaps, rests = (calls[label]["allreduce" + k] for k in (e2e_calls.GAP_SUFFIX, e2e_calls.REST_SUFFIX))
        assert len(rests) == len(gaps) and all(g <= r + 1e-9 for g, r in zip(gaps, rests)), (label, gaps, rests)
    # a matrix method's group goes out fused (runtime/per_tensor.py): the log holds the calls on
    # the wire -- PowerSGD's Ps (with the dense tensors) and Qs, GreedyLore's scores and projections
    # -- each at the whole round's size, not one entry per tensor
    from horovod_compress.tools.bench.e2e_models import build_model
    tensors = sum(1 for _ in build_model("tiny").parameters())
    assert tensors > 2 and len(calls["powersgd"]["allreduce"]) == 2, calls["powersgd"]["allreduce"]
    assert len(calls["greedylore"]["allreduce"]) <= 3, calls["greedylore"]["allreduce"]
    assert "in_mpi" not in vars(comm) and "_account_as" not in vars(comm)   # put back as it was
    return dense_gaps[0]


@pytest.mark.mpi
def test_gap_of_a_bucket_starts_at_its_agreement():
    results = run_cases(2, __file__, timeout=300)
    assert set(results[case_gap_of_a_bucket_starts_at_its_agreement]) == {0, 1}
