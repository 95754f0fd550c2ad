"""MPI layer: the :class:`Communicator` and the collective algorithms built on it.

``Communicator`` (mpi4py) is imported on first use, so the torch.distributed
backend (:mod:`.torch_dist`) and the algorithms import without MPI.
"""
from typing import Any

__all__ = ["Communicator", "OpStats", "Request", "TorchCommunicator", "default_communicator"]


def __getattr__(name: str) -> Any:
    if name in ("Communicator", "OpStats", "Request"):
        from . import communicator
        return getattr(communicator, name)
    if name in ("TorchCommunicator", "default_communicator"):
        from . import torch_dist
        return getattr(torch_dist, name)
    raise AttributeError(name)
