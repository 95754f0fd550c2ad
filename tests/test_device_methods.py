"""GPU arrays end to end through the Communicator and every method, on real MPI ranks.

Runs under Numba's CUDA simulator (tests/cases/device_methods_cases.py), so
device arrays exist without a GPU. CuPy on a real device is covered by
tests/test_gpu_methods_cupy.py (skipped without one).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from horovod_compress import Compression
from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "device_methods_cases.py"
SIM = {"NUMBA_ENABLE_CUDASIM": "1"}


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_communicator_takes_device_arrays(nprocs: int) -> None:
    results = run_cases(nprocs, CASES, ["case_communicator_takes_device_arrays"], env=SIM)
    for rank in range(nprocs):
        r = results["case_communicator_takes_device_arrays"][rank]
        # six collectives each way (alltoallv always staged); counters accumulate over both modes
        assert r["aware=False"] == {"staged": 6, "direct": 0}
        assert r["aware=True"] == {"staged": 7, "direct": 5}


@pytest.mark.mpi
def test_every_method_accepts_device_arrays() -> None:
    results = run_cases(2, CASES, ["case_every_method_on_device_arrays"], env=SIM, timeout=600)
    report = results["case_every_method_on_device_arrays"][0]
    assert sorted(report) == sorted(Compression.available())
    assert set(report.values()) == {3}


def test_gpu_native_methods_declared() -> None:
    """The methods whose ``_reduce`` runs on CuPy arrays (docs/kernels.md lists the same)."""
    from horovod_compress.compressors.registry import method_class
    native = sorted(n for n in Compression.available() if method_class(n).gpu_native)
    assert native == ["arc_topk", "global_qsgd", "none", "oktopk", "qsgd", "randk", "randk_rows",
                      "topk", "topk_rows"]
