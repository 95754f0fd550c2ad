"""The fused estimate-and-error pass of PowerSGD's step (Numba, CPU, one thread).

PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019, Algorithm 1 with the error
feedback of Algorithm 2) ends a step with the estimate ``P Q^T`` every rank
receives and the new local error ``e = M - P Q^T``. Written with NumPy that is
a thin GEMM writing the ``m x n`` estimate, then a subtraction reading it back
together with ``M`` and writing ``e``: two passes over two or three large
arrays. :func:`low_rank_product` does both in one pass over the output rows
(the row just written is still in L1 when it is subtracted). Measured on
this project's CPU machine for a 16384 x 256 float32 matrix, arrays cold:
about 14 ms for the fused pass against 23 ms for ``np.matmul(..., out=)`` +
``np.subtract`` -- on this machine passes that stream several large arrays at
once cost several times a single-array pass, and a DDP bucket of the
11.6M-parameter Transformer spends most of PowerSGD's time in them
(docs/ddp.md).

It is the one implementation of ``P Q^T`` in
:class:`~horovod_compress.compressors.powersgd.PowerSGD` (tensor by tensor
and bucket-wise alike), so both paths give the same bits: ``out[i, j] =
sum_k P[i, k] Q[j, k]`` summed in ``k`` order, every product and sum rounded
(no fused multiply-add, no re-association: no ``fastmath``), and ``acc -
out`` is the same subtraction NumPy does. Arguments: C-contiguous float32 or
float64 arrays of one dtype (:func:`fits`); callers fall back to NumPy otherwise.
"""
from __future__ import annotations

import numpy as np
from numba import njit

@njit(cache=True)
def _low_rank_product(p: np.ndarray, qt: np.ndarray, out: np.ndarray, acc: np.ndarray,
                      subtract: bool) -> None:
    m, r = p.shape
    n = qt.shape[1]
    for i in range(m):
        row = out[i]
        pk = p[i, 0]
        q0 = qt[0]
        for j in range(n):
            row[j] = pk * q0[j]
        for k in range(1, r):
            pk = p[i, k]
            qk = qt[k]
            for j in range(n):
                row[j] = row[j] + pk * qk[j]
        if subtract:
            a = acc[i]
            for j in range(n):
                a[j] = a[j] - row[j]


def low_rank_product(p: np.ndarray, q: np.ndarray, out: np.ndarray,
                     acc: np.ndarray | None = None) -> np.ndarray:
    """``out = P Q^T`` (``p``: m x r, ``q``: n x r, ``out``: m x n) and, given ``acc``, ``acc -= out``.

    Returns ``out``. ``r >= 1``; ``out`` and ``acc`` C-contiguous of ``p``'s dtype.
    """
    qt = np.ascontiguousarray(q.T)
    pc = np.ascontiguousarray(p)
    _low_rank_product(pc, qt, out, out if acc is None else acc, acc is not None)
    return out


def fits(*arrays: np.ndarray) -> bool:
    """Whether the kernels take these arrays: NumPy, C-contiguous, writeable, one float32/float64 dtype."""
    dtype = arrays[0].dtype
    return (dtype in (np.float32, np.float64)
            and all(isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous
                    for a in arrays))


__all__ = ["fits", "low_rank_product"]
