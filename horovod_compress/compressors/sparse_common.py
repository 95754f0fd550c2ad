"""Helpers shared by the sparsifying methods: k from a density, exact top-k, COO packing.

A COO message is one float32 buffer of 2k words: k int32 indices reinterpreted
as float32 bit patterns, followed by k float32 values -- the "(index, value)
pairs" of the papers' volume tables (2 words per selected entry).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.arrays import get_array_module
from .base import Method
from .params import check_float


def k_from_density(method: str, density: float, n: int) -> int:
    """k = max(1, round(density * n)) capped at n (n = 0 gives 0)."""
    if n == 0:
        return 0
    return int(min(n, max(1, round(density * n))))


def check_density(method: str, density: float) -> float:
    return check_float(method, "density", density, 0.0, 1.0, low_open=True)


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x| (unordered, int64); exact, O(n) via introselect.

    NumPy or CuPy (``xp.argpartition``) by the type of ``x``.
    """
    xp = get_array_module(x)
    n = x.size
    if k >= n:
        return xp.arange(n)
    if k <= 0:
        return xp.empty(0, dtype=np.int64)
    return xp.argpartition(xp.abs(x), n - k)[n - k:]


def pack_coo(indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One float32 buffer [indices as int32 bits | values] (on the device of ``values``)."""
    xp = get_array_module(values)
    k = indices.size
    buf = xp.empty(2 * k, dtype=np.float32)
    buf[:k] = indices.astype(np.int32).view(np.float32)
    buf[k:] = values
    return buf


def unpack_coo(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_coo`."""
    k = buf.size // 2
    return get_array_module(buf).ascontiguousarray(buf[:k]).view(np.int32), buf[k:]


def scatter_sum(n: int, indices: np.ndarray, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Dense length-n vector with ``values`` summed at ``indices`` (duplicates add; NumPy or CuPy)."""
    xp = get_array_module(values)
    if indices.size == 0:
        return xp.zeros(n, dtype=dtype)
    return xp.bincount(indices, weights=values, minlength=n).astype(dtype, copy=False)


class DensitySparsifier(Method):
    """Base of the sparsifiers parameterised by ``density`` alone (TopkA, TopkDSA, gTopk).

    Biased, so the default feedback is ``residual`` (EF14); k = density * n
    per tensor or bucket (:func:`k_from_density`).
    """

    biased = True
    default_feedback = "residual"

    def __init__(self, *, density: float = 0.01, feedback: str | None = None,
                 warmup_steps: int = 0, seed: int = 0, **feedback_params: Any) -> None:
        self.density = check_density(self.name, density)
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed,
                         **feedback_params)

    def params(self) -> dict[str, Any]:
        return {"density": self.density, **self.feedback.params()}
