"""GPU versions of :mod:`horovod_compress.kernels.selection` (Numba CUDA).

Same functions, same contracts, device arrays in and out:

* :func:`select_by_threshold` / :func:`count_at_least` -- ordered compaction
  (see :mod:`._common`) of ``|x| >= thr and x != 0``; indices ascending,
  identical to the CPU kernel's.
* :func:`kth_largest_abs` -- the same radix select on the bit patterns of
  ``|x|`` (Ok-Topk, Algorithm 1, ``th_re_evaluate``), with 8-bit digits so
  each pass's 256-bin histogram lives in shared memory (4 passes for float32,
  8 for float64); the k-th largest key is unique, so the result equals the
  CPU kernel's exactly.
* :func:`gaussian_threshold` -- Gaussiank's estimate from the mean and
  standard deviation (two passes; per-block float64 partial sums added on the
  host in block order, so deterministic, within a few ulps of the CPU's
  sequential sum).
* :func:`coo_sum` -- sparse reduction of a COO list by index: counting sort
  over the dense index range (atomic counts, scan, atomic slot fill), then
  one thread per distinct index sorts its handful of entries by input
  position and adds them in float64 in that order -- the same additions in
  the same order as the CPU kernel, hence bit-identical sums. When the index
  range is far larger than the list (range > 8 m + 2^22) the dense counting
  arrays would dominate; the list is then reduced on the host.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, int64

from ._common import (
    TPB,
    Compactor,
    block_sum,
    blocks_for,
    cast,
    dtype_of,
    empty,
    exclusive_scan,
    fill,
    flat,
    gather,
    grid_stride,
    guard_simulator_globals,
    int_min_max,
    to_device,
    to_host,
    zeros,
)
from ..selection import check_density, threshold_from_moments
from .. import selection as cpu


# ------------------------------------------------------------ threshold select
@cuda.jit(device=True)
def _at_least(x, thr, unused2, unused3, i):
    v = x[i]
    return abs(v) >= thr and v != 0


_ABOVE = Compactor(_at_least)


def _float_vector(x: Any) -> Any:
    x = flat(x)
    if dtype_of(x) not in (np.float32, np.float64):
        x = cast(x, np.float32)
    return x


def select_by_threshold(x: Any, threshold: float) -> tuple[Any, Any]:
    """COO ``(int64 indices ascending, values)`` of the entries with ``|x| >= threshold``, ``x != 0``."""
    x = _float_vector(x)
    thr = dtype_of(x).type(threshold)
    idx = _ABOVE.indices(int(x.size), x, thr, 0, 0, x)
    return idx, gather(x, idx)


def count_at_least(x: Any, threshold: float) -> int:
    """How many entries :func:`select_by_threshold` would select."""
    x = _float_vector(x)
    return _ABOVE.count(int(x.size), x, dtype_of(x).type(threshold), 0, 0, x)


# ------------------------------------------------------------------ radix k-th
@cuda.jit
def _digit_hist_kernel(bits, absmask, prefix, prefix_shift, shift, use_prefix, hist):
    sh = cuda.shared.array(256, int64)
    t = cuda.threadIdx.x
    d = t
    while d < 256:
        sh[d] = 0
        d += TPB
    cuda.syncthreads()
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < bits.size:
        key = np.uint64(bits[i]) & absmask
        if use_prefix == 0 or (key >> prefix_shift) == prefix:
            cuda.atomic.add(sh, int64((key >> shift) & np.uint64(255)), 1)
        i += stride
    cuda.syncthreads()
    d = t
    while d < 256:
        if sh[d] != 0:
            cuda.atomic.add(hist, d, sh[d])
        d += TPB


def _radix_kth_largest_key(bits: Any, k: int, nbits: int, absmask: np.uint64) -> int:
    hist = empty(bits, 256, np.int64)
    prefix = 0
    remaining = k
    nb = blocks_for(bits.size)
    for p in range(nbits // 8):
        shift = nbits - 8 * (p + 1)
        fill(hist, 0)
        _digit_hist_kernel[nb, TPB](bits, absmask, np.uint64(prefix), np.uint64(shift + 8),
                                    np.uint64(shift), np.int64(p > 0), hist)
        h = to_host(hist)
        d = 255
        while d > 0 and h[d] < remaining:
            remaining -= int(h[d])
            d -= 1
        prefix = (prefix << 8) | d
    return prefix


def kth_largest_abs(x: Any, k: int) -> float:
    """The exact k-th largest ``|x|`` (ties counted); ``k <= 0`` -> inf, ``k > n`` -> 0.0."""
    x = flat(x)
    k = int(k)
    if k <= 0:
        return math.inf
    if k > x.size:
        return 0.0
    if dtype_of(x) == np.float64:
        key = _radix_kth_largest_key(x.view(np.uint64), k, 64, np.uint64(0x7FFFFFFFFFFFFFFF))
        return float(np.array([key], dtype=np.uint64).view(np.float64)[0])
    x32 = x if dtype_of(x) == np.float32 else cast(x, np.float32)
    key = _radix_kth_largest_key(x32.view(np.uint32), k, 32, np.uint64(0x7FFFFFFF))
    return float(np.array([key], dtype=np.uint32).view(np.float32)[0])


# ------------------------------------------------------------ Gaussian estimate
@cuda.jit
def _partial_sums_kernel(x, mean, squared, out):
    sh = cuda.shared.array(TPB, np.float64)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = 0.0
    while i < x.size:
        v = np.float64(x[i])
        if squared:
            d = v - mean
            s += d * d
        else:
            s += v
        i += stride
    total = block_sum(sh, t, s)
    if t == 0:
        out[cuda.blockIdx.x] = total


def _mean_std(x: Any) -> tuple[float, float]:
    n = int(x.size)
    nb = blocks_for(n)
    part = empty(x, nb, np.float64)
    _partial_sums_kernel[nb, TPB](x, 0.0, False, part)
    mean = float(to_host(part).sum()) / n
    _partial_sums_kernel[nb, TPB](x, mean, True, part)
    ss = float(to_host(part).sum())
    return mean, (math.sqrt(ss / (n - 1)) if n > 1 else 0.0)


def gaussian_threshold(x: Any, density: float) -> float:
    """Gaussiank's estimate ``|mu| + sigma * Phi^-1(1 - density / 2)`` of the k-th largest ``|x|``."""
    x = _float_vector(x)
    if x.size == 0:
        return math.inf
    check_density(density)
    mean, std = _mean_std(x)
    return threshold_from_moments(float(mean), float(std), density)


# --------------------------------------------------------------- COO reduction
@cuda.jit
def _count_kernel(idx, counts):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < idx.size:
        cuda.atomic.add(counts, idx[i], 1)
        i += stride


@cuda.jit
def _slot_kernel(idx, cursor, members):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < idx.size:
        slot = cuda.atomic.add(cursor, idx[i], 1)
        members[slot] = i
        i += stride


@cuda.jit(device=True)
def _positive(counts, unused1, unused2, unused3, i):
    return counts[i] > 0


_PRESENT = Compactor(_positive)


@cuda.jit(device=True)
def _segment_sum_at(u, uniq, counts, cursor, members, values, out_val):
    i = uniq[u]
    end = cursor[i]
    start = end - counts[i]
    # insertion sort of the segment's input positions (segments hold ~P entries)
    for a in range(start + 1, end):
        key = members[a]
        b = a - 1
        while b >= start and members[b] > key:
            members[b + 1] = members[b]
            b -= 1
        members[b + 1] = key
    s = np.float64(values[members[start]])
    for a in range(start + 1, end):
        s += np.float64(values[members[a]])
    out_val[u] = s


_SEGMENT_SUMS = grid_stride(_segment_sum_at)


def coo_sum(indices: Any, values: Any) -> tuple[Any, Any]:
    """Sum a COO list by index: ``(unique ascending int64 indices, float64 sums)``.

    Equal indices are added in input order in float64, as on the CPU.
    Indices must be non-negative.
    """
    idx = flat(indices, "indices")
    val = flat(values, "values")
    if idx.size != val.size:
        raise ValueError(f"indices and values differ in length ({idx.size} != {val.size})")
    m = int(idx.size)
    if m == 0:
        return empty(idx, 0, np.int64), empty(idx, 0, np.float64)
    if dtype_of(idx) != np.int64:
        idx = cast(idx, np.int64)
    lo, hi = int_min_max(idx)
    if lo < 0:
        raise ValueError(f"indices must be non-negative on the GPU, got minimum {lo}")
    span = hi + 1
    if span > 8 * m + (1 << 22):
        ui, uv = cpu.coo_sum(to_host(idx), to_host(val))
        return to_device(ui, idx), to_device(uv, idx)
    counts = zeros(idx, span, np.int64)
    nb = blocks_for(m)
    _count_kernel[nb, TPB](idx, counts)
    cursor, _ = exclusive_scan(counts)
    members = empty(idx, m, np.int64)
    _slot_kernel[nb, TPB](idx, cursor, members)
    uniq = _PRESENT.indices(span, counts, 0, 0, 0, idx)
    out_val = empty(idx, uniq.size, np.float64)
    _SEGMENT_SUMS(uniq.size, uniq, counts, cursor, members, val, out_val)
    return uniq, out_val


__all__ = ["coo_sum", "count_at_least", "gaussian_threshold", "kth_largest_abs", "select_by_threshold"]


guard_simulator_globals(globals())
