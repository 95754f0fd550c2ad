"""``none``: the dense allreduce every paper compares against.

avg = (1/P) * sum_i x_i, computed as MPI_Allreduce(SUM) then a division by P in
the gradient's dtype -- bit for bit what a plain MPI allreduce gives.
Volume: 2N(P-1)/P bytes per rank for N bytes (ring allreduce).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import Method, TensorState
from .registry import register
from ..mpi_collectives.accounting import allreduce_volume


@register
class NoCompression(Method):
    """Dense allreduce (no compression)."""

    name = "none"
    horovod_compatible = True
    gpu_native = True  # the Communicator reduces GPU arrays (CUDA-aware or staged)
    scatters = True    # reduce_scatter: the communicator's dense reduce-scatter

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        block = self._scatter_block(x, comm)
        if block is None:
            return comm.allreduce(x, op="avg"), x
        avg = np.zeros_like(x).reshape(-1)     # the reduce-scatter's block only
        avg[block[0]:block[1]] = comm.reduce_scatter(x, op="avg")
        return avg.reshape(x.shape), x

    def expected_bytes(self, shape: tuple[int, ...], world_size: int, itemsize: int = 4) -> float:
        n = int(np.prod(shape))
        return allreduce_volume(n * itemsize, world_size)

    # Horovod's Compressor protocol: nothing to do.
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return tensor

    @staticmethod
    def _work_dtype(dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype) if np.issubdtype(dtype, np.floating) and dtype.itemsize >= 4 \
            else np.dtype(np.float32)
