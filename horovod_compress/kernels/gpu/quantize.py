"""GPU versions of :mod:`horovod_compress.kernels.quantize` (Numba CUDA), bit-identical to the CPU.

One thread per element (grid-stride), element ``i`` drawing uniform ``i`` of
stream ``key`` from :mod:`.rng`, exactly as the CPU loop does; the arithmetic
is the CPU kernel's, operation for operation, in float64 (products by powers
of two, ``frexp``/``ldexp`` and ``floor`` are exact, so FMA contraction on the
device cannot change a result). Hence the same ``key`` gives the same codes on
either device -- the property the tests check.

Quantizers (Global-QSGD paper, Definition 1 and eq. 2): linear dithering to
levels j/s (signed int8 levels), exponential dithering to {0} U {2^-e}
(codes ``e | sign << sign_shift``); dequantization; 4-bit packing (element 2j
in the low nibble), unpacking, and the lane-wise SWAR sum of packed signed
nibbles.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from ..quantize import exp_code_layout
from ._common import empty, flat, guard_simulator_globals, launch, ldexp
from .rng import random_uniform


# ------------------------------------------------------------------- linear
@cuda.jit
def linear_quantize_kernel(x, scale, levels, key, out):
    """CUDA: stochastic linear quantization of ``x`` to signed levels in ``[-levels, levels]`` (grid-stride)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.size:
        v = np.float64(x[i])
        y = abs(v) * scale * levels
        q = np.int64(0)
        if y > 0.0 and y < math.inf:
            lo = math.floor(y)
            u = random_uniform(key, np.uint64(i))
            q = np.int64(lo) + np.int64(u < (y - lo))
            if q > levels:
                q = levels
            if v < 0.0:
                q = -q
        out[i] = q
        i += stride


def linear_quantize_into(x: Any, scale: float, levels: int, key: int, out: Any) -> None:
    """out[i] = sign(x[i]) * xi(|x[i]| * scale * levels) with uniform i of stream ``key``."""
    launch(linear_quantize_kernel, x.size, x, np.float64(scale), np.int64(levels),
           np.uint64(key), out)


def linear_quantize(x: Any, scale: float, levels: int, key: int) -> Any:
    """int8 signed levels (levels must be in [1, 127])."""
    if not 1 <= levels <= 127:
        raise ValueError(f"levels must be in [1, 127] for int8 output, got {levels}")
    x = flat(x)
    out = empty(x, x.size, np.int8)
    linear_quantize_into(x, float(scale), int(levels), int(key), out)
    return out


@cuda.jit
def linear_dequantize_kernel(q, scale, out):
    """CUDA: ``out = q * scale`` level by level (grid-stride)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < q.size:
        out[i] = np.float64(q[i]) * scale
        i += stride


def linear_dequantize(q: Any, scale: float, dtype: Any = np.float32) -> Any:
    """Floats ``q * scale`` in ``dtype``."""
    q = flat(q, "q")
    out = empty(q, q.size, dtype)
    launch(linear_dequantize_kernel, q.size, q, np.float64(scale), out)
    return out


# -------------------------------------------------------------- exponential
@cuda.jit
def exp_quantize_kernel(x, scale, emax, sign_shift, key, out):
    """CUDA: stochastic exponential (power-of-two) dithering of ``x`` to sign + exponent codes (grid-stride)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.size:
        v = np.float64(x[i])
        a = abs(v) * scale
        code = np.int64(0)
        if a > 0.0 and a < math.inf:
            m, ex = math.frexp(a)
            e_low = np.int64(1) - np.int64(ex)
            u = random_uniform(key, np.uint64(i))
            if e_low > emax:
                e = emax if u < ldexp(a, emax) else np.int64(0)
            else:
                e = e_low - 1 if u < 2.0 * m - 1.0 else e_low
                if e < 1:
                    e = np.int64(1)
            code = e
            if v < 0.0 and e > 0:
                code = e | (np.int64(1) << sign_shift)
        out[i] = code
        i += stride


def exp_quantize(x: Any, scale: float, bits: int, key: int) -> Any:
    """uint8 exponential codes (unpacked) for ``bits`` 8 or 4."""
    sign_shift, emax = exp_code_layout(bits)
    x = flat(x)
    out = empty(x, x.size, np.uint8)
    launch(exp_quantize_kernel, x.size, x, np.float64(scale), np.int64(emax),
           np.int64(sign_shift), np.uint64(key), out)
    return out


@cuda.jit
def exp_dequantize_kernel(codes, scale, sign_shift, out):
    """CUDA: the values of exponential codes, ``sign * scale * 2^-e`` (code 0 is zero; grid-stride)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    emask = (np.int64(1) << sign_shift) - 1
    while i < codes.size:
        c = np.int64(codes[i])
        e = c & emask
        val = 0.0
        if e > 0:
            val = ldexp(scale, -e)
            if (c >> sign_shift) & 1:
                val = -val
        out[i] = val
        i += stride


def exp_dequantize(codes: Any, scale: float, bits: int, dtype: Any = np.float32) -> Any:
    """Floats ``sign * 2^-e * scale`` of unpacked exponential codes, in ``dtype``."""
    sign_shift, _ = exp_code_layout(bits)
    codes = flat(codes, "codes")
    out = empty(codes, codes.size, dtype)
    launch(exp_dequantize_kernel, codes.size, codes, np.float64(scale),
           np.int64(sign_shift), out)
    return out


# ------------------------------------------------------------------ packing
@cuda.jit
def pack_nibbles_kernel(codes, out):
    """CUDA: two 4-bit codes per byte, element 2i in the low nibble (grid-stride)."""
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = codes.size
    while j < out.size:
        lo = np.int64(codes[2 * j]) & 15
        hi = np.int64(0)
        if 2 * j + 1 < n:
            hi = np.int64(codes[2 * j + 1]) & 15
        out[j] = np.uint8(lo | (hi << 4))
        j += stride


def pack_nibbles(codes: Any) -> Any:
    """Two 4-bit codes per byte, element 2j in the low nibble (int8 levels keep two's complement)."""
    codes = flat(codes, "codes")
    out = empty(codes, (codes.size + 1) // 2, np.uint8)
    launch(pack_nibbles_kernel, out.size, codes, out)
    return out


@cuda.jit
def unpack_nibbles_kernel(packed, signed, out):
    """CUDA: the inverse of :func:`pack_nibbles_kernel`, optionally sign-extending each nibble."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        b = np.int64(packed[i // 2])
        v = (b >> (4 * (i % 2))) & 15
        if signed:
            v = (v ^ 8) - 8
        out[i] = v
        i += stride


def unpack_nibbles(packed: Any, n: int, signed: bool = False) -> Any:
    """``n`` codes from packed bytes: uint8 codes, or int8 levels with ``signed``."""
    packed = flat(packed, "packed")
    if n > 2 * packed.size:
        raise ValueError(f"n must be at most 2 * len(packed) = {2 * packed.size}, got {n}")
    out = empty(packed, int(n), np.int8 if signed else np.uint8)
    launch(unpack_nibbles_kernel, n, packed, bool(signed), out)
    return out


@cuda.jit
def nibble_add_kernel(a, b, out):
    """CUDA: lane-wise sum of two packed 4-bit arrays (the reduction of 4-bit linear codes)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < a.size:
        x = np.int64(a[i])
        y = np.int64(b[i])
        out[i] = np.uint8((((x & 0x77) + (y & 0x77)) ^ ((x ^ y) & 0x88)) & 0xFF)
        i += stride


def nibble_add_into(a: Any, b: Any, out: Any) -> None:
    """Lane-wise sum modulo 16 of two signed 4-bit lanes per byte (SWAR); ``out`` may alias."""
    if a.size != b.size or out.size != a.size:
        raise ValueError(f"a, b and out must have the same length, got {a.size}, {b.size}, {out.size}")
    launch(nibble_add_kernel, a.size, a, b, out)


__all__ = ["exp_dequantize", "exp_quantize", "linear_dequantize", "linear_quantize",
           "linear_quantize_into", "nibble_add_into", "pack_nibbles", "unpack_nibbles"]


guard_simulator_globals(globals())
