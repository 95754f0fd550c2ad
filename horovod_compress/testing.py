"""Run test cases on real MPI ranks from pytest.

``run_cases(nprocs, module_file, cases)`` starts ``mpirun -np nprocs`` on
:func:`_worker_main`, which imports ``module_file`` on every rank and calls
each ``case(comm)`` with a fresh :class:`Communicator`. A case asserts on every
rank; any exception on any rank aborts the whole job (no hang) and fails the
test with that rank's traceback. Whatever a case returns (JSON-serialisable)
comes back as ``results[case][rank]`` for further checks in the test.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Sequence


def mpirun_command(nprocs: int) -> list[str]:
    """``mpirun`` with the flags this machine needs (root, oversubscription)."""
    exe = shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("mpirun not found: run scripts/setup.sh (installs Open MPI)")
    cmd = [exe, "-np", str(nprocs), "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for launching MPI ranks: one thread per rank, oversubscription allowed, quiet TF, plus ``extra``."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if extra:
        env.update(extra)
    return env


def torchrun_command(nprocs: int, script: str | Path, *args: str) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) of ``script`` on ``nprocs`` local ranks.

    A fresh free port on 127.0.0.1 for the rendezvous, so concurrent launches
    never meet. The ranks form a ``torch.distributed`` job (gloo on CPU),
    no MPI world.
    """
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
            "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), *args]


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``torchrun`` ranks: no MPI launcher variables, one thread per rank, plus ``extra``.

    The repository root goes first on ``PYTHONPATH`` so the ranks import this
    checkout of ``horovod_compress``.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "HVDC_LAUNCHED"))}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONHASHSEED="0",
               TF_CPP_MIN_LOG_LEVEL="3")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if extra:
        env.update(extra)
    return env


def run_cases(nprocs: int, module_file: str | Path, cases: Sequence[str],
              timeout: float = 300, env: dict[str, str] | None = None) -> dict[str, dict[int, Any]]:
    """Run ``cases`` of ``module_file`` on ``nprocs`` ranks; return their results."""
    with tempfile.TemporaryDirectory(prefix="hvdc-mpi-") as out:
        cmd = mpirun_command(nprocs) + [sys.executable, "-m", "horovod_compress.testing",
                                        str(module_file), out, *cases]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=mpi_env(env))
        if proc.returncode != 0:
            raise AssertionError(
                f"mpirun -np {nprocs} failed (exit {proc.returncode}) for {list(cases)}\n"
                f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
        results: dict[str, dict[int, Any]] = {c: {} for c in cases}
        for rank in range(nprocs):
            data = json.loads(Path(out, f"rank{rank}.json").read_text())
            for case, value in data.items():
                results[case][rank] = value
        return results


def _worker_main(argv: list[str]) -> None:
    import importlib.util

    from mpi4py import MPI

    from .mpi_collectives import Communicator

    module_file, out_dir, *cases = argv
    rank = MPI.COMM_WORLD.Get_rank()
    spec = importlib.util.spec_from_file_location("hvdc_mpi_cases", module_file)
    module = importlib.util.module_from_spec(spec)
    results: dict[str, Any] = {}
    try:
        spec.loader.exec_module(module)
        for case in cases:
            comm = Communicator()
            results[case] = getattr(module, case)(comm)
            MPI.COMM_WORLD.Barrier()
    except BaseException:  # noqa: BLE001 - any failure must abort every rank
        sys.stderr.write(f"[rank {rank}] case failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, default=_jsonable))


def _jsonable(obj: Any) -> Any:
    import numpy as np
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"case returned a non-JSON value of type {type(obj).__name__}")


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
