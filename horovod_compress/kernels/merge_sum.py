"""The mean of P sparse (slot, value) lists as a dense vector, summed in float64 (Numba, CPU).

DeepReduce ("DeepReduce: A Sparse-tensor Communication Framework for
Distributed Deep Learning", Kostopoulou et al., NeurIPS 2021, Section 3)
decodes every rank's container into (slots, values) and averages:
``avg = (1/P) sum_j D(c_j)``. Its reference numerics: at each position the
contributions are added in float64, rank by rank (and in a container's own
order within it), starting from 0.0; the sum is rounded once to the tensor's
dtype and divided by P in that dtype -- what ``np.bincount`` with float64
weights, a cast and a division give, at O(n) float64 work and two dense
temporaries per step.

:func:`merge_sum` forms the same numbers from the P lists alone: each list
sorted by slot (a container of a lossless codec already is; others are
sorted stably), a P-way merge visits each touched position once, adds its
contributions in rank order in a float64 register and writes the rounded,
divided result into fresh zeros: O(P k) reads and one write per touched
position, bit for bit the reference. The zeros are ``np.zeros``'s pages,
zero-filled by the kernel on first touch -- cheaper than writing them in the
sweep (measured: a sweep writing every entry of a fresh 16 MB output takes
2.4x as long at P = 1, the page faults then zero each page before the sweep
overwrites it). The merge compares P list
heads per position, so for P above :data:`MERGE_MAX_PARTS` (where P k
approaches n at the densities DeepReduce is used with) the dense float64
scatter-add of :func:`~horovod_compress.kernels.scatter.scatter_sum` is used
instead; it gives the same bits.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit
from .scatter import scatter_sum

#: Largest number of lists merged; above it the dense float64 ``bincount`` path runs.
MERGE_MAX_PARTS = 16
_NO_SLOT = np.iinfo(np.int64).max


@njit(cache=True)
def _merge_sum(out: np.ndarray, slots: np.ndarray, values: np.ndarray, bounds: np.ndarray,
               div: float) -> None:
    """``out[s] = dtype(sum_j values at s, float64, in list order) / div`` over the merged lists.

    List j is ``slots[bounds[j]:bounds[j + 1]]`` (non-decreasing, inside
    ``[0, out.size)``) with its ``values``; ``div`` has ``out``'s dtype, so
    the division rounds in it. Positions no list touches are left as they are.
    """
    p = bounds.size - 1
    ptr = bounds[:p].copy()
    while True:
        pos = _NO_SLOT
        for j in range(p):
            if ptr[j] < bounds[j + 1] and slots[ptr[j]] < pos:
                pos = slots[ptr[j]]
        if pos == _NO_SLOT:
            return
        acc = 0.0
        for j in range(p):
            q = ptr[j]
            while q < bounds[j + 1] and slots[q] == pos:
                acc += np.float64(values[q])
                q += 1
            ptr[j] = q
        out[pos] = acc           # rounded once to out's dtype
        out[pos] = out[pos] / div


@njit(cache=True)
def _non_decreasing(slots: np.ndarray) -> bool:
    for i in range(1, slots.size):
        if slots[i] < slots[i - 1]:
            return False
    return True


def merge_sum(n: int, slots: Sequence[np.ndarray], values: Sequence[np.ndarray],
              dtype: np.dtype, size: int) -> np.ndarray:
    """Dense length-``n`` vector ``dtype(sum_j values_j at slots_j, in float64) / dtype(size)``.

    ``slots[j]`` (int64, inside ``[0, n)``) and ``values[j]`` (any float
    dtype) are list j; contributions to a position are added in list order,
    and in a list's own order within it (a repeated slot adds each time), in
    float64, then rounded to ``dtype`` (float32 or float64) and divided by
    ``size`` in ``dtype``: bit for bit ``np.bincount(concatenated slots,
    float64 values, minlength=n).astype(dtype) / dtype(size)``.
    """
    dtype = np.dtype(dtype)
    if len(slots) > MERGE_MAX_PARTS:
        cat = np.concatenate([np.asarray(s, np.int64) for s in slots])
        weights = np.concatenate([np.asarray(v).astype(np.float64) for v in values])
        return scatter_sum(n, cat, weights, dtype) / dtype.type(size)
    parts_s, parts_v = [], []
    for s, v in zip(slots, values):
        s = np.ascontiguousarray(s, np.int64)
        v = np.asarray(v)
        if v.dtype == np.float16:        # exact in float32 (Numba has no float16 arrays)
            v = v.astype(np.float32)
        if not _non_decreasing(s):
            order = np.argsort(s, kind="stable")
            s, v = s[order], v[order]
        parts_s.append(s)
        parts_v.append(v)
    bounds = np.zeros(len(parts_s) + 1, np.int64)
    np.cumsum([s.size for s in parts_s], out=bounds[1:])
    if not bounds[-1]:
        return np.zeros(n, dtype)
    for s in parts_s:
        if s.size and (s[0] < 0 or s[-1] >= n):
            raise ValueError(f"merge_sum: a slot outside [0, {n})")
    cat_s = parts_s[0] if len(parts_s) == 1 else np.concatenate(parts_s)
    cat_v = parts_v[0] if len(parts_v) == 1 else np.concatenate(parts_v)
    out = np.zeros(n, dtype)
    _merge_sum(out, cat_s, np.ascontiguousarray(cat_v), bounds, dtype.type(size))
    return out


__all__ = ["MERGE_MAX_PARTS", "merge_sum"]
