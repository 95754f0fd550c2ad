"""Collectives on GPU arrays: pass device buffers to CUDA-aware MPI, stage through host memory otherwise.

Detection (:func:`cuda_aware_mpi`, cached), first answer wins:

1. ``HVDC_CUDA_AWARE_MPI=1`` / ``0`` in the environment (an explicit override);
2. Open MPI's run-time query ``MPIX_Query_cuda_support()`` (from its ``cuda``
   MPI extension, ``mpi-ext.h``), looked up with ctypes in the already loaded
   MPI library -- 1 only when the library was built with CUDA support *and*
   it is enabled at run time;
3. for other MPI libraries, the documented switches: MVAPICH2's
   ``MV2_USE_CUDA=1``, MPICH's ``MPIR_CVAR_ENABLE_GPU=1``, Cray MPICH's
   ``MPICH_GPU_SUPPORT_ENABLED=1``;
4. otherwise not CUDA-aware.

:class:`DeviceCollectives` wraps a :class:`~.communicator.Communicator` and
takes NumPy *or* GPU arrays (CuPy, Numba device arrays). NumPy arrays go to
the Communicator unchanged. GPU arrays go to mpi4py directly when MPI is
CUDA-aware (mpi4py reads ``__cuda_array_interface__``) -- with exactly the
byte accounting the Communicator would have done -- and otherwise are copied
to host memory, sent through the Communicator, and copied back; either way
the result is a GPU array of the same kind.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, Sequence

import numpy as np

from ..kernels.arrays import is_cupy as _is_cupy
from ..kernels.arrays import is_gpu_array, to_device_like, to_host

_ENV_OVERRIDE = "HVDC_CUDA_AWARE_MPI"
_ENV_SWITCHES = ("MV2_USE_CUDA", "MPIR_CVAR_ENABLE_GPU", "MPICH_GPU_SUPPORT_ENABLED")
_CACHE: dict[str, bool] = {}


def query_mpix_cuda_support() -> int | None:
    """Open MPI's ``MPIX_Query_cuda_support()`` (0 or 1), or ``None`` if the symbol is absent."""
    from mpi4py import MPI  # noqa: F401 - loads libmpi into the process
    for lib in (None, "libmpi.so.40", "libmpi.so"):
        try:
            fn = getattr(ctypes.CDLL(lib), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return int(fn())
    return None


def _flag(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false, yes/no, on/off), got {value!r}")


def cuda_aware_mpi(refresh: bool = False) -> bool:
    """Whether the MPI library can read and write GPU memory directly (cached; see module doc)."""
    if _ENV_OVERRIDE in os.environ:
        return _flag(os.environ[_ENV_OVERRIDE], _ENV_OVERRIDE)
    if refresh or "aware" not in _CACHE:
        answer = query_mpix_cuda_support()
        if answer is None:
            answer = any(_flag(os.environ.get(name, ""), name) for name in _ENV_SWITCHES)
        _CACHE["aware"] = bool(answer)
    return _CACHE["aware"]


# ------------------------------------------------------------- array helpers
def empty_like(x: Any) -> Any:
    """An uninitialised GPU array with ``x``'s shape and dtype, of the same kind."""
    if _is_cupy(x):
        import cupy
        return cupy.empty(x.shape, dtype=x.dtype)
    from numba import cuda
    return cuda.device_array(x.shape, dtype=x.dtype)


def _divide_inplace(x: Any, divisor: int) -> None:
    from ..kernels.gpu._common import divide_inplace
    divide_inplace(x, divisor)


def _predefined(op: Any) -> bool:
    """Whether ``op`` is one of MPI's built-in reductions (which CUDA-aware MPI applies on the device)."""
    from mpi4py import MPI
    return any(op == builtin for builtin in (MPI.SUM, MPI.MAX, MPI.MIN, MPI.PROD, MPI.LAND, MPI.LOR,
                                             MPI.BAND, MPI.BOR, MPI.LXOR, MPI.BXOR))


# --------------------------------------------------------------- collectives
class DeviceCollectives:
    """The Communicator's collectives for NumPy or GPU arrays (see module doc).

    ``cuda_aware=None`` detects it with :func:`cuda_aware_mpi`. ``staged``
    counts the collectives that went through host memory (for tests and
    benchmarks).
    """

    def __init__(self, comm: Any, cuda_aware: bool | None = None) -> None:
        self.comm = comm
        self.cuda_aware = cuda_aware_mpi() if cuda_aware is None else bool(cuda_aware)
        self.staged = 0
        self.direct = 0

    def _route(self, *arrays: Any) -> str:
        gpu = [is_gpu_array(a) for a in arrays]
        if not any(gpu):
            return "host"
        if not all(gpu):
            raise ValueError("arguments mix NumPy and GPU arrays; move them to one device first")
        return "direct" if self.cuda_aware else "staged"

    def allreduce(self, x: Any, op: Any = "sum") -> Any:
        """Elementwise reduction over ranks (``op`` as in :meth:`Communicator.allreduce`)."""
        route = self._route(x)
        if route == "host":
            return self.comm.allreduce(x, op)
        if route == "direct" and not isinstance(op, str) and not _predefined(op):
            route = "staged"  # a user operator is a host callback: it cannot read device memory
        if route == "staged":
            self.staged += 1
            return to_device_like(self.comm.allreduce(to_host(x), op), x)
        from .datatypes import NAMED_OPS as _NAMED_OPS   # mpi4py: MPI runs by now
        if isinstance(op, str) and op not in _NAMED_OPS:
            raise ValueError(f"op must be one of {sorted(_NAMED_OPS)} or an MPI.Op, got {op!r}")
        if op in ("avg", "average") and np.dtype(x.dtype).kind != "f":
            raise ValueError("op='avg' needs a floating-point array")
        self.direct += 1
        out = empty_like(x)
        self.comm.comm.Allreduce(x, out, op=_NAMED_OPS[op] if isinstance(op, str) else op)
        item = np.dtype(x.dtype).itemsize
        self.comm.count("allreduce", *self.comm._allreduce_bytes(int(x.size) * item, item))
        if op in ("avg", "average"):
            _divide_inplace(out, self.comm.size)
        return out

    def allgather(self, x: Any) -> Any:
        """Gather equal-shaped arrays: shape ``(P, *x.shape)``."""
        route = self._route(x)
        if route == "host":
            return self.comm.allgather(x)
        if route == "staged":
            self.staged += 1
            return to_device_like(self.comm.allgather(to_host(x)), x)
        self.direct += 1
        p = self.comm.size
        if _is_cupy(x):
            import cupy
            out = cupy.empty((p,) + tuple(x.shape), dtype=x.dtype)
        else:
            from numba import cuda
            out = cuda.device_array((p,) + tuple(x.shape), dtype=x.dtype)
        self.comm.comm.Allgather(x, out)
        nbytes = int(x.size) * np.dtype(x.dtype).itemsize
        self.comm.count("allgather", nbytes * (p - 1), nbytes * (p - 1))
        return out

    def allgatherv(self, x: Any) -> tuple[Any, np.ndarray]:
        """Gather 1-D arrays of different lengths: ``(concatenated, counts)`` (counts on the host)."""
        route = self._route(x)
        if route == "host":
            return self.comm.allgatherv(x)
        if route == "staged":
            self.staged += 1
            out, counts = self.comm.allgatherv(to_host(x))
            return to_device_like(out, x), counts
        self.direct += 1
        from .datatypes import mpi_datatype
        p, rank = self.comm.size, self.comm.rank
        counts = self.comm.allgather(np.array([x.size], dtype=np.int64)).reshape(-1)
        displs = np.zeros(p, dtype=np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        dtype = np.dtype(x.dtype)
        if _is_cupy(x):
            import cupy
            out = cupy.empty(int(counts.sum()), dtype=dtype)
        else:
            from numba import cuda
            out = cuda.device_array(int(counts.sum()), dtype=dtype)
        self.comm.comm.Allgatherv(x, [out, counts, displs, mpi_datatype(dtype)])
        item = dtype.itemsize
        total = int(counts.sum()) * item
        successor = int(counts[(rank + 1) % p]) * item
        self.comm.count("allgatherv", total - successor if p > 1 else 0, total - int(x.size) * item)
        return out, counts

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Broadcast from ``root``: in place for direct transfers, a new device array when staged."""
        route = self._route(x)
        if route == "host":
            return self.comm.broadcast(x, root)
        if route == "staged":
            self.staged += 1
            host = np.ascontiguousarray(to_host(x))
            return to_device_like(self.comm.broadcast(host, root), x)
        self.direct += 1
        self.comm.comm.Bcast(x, root=root)
        nbytes = int(x.size) * np.dtype(x.dtype).itemsize
        if self.comm.size > 1:
            if self.comm.rank == root:
                self.comm.count("broadcast", nbytes, 0)
            else:
                self.comm.count("broadcast", 0, nbytes)
        return x

    def alltoallv(self, chunks: Sequence[Any]) -> list[Any]:
        """Send ``chunks[j]`` to rank j; GPU chunks are staged (no CUDA-aware path for this one)."""
        route = self._route(*chunks) if chunks else "host"
        if route == "host":
            return self.comm.alltoallv(chunks)
        self.staged += 1
        parts = self.comm.alltoallv([to_host(c) for c in chunks])
        return [to_device_like(p, chunks[0]) for p in parts]


__all__ = ["DeviceCollectives", "cuda_aware_mpi", "empty_like", "query_mpix_cuda_support",
           "to_device_like", "to_host"]
