"""Compile the Numba kernels once, into their on-disk cache, before anything else runs them.

Every CPU kernel is ``@njit(cache=True)``: compiled on its first call with a
given signature and stored next to its module (``__pycache__/*.nbi, *.nbc``).
A fresh checkout has no cache, so the first program that reaches a kernel
compiles it -- and under ``mpirun -np 4`` on a small machine all four ranks
compile the same kernels at once, each a few seconds of one core per kernel.
``scripts/setup.sh`` runs this module once, serially, so that later runs
(tests, benchmarks, training) load the compiled code instead.

What it runs: every registered method at its defaults, and each biased one
also under every error-feedback scheme it accepts, for a few steps on small
float32 and float64 gradients (a 2-D one that the low-rank and row methods
compress, a small vector and one large enough for the rings), on this
process's ``MPI.COMM_WORLD`` -- ``scripts/setup.sh`` runs it alone (P = 1) and
under ``mpirun -np 2`` to reach the P > 1 paths too (pipelined rings or
shared-memory windows, custom reduction operators, merges of received
messages). Kernels only some options
reach (e.g. the 4-bit variants) are compiled by their first real use, as
before. Nothing is written except the cache.

    python -m horovod_compress.tools.precompile            # P = 1
    mpirun -np 2 python -m horovod_compress.tools.precompile
"""
from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

#: Gradient shapes: one matrix every compressor compresses and its tall transpose (the low-rank
#: methods work on tall matrices transposed, with kernels of their own layout), one vector (dense
#: paths, flat buckets), and one vector large enough for the pipelined rings and shared-memory
#: windows (payloads of at least 64 KiB: fp16's 2 bytes and Global-QSGD's 1 byte per element).
SHAPES = ((96, 160), (160, 96), (2048,), (70_000,))


def _variants(name: str) -> list[dict[str, Any]]:
    """The parameter sets a method is warmed with: its defaults, plus each feedback scheme
    a biased method takes (EF14, EF21, EF21M ... each has its own fused kernels)."""
    from ..compressors.registry import method_class, parameter_names
    from ..feedback import available_feedback
    out: list[dict[str, Any]] = [{}]
    if "feedback" in parameter_names(name) and method_class(name).biased:
        for fb in available_feedback():
            try:
                method_class(name)(feedback=fb)
            except (ValueError, TypeError):
                continue                                  # a scheme this method refuses
            out.append({"feedback": fb})
    return out


def warm(steps: int = 3, verbose: bool = True) -> float:
    """Run every method and variant for ``steps`` steps on each dtype and shape; returns seconds."""
    from ..compressors.registry import available, method_class
    from ..mpi_collectives import Communicator
    comm = Communicator()
    t0 = time.perf_counter()
    for name in available():
        for params in _variants(name):
            for dtype in (np.float32, np.float64):
                method = method_class(name)(**params)
                rng = np.random.default_rng(comm.rank)
                for step in range(steps):
                    for k, shape in enumerate(SHAPES):
                        g = rng.standard_normal(shape).astype(dtype)
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            method.allreduce(g, f"t{k}", comm)
        if verbose and comm.rank == 0:
            print(f"precompile: {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return time.perf_counter() - t0


def main() -> None:
    """Warm the cache on this process's ``MPI.COMM_WORLD`` and report the time on rank 0."""
    seconds = warm()
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        print(f"precompile: kernels cached in {seconds:.0f} s at P = {MPI.COMM_WORLD.size}")


if __name__ == "__main__":
    main()
