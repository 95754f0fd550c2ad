"""Start every rank from the same state: parameters and optimizer state from a root."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from . import world
from .tensors import copy_into, to_numpy


def broadcast_parameters(params: Any, root_rank: int = 0, comm: Any = None) -> None:
    """Overwrite tensors on every rank with ``root_rank``'s values, in place.

    ``params`` is a ``state_dict()`` or an iterable of ``(name, tensor)``
    (e.g. ``model.named_parameters()``). Names are sorted so every rank
    broadcasts in the same order.
    """
    comm = comm if comm is not None else world.communicator()
    items = sorted(params.items() if isinstance(params, dict) else list(params),
                   key=lambda kv: kv[0])
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is not a tensor")
        buf = np.ascontiguousarray(to_numpy(tensor)).copy()
        comm.broadcast(buf, root=root_rank)
        with torch.no_grad():
            copy_into(tensor.data if tensor.requires_grad else tensor, buf)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              comm: Any = None) -> None:
    """Give every rank ``root_rank``'s optimizer state (incl. hvdc compressor state)."""
    comm = comm if comm is not None else world.communicator()
    state = optimizer.state_dict() if comm.rank == root_rank else None
    state = comm.broadcast_object(state, root=root_rank)
    optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, comm: Any = None) -> Any:
    """Broadcast any picklable object from ``root_rank``."""
    comm = comm if comm is not None else world.communicator()
    return comm.broadcast_object(obj, root=root_rank)


__all__: Iterable[str] = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]
