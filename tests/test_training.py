"""Convergence on real data: each foundation method within 2 points of dense, 4 ranks."""
import pytest
from conftest import CASES

from horovod_compress.testing import run_cases

METHODS = ["fp16", "bf16", "topk", "randk"]


@pytest.fixture(scope="module")
def runs():
    return run_cases(4, CASES / "training_cases.py", ["case_train_all"], timeout=900)["case_train_all"][0]


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
    assert runs["fp16"]["compression_ratio"] == pytest.approx(2.0)
    assert runs["topk"]["compression_ratio"] > 20
    assert runs["randk"]["compression_ratio"] == pytest.approx(4.0, rel=1e-3)
