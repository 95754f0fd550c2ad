"""Which MPI the tests and benchmarks launch, and how: Open MPI or MPICH, in one place.

The same virtual environment runs on both. mpi4py's binary wheel carries one
extension module per MPI ABI (``MPI.openmpi*.so``, ``MPI.mpich*.so``) and picks
the one matching the MPI library it finds at import
(``MPI4PY_LIBMPI``/``MPI4PY_MPIABI``): Open MPI's ``libmpi.so`` by default,
MPICH's when told so. What differs between the two is collected here:

============================  ===========================  ==============================
                              Open MPI (``openmpi``)        MPICH (``mpich``)
============================  ===========================  ==============================
launcher                      ``mpirun -np N``             ``mpiexec.mpich -np N`` (Hydra)
more ranks than cores         ``--oversubscribe``          allowed by default
as root                       ``--allow-run-as-root``      allowed by default
idle ranks                    ``OMPI_MCA_mpi_yield_...``   (Hydra: nothing to set)
library mpi4py loads          ``libmpi.so`` (default)      ``libmpich.so.12`` (+ the
                                                           ``libmpi.so.12`` name its
                                                           extension links to)
variables of a running job    ``OMPI_*``, ``PMIX_*``       ``PMI_*``, ``MPI_LOCAL*``
============================  ===========================  ==============================

``HVDC_MPI`` selects the implementation (``openmpi``, the default, or
``mpich``); :func:`selected` returns it. Debian's ``mpich`` package provides
``libmpich.so.12`` but not the ``libmpi.so.12`` name mpi4py's MPICH module
is linked against; ``scripts/setup.sh`` puts that one symbolic link in
``<venv>/mpich-abi`` (:data:`ABI_DIR_NAME`), prepended to ``LD_LIBRARY_PATH``
for MPICH ranks only, so nothing changes for Open MPI runs.
"""
from __future__ import annotations

import collections
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "HVDC_MPI"
ABI_DIR_NAME = "mpich-abi"

#: MPI cases run per implementation in this process (``testing.CaseResults`` adds to it).
CASES_RUN: "collections.Counter[str]" = collections.Counter()


@dataclass(frozen=True)
class MPIImplementation:
    """One MPI implementation's launcher and environment."""

    name: str
    launchers: tuple[str, ...]
    oversubscribe_flags: tuple[str, ...]
    root_flags: tuple[str, ...]
    env_defaults: tuple[tuple[str, str], ...]
    library: str | None = None

    def launcher(self) -> str:
        """The launcher's path; ``RuntimeError`` naming what to install if none is found."""
        for name in self.launchers:
            exe = shutil.which(name)
            if exe is not None:
                return exe
        raise RuntimeError(f"{' / '.join(self.launchers)} not found: run scripts/setup.sh "
                           f"(installs Open MPI and MPICH)")

    def command(self, nprocs: int) -> list[str]:
        """The launcher line for ``nprocs`` ranks on this machine (oversubscribed, root allowed)."""
        if nprocs < 1:
            raise ValueError(f"nprocs must be at least 1, got {nprocs}")
        cmd = [self.launcher(), "-np", str(nprocs), *self.oversubscribe_flags]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd += list(self.root_flags)
        return cmd

    def environ(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with this implementation's settings added (the caller's values win)."""
        out = dict(env)
        for key, value in self.env_defaults:
            out.setdefault(key, value)
        if self.library is not None:
            out.setdefault("MPI4PY_LIBMPI", self.library)
            out.setdefault("MPI4PY_MPIABI", self.name)
            abi_dir = abi_directory()
            if not (abi_dir / "libmpi.so.12").exists():
                raise RuntimeError(f"{abi_dir}/libmpi.so.12 is missing: run scripts/setup.sh "
                                   "(installs MPICH and links it for mpi4py)")
            parts = [str(abi_dir)] + [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
            out["LD_LIBRARY_PATH"] = os.pathsep.join(parts)
        return out


OPENMPI = MPIImplementation(
    name="openmpi", launchers=("mpirun", "mpirun.openmpi"), oversubscribe_flags=("--oversubscribe",),
    root_flags=("--allow-run-as-root",),
    env_defaults=(("OMPI_MCA_rmaps_base_oversubscribe", "1"), ("OMPI_MCA_mpi_yield_when_idle", "1"),
                  ("OMPI_MCA_btl_vader_single_copy_mechanism", "none")))
MPICH = MPIImplementation(
    name="mpich", launchers=("mpiexec.mpich", "mpiexec.hydra"), oversubscribe_flags=(),
    root_flags=(), env_defaults=(), library="libmpich.so.12")
IMPLEMENTATIONS = {impl.name: impl for impl in (OPENMPI, MPICH)}


def abi_directory() -> Path:
    """Where ``scripts/setup.sh`` links ``libmpi.so.12`` to MPICH's library (in the venv)."""
    return Path(sys.prefix) / ABI_DIR_NAME


def selected(env: dict[str, str] | None = None) -> MPIImplementation:
    """The implementation ``HVDC_MPI`` names (default Open MPI); ``ValueError`` for another name."""
    name = (env if env is not None else os.environ).get(ENV_VAR, "openmpi").strip().lower() or "openmpi"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"{ENV_VAR}={name!r}: choose one of {sorted(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[name]


__all__ = ["CASES_RUN", "ENV_VAR", "IMPLEMENTATIONS", "MPICH", "MPIImplementation", "OPENMPI",
           "abi_directory", "selected"]
