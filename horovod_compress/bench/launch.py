"""Re-launch a command under ``mpirun`` when it was started as a single process."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_SIZE",
            "SLURM_STEP_NUM_TASKS", "HVDC_LAUNCHED")


def under_mpi_launcher() -> bool:
    """True when this process was started by mpirun/srun/horovodrun (or by us)."""
    return any(k in os.environ for k in _MPI_ENV)


def relaunch(nprocs: int, module: str, argv: Sequence[str]) -> int:
    """Run ``python -m module argv`` on ``nprocs`` ranks; return mpirun's exit code."""
    from ..testing import mpi_env, mpirun_command
    cmd = mpirun_command(nprocs) + [sys.executable, "-m", module, *argv]
    env = mpi_env({"HVDC_LAUNCHED": "1"})
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)
