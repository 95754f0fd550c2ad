"""TensorFlow front-end on real MPI ranks (mpirun -np 2; the 4-rank run is in test_keras.py):
the tape (eager and tf.function) against MPI references, dtypes / None / IndexedSlices,
broadcast, Horovod's own tape with our compressors, and PyTorch == TensorFlow for every method."""
import pytest

pytest.importorskip("tensorflow")

from conftest import CASES  # noqa: E402

import horovod_compress as hvdc  # noqa: E402
from horovod_compress.testing import run_cases  # noqa: E402

FILE = CASES / "tf_cases.py"
ALL = ["case_tape_none_exact", "case_tape_dtypes_none_indexed_slices",
       "case_stateful_eager_equals_graph", "case_broadcast_variables", "case_allreduce_and_errors",
       "case_horovod_tape", "case_cross_framework"]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, FILE, ALL, timeout=600)


@pytest.mark.mpi
@pytest.mark.parametrize("case", [c for c in ALL if c not in ("case_horovod_tape", "case_cross_framework")])
def test_case(results, case):
    assert set(results[case]) == {0, 1}  # every rank finished the case


@pytest.mark.mpi
def test_argument_errors_name_the_argument(results):
    messages = results["case_allreduce_and_errors"][0]
    for word in ("compression", "op", "gradient_predivide_factor", "gradtape",
                 "int32", "jit_compile=False"):
        assert any(word in m for m in messages), (word, messages)


@pytest.mark.mpi
@pytest.mark.horovod
def test_horovod_tape_accepts_our_compressors(results):
    per_rank = results["case_horovod_tape"]
    if "skipped" in per_rank[0]:
        pytest.skip(per_rank[0]["skipped"])
    assert {"fp16/eager", "fp16/graph", "bf16/eager", "bf16/graph", "randk/eager",
            "randk/graph"} <= set(per_rank[0]["checked"])
    assert per_rank[0] == per_rank[1]


@pytest.mark.mpi
@pytest.mark.parametrize("method", hvdc.Compression.available())
def test_cross_framework_identical(results, method):
    """Checked bit for bit on the ranks; here: every registered method was covered."""
    for rank in (0, 1):
        assert method in results["case_cross_framework"][rank]
