"""Multi-core (Numba ``prange``) variants of the element-wise and selection CPU kernels.

Same results as the serial kernels, bit for bit, on any number of threads:

* :func:`select_by_threshold` / :func:`count_at_least` -- the input is cut
  into ``chunks`` contiguous pieces; pass 1 counts each piece's hits in
  parallel, an exclusive scan of the counts gives each piece its output
  offset, pass 2 writes each piece's hits in parallel. Indices come out
  ascending, as from :mod:`.selection`. Two reads of the input instead of one:
  this pays from about 3 threads on (see benchmarks/kernels.md).
* :func:`linear_quantize` / :func:`exp_quantize` -- element ``i`` draws uniform
  ``i`` of stream ``key`` (:mod:`.quantize`), so the split across threads
  cannot change a bit. The exponential quantizer here also avoids the libm
  ``frexp`` call and the data-dependent branches of the serial kernel (the
  random rounding and the sign are 50/50 branches, mispredicted half the
  time): exponent and mantissa are read from the bit pattern of ``a``, and the
  rounding decision becomes an integer compare -- the same decisions, so the
  same codes, about 8x faster on one core (benchmarks/kernels.md).
* :func:`exp_reduce8_into` / :func:`exp_reduce4_into` -- Global-QSGD's
  Algorithm 2 over the elements in parallel (word ``counter + i`` per
  element, as in :mod:`.exp_reduce`); saturations summed by a reduction.

:mod:`horovod_compress.kernels.dispatch` uses them for NumPy inputs of at
least ``PARALLEL_MIN_SIZE`` elements when Numba runs more than one thread.
"""
from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange

from .exp_reduce import exp_reduce_pair
from .quantize import exp_code_layout, random_uniform, random_word

PARALLEL_MIN_SIZE = 1 << 20


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


@njit(cache=True, parallel=True)
def _select_chunks(x, threshold, nchunks):
    n = x.size
    size = (n + nchunks - 1) // nchunks
    counts = _count_chunks(x, threshold, nchunks)
    offsets = np.zeros(nchunks + 1, np.int64)
    for c in range(nchunks):
        offsets[c + 1] = offsets[c] + counts[c]
    idx = np.empty(offsets[nchunks], np.int64)
    val = np.empty(offsets[nchunks], x.dtype)
    for c in prange(nchunks):
        lo = c * size
        hi = min(lo + size, n)
        w = offsets[c]
        for i in range(lo, hi):
            v = x[i]
            if abs(v) >= threshold and v != 0:
                idx[w] = i
                val[w] = v
                w += 1
    return idx, val


def _float_vector(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    return x


def select_by_threshold(x: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """COO ``(indices ascending, values)`` of ``|x| >= threshold``, ``x != 0`` (multi-threaded)."""
    x = _float_vector(x)
    return _select_chunks(x, x.dtype.type(threshold), _chunks(x.size))


def count_at_least(x: np.ndarray, threshold: float) -> int:
    """How many entries :func:`select_by_threshold` selects (multi-threaded)."""
    x = _float_vector(x)
    return int(_count_chunks(x, x.dtype.type(threshold), _chunks(x.size)).sum())


# ---------------------------------------------------------------------- quantizers
@njit(cache=True, parallel=True)
def linear_quantize_into(x, scale, levels, key, out):
    """out[i] = sign(x[i]) * xi(|x[i]| * scale * levels) (as :func:`.quantize.linear_quantize_into`)."""
    for i in prange(x.size):
        v = np.float64(x[i])
        y = abs(v) * scale * levels
        q = 0
        if y > 0.0 and y < math.inf:
            lo = math.floor(y)
            u = random_uniform(key, np.uint64(i))
            q = np.int64(lo) + np.int64(u < (y - lo))
            if q > levels:
                q = levels
            if v < 0.0:
                q = -q
        out[i] = q


def linear_quantize(x: np.ndarray, scale: float, levels: int, key: int) -> np.ndarray:
    """int8 signed levels, identical to :func:`horovod_compress.kernels.quantize.linear_quantize`."""
    if not 1 <= levels <= 127:
        raise ValueError(f"levels must be in [1, 127] for int8 output, got {levels}")
    x = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(x.size, dtype=np.int8)
    linear_quantize_into(x, float(scale), int(levels), np.uint64(key), out)
    return out


_EXP_MASK = np.int64(0x7FF)
_MANT_MASK = np.int64(0x000FFFFFFFFFFFFF)
_TWO_POW_M53 = 1.0 / 9007199254740992.0


@njit(cache=True, parallel=True)
def exp_quantize_into(x, scale, emax, sign_shift, key, out):
    """Exponential dithering, identical to :func:`.quantize.exp_quantize_into`, branch-free.

    With a = |x| * scale = (1 + f 2^-52) 2^(biased - 1023) (normal), frexp's
    exponent is ex = biased - 1022, so e_low = 1 - ex = 1023 - biased, and
    2m - 1 = f 2^-52. The uniform is u = W 2^-53 with W the top 53 bits of the
    random word, hence ``u < 2m - 1`` is the integer test ``W < 2 f``. Below
    the smallest level (e_low > emax, every subnormal included) the test
    ``u < a 2^emax`` is kept in floating point (both sides exact).
    """
    n = x.size
    two_emax = math.ldexp(1.0, emax)
    nchunks = max(1, min(n, 1024))
    size = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        buf = np.empty(1, np.float64)
        bits = buf.view(np.int64)
        for i in range(c * size, min(c * size + size, n)):
            v = np.float64(x[i])
            a = abs(v) * scale
            buf[0] = a
            b = bits[0]
            biased = (b >> 52) & _EXP_MASK
            frac = b & _MANT_MASK
            w = np.int64(random_word(key, np.uint64(i)) >> np.uint64(11))
            e_low = 1023 - biased
            e_norm = max(e_low - np.int64(w < 2 * frac), 1)
            e_tiny = emax * np.int64(np.float64(w) * _TWO_POW_M53 < a * two_emax)
            e = e_tiny if e_low > emax else e_norm
            e = e * np.int64((a > 0.0) & (biased != _EXP_MASK))  # 0, NaN and inf give code 0
            out[i] = e | (np.int64((v < 0.0) & (e > 0)) << sign_shift)


def exp_quantize(x: np.ndarray, scale: float, bits: int, key: int) -> np.ndarray:
    """uint8 codes identical to :func:`horovod_compress.kernels.quantize.exp_quantize`."""
    sign_shift, emax = exp_code_layout(bits)
    x = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(x.size, dtype=np.uint8)
    exp_quantize_into(x, float(scale), emax, sign_shift, np.uint64(key), out)
    return out


# ---------------------------------------------------------------- exponential reduce
@njit(cache=True, parallel=True)
def exp_reduce8_into(a, b, out, key, counter):
    """As :func:`.exp_reduce.exp_reduce8_into`, multi-threaded; returns the saturations."""
    sat = 0
    for i in prange(a.size):
        r = random_word(key, counter + np.uint64(i))
        c, s = exp_reduce_pair(np.int64(a[i]), np.int64(b[i]), r, 7)
        out[i] = np.uint8(c)
        sat += s
    return sat


@njit(cache=True, parallel=True)
def exp_reduce4_into(a, b, out, key, counter):
    """As :func:`.exp_reduce.exp_reduce4_into`, multi-threaded; returns the saturations."""
    sat = 0
    for i in prange(a.size):
        x = np.int64(a[i])
        y = np.int64(b[i])
        r0 = random_word(key, counter + np.uint64(2 * i))
        r1 = random_word(key, counter + np.uint64(2 * i + 1))
        lo, s0 = exp_reduce_pair(x & 15, y & 15, r0, 3)
        hi, s1 = exp_reduce_pair(x >> 4, y >> 4, r1, 3)
        out[i] = np.uint8(lo | (hi << 4))
        sat += s0 + s1
    return sat


__all__ = ["PARALLEL_MIN_SIZE", "count_at_least", "exp_quantize", "exp_quantize_into",
           "exp_reduce4_into", "exp_reduce8_into", "linear_quantize", "linear_quantize_into",
           "select_by_threshold"]
