"""Multi-core (Numba ``prange``) variants of the element-wise and selection CPU kernels.

Same results as the serial kernels, bit for bit, on any number of threads, and
no slower than them on one thread (each task runs the serial kernel's loop on
its chunk):

* :func:`select_by_threshold` -- one read of the input: each chunk writes
  its hits' indices into its own slice of a lazily committed scratch array
  (:func:`.selection.scan_hits`, the serial kernel's loop), then the chunks'
  hit lists are concatenated at the offsets an exclusive scan of their
  counts gives. Indices come out ascending, as from :mod:`.selection`.
  :func:`count_at_least` counts per chunk.
* :func:`linear_quantize` / :func:`exp_quantize` -- element ``i`` draws word
  ``i`` of stream ``key`` (:mod:`.quantize`), so the split across threads
  cannot change a bit; each chunk of ``_CHUNK`` elements runs the serial
  kernels' element function (:func:`.quantize.linear_level`,
  :func:`.quantize.exp_code`) with its own start state of the generator.
* :func:`exp_reduce8_into` / :func:`exp_reduce4_into` -- Global-QSGD's
  Algorithm 2 over chunks in parallel (byte i decides with
  :func:`.exp_reduce.lane_word` (key, counter + i) at 8 bits, words
  ``counter + 2i`` and ``counter + 2i + 1`` at 4 bits, as in :mod:`.exp_reduce`:
  a word depends only on its position, so the chunking cannot change a bit);
  saturations summed by a reduction.

:mod:`horovod_compress.kernels.dispatch` uses them for NumPy inputs of at
least ``PARALLEL_MIN_SIZE`` elements when Numba runs more than one thread.
"""
from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange

from .bloom import positive_mask_range
from .dispatch import PARALLEL_MIN_SIZE  # noqa: F401 - re-exported; dispatch applies it
from .exp_reduce import exp_reduce4_range, exp_reduce8_range
from .quantize import (
    exp_quantize_by,
    exp_quantize_range,
    linear_quantize_by,
    linear_quantize_range,
)
from .selection import _as_float_vector, scan_hits  # the serial kernels' input rule


def _chunks(n: int) -> int:
    return max(1, min(4 * get_num_threads(), (n + 65535) // 65536))


# ------------------------------------------------------------- threshold selection
@njit(cache=True, parallel=True)
def _count_chunks(x, threshold, nchunks):
    n = x.size
    size = (n + nchunks - 1) // nchunks
    counts = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        lo = c * size
        hi = min(lo + size, n)
        k = 0
        for i in range(lo, hi):
            v = x[i]
            k += (abs(v) >= threshold) & (v != 0)
        counts[c] = k
    return counts


@njit(cache=True)
def _scan_chunk(x, threshold, lo, hi, idx):
    """Hits of x[lo:hi] written to idx[lo:] (a chunk never has more hits than elements)."""
    return scan_hits(x, threshold, lo, hi, idx, lo) - lo


@njit(cache=True, parallel=True)
def _select_chunks(x, threshold, nchunks):
    n = x.size
    size = (((n + nchunks - 1) // nchunks + 63) // 64) * 64
    idx = np.empty(n, np.int64)  # lazily committed: only pages holding hits are touched
    counts = np.empty(nchunks, np.int64)
    for c in prange(nchunks):
        lo = min(c * size, n)
        counts[c] = _scan_chunk(x, threshold, lo, min(lo + size, n), idx)
    offsets = np.zeros(nchunks + 1, np.int64)
    for c in range(nchunks):
        offsets[c + 1] = offsets[c] + counts[c]
    out_idx = np.empty(offsets[nchunks], np.int64)
    out_val = np.empty(offsets[nchunks], x.dtype)
    for c in prange(nchunks):
        lo = min(c * size, n)
        w = offsets[c]
        for j in range(counts[c]):
            p = idx[lo + j]
            out_idx[w + j] = p
            out_val[w + j] = x[p]
    return out_idx, out_val


def select_by_threshold(x: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """COO ``(indices ascending, values)`` of ``|x| >= threshold``, ``x != 0`` (multi-threaded)."""
    x = _as_float_vector(x)
    return _select_chunks(x, x.dtype.type(threshold), _chunks(x.size))


def count_at_least(x: np.ndarray, threshold: float) -> int:
    """How many entries :func:`select_by_threshold` selects (multi-threaded)."""
    x = _as_float_vector(x)
    return int(_count_chunks(x, x.dtype.type(threshold), _chunks(x.size)).sum())


# ---------------------------------------------------------------------- quantizers
_CHUNK = 1 << 16  # elements per parallel task of the quantizers


@njit(cache=True, parallel=True)
def linear_quantize_into(x, scale, levels, key, out):
    """out[i] = sign(x[i]) * xi(|x[i]| * scale * levels) (as :func:`.quantize.linear_quantize_into`)."""
    if not scale >= 0.0:
        scale = 0.0
    n = x.size
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        linear_quantize_range(x, scale, levels, key, out, c * _CHUNK, min(c * _CHUNK + _CHUNK, n))


def linear_quantize(x: np.ndarray, scale: float, levels: int, key: int) -> np.ndarray:
    """int8 signed levels, identical to :func:`horovod_compress.kernels.quantize.linear_quantize`."""
    return linear_quantize_by(linear_quantize_into, x, scale, levels, key)


@njit(cache=True, parallel=True)
def exp_quantize_into(x, scale, emax, sign_shift, key, out):
    """Exponential dithering, identical to :func:`.quantize.exp_quantize_into` (same element function)."""
    if not scale >= 0.0:
        scale = 0.0
    tiny_mul = math.ldexp(1.0, emax + 53)
    sign_bit = np.int64(1) << sign_shift
    n = x.size
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        exp_quantize_range(x, scale, emax, sign_bit, tiny_mul, key, out, c * _CHUNK,
                           min(c * _CHUNK + _CHUNK, n))


def exp_quantize(x: np.ndarray, scale: float, bits: int, key: int) -> np.ndarray:
    """uint8 codes identical to :func:`horovod_compress.kernels.quantize.exp_quantize`."""
    return exp_quantize_by(exp_quantize_into, x, scale, bits, key)


# ---------------------------------------------------------------- exponential reduce
@njit(cache=True, parallel=True)
def _exp_reduce_into(a, b, out, key, counter, packed4):
    """Algorithm 2 over chunks in parallel: packed 4-bit codes or 8-bit codes; the saturations."""
    n = a.size
    sat = 0
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        if packed4:
            sat += exp_reduce4_range(a, b, out, key, counter, lo, hi)
        else:
            sat += exp_reduce8_range(a, b, out, key, counter, lo, hi)
    return sat


def exp_reduce8_into(a: np.ndarray, b: np.ndarray, out: np.ndarray, key: int, counter: int) -> int:
    """As :func:`.exp_reduce.exp_reduce8_into`, multi-threaded; returns the saturations."""
    return _exp_reduce_into(a, b, out, key, counter, False)


def exp_reduce4_into(a: np.ndarray, b: np.ndarray, out: np.ndarray, key: int, counter: int) -> int:
    """As :func:`.exp_reduce.exp_reduce4_into`, multi-threaded; returns the saturations."""
    return _exp_reduce_into(a, b, out, key, counter, True)


# ---------------------------------------------------------------------- Bloom query
@njit(cache=True, parallel=True)
def _positive_mask(bits, m, h, seed, n):
    mask = np.empty(n, np.bool_)
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        positive_mask_range(bits, m, h, seed, mask, c * _CHUNK, min(c * _CHUNK + _CHUNK, n))
    return mask


def bloom_query_range(bits: np.ndarray, m: int, h: int, seed: np.uint64, n: int) -> np.ndarray:
    """All positives in ``[0, n)``, identical to :func:`horovod_compress.kernels.bloom.bloom_query_range`."""
    return np.flatnonzero(_positive_mask(bits, m, h, seed, n)).astype(np.int64)


__all__ = ["PARALLEL_MIN_SIZE", "bloom_query_range", "count_at_least", "exp_quantize", "exp_quantize_into",
           "exp_reduce4_into", "exp_reduce8_into", "linear_quantize", "linear_quantize_into",
           "select_by_threshold"]
