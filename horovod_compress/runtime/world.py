"""Process-wide MPI state shared by the front-ends: ``init``, ``rank``, ``size``.

One :class:`~horovod_compress.mpi_collectives.Communicator` per process,
whichever front-end (PyTorch, TensorFlow, Keras) initialises it first, so
there is one byte count per rank whatever framework sends. ``init()`` starts
MPI through mpi4py (``MPI.COMM_WORLD``, or a communicator you pass) and, when
the script also uses Horovod (it imported the framework's Horovod module),
initialises Horovod on the same communicator so ``hvd.*`` calls and ours can
be mixed in one script. Under ``horovodrun`` (which starts ``mpirun``)
everything works unchanged: the ranks are an ordinary MPI world.
"""
from __future__ import annotations

import os
import sys
from typing import Any

_COMM: Any = None

_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                    "HOROVOD_LOCAL_RANK", "LOCAL_RANK")


class FrontEndWorld:
    """``init``/``rank``/``size`` of one front-end; ``horovod_module`` is the Horovod it may join."""

    def __init__(self, horovod_module: str) -> None:
        self.horovod_module = horovod_module
        self.horovod: Any = None

    def init(self, comm: Any = None, horovod: bool | None = None) -> Any:
        """Initialise (idempotent) and return the :class:`Communicator` used by default.

        ``comm``: an mpi4py communicator (default ``MPI.COMM_WORLD``).
        ``horovod``: also call ``hvd.init(comm)`` on the same communicator;
        default: when the script has imported the framework's Horovod module.
        """
        global _COMM
        from ..mpi_collectives import Communicator
        if comm is not None:
            _COMM = Communicator(comm)
        elif _COMM is None:
            _COMM = Communicator()
        if horovod is None:
            horovod = self.horovod_module in sys.modules
        if horovod and self.horovod is None:
            import importlib
            hvd = importlib.import_module(self.horovod_module)
            if not hvd.is_initialized():
                hvd.init(comm=_COMM.comm)
            self.horovod = hvd
        return _COMM

    def communicator(self) -> Any:
        """The communicator ``init()`` created (calls ``init()`` if needed)."""
        return _COMM if _COMM is not None else self.init()

    def rank(self) -> int:
        return self.communicator().rank

    def size(self) -> int:
        return self.communicator().size

    @staticmethod
    def local_rank() -> int:
        """Rank within this node (from the launcher's environment; 0 if unknown)."""
        for key in _LOCAL_RANK_VARS:
            if key in os.environ:
                return int(os.environ[key])
        return 0

    def horovod_active(self) -> bool:
        """Whether Horovod was initialised alongside."""
        return self.horovod is not None
