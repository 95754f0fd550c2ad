"""Choose a kernel's CPU or GPU implementation by the type of its array arguments.

Rule: NumPy arrays run the Numba CPU kernel (:mod:`horovod_compress.kernels`)
-- its multi-threaded variant (:mod:`horovod_compress.kernels.parallel`, same
results bit for bit) when there is one, Numba runs more than one thread and
the first array has at least ``PARALLEL_MIN_SIZE`` elements; device arrays -- CuPy arrays, Numba device arrays, anything exposing
``__cuda_array_interface__`` -- run the GPU kernel
(:mod:`horovod_compress.kernels.gpu`), and results stay on the device. A call
mixing host and device arrays is an error (a silent transfer would hide a
bandwidth cost), and so is a device array for a kernel without a GPU
implementation.

Every kernel is registered once, by name, with the ``"module:function"``
paths of its two implementations; they are imported on first use, so CPU-only
code never imports ``numba.cuda`` or CuPy::

    from horovod_compress.kernels import dispatch
    idx, val = dispatch.call("select_by_threshold", x, thr)   # x: NumPy or CuPy
    idx, val = dispatch.select_by_threshold(x, thr)           # same, by attribute
    xp = dispatch.get_array_module(x)                          # numpy or cupy
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .arrays import get_array_module, is_gpu_array

CPU = "cpu"
GPU = "gpu"
# Below 2^17 elements a second thread does not pay: measured with NUMBA_NUM_THREADS=2 on the
# 2-core development VM, the parallel selection/quantizers are 0.67-0.97x of the serial ones at
# 2^16 elements and 1.2-1.9x at 2^17 (docs/kernels.md).
PARALLEL_MIN_SIZE = 1 << 17


# ----------------------------------------------------------------- array kinds
# is_gpu_array and get_array_module live in kernels/arrays.py and are re-exported here.


def device_of(*args: Any) -> str:
    """``"gpu"`` if the array arguments are device arrays, ``"cpu"`` if NumPy (or none are arrays).

    Raises ValueError when host and device arrays are mixed.
    """
    kinds = set()
    for a in args:
        if isinstance(a, np.ndarray):
            kinds.add(CPU)
        elif is_gpu_array(a):
            kinds.add(GPU)
    if len(kinds) > 1:
        raise ValueError("arguments mix NumPy and GPU arrays; move them to one device first")
    return kinds.pop() if kinds else CPU


# -------------------------------------------------------------------- registry
def _resolve(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


PARALLEL = "cpu_parallel"


@dataclass
class KernelEntry:
    """One kernel: its name and the import paths of its implementations (``None``: none)."""

    name: str
    cpu: str
    gpu: str | None
    cpu_parallel: str | None = None
    work: Callable[..., int] | None = None   # elements of work for a call (default: first array's size)
    _loaded: dict[str, Callable] | None = None

    def implementation(self, device: str) -> Callable:
        """The kernel's function for ``device`` (``cpu``, ``gpu``, ``cpu_parallel``), imported once."""
        if device not in (CPU, GPU, PARALLEL):
            raise ValueError(f"device must be 'cpu', 'gpu' or 'cpu_parallel', got {device!r}")
        path = {CPU: self.cpu, GPU: self.gpu, PARALLEL: self.cpu_parallel}[device]
        if path is None:
            raise ValueError(f"kernel {self.name!r} has no {device.upper()} implementation")
        if self._loaded is None:
            self._loaded = {}
        if device not in self._loaded:
            self._loaded[device] = _resolve(path)
        return self._loaded[device]


_REGISTRY: dict[str, KernelEntry] = {}


def register_kernel(name: str, cpu: str, gpu: str | None = None, cpu_parallel: str | None = None,
                    replace: bool = False, work: Callable[..., int] | None = None) -> None:
    """Register kernel ``name`` with ``"module:function"`` paths of its implementations.

    ``cpu`` is required; ``gpu`` and ``cpu_parallel`` (a multi-threaded CPU
    variant with identical results) are optional. ``work(*args, **kwargs)``
    gives the elements a call processes, which decides the parallel variant
    (default: the size of the first array argument).
    """
    if not name or not name.isidentifier():
        raise ValueError(f"name must be a Python identifier, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"kernel {name!r} is already registered (pass replace=True)")
    for label, path in (("cpu", cpu), ("gpu", gpu), ("cpu_parallel", cpu_parallel)):
        if (path is None and label == "cpu") or (path is not None and ":" not in path):
            raise ValueError(f"{label} must be 'module:function', got {path!r}")
    _REGISTRY[name] = KernelEntry(name, cpu, gpu, cpu_parallel, work)


def registered() -> list[str]:
    """Names of all registered kernels, sorted."""
    return sorted(_REGISTRY)


def has_gpu(name: str) -> bool:
    """Whether kernel ``name`` has a GPU implementation."""
    return _entry(name).gpu is not None


def _entry(name: str) -> KernelEntry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; registered: {', '.join(registered())}") from None


def implementation(name: str, device: str) -> Callable:
    """The ``device`` ("cpu", "gpu" or "cpu_parallel") implementation of kernel ``name``."""
    return _entry(name).implementation(device)


def _numba_threads() -> int:
    import numba  # noqa: PLC0415 - the CPU kernels import it anyway
    return int(numba.get_num_threads())


def choose(name: str, *args: Any, **kwargs: Any) -> str:
    """Which implementation :func:`call` runs for these arguments ("cpu", "cpu_parallel" or "gpu")."""
    entry = _entry(name)
    values = (*args, *kwargs.values())
    device = device_of(*values)
    if device == GPU:
        return GPU
    if entry.cpu_parallel is not None:
        if entry.work is not None:
            size = int(entry.work(*args, **kwargs))
        else:
            first = next((a for a in values if isinstance(a, np.ndarray)), None)
            size = 0 if first is None else first.size
        if size >= PARALLEL_MIN_SIZE and _numba_threads() > 1:
            return PARALLEL
    return CPU


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run kernel ``name`` on the device its array arguments live on."""
    return implementation(name, choose(name, *args, **kwargs))(*args, **kwargs)


def kernel(name: str) -> Callable:
    """A callable that dispatches kernel ``name`` on every call."""
    entry = _entry(name)

    def dispatched(*args: Any, **kwargs: Any) -> Any:
        return entry.implementation(choose(name, *args, **kwargs))(*args, **kwargs)

    dispatched.__name__ = name
    dispatched.__qualname__ = name
    dispatched.__doc__ = f"Kernel {name!r}: CPU ({entry.cpu}) or GPU ({entry.gpu}) by array type."
    return dispatched


def __getattr__(name: str) -> Callable:
    if name in _REGISTRY:
        return kernel(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------- the kernels
_PKG = "horovod_compress.kernels"
_BUILTIN = {
    "selection": ["select_by_threshold", "count_at_least", "kth_largest_abs", "gaussian_threshold",
                  "coo_sum"],
    "quantize": ["linear_quantize", "linear_dequantize", "exp_quantize", "exp_dequantize",
                 "pack_nibbles", "unpack_nibbles", "nibble_add_into"],
    "exp_reduce": ["exp_reduce8_into", "exp_reduce4_into", "exp_reduce_codes", "exp_reduce_packed"],
    "bloom": ["bloom_positions", "bloom_insert", "bloom_query_range"],
    "rle": ["runs_from_sorted_indices", "indices_from_runs", "varint_encode", "varint_decode"],
    "rows": ["gather_rows", "scatter_rows", "row_sq_norms"],
}
_PARALLEL = {"select_by_threshold", "count_at_least", "linear_quantize", "exp_quantize",
             "exp_reduce8_into", "exp_reduce4_into", "bloom_query_range"}
_WORK = {"bloom_query_range": lambda bits, m, h, seed, n: n}   # tests every i < n, whatever the filter size
for _module, _names in _BUILTIN.items():
    for _name in _names:
        register_kernel(_name, f"{_PKG}.{_module}:{_name}", f"{_PKG}.gpu.{_module}:{_name}",
                        f"{_PKG}.parallel:{_name}" if _name in _PARALLEL else None, work=_WORK.get(_name))
del _module, _names, _name
# Global-QSGD's 8-bit codes with its word layout (one draw decides most elements)
register_kernel("exp8_quantize", f"{_PKG}.qsgd_fused:exp8_quantize", f"{_PKG}.gpu.quantize:exp8_quantize")

__all__ = ["CPU", "GPU", "PARALLEL", "PARALLEL_MIN_SIZE", "KernelEntry", "call", "choose", "device_of", "get_array_module", "has_gpu",
           "implementation", "is_gpu_array", "kernel", "register_kernel", "registered"]
