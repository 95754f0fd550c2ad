"""GPU kernels (Numba CUDA): the same functions as the CPU kernels, on device arrays.

Each module mirrors one CPU module of :mod:`horovod_compress.kernels` --
``selection``, ``quantize`` (+ ``rng``), ``exp_reduce``, ``bloom``, ``rle``,
``rows`` -- with the same names, arguments and results, taking and returning
device arrays (CuPy arrays, or Numba device arrays). Randomized kernels use
the CPU kernels' counter-based generator, so the same key gives the same bits
on both devices. Code normally reaches them through
:mod:`horovod_compress.kernels.dispatch`, which picks CPU or GPU by array type.

Kernels compile on first launch, so importing this package needs Numba but
no GPU. They run on a CUDA device, or on Numba's CUDA simulator when
``NUMBA_ENABLE_CUDASIM=1`` is set before Numba is first imported (how the
tests run them without a GPU).
"""
from __future__ import annotations


def available() -> bool:
    """Whether the kernels can run here: a CUDA device is present, or the simulator is on."""
    from numba import config, cuda
    return bool(config.ENABLE_CUDASIM) or bool(cuda.is_available())
