"""Convergence on real data: each foundation method within 2 points of dense, 4 ranks.

One mpirun launch of ``case_train_all`` trains the digits MLP (scikit-learn's
digits, through ``horovod_compress.tools.bench.digits.train_digits``) densely and
with fp16, bf16, Top-k (density 1 %) and unbiased Rand-K (density 25 %).
"""
import pytest

import horovod_compress as hvdc
from horovod_compress.tools.bench.digits import train_digits
from horovod_compress.tools.testing import run_cases

EPOCHS = 40
# The settings the suite checks; each within 2 points of dense test accuracy.
TRAINED = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {"density": 0.01},
    "randk": {"density": 0.25, "unbiased": True},
}


def case_train_all(comm):
    """Dense and each foundation method train the digits MLP with the same seed; every rank
    ends with the same parameters."""
    out = {}
    for name, params in TRAINED.items():
        r = train_digits(hvdc.Compression.by_name(name, **params), comm, epochs=EPOCHS, seed=0)
        digests = comm.allgather_object(r["params_digest"])
        assert len(set(digests)) == 1, f"{name}: ranks ended with different parameters"
        out[name] = {k: r[k] for k in ("test_accuracy", "bytes_sent_per_step",
                                       "dense_bytes_per_step", "compression_ratio")}
    return out


METHODS = ["fp16", "bf16", "topk", "randk"]


@pytest.fixture(scope="module")
def runs():
    return run_cases(4, __file__, [case_train_all], timeout=900)[case_train_all][0]


@pytest.mark.mpi
@pytest.mark.slow
def test_dense_reaches_high_accuracy(runs):
    assert runs["none"]["test_accuracy"] > 0.95


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_method_within_two_points_of_dense(runs, method):
    dense = runs["none"]["test_accuracy"]
    assert runs[method]["test_accuracy"] >= dense - 0.02, (method, runs[method], dense)


@pytest.mark.mpi
@pytest.mark.slow
def test_compressed_methods_send_less(runs):
    # each rank counts its own whole chunks of the ring (the same partition for both), so
    # fp16 sends exactly half of dense's bytes, and the ratio against the formula 2N(P-1)/P
    # is 2 within that rounding (a few elements in 2N(P-1)/P)
    assert runs["fp16"]["bytes_sent_per_step"] * 2 == runs["none"]["bytes_sent_per_step"]
    assert runs["fp16"]["compression_ratio"] == pytest.approx(2.0, rel=1e-4)
    assert runs["topk"]["compression_ratio"] > 20
    assert runs["randk"]["compression_ratio"] == pytest.approx(4.0, rel=1e-3)
