"""Issue 19 on real ranks: no hang from a failing rank, mismatches and NaN/Inf through the core."""
import subprocess
import sys
import time

import pytest
from conftest import CASES

from horovod_compress.testing import mpi_env, mpirun_command, run_cases

FILE = CASES / "reliability_cases.py"
CORE = ["case_mismatches_every_method", "case_nonfinite_policies_every_method",
        "case_nonfinite_raise_every_method", "case_torch_checkpoint_weights_only_every_method",
        "case_torch_skip_step", "case_keras_state_encoding_every_method"]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def results(request):
    return request.param, run_cases(request.param, FILE, CORE, timeout=600)


@pytest.mark.mpi
@pytest.mark.parametrize("case", CORE)
def test_core_case(results, case):
    nprocs, res = results
    assert set(res[case]) == set(range(nprocs))


def _abort_run(mode, extra_env=None, timeout=60):
    cmd = mpirun_command(2) + [sys.executable, str(CASES / "abort_script.py"), mode]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(extra_env))
    return proc, time.monotonic() - start


@pytest.mark.mpi
@pytest.mark.parametrize("mode,error", [("main", "RuntimeError"), ("thread", "ZeroDivisionError")])
def test_exception_on_one_rank_ends_the_job(mode, error):
    """Rank 1 raises while rank 0 waits in an allreduce: the job ends promptly, non-zero, naming rank 1."""
    proc, seconds = _abort_run(mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"[hvdc] rank 1 of 2: uncaught {error}" in out, out
    assert "unreachable" not in out
    assert seconds < 60


@pytest.mark.mpi
@pytest.mark.parametrize("mode,env", [("disabled", {"HVDC_ABORT_ON_EXCEPTION": "0"}),
                                      ("init_false", None)])
def test_abort_hook_can_be_turned_off(mode, env):
    proc, _ = _abort_run(mode, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("installed=False") == 2


@pytest.mark.mpi
def test_abort_hook_installed_by_default():
    proc, _ = _abort_run("disabled", {"HVDC_ABORT_ON_EXCEPTION": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("installed=True") == 2


@pytest.mark.mpi
def test_exception_under_horovodrun():
    """The same under Horovod's launcher (it starts mpirun)."""
    import os
    import shutil
    exe = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        pytest.skip("horovodrun not installed")
    env = mpi_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    start = time.monotonic()
    proc = subprocess.run([exe, "-np", "2", "--mpi-args=--oversubscribe", sys.executable,
                           str(CASES / "abort_script.py"), "main"],
                          capture_output=True, text=True, timeout=90, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "[hvdc] rank 1 of 2: uncaught RuntimeError" in out, out
    assert time.monotonic() - start < 90
