"""Process-group state for the TensorFlow front-end: ``init``, ``rank``, ``size``.

``init()`` starts MPI through mpi4py (``MPI.COMM_WORLD``, or a communicator
you pass) and, when the script also uses Horovod (it imported
``horovod.tensorflow``), initialises Horovod on the same communicator so that
``hvd.*`` calls and ours can be mixed in one script. When the PyTorch
front-end was initialised first in the same process, its communicator is
shared (one byte count per rank, whichever framework sends).
"""
from __future__ import annotations

import os
import sys
from typing import Any

_COMM: Any = None
_HOROVOD: Any = None


def _script_uses_horovod() -> bool:
    """The script imported ``horovod.tensorflow`` (or its Keras layer)."""
    return "horovod.tensorflow" in sys.modules


def _torch_front_end_comm() -> Any:
    world = sys.modules.get("horovod_compress.torch.world")
    return getattr(world, "_COMM", None) if world is not None else None


def init(comm: Any = None, horovod: bool | None = None) -> Any:
    """Initialise (idempotent) and return the :class:`Communicator` used by default.

    ``comm``: an mpi4py communicator (default ``MPI.COMM_WORLD``).
    ``horovod``: also call ``hvd.init(comm)`` on the same communicator;
    default: when the script has imported ``horovod.tensorflow``.
    """
    global _COMM, _HOROVOD
    from ..mpi_collectives import Communicator
    if comm is not None:
        _COMM = Communicator(comm)
    elif _COMM is None:
        _COMM = _torch_front_end_comm() or Communicator()
    if horovod is None:
        horovod = _script_uses_horovod()
    if horovod and _HOROVOD is None:
        import horovod.tensorflow as hvd
        if not hvd.is_initialized():
            hvd.init(comm=_COMM.comm)
        _HOROVOD = hvd
    return _COMM


def communicator() -> Any:
    """The communicator ``init()`` created (calls ``init()`` if needed)."""
    return _COMM if _COMM is not None else init()


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    """Rank within this node (from the launcher's environment; 0 if unknown)."""
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                "HOROVOD_LOCAL_RANK", "LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def horovod_active() -> bool:
    """Whether Horovod was initialised alongside."""
    return _HOROVOD is not None
