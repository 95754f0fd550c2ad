"""GPU versions of :mod:`horovod_compress.kernels.rle` (DeepReduce's RLE index codec).

Same outputs and status codes as the CPU kernels, computed in parallel:

* :func:`runs_from_sorted_indices` -- the starts of the runs of ones are the
  positions j with ``idx[j] != idx[j-1] + 1`` (ordered compaction); run r is
  then computed by one thread from its start and the next run's start.
* :func:`indices_from_runs` -- validity checks per run (one flag, atomic
  max), the start position of every run and the output offset of every run
  of ones by exclusive scans, then each run of ones is written by one thread.
* :func:`varint_encode` -- byte count per value, scan, every value written by
  one thread at its offset.
* :func:`varint_decode` -- the terminating bytes (``b < 128``) by ordered
  compaction; value j spans the bytes after terminator j-1 up to terminator j.
  The first value that is too long (> 9 bytes) or missing decides the status
  exactly as the CPU's sequential reader would (``OVERFLOW`` if 9 bytes with
  the continuation bit exist from its start, else ``TRUNCATED``); values
  before it are decoded one per thread.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from ..rle import INVALID, OK, OVERFLOW, TRUNCATED
from ._common import (Compactor, empty, exclusive_scan, flat, grid_stride, guard_simulator_globals,
                      launch, to_device, to_host, zeros)


# --------------------------------------------------------------- encoding runs
@cuda.jit(device=True)
def _run_start(idx, unused1, unused2, unused3, j):
    return j == 0 or idx[j] != idx[j - 1] + 1


_RUN_STARTS = Compactor(_run_start)


@cuda.jit(device=True)
def _run_at(r, idx, starts, n, runs, _4, _5):
    """Run r of ones (from its start and the next run's) and the zeros before it (and after the last)."""
    nr = starts.size
    k = idx.size
    s = starts[r]
    e = (starts[r + 1] if r + 1 < nr else k) - 1
    if r == 0:
        runs[0] = idx[s]
    else:
        runs[2 * r] = idx[s] - idx[s - 1] - 1
    runs[2 * r + 1] = idx[e] + 1 - idx[s]
    if r == nr - 1:
        runs[2 * r + 2] = n - idx[k - 1] - 1


_RUNS = grid_stride(_run_at)


def runs_from_sorted_indices(indices: Any, n: int) -> Any:
    """Run lengths ``[z_0, o_0, ..., z_m]`` of the bitmap of strictly increasing ``indices`` over [0, n)."""
    idx = flat(indices, "indices")
    k = int(idx.size)
    if k == 0:
        return to_device(np.array([n], np.int64), idx)
    starts = _RUN_STARTS.indices(k, idx, 0, 0, 0, idx)
    runs = empty(idx, 2 * starts.size + 1, np.int64)
    _RUNS(starts.size, idx, starts, np.int64(n), runs)
    return runs


# --------------------------------------------------------------- decoding runs
@cuda.jit
def _check_runs_kernel(runs, n, flag):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    m = runs.size
    while j < m:
        v = runs[j]
        inner = j > 0 and j < m - 1
        if v < 0 or (inner and v < 1) or v > n:
            cuda.atomic.max(flag, 0, 1)
        j += stride


@cuda.jit(device=True)
def _ones_only_at(j, runs, out, _2, _3, _4, _5):
    out[j] = runs[j] if j % 2 == 1 else 0


@cuda.jit(device=True)
def _expand_at(j, runs, pos, offs, out, _4, _5):
    if j % 2 == 1:
        p = pos[j]
        w = offs[j]
        for q in range(runs[j]):
            out[w + q] = p + q


_ONES_ONLY = grid_stride(_ones_only_at)
_EXPAND = grid_stride(_expand_at)


def indices_from_runs(runs: Any, n: int) -> tuple[Any, int]:
    """Inverse of :func:`runs_from_sorted_indices`: ``(indices, status)``; bad runs give ``INVALID``.

    A run above n is rejected before any sum is formed (the CPU rejects it
    when the running total would pass n), so sums cannot overflow.
    """
    runs = flat(runs, "runs")
    m = int(runs.size)
    empty_out = empty(runs, 0, np.int64)
    if m % 2 == 0:
        return empty_out, INVALID
    flag = zeros(runs, 1, np.int64)
    launch(_check_runs_kernel, m, runs, np.int64(n), flag)
    if int(to_host(flag)[0]):
        return empty_out, INVALID
    pos, total = exclusive_scan(runs)
    if total != n:
        return empty_out, INVALID
    ones_only = empty(runs, m, np.int64)
    _ONES_ONLY(m, runs, ones_only)
    offs, ones = exclusive_scan(ones_only)
    out = empty(runs, ones, np.int64)
    if ones:
        _EXPAND(m, runs, pos, offs, out)
    return out, OK


# ------------------------------------------------------------------- varints
@cuda.jit(device=True)
def _varint_size_at(j, values, sizes, _2, _3, _4, _5):
    v = values[j]
    s = 1
    while v >= 128:
        v >>= 7
        s += 1
    sizes[j] = s


@cuda.jit(device=True)
def _varint_write_at(j, values, offs, out, _3, _4, _5):
    v = values[j]
    w = offs[j]
    while v >= 128:
        out[w] = np.uint8((v & 127) | 128)
        v >>= 7
        w += 1
    out[w] = np.uint8(v & 255)


_VARINT_SIZES = grid_stride(_varint_size_at)
_VARINT_WRITE = grid_stride(_varint_write_at)


def varint_encode(values: Any) -> Any:
    """Unsigned LEB128 encoding of non-negative int64 ``values`` (uint8 device array)."""
    values = flat(values, "values")
    k = int(values.size)
    if k == 0:
        return empty(values, 0, np.uint8)
    sizes = empty(values, k, np.int64)
    _VARINT_SIZES(k, values, sizes)
    offs, total = exclusive_scan(sizes)
    out = empty(values, total, np.uint8)
    _VARINT_WRITE(k, values, offs, out)
    return out


@cuda.jit(device=True)
def _terminator(buf, unused1, unused2, unused3, p):
    return buf[p] < 128


_TERMINATORS = Compactor(_terminator)


@cuda.jit
def _first_long_kernel(ends, count, first_bad):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < count:
        start = ends[j - 1] + 1 if j > 0 else 0
        if ends[j] - start > 8:
            cuda.atomic.min(first_bad, 0, j)
        j += stride


@cuda.jit(device=True)
def _varint_decode_at(j, buf, ends, out, _3, _4, _5):
    start = ends[j - 1] + 1 if j > 0 else 0
    v = np.int64(0)
    shift = np.int64(0)
    for p in range(start, ends[j] + 1):
        v |= (np.int64(buf[p]) & 127) << shift
        shift += 7
    out[j] = v


_VARINT_DECODE = grid_stride(_varint_decode_at)


def varint_decode(buf: Any, count: int) -> tuple[Any, int, int]:
    """Read ``count`` LEB128 varints: ``(values, bytes_used, status)`` as the CPU reader returns them."""
    buf = flat(buf, "buf")
    nbuf = int(buf.size)
    count = int(count)
    ends = _TERMINATORS.indices(nbuf, buf, 0, 0, 0, buf)
    have = min(count, int(ends.size))
    bad = to_device(np.array([count], np.int64), buf)
    launch(_first_long_kernel, have, ends, np.int64(have), bad)
    first_bad = min(int(to_host(bad)[0]), have if have < count else count)
    out = empty(buf, first_bad, np.int64)
    _VARINT_DECODE(first_bad, buf, ends, out)
    if first_bad == count:
        used = int(to_host(ends[count - 1:count])[0]) + 1 if count else 0
        return out, used, OK
    start = int(to_host(ends[first_bad - 1:first_bad])[0]) + 1 if first_bad else 0
    if nbuf - start >= 9:
        return out, start + 9, OVERFLOW
    return out, nbuf, TRUNCATED


__all__ = ["indices_from_runs", "runs_from_sorted_indices", "varint_decode", "varint_encode"]


guard_simulator_globals(globals())
