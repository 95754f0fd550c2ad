"""GPU versions of the row kernels of :mod:`horovod_compress.kernels.rows` (ARC-Top-K).

* :func:`gather_rows` -- the contiguous K x n block ``G[I, :]``: one thread per
  output element, consecutive threads on consecutive columns (coalesced reads
  and writes);
* :func:`scatter_rows` -- ``[U]_{I,:}``: zero the m x n output, then the inverse copy;
* :func:`row_sq_norms` -- one block per row, a float64 block reduction of the
  squares (a fixed tree, so deterministic; rounding differs from NumPy's
  einsum by a few ulps).

``top_rows`` needs a selection on m row scores (m is the number of rows, a
few thousand): it runs on the host.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from ._common import (
    TPB,
    block_sum,
    blocks_for,
    empty,
    fill,
    flat,
    grid_stride,
    guard_simulator_globals,
    is_device_array,
)


def _matrix(mat: Any, name: str) -> Any:
    if not is_device_array(mat):
        raise ValueError(f"{name} must be a device array, got {type(mat).__name__}")
    if len(mat.shape) != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(mat.shape)}")
    return mat


@cuda.jit(device=True)
def _copy_row_element(e, src, rows, dst, scatter, _4, _5):
    """Element e of the K x n block: ``dst[r, c] = src[rows[r], c]`` (gather) or, with
    ``scatter``, ``dst[rows[r], c] = src[r, c]``; consecutive e on consecutive columns."""
    n = src.shape[1]
    r = e // n
    c = e - r * n
    if scatter:
        dst[rows[r], c] = src[r, c]
    else:
        dst[r, c] = src[rows[r], c]


_COPY_ROWS = grid_stride(_copy_row_element)


def gather_rows(mat: Any, rows: Any) -> Any:
    """``mat[rows, :]`` as a contiguous K x n device array."""
    mat = _matrix(mat, "mat")
    rows = flat(rows, "rows")
    out = empty(mat, (rows.size, mat.shape[1]), mat.dtype)
    _COPY_ROWS(out.size, mat, rows, out, False)
    return out


def scatter_rows(block: Any, rows: Any, m: int, out: Any = None) -> Any:
    """The m x n matrix that is ``block`` at ``rows`` and zero elsewhere (``out`` reused if given)."""
    block = _matrix(block, "block")
    rows = flat(rows, "rows")
    n = block.shape[1]
    if out is None:
        out = empty(block, (int(m), n), block.dtype)
    fill(out, 0)
    _COPY_ROWS(block.size, block, rows, out, True)
    return out


@cuda.jit
def _sq_norms_kernel(mat, out):
    sh = cuda.shared.array(TPB, np.float64)
    t = cuda.threadIdx.x
    r = cuda.blockIdx.x
    m, n = mat.shape
    while r < m:
        s = 0.0
        c = t
        while c < n:
            v = np.float64(mat[r, c])
            s += v * v
            c += TPB
        total = block_sum(sh, t, s)
        if t == 0:
            out[r] = total
        r += cuda.gridDim.x


def row_sq_norms(mat: Any) -> Any:
    """Squared Euclidean norm of every row (``diag(M M^T)``), in ``mat``'s dtype."""
    mat = _matrix(mat, "mat")
    out = empty(mat, mat.shape[0], mat.dtype)
    if mat.shape[0]:
        _sq_norms_kernel[blocks_for(mat.shape[0] * TPB), TPB](mat, out)
    return out


__all__ = ["gather_rows", "row_sq_norms", "scatter_rows"]


guard_simulator_globals(globals())
