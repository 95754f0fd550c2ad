"""``allreduce`` of one tensor with any method (Horovod's ``hvd.allreduce``), eager or graph."""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ..compressors.base import Method
from . import world
from .bridge import numpy_call
from .reducer import Average, Sum, op_name
from .tensors import check_float_dtype, to_wire, wire_dtype
from ..compressors.registry import create


def allreduce(tensor: Any, name: str | None = None, compression: Method | None = None,
              op: Any = Average, comm: Any = None) -> tf.Tensor:
    """The average (or, with ``op=Sum``, the sum) of ``tensor`` over ranks.

    ``compression`` (default ``Compression.none()``, exact) runs its compressed
    allreduce on the tensor under ``name`` (its state key; default derived from
    the shape). ``tf.IndexedSlices`` are densified.
    """
    method = compression if compression is not None else create("none")
    comm = comm if comm is not None else world.communicator()
    kind = op_name(op)
    value = to_wire(tensor)
    dtype = check_float_dtype(tensor.dtype, name or "tensor")
    shape = value.shape
    key = name if name is not None else f"allreduce{tuple(shape)}"

    def run(x: np.ndarray) -> list[np.ndarray]:
        out = method.allreduce(x, key, comm)
        if kind == Sum:
            out = out * out.dtype.type(comm.size)
        return [np.ascontiguousarray(out, dtype=x.dtype)]

    (out,) = numpy_call(run, [value], [wire_dtype(dtype)], [shape], name="hvdc_allreduce_tensor",
                        in_shapes=[shape])
    return tf.cast(out, dtype) if out.dtype != dtype else out
