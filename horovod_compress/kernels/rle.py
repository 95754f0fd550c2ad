"""Run-length encoding of a sparse tensor's bitmap, and LEB128 varints (Numba, CPU).

DeepReduce's RLE index codec ("DeepReduce: A Sparse-tensor Communication Framework for Distributed Deep Learning" (Kostopoulou et al., NeurIPS 2021),
Section 3 and Appendix 11.0.1) views the support S of a sparse vector of length n as a bitmap
B in {0,1}^n (B[i] = 1 iff i in S) and encodes the bitmap as its run lengths.
Symbols alternate, so only the lengths are needed:

    runs = [z_0, o_0, z_1, o_1, ..., z_m]     (2m + 1 entries for m runs of ones)

z_0 >= 0 and z_m >= 0 are the leading and trailing runs of zeros, every other
run is >= 1, and sum(runs) = n. The runs are then written as unsigned LEB128
varints (7 bits per byte, high bit = "more bytes follow"), so a run below 128
costs one byte.

All functions are pure (inputs are never modified) and return a status code
instead of raising, so the same contract can be implemented on a GPU; the
Python callers in :mod:`horovod_compress.codecs` turn a non-zero status into
a ``ValueError``. Status codes: ``OK = 0``, ``TRUNCATED = 1`` (the buffer
ends inside a value), ``OVERFLOW = 2`` (a varint longer than 9 bytes, i.e. above
2**63 - 1), ``INVALID = 3`` (runs that do not describe a bitmap of length n).
"""
from __future__ import annotations

import numpy as np
from numba import njit

OK = 0
TRUNCATED = 1
OVERFLOW = 2
INVALID = 3


@njit(cache=True)
def runs_from_sorted_indices(indices: np.ndarray, n: int) -> np.ndarray:
    """Run lengths ``[z_0, o_0, ..., z_m]`` of the bitmap of ``indices`` over ``[0, n)``.

    ``indices`` must be strictly increasing int64 values in ``[0, n)`` (the
    caller checks). An empty set gives ``[n]``; the full set gives ``[0, n, 0]``.
    """
    k = indices.size
    if k == 0:
        out = np.empty(1, np.int64)
        out[0] = n
        return out
    one_runs = 1
    for j in range(1, k):
        if indices[j] != indices[j - 1] + 1:
            one_runs += 1
    runs = np.empty(2 * one_runs + 1, np.int64)
    runs[0] = indices[0]
    w = 1
    start = indices[0]
    for j in range(1, k):
        if indices[j] != indices[j - 1] + 1:
            runs[w] = indices[j - 1] + 1 - start          # ones
            runs[w + 1] = indices[j] - indices[j - 1] - 1  # zeros between
            w += 2
            start = indices[j]
    runs[w] = indices[k - 1] + 1 - start
    runs[w + 1] = n - indices[k - 1] - 1
    return runs


@njit(cache=True)
def indices_from_runs(runs: np.ndarray, n: int) -> tuple:
    """Inverse of :func:`runs_from_sorted_indices`: ``(indices, status)``.

    Checks that ``runs`` has odd length, that every inner run is >= 1, the
    outer zero runs are >= 0, and that the runs add up to exactly ``n``;
    otherwise returns an empty array and ``INVALID``.
    """
    empty = np.empty(0, np.int64)
    m = runs.size
    if m % 2 == 0:
        return empty, INVALID
    total = 0
    ones = 0
    for j in range(m):
        v = runs[j]
        inner = 0 < j < m - 1
        if v < 0 or (inner and v < 1):
            return empty, INVALID
        if v > n - total:
            return empty, INVALID
        total += v
        if j % 2 == 1:
            ones += v
    if total != n:
        return empty, INVALID
    out = np.empty(ones, np.int64)
    pos = 0
    w = 0
    for j in range(m):
        if j % 2 == 1:
            for q in range(runs[j]):
                out[w] = pos + q
                w += 1
        pos += runs[j]
    return out, OK


@njit(cache=True)
def varint_encode(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 encoding of non-negative int64 ``values`` (uint8 array)."""
    size = 0
    for j in range(values.size):
        v = values[j]
        size += 1
        while v >= 128:
            v >>= 7
            size += 1
    out = np.empty(size, np.uint8)
    w = 0
    for j in range(values.size):
        v = values[j]
        while v >= 128:
            out[w] = np.uint8((v & 127) | 128)
            v >>= 7
            w += 1
        out[w] = np.uint8(v)
        w += 1
    return out


@njit(cache=True)
def varint_decode(buf: np.ndarray, count: int) -> tuple:
    """Read ``count`` LEB128 varints from uint8 ``buf``: ``(values, bytes_used, status)``.

    Never reads past ``buf``; a varint of more than 9 bytes (values are
    < 2**63, 7 bits per byte) is ``OVERFLOW``, a buffer that ends early is ``TRUNCATED``.
    """
    out = np.empty(count, np.int64)
    pos = 0
    nbuf = buf.size
    for j in range(count):
        v = np.int64(0)
        shift = 0
        while True:
            if pos >= nbuf:
                return out[:j], pos, TRUNCATED
            b = np.int64(buf[pos])
            pos += 1
            v |= (b & 127) << shift
            if b < 128:
                break
            if shift == 56:  # a 10th byte would exceed 63 bits
                return out[:j], pos, OVERFLOW
            shift += 7
        out[j] = v
    return out, pos, OK
