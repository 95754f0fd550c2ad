"""Shared pytest setup: the ``cupy`` fixture for the tests that need a CUDA device, and the
MPI-case plugin (:mod:`horovod_compress.tools.testing_plugin`): a case that failed on real ranks
fails its module even when no test reads it, and the run ends with a tally of case runs."""
import pytest

from horovod_compress.tools.testing_plugin import every_failed_case_is_read  # noqa: F401
from horovod_compress.tools.testing_plugin import pytest_terminal_summary as case_tally


@pytest.fixture
def cupy():
    """The ``cupy`` module on a usable CUDA device; skips the test cleanly otherwise.

    Skips without CuPy, without a visible device (or a working driver), and
    when this process runs Numba's CUDA simulator (it cannot launch on CuPy memory).
    """
    module = pytest.importorskip("cupy")
    from numba import config
    if config.ENABLE_CUDASIM:
        pytest.skip("Numba's CUDA simulator is on in this process")
    try:
        if module.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # noqa: BLE001 - CUDA driver missing or broken
        pytest.skip(f"no usable CUDA device: {exc}")
    return module


def pytest_report_header(config):
    """Which MPI implementation this run launches (``HVDC_MPI``: openmpi or mpich)."""
    from horovod_compress.tools.mpi_launcher import ENV_VAR, selected
    return f"MPI implementation: {selected().name} (set {ENV_VAR}=openmpi|mpich to choose)"


def pytest_terminal_summary(terminalreporter):
    """The tally of case runs (read, failed, unread) and the number of MPI cases (``run_cases``)
    this run executed on each implementation."""
    from horovod_compress.tools.mpi_launcher import CASES_RUN
    case_tally(terminalreporter)
    for name, count in sorted(CASES_RUN.items()):
        terminalreporter.write_line(f"MPI cases run on {name}: {count}")
