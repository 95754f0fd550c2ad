"""Helpers shared by the low-rank methods (``powersgd``, ``greedylore``, ``lazy_projection``).

All three run per tensor (``layout = "matrix"``) and see each gradient in its
own shape. A tensor of ``ndim >= 2`` is viewed as the matrix
``(shape[0], prod(shape[1:]))`` -- a conv kernel ``(out, in, kh, kw)`` becomes
``(out, in*kh*kw)``, as PowerSGD (Vogels et al. 2019) and
``torch.distributed``'s ``powerSGD_hook`` do.

Which tensors are compressed: PowerSGD's *min-compression-rate rule*,
exactly as ``powerSGD_hook``'s ``_should_compress`` states it. With
``r = min(rank, rows, cols)`` a matrix is compressed iff

    (rows + cols) * r * min_compression_rate  <  rows * cols,

otherwise it is averaged with one dense allreduce (it is too small to be worth
the compute). 1-D tensors (biases, norms) and scalars are always sent dense.
The same rule decides for all three low-rank methods, so they compress the
same set of tensors and compare like for like; ``min_compression_rate=0``
compresses every matrix, including those with ``rank >= min(rows, cols)``
(which the methods then reproduce exactly).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from scipy.linalg import get_lapack_funcs

from ..params import check_float, check_int
from ..mpi_collectives.accounting import allreduce_volume


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(shape[0], prod(shape[1:]))`` for ``ndim >= 2``, ``None`` for vectors and scalars."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))


def effective_rank(rows: int, cols: int, rank: int) -> int:
    """``min(rank, rows, cols)``: a rank larger than the matrix allows is clipped."""
    return int(min(rank, rows, cols))


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """PowerSGD's rule (``powerSGD_hook._should_compress``): is the saving worth it?"""
    r = effective_rank(rows, cols, rank)
    return (rows + cols) * r * min_compression_rate < rows * cols


def compressed_matrix(x: np.ndarray, rank: int, min_compression_rate: float) -> np.ndarray | None:
    """The 2-D view of ``x`` if the rule says compress it, else ``None`` (send dense)."""
    ms = matrix_shape(x.shape)
    if ms is None or ms[0] * ms[1] == 0 or not should_compress(*ms, rank, min_compression_rate):
        return None
    return x.reshape(ms)


def dense_bytes(numel: int, world_size: int, itemsize: int) -> float:
    """Bytes per rank of a ring allreduce of ``numel`` words: 2N(P-1)/P."""
    return allreduce_volume(numel * itemsize, world_size)


def orthogonalize(mat: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    """Orthonormalize the columns of ``mat`` (rows >= cols) in place; returns ``mat``.

    Mirrors ``powerSGD_hook._orthogonalize``: modified Gram-Schmidt for one or
    two columns (each column divided by ``norm + epsilon``), Householder QR
    for more -- LAPACK's ``?geqrf`` and ``?orgqr`` through SciPy's wrappers,
    overwriting one F-ordered copy of ``mat`` (``mat`` itself when it is
    F-ordered), then ``Q`` written back: the algorithm of ``torch.linalg.qr``,
    so the same column signs, and 36 against 127 us for a 2000 x 8 float32
    ``P`` with ``np.linalg.qr`` (which also allocates ``R`` and ``Q`` and
    zeroes ``R``'s lower triangle; it still serves other dtypes). One
    deviation: with ``epsilon == 0`` an all-zero column stays zero instead of
    becoming NaN (torch divides by zero there and documents that users should
    set an epsilon); every other input gives torch's result up to rounding.
    """
    rows, cols = mat.shape
    if cols <= 2:
        for i in range(cols):
            col = mat[:, i]
            norm = float(np.linalg.norm(col))
            denom = norm + epsilon
            if denom > 0:
                col /= mat.dtype.type(denom)
            else:
                col[...] = 0
            if i + 1 < cols:
                rest = mat[:, i + 1:]
                rest -= np.outer(col, col @ rest)
        return mat
    if mat.dtype not in (np.float32, np.float64) or rows < cols:
        q, _ = np.linalg.qr(mat, mode="reduced")
        mat[...] = q
        return mat
    geqrf, orgqr = get_lapack_funcs(("geqrf", "orgqr"), (mat,))
    work = mat if mat.flags.f_contiguous else np.asfortranarray(mat)
    qr, tau, _lwork, info = geqrf(work, overwrite_a=True)
    if info == 0:
        q, _lwork, info = orgqr(qr, tau, overwrite_a=True)
    if info != 0:
        raise np.linalg.LinAlgError(f"LAPACK QR failed (info={info}) on a {rows} x {cols} matrix")
    if not np.shares_memory(q, mat):
        mat[...] = q
    return mat


def check_rank(method: str, rank: Any) -> int:
    """``rank`` as an int >= 1, else ``ValueError`` naming ``method``."""
    return check_int(method, "rank", rank, 1)


def check_min_rate(method: str, value: Any) -> float:
    """``min_compression_rate`` as a float >= 0, else ``ValueError`` naming ``method``."""
    return check_float(method, "min_compression_rate", value, 0.0)


def check_bool(method: str, name: str, value: Any) -> bool:
    """``value`` as a bool (Python or NumPy), else ``ValueError`` naming ``method`` and ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{method}: {name} must be True or False, got {value!r}")
    return bool(value)


def top_indices(scores: np.ndarray, r: int) -> np.ndarray:
    """Indices of the ``r`` largest scores, sorted ascending; ties go to the lower index.

    Deterministic, so ranks holding bitwise-equal scores pick the same set.
    """
    order = np.argsort(-scores, kind="stable")[:r]
    return np.sort(order)


class PeriodicSubspaceSchedule:
    """Schedule and volume shared by GreedyLore and the lazy projection (mixin).

    Every ``period`` compressed steps (counted after the ``warmup_steps``)
    the subspace is refreshed from a dense allreduce (m n words); in between
    a step costs :meth:`projection_words`. The host class provides
    ``warmup_steps``, ``period``, ``rank`` and ``min_compression_rate``.
    """

    warmup_steps: int
    period: int
    rank: int
    min_compression_rate: float

    def projection_words(self, m: int, n: int, r: int) -> int:
        """Words one rank allreduces on a step between refreshes (m <= n, r the rank used)."""
        raise NotImplementedError(f"{type(self).__name__} must define projection_words")

    def is_svd_step(self, step: int) -> bool:
        """Whether training step ``step`` (1-based, warm-up included) refreshes the subspace."""
        c = step - self.warmup_steps
        return c >= 1 and (c - 1) % self.period == 0

    def step_bytes(self, shape: tuple[int, ...], world_size: int, step: int,
                   itemsize: int = 4) -> float:
        """Exact bytes per rank at training step ``step`` (1-based, warm-up included)."""
        numel = int(np.prod(shape)) if len(shape) else 1
        ms = matrix_shape(tuple(shape))
        if step <= self.warmup_steps or ms is None or numel == 0 or \
                not should_compress(*ms, self.rank, self.min_compression_rate):
            return dense_bytes(numel, world_size, itemsize)
        m, n = min(ms), max(ms)
        if self.is_svd_step(step):
            return dense_bytes(m * n, world_size, itemsize)
        return dense_bytes(self.projection_words(m, n, effective_rank(m, n, self.rank)),
                           world_size, itemsize)

    def expected_bytes(self, shape: tuple[int, ...], world_size: int,
                       itemsize: int = 4) -> float:
        """Bytes per rank per step averaged over one period (one refresh + period-1 projections)."""
        start = self.warmup_steps + 1
        return sum(self.step_bytes(shape, world_size, s, itemsize)
                   for s in range(start, start + self.period)) / self.period
