"""MPI layer: the :class:`Communicator` and the collective algorithms built on it.

``Communicator`` (mpi4py) is imported on first use, so the torch.distributed
backend (:mod:`.torch_dist`) and the algorithms import without MPI.
"""
import sys
from typing import Any

__all__ = ["Communicator", "OpStats", "Request", "TorchCommunicator", "default_communicator",
           "is_mpi_communicator"]


def is_mpi_communicator(comm: Any) -> bool:
    """Whether ``comm`` is the mpi4py :class:`Communicator` itself (not torch.distributed's,
    not a lockstep proxy), decided without importing mpi4py: a process that never
    imported the module cannot hold one, and torch.distributed runs must not need MPI."""
    module = sys.modules.get(f"{__name__}.communicator")
    return module is not None and type(comm) is module.Communicator


def __getattr__(name: str) -> Any:
    if name in ("Communicator", "OpStats", "Request"):
        from . import communicator
        return getattr(communicator, name)
    if name in ("TorchCommunicator", "default_communicator"):
        from . import torch_dist
        return getattr(torch_dist, name)
    raise AttributeError(name)
