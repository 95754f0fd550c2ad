"""The launcher differences between Open MPI and MPICH, and a real job on each.

``horovod_compress.tools.mpi_launcher`` is the one place that knows them: the
launcher and its flags (oversubscription, root), the environment (Open MPI's
MCA settings; for MPICH, the library mpi4py must load), selected by
``HVDC_MPI``. The unit tests pin each difference; the cases run on real ranks
under each implementation (``run_cases`` with ``HVDC_MPI`` set) and report the
library the ranks actually loaded, its error handler and a collective.
"""
import os
import shutil

import numpy as np
import pytest

from horovod_compress.tools import mpi_launcher
from horovod_compress.tools.mpi_launcher import MPICH, OPENMPI, selected
from horovod_compress.tools.testing import mpi_env, mpirun_command, run_cases

HAVE = {"openmpi": shutil.which("mpirun") is not None,
        "mpich": shutil.which("mpiexec.mpich") is not None
        and (mpi_launcher.abi_directory() / "libmpi.so.12").exists()}


# ------------------------------------------------------------------------- unit
def test_selection_by_environment_variable():
    assert selected({}) is OPENMPI
    assert selected({"HVDC_MPI": "MPICH"}) is MPICH
    assert selected({"HVDC_MPI": " openmpi "}) is OPENMPI
    with pytest.raises(ValueError, match="HVDC_MPI='intel'.*mpich.*openmpi"):
        selected({"HVDC_MPI": "intel"})


@pytest.mark.skipif(not HAVE["openmpi"], reason="Open MPI is not installed")
def test_openmpi_command_and_environment():
    cmd = OPENMPI.command(4)
    assert os.path.basename(cmd[0]).startswith("mpirun") and cmd[1:4] == ["-np", "4", "--oversubscribe"]
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    env = OPENMPI.environ({"OMPI_MCA_mpi_yield_when_idle": "0"})
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "0"          # the caller's value wins
    assert env["OMPI_MCA_rmaps_base_oversubscribe"] == "1"
    assert "MPI4PY_LIBMPI" not in env and "LD_LIBRARY_PATH" not in env


@pytest.mark.skipif(not HAVE["mpich"], reason="MPICH is not installed (scripts/setup.sh)")
def test_mpich_command_and_environment():
    cmd = MPICH.command(2)
    assert os.path.basename(cmd[0]).startswith("mpiexec") and cmd[1:] == ["-np", "2"]
    env = MPICH.environ({"LD_LIBRARY_PATH": "/opt/x"})
    assert env["MPI4PY_LIBMPI"] == "libmpich.so.12" and env["MPI4PY_MPIABI"] == "mpich"
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [str(mpi_launcher.abi_directory()), "/opt/x"]
    assert not any(k.startswith("OMPI_MCA") for k in env)


def test_bad_process_count_and_missing_launcher(monkeypatch):
    with pytest.raises(ValueError, match="nprocs must be at least 1"):
        OPENMPI.command(0)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="mpiexec.mpich / mpiexec.hydra not found: run scripts/setup.sh"):
        MPICH.command(2)


def test_harness_follows_the_selection(monkeypatch):
    monkeypatch.setenv("HVDC_MPI", "openmpi")
    if HAVE["openmpi"]:
        assert mpirun_command(2) == OPENMPI.command(2)
    assert mpi_env()["OMPI_MCA_mpi_yield_when_idle"] == "1"
    if HAVE["mpich"]:
        monkeypatch.setenv("HVDC_MPI", "mpich")
        assert mpirun_command(2) == MPICH.command(2)
        env = mpi_env({"X": "1"})
        assert env["MPI4PY_LIBMPI"] == "libmpich.so.12" and env["X"] == "1"
        assert "OMPI_MCA_mpi_yield_when_idle" not in env


# ------------------------------------------------------------------ real ranks
def case_library_and_errors(comm):
    """The MPI library the ranks loaded, errors raised as Python exceptions, a collective."""
    from mpi4py import MPI
    raw = comm.comm
    got = comm.allreduce(np.array([comm.rank + 1.0]), "sum")
    assert got[0] == comm.size * (comm.size + 1) / 2
    try:
        raw.Send(np.zeros(1), dest=comm.size + 5)     # an invalid rank: an error, not an abort
    except MPI.Exception as exc:
        error_class = exc.Get_error_class()
    else:
        raise AssertionError("sending to an invalid rank did not raise")
    return {"library": MPI.Get_library_version().splitlines()[0], "size": comm.size,
            "error_class": int(error_class), "rank_error": int(MPI.ERR_RANK)}


@pytest.mark.mpi
@pytest.mark.parametrize("impl", ["openmpi", "mpich"])
@pytest.mark.parametrize("nprocs", [2, 4])
def test_real_ranks_on_each_implementation(impl, nprocs, monkeypatch):
    if not HAVE[impl]:
        pytest.skip(f"{impl} is not installed (scripts/setup.sh)")
    monkeypatch.setenv("HVDC_MPI", impl)
    res = run_cases(nprocs, __file__, [case_library_and_errors], timeout=120)
    per_rank = res[case_library_and_errors]
    assert sorted(per_rank) == list(range(nprocs))
    want = "Open MPI" if impl == "openmpi" else "MPICH"
    for r, got in per_rank.items():
        assert want in got["library"], (r, got)
        assert got["size"] == nprocs and got["error_class"] == got["rank_error"], (r, got)
