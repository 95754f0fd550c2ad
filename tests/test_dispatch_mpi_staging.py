"""GPU arrays through MPI: staged through host memory, or direct with CUDA-aware MPI.

The per-rank cases (tests/cases/cuda_aware_cases.py) run under Numba's CUDA
simulator so device arrays exist without a GPU; the direct route then hands
the simulator's arrays (host memory) straight to mpi4py, which exercises the
CUDA-aware code path on a CPU-only MPI. Both routes must give the dense
references and count exactly the bytes the NumPy route counts.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "cuda_aware_cases.py"
ROUTES = ["case_numpy_route", "case_staged_route", "case_direct_route"]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_device_collectives_match_numpy_route(nprocs: int) -> None:
    results = run_cases(nprocs, CASES, ROUTES, env={"NUMBA_ENABLE_CUDASIM": "1"})
    for rank in range(nprocs):
        numpy_route = results["case_numpy_route"][rank]
        staged = results["case_staged_route"][rank]
        direct = results["case_direct_route"][rank]
        assert numpy_route["staged"] == numpy_route["direct"] == 0
        assert staged["staged"] == 6 and staged["direct"] == 0       # every collective staged
        assert direct["direct"] == 5 and direct["staged"] == 1       # alltoallv is always staged
        for route in (staged, direct):
            assert route["sent"] == numpy_route["sent"]
            assert route["received"] == numpy_route["received"]
            assert route["stats"] == numpy_route["stats"]
    p = nprocs
    n = 37 * 4
    ar = results["case_numpy_route"][0]["stats"]["allreduce"]
    assert ar["calls"] == 2 and ar["sent"] == pytest.approx(2 * 2 * n * (p - 1) / p)


def test_env_override_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    from horovod_compress.mpi_collectives import cuda_aware
    monkeypatch.setenv("HVDC_CUDA_AWARE_MPI", "1")
    assert cuda_aware.cuda_aware_mpi() is True
    monkeypatch.setenv("HVDC_CUDA_AWARE_MPI", "off")
    assert cuda_aware.cuda_aware_mpi() is False
    monkeypatch.setenv("HVDC_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(ValueError, match="HVDC_CUDA_AWARE_MPI"):
        cuda_aware.cuda_aware_mpi()


def test_detection_agrees_with_ompi_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPIX_Query_cuda_support() (run time) against ompi_info's build flag (Open MPI only)."""
    from mpi4py import MPI

    from horovod_compress.mpi_collectives import cuda_aware
    monkeypatch.delenv("HVDC_CUDA_AWARE_MPI", raising=False)
    if "Open MPI" not in MPI.Get_library_version() or shutil.which("ompi_info") is None:
        pytest.skip("not Open MPI")
    info = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True,
                          timeout=60).stdout
    built = any(line.endswith("built_with_cuda_support:value:true") for line in info.splitlines())
    answer = cuda_aware.query_mpix_cuda_support()
    assert answer in (0, 1)
    if not built:  # a library without CUDA support can never be CUDA-aware at run time
        assert answer == 0 and cuda_aware.cuda_aware_mpi(refresh=True) is False
    else:
        assert cuda_aware.cuda_aware_mpi(refresh=True) == bool(answer)


def test_host_arrays_pass_through_untouched() -> None:
    """NumPy input: the Communicator's own result object, nothing staged."""
    import numpy as np

    from horovod_compress.mpi_collectives import Communicator
    from horovod_compress.mpi_collectives.cuda_aware import DeviceCollectives
    dc = DeviceCollectives(Communicator(), cuda_aware=True)
    x = np.arange(5, dtype=np.float32)
    out = dc.allreduce(x, "sum")
    assert isinstance(out, np.ndarray) and np.array_equal(out, x) and dc.direct == dc.staged == 0
