"""``fp16`` and ``bf16``: cast to 16 bits, allreduce in 16 bits, cast back.

Each rank sends q_i = round16(x_i / P); ranks sum the 16-bit values with a
custom reduction (float32 add, then rounding back to 16 bits, as 16-bit
hardware arithmetic would): an MPI operator under mpi4py, alltoall + local
reduce + allgather under torch.distributed (``Communicator.allreduce_custom``); the result is widened to the gradient's
dtype. Conversions and the operator's inner loop are compiled kernels on the
bit patterns (:mod:`horovod_compress.kernels.halfprec`), one pass each. Pre-dividing by P keeps the partial sums inside the 16-bit range, as
Horovod's ``gradient_predivide_factor`` does. Volume: N elements * 2 bytes
through a ring allreduce, i.e. half the dense volume.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.halfprec import decode16, encode16
from .base import Method, TensorState
from .registry import register

class _HalfPrecision(Method):
    kind = "fp16"
    horovod_compatible = True

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)

    def encode(self, x: np.ndarray, world_size: int) -> np.ndarray:
        """16-bit words of x / P (float16 or bfloat16 bit patterns, one fused pass)."""
        return encode16(x, self.kind, scale=1.0 / world_size)

    def decode(self, words: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """float32 values of the 16-bit words times ``scale``."""
        return decode16(words, self.kind, scale=scale)

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        words = self.encode(x.reshape(-1), comm.size)
        out = comm.allreduce_custom(words, f"{self.kind}_sum")
        avg = self.decode(out).astype(x.dtype, copy=False).reshape(x.shape)
        if not self.feedback.uses_local:    # unbiased, no feedback: skip a pass over the gradient
            return avg, None
        local = self.decode(words, scale=comm.size).astype(x.dtype, copy=False).reshape(x.shape)
        return avg, local

    def expected_bytes(self, shape: tuple[int, ...], world_size: int, itemsize: int = 4) -> float:
        n = int(np.prod(shape))
        return 2.0 * n * 2 * (world_size - 1) / world_size

    # Horovod's Compressor protocol: Method.compress/decompress
    # (horovod_compat): fp16 is a cast around Horovod's allreduce; bf16 runs
    # our exchange (Horovod 0.28 has no bfloat16 allreduce).


@register
class FP16(_HalfPrecision):
    """IEEE half precision on the wire (Horovod's ``Compression.fp16``)."""

    name = "fp16"
    kind = "fp16"


@register
class BF16(_HalfPrecision):
    """bfloat16 on the wire: float32's exponent range, 8 bits of mantissa."""

    name = "bf16"
    kind = "bf16"
    horovod_compatible = False   # Horovod 0.28 has no bfloat16 allreduce: our exchange runs it
