"""Re-launch a command under ``mpirun`` when it was started as a single process."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

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


def worker_entry(description: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                 worker: Callable[[argparse.Namespace], None],
                 run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> None:
    """``python -m`` entry of a benchmark that re-launches itself under mpirun.

    Parses the benchmark's own arguments plus the hidden ``--worker``/``--json``
    pair: with ``--worker`` this process is one MPI rank and runs ``worker``;
    otherwise it is the launcher and runs ``run`` (which starts the ranks).
    """
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        sys.exit(run(args))


def worker_bench(name: str, help: str, description: str | None,
                 add_arguments: Callable[[argparse.ArgumentParser], None],
                 worker: Callable[[argparse.Namespace], None],
                 run: Callable[[argparse.Namespace], int],
                 ) -> tuple[Callable[[argparse._SubParsersAction], None],
                            Callable[[list[str] | None], None]]:
    """``(register_bench, main)`` of a benchmark that re-launches itself under mpirun.

    ``register_bench(subparsers)`` adds ``hvdc bench <name>`` (its options from
    ``add_arguments``, then ``run``); ``main(argv)`` is the ``python -m`` entry
    (:func:`worker_entry`).
    """
    def register_bench(subparsers: argparse._SubParsersAction) -> None:
        p = subparsers.add_parser(name, help=help)
        add_arguments(p)
        p.set_defaults(func=run)

    def main(argv: list[str] | None = None) -> None:
        worker_entry(description, add_arguments, worker, run, argv)

    return register_bench, main
