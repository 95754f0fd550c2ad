"""Keras 3 front-end on 4 real MPI ranks: model.fit with every method (identical weights,
dense accuracy within 2 points, exact byte counts), callbacks, checkpoints, accumulation,
mixed dtypes; plus the TensorFlow tape cases at 4 ranks."""
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

from conftest import CASES  # noqa: E402

import horovod_compress as hvdc  # noqa: E402
from horovod_compress.testing import run_cases  # noqa: E402

FILE = CASES / "keras_cases.py"
KERAS = ["case_callbacks", "case_warmup_epochs", "case_checkpoint_roundtrip",
         "case_backward_passes_per_step", "case_fit_mixed_dtypes_embedding_unused"]
# the tape cases again at 4 ranks (PyTorch == TensorFlow runs at 2 ranks, test_tensorflow.py)
TF_AT_4 = ["case_tape_none_exact", "case_tape_dtypes_none_indexed_slices",
           "case_stateful_eager_equals_graph", "case_broadcast_variables"]
ALL = KERAS + TF_AT_4 + ["case_fit_every_method"]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, FILE, ALL, timeout=900)


@pytest.mark.mpi
@pytest.mark.parametrize("case", KERAS + TF_AT_4)
def test_case(results, case):
    assert set(results[case]) == set(range(4))  # every rank finished the case


@pytest.mark.mpi
def test_metric_average_and_stats_in_history(results):
    per_rank = results["case_callbacks"]
    assert all(v["loss"] == per_rank[0]["loss"] for v in per_rank.values())  # averaged
    assert per_rank[0]["bad_args"] == 7


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("method", hvdc.Compression.available())
def test_fit_every_method(results, method):
    """Weights, accuracy and bytes are asserted on the ranks; here: the method was covered."""
    report = results["case_fit_every_method"][0]
    assert method in report
    assert report[method]["acc"] >= report[f"dense/{report[method]['sgd']}"] - 0.02

