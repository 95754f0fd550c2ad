"""Row kernels of the row-sparsifying methods (ARC-Top-K and its row baselines).

A row-sparse message is a set of K row indices I of an m x n matrix and the
K x n block ``G[I, :]``. The kernels here are:

* :func:`row_sq_norms` -- ``diag(P P^T)``, the row scores of ARC-Top-K's
  sketch (paper, eq. 4);
* :func:`top_rows` -- ``argtop_K`` of a score vector with a *deterministic*
  tie-break (lower index wins), so every rank holding the same scores selects
  the same rows even when scores tie (e.g. all-zero rows);
* :func:`gather_rows` / :func:`scatter_rows` -- ``G[I, :]`` packed into a
  contiguous K x n buffer, and its inverse ``[U]_{I,:}`` (zero elsewhere).

Implementation choice: **NumPy, not Numba**, because NumPy is already at the
speed of memory here and a compiled loop cannot move fewer bytes:

* a row gather (``mat.take(rows, axis=0)``) and a row scatter
  (``zeros; out[rows] = block``) are one ``memcpy`` of n contiguous words per
  selected row, and ``np.zeros`` gets pre-zeroed pages from ``calloc``;
* the scores are one vectorised ``einsum`` pass over the m x r sketch and
  the selection one ``np.partition`` (O(m) introselect) plus two compare
  passes; the sketch ``G V`` itself is a BLAS GEMM in the caller.

``hvdc bench arc`` measures this (benchmarks/arc.md, "row kernels"): a
bounds-checked ``@njit`` gather + scatter saves about 1 us per call on small
tensors (NumPy's call overhead, against hundreds of us for the two
allreduces around it) and is up to ~16% slower on the large, memory-bound ones
(it writes its zeros where ``calloc`` gets them for free). The functions use only array methods that CuPy
mirrors, so they also run unchanged on CuPy arrays.
"""
from __future__ import annotations

import numpy as np


# ------------------------------------------------------------------ scores
def row_sq_norms(mat: np.ndarray) -> np.ndarray:
    """Squared Euclidean norm of every row: ``diag(M M^T)`` without forming ``M M^T``."""
    if mat.ndim != 2:
        raise ValueError(f"row_sq_norms needs a 2-D array, got shape {mat.shape}")
    return np.einsum("ij,ij->i", mat, mat)


def top_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``scores``, ascending, ties broken by lower index.

    O(m): one introselect for the k-th largest score ``thr``, then every
    index with a score above ``thr`` plus the lowest-numbered indices whose
    score equals ``thr``. NaN scores count as +inf (a NaN row is selected and
    propagates, as a dense allreduce would propagate it). The result depends
    on the scores only, never on the rank or on the order of a sort.
    """
    scores = np.asarray(scores).reshape(-1)
    m = scores.size
    if k < 0:
        raise ValueError(f"top_rows: k must be >= 0, got {k}")
    if k >= m:
        return np.arange(m, dtype=np.int64)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    s = np.where(np.isnan(scores), np.inf, scores)
    thr = np.partition(s, m - k)[m - k]
    above = np.flatnonzero(s > thr)
    ties = np.flatnonzero(s == thr)[: k - above.size]
    return np.sort(np.concatenate([above, ties])).astype(np.int64, copy=False)


# --------------------------------------------------------- gather / scatter
def gather_rows(mat: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The contiguous K x n block ``mat[rows, :]`` (the message of a row-sparse allreduce)."""
    return mat.take(rows, axis=0)


def scatter_rows(block: np.ndarray, rows: np.ndarray, m: int,
                 out: np.ndarray | None = None) -> np.ndarray:
    """The m x n matrix that is ``block`` at ``rows`` and zero elsewhere (``[U]_{I,:}``).

    With ``out`` given (m x n), it is zeroed and filled in place.
    """
    if out is None:
        out = np.zeros_like(block, shape=(m, block.shape[1]))   # CuPy-aware via NEP 18
    else:
        out.fill(0)
    out[rows] = block
    return out


# ------------------------------------------------------------- 2-D view
def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The paper's 2-D view (m, n) of a tensor: rows = first axis, n = the rest.

    2-D weights keep their shape; a conv kernel (out, in, kh, kw) becomes
    (out, in*kh*kw) (ARC-Top-K paper, Sec. VI, following ATOMO). 0-D and
    1-D tensors have no row structure and return ``None`` (sent dense).
    """
    if len(shape) < 2:
        return None
    m = int(shape[0])
    n = int(np.prod(shape[1:], dtype=np.int64))
    return m, n
