"""GPU versions of :mod:`horovod_compress.kernels.quantize` (Numba CUDA), bit-identical to the CPU.

One thread per element (grid-stride, :func:`._common.grid_stride`), element ``i`` drawing uniform ``i`` of
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
from ._common import empty, flat, grid_stride, guard_simulator_globals, ldexp
from .rng import TWO_POW_M53, random_uniform, random_word

#: Index offset of the refinement words of the 8-bit layout (``kernels.qsgd_fused.EXP8_FINE``).
EXP8_FINE = np.uint64(1 << 62)


# ------------------------------------------------------------------- linear
@cuda.jit(device=True)
def _linear_quantize_at(i, x, scale, levels, key, out, _5):
    """Stochastic linear quantization of ``x[i]`` to a signed level in ``[-levels, levels]``."""
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


_LINEAR_QUANTIZE = grid_stride(_linear_quantize_at)


def linear_quantize_into(x: Any, scale: float, levels: int, key: int, out: Any) -> None:
    """out[i] = sign(x[i]) * xi(|x[i]| * scale * levels) with uniform i of stream ``key``."""
    _LINEAR_QUANTIZE(x.size, x, np.float64(scale), np.int64(levels), np.uint64(key), out)


def linear_quantize(x: Any, scale: float, levels: int, key: int) -> Any:
    """int8 signed levels (levels must be in [1, 127])."""
    if not 1 <= levels <= 127:
        raise ValueError(f"levels must be in [1, 127] for int8 output, got {levels}")
    x = flat(x)
    out = empty(x, x.size, np.int8)
    linear_quantize_into(x, float(scale), int(levels), int(key), out)
    return out


@cuda.jit(device=True)
def _linear_dequantize_at(i, q, scale, out, _3, _4, _5):
    out[i] = np.float64(q[i]) * scale


_LINEAR_DEQUANTIZE = grid_stride(_linear_dequantize_at)


def linear_dequantize(q: Any, scale: float, dtype: Any = np.float32) -> Any:
    """Floats ``q * scale`` in ``dtype``."""
    q = flat(q, "q")
    out = empty(q, q.size, dtype)
    _LINEAR_DEQUANTIZE(q.size, q, np.float64(scale), out)
    return out


# -------------------------------------------------------------- exponential
@cuda.jit(device=True)
def _exp_quantize_at(i, x, scale, emax, sign_shift, key, out):
    """Stochastic exponential (power-of-two) dithering of ``x[i]`` to a sign + exponent code
    (element ``i`` draws uniform ``i`` of stream ``key``)."""
    out[i] = _exp_code(np.float64(x[i]), scale, emax, sign_shift, random_uniform(key, np.uint64(i)))


@cuda.jit(device=True)
def _exp_code(v, scale, emax, sign_shift, u):
    """The code of ``v``: exponent e of 2^-e chosen with the probabilities of the paper's
    Definition 1 by the uniform ``u`` in [0, 1); the sign above bit ``sign_shift``; 0 for 0, NaN, Inf."""
    a = abs(v) * scale
    code = np.int64(0)
    if a > 0.0 and a < math.inf:
        m, ex = math.frexp(a)
        e_low = np.int64(1) - np.int64(ex)
        if e_low > emax:
            e = emax if u < ldexp(a, emax) else np.int64(0)
        else:
            e = e_low - 1 if u < 2.0 * m - 1.0 else e_low
            if e < 1:
                e = np.int64(1)
        code = e
        if v < 0.0 and e > 0:
            code = e | (np.int64(1) << sign_shift)
    return code


_EXP_QUANTIZE = grid_stride(_exp_quantize_at)


@cuda.jit(device=True)
def exp8_word(key, i):
    """Element ``i``'s rounding word in Global-QSGD's 8-bit layout (``kernels.qsgd_fused.exp8_word``):
    top 16 bits 2^16 - 1 - (16-bit lane i % 4 of word i // 4), low 48 bits word 2^62 + i >> 16."""
    h = (random_word(key, i >> np.uint64(2)) >> (np.uint64(16) * (i & np.uint64(3)))) & np.uint64(0xFFFF)
    fine = random_word(key, EXP8_FINE + i)
    return ((np.uint64(0xFFFF) - h) << np.uint64(48)) | (fine >> np.uint64(16))


@cuda.jit(device=True)
def _exp8_quantize_at(i, x, scale, key, out, _4, _5):
    """:func:`_exp_quantize_at` at 8 bits (emax 127, sign bit 7) with the word :func:`exp8_word`."""
    u = np.float64(exp8_word(key, np.uint64(i)) >> np.uint64(11)) * TWO_POW_M53
    out[i] = _exp_code(np.float64(x[i]), scale, np.int64(127), np.int64(7), u)


_EXP8_QUANTIZE = grid_stride(_exp8_quantize_at)


def exp8_quantize(x: Any, scale: float, key: int) -> Any:
    """uint8 8-bit exponential codes of ``x`` with the words of :func:`exp8_word`: the codes
    the host's ``kernels.qsgd_fused.exp8_quantize`` gives for the same ``key`` (Global-QSGD's
    8-bit layout), as ``exp_quantize(x, scale, 8, key)`` gives them for word ``i``."""
    x = flat(x)
    out = empty(x, x.size, np.uint8)
    _EXP8_QUANTIZE(x.size, x, np.float64(scale), np.uint64(key), out)
    return out


def exp_quantize(x: Any, scale: float, bits: int, key: int) -> Any:
    """uint8 exponential codes (unpacked) for ``bits`` 8 or 4."""
    sign_shift, emax = exp_code_layout(bits)
    x = flat(x)
    out = empty(x, x.size, np.uint8)
    _EXP_QUANTIZE(x.size, x, np.float64(scale), np.int64(emax), np.int64(sign_shift),
                  np.uint64(key), out)
    return out


@cuda.jit(device=True)
def _exp_dequantize_at(i, codes, scale, sign_shift, out, _4, _5):
    """The value of exponential code i, ``sign * scale * 2^-e`` (code 0 is zero)."""
    c = np.int64(codes[i])
    e = c & ((np.int64(1) << sign_shift) - 1)
    val = 0.0
    if e > 0:
        val = ldexp(scale, -e)
        if (c >> sign_shift) & 1:
            val = -val
    out[i] = val


_EXP_DEQUANTIZE = grid_stride(_exp_dequantize_at)


def exp_dequantize(codes: Any, scale: float, bits: int, dtype: Any = np.float32) -> Any:
    """Floats ``sign * 2^-e * scale`` of unpacked exponential codes, in ``dtype``."""
    sign_shift, _ = exp_code_layout(bits)
    codes = flat(codes, "codes")
    out = empty(codes, codes.size, dtype)
    _EXP_DEQUANTIZE(codes.size, codes, np.float64(scale), np.int64(sign_shift), out)
    return out


# ------------------------------------------------------------------ packing
@cuda.jit(device=True)
def _pack_nibbles_at(j, codes, out, _2, _3, _4, _5):
    """Byte j: codes 2j (low nibble) and 2j + 1 (high nibble, 0 past the end)."""
    lo = np.int64(codes[2 * j]) & 15
    hi = np.int64(0)
    if 2 * j + 1 < codes.size:
        hi = np.int64(codes[2 * j + 1]) & 15
    out[j] = np.uint8(lo | (hi << 4))


_PACK_NIBBLES = grid_stride(_pack_nibbles_at)


def pack_nibbles(codes: Any) -> Any:
    """Two 4-bit codes per byte, element 2j in the low nibble (int8 levels keep two's complement)."""
    codes = flat(codes, "codes")
    out = empty(codes, (codes.size + 1) // 2, np.uint8)
    _PACK_NIBBLES(out.size, codes, out)
    return out


@cuda.jit(device=True)
def _unpack_nibble_at(i, packed, signed, out, _3, _4, _5):
    """Code i of packed bytes, optionally sign-extending the nibble."""
    v = (np.int64(packed[i // 2]) >> (4 * (i % 2))) & 15
    if signed:
        v = (v ^ 8) - 8
    out[i] = v


_UNPACK_NIBBLES = grid_stride(_unpack_nibble_at)


def unpack_nibbles(packed: Any, n: int, signed: bool = False) -> Any:
    """``n`` codes from packed bytes: uint8 codes, or int8 levels with ``signed``."""
    packed = flat(packed, "packed")
    if n > 2 * packed.size:
        raise ValueError(f"n must be at most 2 * len(packed) = {2 * packed.size}, got {n}")
    out = empty(packed, int(n), np.int8 if signed else np.uint8)
    _UNPACK_NIBBLES(n, packed, bool(signed), out)
    return out


@cuda.jit(device=True)
def _nibble_add_at(i, a, b, out, _3, _4, _5):
    """Lane-wise sum of two bytes of packed 4-bit lanes (the reduction of 4-bit linear codes)."""
    x = np.int64(a[i])
    y = np.int64(b[i])
    out[i] = np.uint8((((x & 0x77) + (y & 0x77)) ^ ((x ^ y) & 0x88)) & 0xFF)


_NIBBLE_ADD = grid_stride(_nibble_add_at)


def nibble_add_into(a: Any, b: Any, out: Any) -> None:
    """Lane-wise sum modulo 16 of two signed 4-bit lanes per byte (SWAR); ``out`` may alias."""
    if a.size != b.size or out.size != a.size:
        raise ValueError(f"a, b and out must have the same length, got {a.size}, {b.size}, {out.size}")
    _NIBBLE_ADD(a.size, a, b, out)


__all__ = ["exp_dequantize", "exp_quantize", "linear_dequantize", "linear_quantize",
           "linear_quantize_into", "nibble_add_into", "pack_nibbles", "unpack_nibbles"]


guard_simulator_globals(globals())
