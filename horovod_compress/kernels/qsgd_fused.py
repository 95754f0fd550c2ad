"""Fused Global-QSGD kernels: quantize and dequantize in one pass, by ranges (Numba, CPU).

Global-QSGD (J. Xin, M. Canini, P. Richtárik, S. Horváth, "Global-QSGD:
Allreduce-Compatible Quantization for Distributed Learning with Theoretical
Guarantees", Algorithm 1) quantizes each rank's gradient once, y = |x| / norm,
with the exponential dithering of Definition 1 / equation (2), and needs the
dequantized message ``local`` = sign 2^-e d_scale as well (the feedback
schemes read it). :mod:`.quantize` does that in two passes (codes, then
codes back to floats); the kernels here compute both from the same register
values in one pass over x, and work on element (or byte) ranges so that the
pipelined ring of :func:`~horovod_compress.mpi_collectives.reduce_ops.ring_reduce_once`
can quantize block by block while earlier blocks are on the wire.

Same codes, bit for bit, as :func:`.quantize.exp_quantize_into` (element i
uses word i of stream ``key``; :func:`.quantize.exp_code` decides), same
floats as :func:`.quantize.exp_dequantize_into` (2^-e built from its float64
bit pattern times ``d_scale``: one correctly rounded product); 4-bit codes are
packed as :func:`.quantize.pack_nibbles` does (element 2j in the low nibble).
The tests check all three equalities.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .quantize import GOLDEN, bits_float64, exp_code, splitmix64, word_state


@njit(cache=True, nogil=True, inline="always")
def _exp_value(c: int, sign_shift: int, d_scale: float) -> float:
    """sign 2^-e d_scale of code c = e | (negative << sign_shift); e = 0 gives 0.0."""
    e = c & ((1 << sign_shift) - 1)
    val = bits_float64((1023 - e) << 52) * d_scale
    val = val if e > 0 else 0.0
    return -val if (c >> sign_shift) & 1 else val


@njit(cache=True, nogil=True)
def exp_quantize_dequant8_range(x: np.ndarray, scale: float, emax: int, tiny_mul: float,
                                key: np.uint64, d_scale: float, codes: np.ndarray,
                                local: np.ndarray, lo: int, hi: int) -> None:
    """Elements ``lo <= i < hi``: codes[i] = 8-bit exponential code of x[i] (paper, eq. 2),
    local[i] = its value sign 2^-e times ``d_scale``.

    ``scale`` >= 0 (y = |x| scale <= 1/2), ``tiny_mul`` = 2^(emax + 53) as in
    :func:`.quantize.exp_code`; element i uses word i of stream ``key``.
    """
    s = word_state(key, np.uint64(lo)) - GOLDEN
    for i in range(np.uint64(lo), np.uint64(hi)):
        s += GOLDEN
        c = exp_code(np.float64(x[i]), scale, emax, 128, tiny_mul, splitmix64(s))
        codes[i] = c
        local[i] = _exp_value(c, 7, d_scale)


@njit(cache=True, nogil=True, inline="always")
def _quantize4_range(x, scale, emax, tiny_mul, key, d_scale, packed, local, with_local, lo, hi):
    """Packed 4-bit codes of bytes ``lo <= j < hi`` and, ``with_local``, their values (see below)."""
    n = x.size
    full = min(hi, n // 2)
    s = word_state(key, np.uint64(2 * lo)) - GOLDEN
    for j in range(np.uint64(lo), np.uint64(max(full, lo))):
        i = np.uint64(2) * j
        s += GOLDEN
        c0 = exp_code(np.float64(x[i]), scale, emax, 8, tiny_mul, splitmix64(s))
        s += GOLDEN
        c1 = exp_code(np.float64(x[i + np.uint64(1)]), scale, emax, 8, tiny_mul, splitmix64(s))
        packed[j] = np.uint8(c0 | (c1 << 4))
        if with_local:
            local[i] = _exp_value(c0, 3, d_scale)
            local[i + np.uint64(1)] = _exp_value(c1, 3, d_scale)
    if hi > full and n % 2 == 1 and lo <= n // 2 < hi:   # the odd last element
        i = n - 1
        c0 = exp_code(np.float64(x[i]), scale, emax, 8, tiny_mul,
                      splitmix64(word_state(key, np.uint64(i))))
        packed[n // 2] = np.uint8(c0)
        if with_local:
            local[i] = _exp_value(c0, 3, d_scale)


@njit(cache=True, nogil=True)
def exp_quantize_dequant4_range(x: np.ndarray, scale: float, emax: int, tiny_mul: float,
                                key: np.uint64, d_scale: float, packed: np.ndarray,
                                local: np.ndarray, lo: int, hi: int) -> None:
    """Packed bytes ``lo <= j < hi`` of 4-bit codes (elements 2j, 2j+1; low nibble first) and
    local[2j], local[2j+1] as in :func:`exp_quantize_dequant8_range`.

    An odd element count leaves the last byte's high nibble 0 (as ``pack_nibbles``).
    """
    _quantize4_range(x, scale, emax, tiny_mul, key, d_scale, packed, local, True, lo, hi)


@njit(cache=True, nogil=True)
def exp_quantize4_packed_range(x: np.ndarray, scale: float, emax: int, tiny_mul: float,
                               key: np.uint64, packed: np.ndarray, lo: int, hi: int) -> None:
    """Packed bytes ``lo <= j < hi`` of 4-bit codes only (no ``local``): the codes of
    :func:`exp_quantize_dequant4_range`, for callers whose feedback does not read ``local``."""
    _quantize4_range(x, scale, emax, tiny_mul, key, 1.0, packed, np.empty(0, np.float32),
                     False, lo, hi)


@njit(cache=True, nogil=True)
def exp_dequantize8_range(codes: np.ndarray, d_scale: float, out: np.ndarray,
                          lo: int, hi: int) -> None:
    """out[i] = sign 2^-e d_scale for 8-bit codes ``lo <= i < hi`` (= exp_dequantize_into)."""
    for i in range(np.uint64(lo), np.uint64(hi)):   # unsigned bounds: LLVM vectorises (4x)
        out[i] = _exp_value(np.int64(codes[i]), 7, d_scale)


@njit(cache=True, nogil=True)
def exp_dequantize4_range(packed: np.ndarray, d_scale: float, out: np.ndarray,
                          lo: int, hi: int) -> None:
    """Elements 2j, 2j+1 (< out.size) of packed 4-bit codes in bytes ``lo <= j < hi``,
    times ``d_scale``."""
    n = out.size
    full = min(hi, n // 2)
    for j in range(np.uint64(lo), np.uint64(max(full, lo))):
        b = np.int64(packed[j])
        i = np.uint64(2) * j
        out[i] = _exp_value(b & 15, 3, d_scale)
        out[i + np.uint64(1)] = _exp_value(b >> 4, 3, d_scale)
    if hi > full and n % 2 == 1 and lo <= n // 2 < hi:
        out[n - 1] = _exp_value(np.int64(packed[n // 2]) & 15, 3, d_scale)


def exp_quantize_dequant(x: np.ndarray, scale: float, bits: int, key: int, d_scale: float,
                         local: np.ndarray) -> np.ndarray:
    """Codes of all of ``x`` (uint8; 8-bit one per byte, 4-bit packed two per byte) and
    ``local`` filled with their values times ``d_scale``, in one pass.

    ``scale`` is clamped to >= 0 (a NaN scale gives zeros), as in ``exp_quantize_into``.
    """
    x = np.ascontiguousarray(x).reshape(-1)
    if not scale >= 0.0:
        scale = 0.0
    emax = 127 if bits == 8 else 7
    tiny = math.ldexp(1.0, emax + 53)
    if bits == 8:
        codes = np.empty(x.size, dtype=np.uint8)
        exp_quantize_dequant8_range(x, float(scale), emax, tiny, np.uint64(key), float(d_scale),
                                    codes, local, 0, x.size)
    elif bits == 4:
        codes = np.empty((x.size + 1) // 2, dtype=np.uint8)
        exp_quantize_dequant4_range(x, float(scale), emax, tiny, np.uint64(key), float(d_scale),
                                    codes, local, 0, codes.size)
    else:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return codes

