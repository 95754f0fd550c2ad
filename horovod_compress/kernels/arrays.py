"""Array kinds: which device an array lives on, its array module, and copies between host and device.

The core works on NumPy arrays and, on a GPU, on CuPy arrays (docs/architecture.md);
GPU kernels also accept Numba device arrays (``numba.cuda.to_device``, and the
simulator's stand-ins under ``NUMBA_ENABLE_CUDASIM=1``). This module answers
the questions every layer asks about an array without importing CuPy or
``numba.cuda`` until such an array is actually seen:

* :func:`is_gpu_array` / :func:`is_cupy` -- where it lives;
* :func:`get_array_module` -- ``numpy`` or ``cupy`` (as ``cupy.get_array_module``),
  so code written against ``xp`` runs on either;
* :func:`to_host` / :func:`to_device_like` -- explicit copies (never implicit:
  a silent transfer would hide a PCIe copy).
"""
from __future__ import annotations

from typing import Any

import numpy as np


def is_cupy(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.split(".")[0] == "cupy"


def is_gpu_array(x: Any) -> bool:
    """Whether ``x`` lives on a GPU: CuPy, Numba device arrays (also simulated), CUDA array interface."""
    if isinstance(x, np.ndarray):
        return False
    return bool(getattr(x, "__cuda_ndarray__", False)) or hasattr(x, "__cuda_array_interface__")


def _cupy() -> Any:
    import cupy  # noqa: PLC0415 - optional dependency, imported on first CuPy array
    return cupy


def get_array_module(*arrays: Any) -> Any:
    """``cupy`` if any argument is a CuPy array, else ``numpy`` (as ``cupy.get_array_module``)."""
    for a in arrays:
        if is_cupy(a):
            return _cupy()
    return np


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy of a GPU array; NumPy arrays (and scalars, lists) pass through ``np.asarray``."""
    if is_cupy(x):
        return _cupy().asnumpy(x)
    if is_gpu_array(x):
        return x.copy_to_host()
    return np.asarray(x)


def to_device_like(host: Any, like: Any) -> Any:
    """``host`` copied to the GPU as the same kind of array as ``like`` (CuPy or Numba)."""
    host = np.ascontiguousarray(host)
    if is_cupy(like):
        return _cupy().asarray(host)
    from numba import cuda  # noqa: PLC0415 - only for Numba device arrays
    return cuda.to_device(host)


def as_module_array(x: Any, xp: Any) -> Any:
    """``x`` as an array of module ``xp`` (``numpy`` or ``cupy``), copying across devices if needed."""
    if xp is np:
        return to_host(x)
    return x if is_cupy(x) else xp.asarray(to_host(x))


__all__ = ["as_module_array", "get_array_module", "is_cupy", "is_gpu_array", "to_device_like",
           "to_host"]
