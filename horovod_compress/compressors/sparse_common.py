"""Helpers shared by the sparsifying methods: k from a density, exact top-k, COO packing.

A COO message is one float32 buffer of 2k words: k int32 indices reinterpreted
as float32 bit patterns, followed by k float32 values -- the "(index, value)
pairs" of the papers' volume tables (2 words per selected entry).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.arrays import get_array_module
from ..kernels.scatter import scatter_sum  # noqa: F401  (re-exported: the methods' COO sum)
from .base import Method
from ..params import check_float
from ..kernels.scatter import SparseScratch, topk_coo, topk_coo_float32
from ..kernels.selection import kth_largest_abs, topk_by_candidates


def k_from_density(method: str, density: float, n: int) -> int:
    """k = max(1, round(density * n)) capped at n (n = 0 gives 0)."""
    if n == 0:
        return 0
    return int(min(n, max(1, round(density * n))))


def check_density(method: str, density: float) -> float:
    """``density`` as a float in (0, 1], else ``ValueError`` naming ``method``."""
    return check_float(method, "density", density, 0.0, 1.0, low_open=True)


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x| (int64, k distinct indices); exact, O(n).

    NumPy float32/float64 vectors: the k-th largest magnitude ``t`` by the
    project's radix select (:func:`~horovod_compress.kernels.selection.kth_largest_abs`,
    two passes for float32), then one pass keeping ``|x_j| > t`` and the
    first ties ``|x_j| == t`` (:func:`~horovod_compress.kernels.scatter.topk_coo`),
    in ascending index order. When ``x`` has fewer than k nonzeros, or on
    CuPy, ``xp.argpartition`` (introselect) picks k distinct indices, zeros
    included, as before.
    """
    xp = get_array_module(x)
    n = x.size
    if k >= n:
        return xp.arange(n)
    if k <= 0:
        return xp.empty(0, dtype=np.int64)
    if xp is np and x.dtype in (np.float32, np.float64):
        flat = np.ascontiguousarray(x).reshape(-1)
        idx, _val, real = exact_topk_coo(flat, k)
        if real == k:
            return idx
    return xp.argpartition(xp.abs(x), n - k)[n - k:]


def exact_topk_coo(flat: np.ndarray, k: int, index_dtype: Any = np.int64,
                   out_idx: np.ndarray | None = None,
                   out_val: np.ndarray | None = None,
                   scratch: dict | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Exact top-k of a flat NumPy float vector as ``(indices, values, real)`` of length k.

    Vectors of at least 2^16 entries: one read of ``flat``
    (:func:`~horovod_compress.kernels.selection.topk_by_candidates`: a sampled
    lower bound on the k-th largest magnitude, the entries above it collected
    in one vectorised pass, the exact k-th largest found among those few),
    written in ascending index order. Where the sample gives no usable bound
    (small vectors, fewer than k nonzeros, a bound that misses) float32 takes
    two passes, the radix select of the k-th largest magnitude fused with the
    packing (:func:`~horovod_compress.kernels.scatter.topk_coo_float32`);
    float64 the radix select, then one pass emitting the entries above it and
    the first ties (:func:`~horovod_compress.kernels.scatter.topk_coo`).
    Either way the same set: every entry above the k-th largest magnitude,
    then the lowest-index ties. Then ``k - real`` padding pairs ``(0, 0.0)``
    when ``flat`` has fewer than k nonzeros (:mod:`horovod_compress.kernels.scatter`).
    ``out_idx``/``out_val`` (length >= k) are written in place when given --
    e.g. the two halves of a COO message buffer; ``scratch`` (a dict kept by
    the caller) holds the candidate buffers between calls.
    """

    if out_idx is None:
        out_idx = np.empty(k, index_dtype)
    if out_val is None:
        out_val = np.empty(k, flat.dtype)
    if k <= 0:
        return out_idx[:0], out_val[:0], 0
    if k < flat.size:
        real = topk_by_candidates(flat, k, out_idx, out_val, scratch=scratch)
        if real is not None:
            return out_idx, out_val, real
    if flat.dtype == np.float32 and k <= flat.size:
        return out_idx, out_val, topk_coo_float32(flat, k, out_idx, out_val)
    thr = kth_largest_abs(flat, k)
    real = topk_coo(flat, thr, k, out_idx, out_val)
    return out_idx, out_val, real


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


def sparse_local(method: Any, name: str, n: int, dtype: np.dtype, idx: np.ndarray,
                 src: np.ndarray, count: int | None = None) -> np.ndarray:
    """The dense ``local`` of ``_reduce``: ``src`` at the first ``count`` of ``idx``, zeros elsewhere.

    NumPy: a per-(method, tensor) reused buffer whose previous entries are
    erased in O(k) (:class:`~horovod_compress.kernels.scatter.SparseScratch`);
    valid until the next call for ``name`` -- error feedback consumes
    ``local`` within the call. CuPy: fresh zeros and a scatter.
    """
    xp = get_array_module(src)
    if xp is not np:
        local = xp.zeros(n, dtype=dtype)
        sel = idx if count is None else idx[:count]
        local[sel] = src[sel]
        return local
    scratch = method.scratch.local.setdefault(name, SparseScratch())
    return scratch.fill(n, dtype, idx, src, count)
