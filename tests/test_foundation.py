"""Foundation on real MPI ranks (mpirun -np 2 and -np 4): Communicator, first methods, optimizer."""
import pytest
from conftest import CASES

from horovod_compress.testing import run_cases

FILE = CASES / "foundation_cases.py"
ALL = ["case_communicator_bytes", "case_none_bit_exact", "case_methods_vs_dense_reference",
       "case_residual_feedback_keeps_everything", "case_optimizer_identical_params",
       "case_optimizer_none_matches_plain_allreduce", "case_unused_parameter_and_accumulation",
       "case_state_dict_roundtrip", "case_mismatch_raises_everywhere", "case_overlap_bucketed"]


@pytest.fixture(scope="module", params=[2, 4], ids=["np2", "np4"])
def results(request):
    return request.param, run_cases(request.param, FILE, ALL)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ALL)
def test_case(results, case):
    nprocs, res = results
    assert set(res[case]) == set(range(nprocs))  # every rank finished the case


@pytest.mark.mpi
def test_topk_bytes_formula(results):
    nprocs, res = results
    for rank_value in res["case_methods_vs_dense_reference"].values():
        k = 40  # density 0.02 of 2000
        assert rank_value["topk_bytes"] == 2 * k * 4 * (nprocs - 1)
