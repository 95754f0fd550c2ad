"""Issue 19 under ``torchrun`` (gloo, no MPI): a failing rank ends the job; mismatches and NaN/Inf in DDP hooks.

tests/cases/reliability_torchrun.py runs on real ``torchrun`` ranks with
mpi4py blocked. ``abort_main`` / ``abort_thread``: the last rank raises (in
its main thread, or in a thread its main thread waits on) while the others
wait in our DDP hook's collective; our exception hooks, installed by the
first compressed allreduce, must end the job promptly and name the rank.
``abort_plain`` is the control without any of our code: torchrun's agent
alone ends a job whose rank raised in its main thread. ``checks``: every
mismatch and NaN/Inf case of the DDP hook, each reported by name.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CASES

from horovod_compress.testing import torchrun_command, torchrun_env

SCRIPT = CASES / "reliability_torchrun.py"
ROOT = Path(__file__).resolve().parents[1]


def _torchrun(nprocs: int, *args: str, timeout: float, extra_env=None):
    start = time.monotonic()
    proc = subprocess.run(torchrun_command(nprocs, SCRIPT, *args), capture_output=True, text=True,
                          timeout=timeout, env=torchrun_env(extra_env), cwd=ROOT)
    return proc, time.monotonic() - start


@pytest.mark.mpi
@pytest.mark.parametrize("mode,error", [("abort_main", "RuntimeError"),
                                        ("abort_thread", "ZeroDivisionError")])
def test_exception_on_one_rank_ends_the_torchrun_job(mode, error):
    """The last rank raises while the other waits in the hook's collective: ends promptly, non-zero, naming it."""
    proc, seconds = _torchrun(2, mode, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"[hvdc] rank 1 of 2: uncaught {error}" in out, out[-6000:]
    assert "torchrun stops every other rank" in out
    assert "unreachable" not in out, out[-6000:]
    assert seconds < 60, (seconds, out[-6000:])


@pytest.mark.mpi
def test_thread_exception_hangs_without_our_hook():
    """Control: with ``HVDC_ABORT_ON_EXCEPTION=0`` a thread's exception does not end its rank, so the job
    waits (here bounded by the script's own 10 s wait); with the hook it ends at once (test above)."""
    proc, seconds = _torchrun(2, "abort_thread", timeout=120,
                              extra_env={"HVDC_ABORT_ON_EXCEPTION": "0", "HVDC_THREAD_WAIT_S": "10"})
    out = proc.stdout + proc.stderr
    assert "[hvdc] rank" not in out, out[-6000:]
    assert seconds >= 10, (seconds, out[-6000:])


@pytest.mark.mpi
def test_plain_torch_distributed_failure_ends_by_torchrun():
    """Control without our code: a main-thread exception is ended by torchrun's agent (nothing of ours printed)."""
    proc, seconds = _torchrun(2, "abort_plain", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "[hvdc]" not in out and "unreachable" not in out, out[-6000:]
    assert seconds < 60


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability-torchrun")
    proc, _ = _torchrun(2, "checks", str(out), timeout=900,
                        extra_env={"HVDC_ABORT_ON_EXCEPTION": "0"})
    if proc.returncode != 0:
        raise AssertionError(f"torchrun checks failed (exit {proc.returncode})\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"checks_rank{r}.json").read_text()) for r in range(2)]


def _labels() -> list[str]:
    import importlib.util
    spec = importlib.util.spec_from_file_location("reliability_torchrun", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_labels()


@pytest.mark.mpi
@pytest.mark.parametrize("label", _labels())
def test_ddp_hook_check(checks, label):
    """Each mismatch is refused on every rank with the same words; each NaN/Inf policy recovers or raises."""
    for rank, res in enumerate(checks):
        assert res.get(label) == "ok", f"rank {rank}, {label}:\n{res.get(label)}"
