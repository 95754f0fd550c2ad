"""Shared pieces of the row-sparsifying methods (``arc_topk``, ``randk_rows``, ``topk_rows``).

All three follow the ARC-Top-K paper's setting (Table I): every tensor is seen
as an m x n matrix (:func:`~horovod_compress.kernels.rows.matrix_shape`) and
K = ceil(ratio * m) of its m rows are kept, the same ``ratio`` (the paper's
sparsity mu, 0.2 in all its experiments) for every tensor.
"""
from __future__ import annotations

import math

from ..params import check_float


def check_ratio(method: str, ratio: float) -> float:
    """``ratio`` (mu) must be in (0, 1]."""
    return check_float(method, "ratio", ratio, 0.0, 1.0, low_open=True)


def rows_from_ratio(ratio: float, m: int) -> int:
    """K = ceil(mu * m) (Algorithm 1, input line), at least 1 and at most m.

    A small epsilon keeps ``ceil(0.2 * 10)`` at 2 despite 0.2 * 10 being
    2.0000000000000004 in binary floating point.
    """
    if m <= 0:
        return 0
    return int(min(m, max(1, math.ceil(ratio * m - 1e-9))))
