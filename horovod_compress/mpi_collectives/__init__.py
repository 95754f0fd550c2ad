"""MPI layer: the :class:`Communicator` and the collective algorithms built on it."""
from .communicator import Communicator, OpStats, Request

__all__ = ["Communicator", "OpStats", "Request"]
