"""The MPI datatype and reduction-op tables the collectives share (host and CUDA-aware paths).

:data:`NAMED_OPS` maps the op names the API accepts to MPI's predefined ops
(``avg``/``average`` reduce by ``MPI.SUM``; the caller divides);
:func:`mpi_datatype` gives the MPI datatype of a NumPy dtype. Importing this
module imports mpi4py (and so initializes MPI): import it where MPI runs.
"""
from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

NAMED_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD,
             "avg": MPI.SUM, "average": MPI.SUM}


@functools.cache
def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype of a native-byte-order NumPy ``dtype`` (``mpi4py.util.dtlib``).

    ``dtlib.from_numpy_dtype`` returns a fresh duplicate handle (~0.8 us, to be
    freed by the caller); cached, each dtype gets one handle for the process and
    the lookup costs about what the private ``MPI._typedict[dtype.char]`` did
    (docs/architecture.md).
    A non-native byte order raises ``ValueError`` instead of sending wrong bytes.
    """
    return dtlib.from_numpy_dtype(dtype)
