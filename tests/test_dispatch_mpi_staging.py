"""GPU arrays through MPI: staged through host memory, or direct with CUDA-aware MPI.

The per-rank cases (``case_*``, one per route) run under Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``) so device arrays exist without a GPU;
the direct route then hands the simulator's arrays (host memory) straight to
mpi4py, which exercises the CUDA-aware code path on a CPU-only MPI. Each case
runs every collective on "GPU" arrays through its route (staged through host
memory, or direct to mpi4py as with CUDA-aware MPI), checks the results
against references computed from all ranks' data (every rank can regenerate
every other rank's data from its seed) and that results stay device arrays,
and returns the byte counters. Both routes must give the dense references
and count exactly the bytes the NumPy route counts.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from horovod_compress.tools.testing import run_cases


# ------------------------------------------------------------------------ cases
def _data(rank: int, n: int = 37) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(n).astype(np.float32)


def _run(comm, route: str) -> dict:
    from numba import cuda

    from horovod_compress.kernels.dispatch import is_gpu_array
    from horovod_compress.mpi_collectives.cuda_aware import DeviceCollectives

    p, rank = comm.size, comm.rank
    everyone = [_data(j) for j in range(p)]
    if route == "numpy":
        dc = DeviceCollectives(comm, cuda_aware=False)
        wrap, unwrap = (lambda a: a), (lambda a: a)
    else:
        dc = DeviceCollectives(comm, cuda_aware=(route == "direct"))
        wrap, unwrap = cuda.to_device, (lambda a: a.copy_to_host())
    comm.reset_stats()
    out = {}

    s = dc.allreduce(wrap(everyone[rank]), "sum")
    assert route == "numpy" or is_gpu_array(s)
    ref = everyone[0].copy()
    for j in range(1, p):
        ref += everyone[j]
    np.testing.assert_allclose(unwrap(s), ref, rtol=1e-6, atol=1e-6)
    a = dc.allreduce(wrap(everyone[rank]), "avg")
    np.testing.assert_allclose(unwrap(a), ref / np.float32(p), rtol=1e-6, atol=1e-6)

    g = dc.allgather(wrap(everyone[rank]))
    assert tuple(g.shape) == (p, 37)
    np.testing.assert_array_equal(unwrap(g), np.stack(everyone))

    mine = everyone[rank][: rank + 3]
    v, counts = dc.allgatherv(wrap(mine))
    np.testing.assert_array_equal(counts, [j + 3 for j in range(p)])
    np.testing.assert_array_equal(unwrap(v), np.concatenate([everyone[j][: j + 3] for j in range(p)]))

    b = dc.broadcast(wrap(everyone[rank].copy()), root=p - 1)
    np.testing.assert_array_equal(unwrap(b), everyone[p - 1])

    chunks = [wrap(np.full(j + 1, rank, np.float32)) for j in range(p)]
    got = dc.alltoallv(chunks)
    for j in range(p):
        np.testing.assert_array_equal(unwrap(got[j]), np.full(rank + 1, j, np.float32))

    if route != "numpy":  # a host chunk among device chunks: refused before any communication
        try:
            dc.alltoallv([wrap(np.zeros(1, np.float32))] + [np.zeros(1, np.float32)] * (p - 1))
        except ValueError as e:
            assert "mix" in str(e)
        else:
            raise AssertionError("mixing NumPy and GPU arrays must raise")

    out["stats"] = comm.stats()["by_op"]
    out["sent"] = comm.bytes_sent
    out["received"] = comm.bytes_received
    out["staged"] = dc.staged
    out["direct"] = dc.direct
    return out


def case_numpy_route(comm):
    return _run(comm, "numpy")


def case_staged_route(comm):
    return _run(comm, "staged")


def case_direct_route(comm):
    return _run(comm, "direct")


# ------------------------------------------------------------------------ tests

@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_device_collectives_match_numpy_route(nprocs: int) -> None:
    results = run_cases(nprocs, __file__, env={"NUMBA_ENABLE_CUDASIM": "1"})
    for rank in range(nprocs):
        numpy_route = results[case_numpy_route][rank]
        staged = results[case_staged_route][rank]
        direct = results[case_direct_route][rank]
        assert numpy_route["staged"] == numpy_route["direct"] == 0
        assert staged["staged"] == 6 and staged["direct"] == 0       # every collective staged
        assert direct["direct"] == 5 and direct["staged"] == 1       # alltoallv is always staged
        for route in (staged, direct):
            assert route["sent"] == numpy_route["sent"]
            assert route["received"] == numpy_route["received"]
            assert route["stats"] == numpy_route["stats"]
    p = nprocs
    n = 37 * 4
    ars = [results[case_numpy_route][r]["stats"]["allreduce"] for r in range(p)]
    assert all(ar["calls"] == 2 for ar in ars)
    assert sum(ar["sent"] for ar in ars) == pytest.approx(2 * 2 * n * (p - 1))   # mean: 2N(P-1)/P


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
    from horovod_compress.mpi_collectives import Communicator
    from horovod_compress.mpi_collectives.cuda_aware import DeviceCollectives
    dc = DeviceCollectives(Communicator(), cuda_aware=True)
    x = np.arange(5, dtype=np.float32)
    out = dc.allreduce(x, "sum")
    assert isinstance(out, np.ndarray) and np.array_equal(out, x) and dc.direct == dc.staged == 0
