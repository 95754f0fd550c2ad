"""Start every rank from the same state: variables and objects from a root rank.

``broadcast_variables`` packs the variables' bytes into one buffer, sends it
with one ``Communicator.broadcast`` (counted: N bytes sent by the root, N
received by every other rank) and assigns the root's values. It works eagerly
and inside ``tf.function`` (through the NumPy bridge), so Horovod's pattern
``if first_batch: hvd.broadcast_variables(model.variables, root_rank=0)``
inside a ``tf.function`` training step works unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from . import world
from .bridge import numpy_call


def _broadcast_arrays(comm: Any, arrays: Sequence[np.ndarray], root_rank: int) -> list[np.ndarray]:
    """Root's arrays on every rank (one fused byte buffer, one broadcast)."""
    raw = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    sizes = [r.size for r in raw]
    buf = np.concatenate(raw) if raw else np.zeros(0, np.uint8)
    comm.broadcast(buf, root=root_rank)
    out, start = [], 0
    for a, n in zip(arrays, sizes):
        out.append(buf[start:start + n].view(a.dtype).reshape(a.shape).copy())
        start += n
    return out


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, comm: Any = None) -> None:
    """Assign ``root_rank``'s values to ``variables`` on every rank (eager or graph).

    Every rank must pass the same variables (shapes, dtypes) in the same order.
    """
    comm = comm if comm is not None else world.communicator()
    if not 0 <= int(root_rank) < comm.size:
        raise ValueError(f"root_rank must be in [0, {comm.size - 1}], got {root_rank}")
    variables = list(variables)
    if not variables:
        return
    values = [tf.convert_to_tensor(v) for v in variables]

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        return _broadcast_arrays(comm, arrays, int(root_rank))

    outs = numpy_call(run, values, [t.dtype for t in values], [t.shape for t in values],
                      name="hvdc_broadcast")
    for v, o in zip(variables, outs):
        v.assign(o)


def broadcast_object(obj: Any, root_rank: int = 0, comm: Any = None) -> Any:
    """Broadcast any picklable object from ``root_rank`` (eager only)."""
    comm = comm if comm is not None else world.communicator()
    return comm.broadcast_object(obj, root=root_rank)
