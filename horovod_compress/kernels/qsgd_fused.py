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

The 4-bit kernels and :func:`exp_quantize_dequant8_range` give the same codes,
bit for bit, as :func:`.quantize.exp_quantize_into` (element i uses word i of
stream ``key``; :func:`.quantize.exp_code` decides), the same floats as
:func:`.quantize.exp_dequantize_into` (2^-e built from its float64 bit pattern
times ``d_scale``: one correctly rounded product); 4-bit codes are packed as
:func:`.quantize.pack_nibbles` does (element 2j in the low nibble). The tests
check all three equalities.

8-bit codes at memory speed: :func:`exp8_quantize_range`,
what ``global_qsgd`` runs on NumPy arrays. The rounding decision of
:func:`.quantize.exp_code` -- up iff W < 2 mant(A), W the top 53 bits of a
uniform 64-bit word, A = |x| scale in float64 -- is settled by the top 16 bits of
W alone unless they equal the top 16 mantissa bits of A (probability 2^-16).
So each element draws 16 bits, four per SplitMix64 word (h_i = lane i mod 4 of
word i div 4), and the word it is rounded with is (2^16 - 1 - h_i) 2^48 + the
top 48 bits of word 2^62 + i (:func:`exp8_word`): uniform and independent
across elements, so every code has exactly the distribution of
:func:`.quantize.exp_code` with a fresh word -- E[2^-e] = A, the paper's
unbiasedness (Definition 1, equation 2), to the same 2^-53 as before, not to the
2^-16 of the draw. The vector loop works on 32-bit lanes: for float32 x it
forms a = |x| fl32(scale) in float32 (within 2^-23 of A) and adds h to a's top
16 mantissa bits, so the carry into the exponent is the round-up; elements
whose sum lies within 2^-6 of the carry point (where a and A could decide
differently, or straddle a power of two), and every a outside the normal range
of the levels, are recomputed with exp_code and the whole word, about 3 in
10^5 of them. Results are exp_code's with the documented words, bit for bit
(tested on adversarial inputs). Costs per 2^20 float32 elements, one core:
0.31-0.33 ms against 0.75-0.8 ms for one SplitMix64 word per element
(:func:`.quantize.exp_quantize_range`), and a memcpy of the gradient 0.28 ms.
:func:`exp8_dequantize_range` dequantizes on float32 bit patterns
(2^-e d_scale rounded to float32 = fl32(d_scale) with e subtracted from its
exponent, the same bits as the float64 product).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .llvm_casts import bits_float32, float32_bits, float64_bits
from .quantize import GOLDEN, bits_float64, exp_code, prefer_512bit_vectors, splitmix64, word_state


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



# ---------------------------------------------------------------------------
# 8-bit exponential dithering at memory speed: 16 random bits per element, exact.

#: Word index where the refinement stream of :func:`exp8_word` starts: element i's low
#: 48 bits come from word ``EXP8_FINE + i`` (2^62: far past every draw word i // 4).
EXP8_FINE = np.uint64(1 << 62)
#: Elements per block of the 8-bit quantizer: the block's draws (a quarter word each) sit in
#: an L1-resident buffer between the generator loop and the rounding loop.
EXP8_BLOCK = 2048
_EMAX8 = 127
_TINY8 = math.ldexp(1.0, _EMAX8 + 53)      # exp_code's tiny_mul for emax = 127
_U = np.uint32
_MIN_NORMAL32 = 1.1754943508222875e-38     # 2^-126


@njit(cache=True, nogil=True, inline="always")
def exp8_draw(key: np.uint64, i: np.uint64) -> np.uint64:
    """h_i: the 16 random bits of element ``i`` -- 16-bit lane i % 4 (little end first) of
    word i // 4 of stream ``key`` (:func:`.quantize.random_word`), as an integer < 2^16."""
    w = splitmix64(word_state(key, i >> np.uint64(2)))
    return (w >> (np.uint64(16) * (i & np.uint64(3)))) & np.uint64(0xFFFF)


@njit(cache=True, nogil=True, inline="always")
def exp8_word_from_draw(key: np.uint64, i: np.uint64, h: np.uint64) -> np.uint64:
    """The 64-bit word element ``i`` is rounded with, given its draw ``h`` (:func:`exp8_draw`):
    (2^16 - 1 - h) 2^48 + (word ``EXP8_FINE`` + i of stream ``key``) >> 16."""
    fine = splitmix64(word_state(key, EXP8_FINE + i))
    return ((np.uint64(0xFFFF) - h) << np.uint64(48)) | (fine >> np.uint64(16))


@njit(cache=True, nogil=True)
def exp8_word(key: np.uint64, i: np.uint64) -> np.uint64:
    """Element ``i``'s rounding word in the 8-bit kernels below (:func:`exp8_quantize_range`):
    uniform on [0, 2^64), its top 16 bits 2^16 - 1 - h_i (:func:`exp8_draw`), its low 48 bits
    from the refinement stream, so words of different elements are independent."""
    return exp8_word_from_draw(key, i, exp8_draw(key, i))


@njit(cache=True, nogil=True, inline="always")
def _lane32(xb: np.uint32, h: np.uint16, s32: np.float32) -> tuple[np.uint32, bool]:
    """(code, needs the scalar path) of a float32 element with bits ``xb`` and draw ``h``.

    a = |x| s32 in float32 approximates the float64 product A = |x| scale that
    :func:`.quantize.exp_code` rounds, within 2^-23 relative, i.e. within 2^-6 of
    the top 16 mantissa bits F of A. Adding h to the top 16 of a's 23 mantissa
    bits carries into the exponent iff F > 2^16 - 1 - h (= the word's top 16
    bits) -- exp_code's "round up" -- except when the sum T = mant(a) + 2^7 h
    lies within 2^-6 F-units of the carry point (2^23 - 132 <= T <= 2^23 + 3,
    which also holds when A and a straddle a power of two): those, and every a
    outside [2^-126, 2^-2) (subnormal, below the smallest levels, at or above
    1/2, NaN/Inf), are flagged; a = 0 gives code 0.
    """
    ax = _U(xb & _U(0x7FFFFFFF))
    from_bits = float32_bits(np.float32(bits_float32(ax) * s32))
    y = _U(from_bits + _U(_U(h) << _U(7)))
    code = _U(_U(_U(127) - _U(y >> _U(23))) | _U(_U(xb >> _U(24)) & _U(0x80)))
    valid = _U(from_bits - _U(1 << 23)) < _U(125 << 23)        # exponent field 1..125
    window = _U(_U(y + _U(132)) & _U(0x7FFFFF)) < _U(136)
    redo = (valid & window) | ((not valid) & (ax != _U(0)))
    return (code if valid else _U(0)), redo


@njit(cache=True, nogil=True, inline="always")
def _lane64(xb: np.uint64, h: np.uint16, scale: float) -> tuple[np.uint32, bool]:
    """(code, needs the scalar path) of a float64 element with bits ``xb`` and draw ``h``:
    exp_code's own product A = |x| scale; hi = its top 32 bits. Adding h to the top 16
    mantissa bits carries iff they exceed 2^16 - 1 - h; a tie (the 16-bit field all ones
    after the add) and A outside [2^-127, 2^-2) are flagged; A = 0 gives code 0."""
    a = abs(bits_float64(np.int64(xb & np.uint64(0x7FFFFFFFFFFFFFFF)))) * scale
    hi = _U(np.uint64(float64_bits(a)) >> np.uint64(32))
    y = _U(hi + _U(_U(h) << _U(4)))
    code = _U(_U(_U(1023) - _U(y >> _U(20))) | _U(np.uint64(xb >> np.uint64(56)) & np.uint64(0x80)))
    valid = _U(hi - _U(896 << 20)) < _U(126 << 20)            # exponent field 896..1021
    tie = _U(y & _U(0xFFFF0)) == _U(0xFFFF0)
    redo = (valid & tie) | ((not valid) & (hi != _U(0)))
    return (code if valid else _U(0)), redo


@njit(cache=True, nogil=True, inline="always")
def _draws(key: np.uint64, words: np.ndarray, b0: int, b1: int) -> np.ndarray:
    """The draws h_i (uint16) of elements b0 <= i < b1, generated into ``words``."""
    w0 = b0 >> 2
    s = word_state(key, np.uint64(w0)) - GOLDEN
    for j in range(np.uint64(0), np.uint64(((b1 + 3) >> 2) - w0)):
        s += GOLDEN
        words[j] = splitmix64(s)
    off = b0 - 4 * w0
    return words.view(np.uint16)[off:off + (b1 - b0)]


@njit(cache=True, nogil=True, inline="always")
def _codes_block(xb: np.ndarray, scale: float, s32: np.float32, hs: np.ndarray,
                 codes: np.ndarray, b0: int, b1: int) -> bool:
    """codes[b0:b1] by the vector path from the bit patterns ``xb`` of x (uint32: float32,
    uint64: float64); True if some element needs the scalar path."""
    cs = codes[b0:b1]
    xs = xb[b0:b1]
    redo = _U(0)
    if xb.itemsize == 4:
        for j in range(np.uint64(0), np.uint64(b1 - b0)):
            c, r = _lane32(xs[j], hs[j], s32)
            cs[j] = np.uint8(c)
            redo = _U(redo | _U(r))
    else:
        for j in range(np.uint64(0), np.uint64(b1 - b0)):
            c, r = _lane64(xs[j], hs[j], scale)
            cs[j] = np.uint8(c)
            redo = _U(redo | _U(r))
    return redo != _U(0)


@njit(cache=True, nogil=True, inline="always")
def _value(xb: np.ndarray, i: int) -> float:
    """x[i] as a float64, from the bit patterns ``xb`` (uint32: float32, uint64: float64)."""
    if xb.itemsize == 4:
        return np.float64(bits_float32(_U(xb[i])))
    return bits_float64(np.int64(xb[i]))


@njit(cache=True, nogil=True, inline="always")
def _scalar_block(xb: np.ndarray, scale: float, s32: np.float32, every: bool, key: np.uint64,
                  hs: np.ndarray, codes: np.ndarray, b0: int, b1: int) -> None:
    """Re-decide the flagged elements of codes[b0:b1] (all of them with ``every``) with
    :func:`.quantize.exp_code` and their whole words."""
    for j in range(b1 - b0):
        i = b0 + j
        redo = every
        if not every:
            if xb.itemsize == 4:
                _, redo = _lane32(_U(xb[i]), hs[j], s32)
            else:
                _, redo = _lane64(np.uint64(xb[i]), hs[j], scale)
        if redo:
            word = exp8_word_from_draw(key, np.uint64(i), np.uint64(hs[j]))
            codes[i] = exp_code(_value(xb, i), scale, _EMAX8, 128, _TINY8, word)


@njit(cache=True, nogil=True, inline="always")
def _fast_dequant_bits(d_scale: float) -> np.int64:
    """The float32 bits of ``d_scale`` if 2 <= fl32(d_scale) < inf (then fl32(2^-e d_scale) =
    fl32(d_scale) 2^-e exactly for every e <= 127: a subtraction on the exponent), else -1."""
    d32 = np.float32(d_scale)
    if d32 >= np.float32(2.0) and d32 < np.inf:
        return np.int64(float32_bits(d32))
    return np.int64(-1)


@njit(cache=True, nogil=True, inline="always")
def _dequant8_bits(codes: np.ndarray, dbits: np.int64, ob: np.ndarray, lo: int, hi: int) -> None:
    """ob[lo:hi] = float32 bits of sign 2^-e d for 8-bit codes, d's bits ``dbits``
    (:func:`_fast_dequant_bits` >= 0): e << 23 off the exponent, the code's sign on top."""
    db = _U(dbits)
    ob = ob[lo:hi]
    cs = codes[lo:hi]
    for i in range(np.uint64(0), np.uint64(hi - lo)):
        c = _U(cs[i])
        e = _U(c & _U(0x7F))
        v = _U(db - _U(e << _U(23))) if e != _U(0) else _U(0)
        ob[i] = _U(v | _U(_U(c & _U(0x80)) << _U(24)))


@njit(cache=True, nogil=True, inline="always")
def _quantize_blocks(xb: np.ndarray, scale: float, key: np.uint64, codes: np.ndarray,
                     d_scale: float, out: np.ndarray, lo: int, hi: int) -> None:
    """The block loop of :func:`exp8_quantize_range` (``out`` empty) and
    :func:`exp8_quantize_dequant_range` (``out`` filled block by block)."""
    words = np.empty(EXP8_BLOCK // 4 + 2, np.uint64)
    s32 = np.float32(scale)
    every = xb.itemsize == 4 and not (s32 >= _MIN_NORMAL32 and s32 < np.inf)  # a loses bits
    with_out = out.size > 0
    dbits = _fast_dequant_bits(d_scale) if out.itemsize == 4 else np.int64(-1)
    ob = out.view(np.uint32)
    for b0 in range(lo, hi, EXP8_BLOCK):
        b1 = min(b0 + EXP8_BLOCK, hi)
        hs = _draws(key, words, b0, b1)
        if every or _codes_block(xb, scale, s32, hs, codes, b0, b1):
            _scalar_block(xb, scale, s32, every, key, hs, codes, b0, b1)
        if with_out:
            if dbits >= 0:
                _dequant8_bits(codes, dbits, ob, b0, b1)
            else:
                exp_dequantize8_range(codes, d_scale, out, b0, b1)


@njit(cache=True, nogil=True)
def exp8_quantize_range(x: np.ndarray, scale: float, key: np.uint64, codes: np.ndarray,
                        lo: int, hi: int) -> None:
    """codes[i], lo <= i < hi: 8-bit exponential codes of float32 or float64 ``x`` (paper,
    Definition 1 and equation 2), i.e. :func:`.quantize.exp_code` (emax 127) of x[i] with
    the word :func:`exp8_word` (key, i).

    ``scale`` >= 0 (y = |x| scale <= 1/2). Per block of :data:`EXP8_BLOCK`
    elements: one SplitMix64 word per four elements fills an L1 buffer with
    16-bit draws, then one branch-free loop (32-bit lanes, 16 per AVX-512
    vector) rounds every element whose draw decides it (:func:`_lane32`,
    :func:`_lane64`: all but about 2^-15 of them), and the rare rest are redone
    with the whole word. A code depends only on (x[i], scale, key, i), so the
    result does not depend on how a caller cuts the range.
    """
    prefer_512bit_vectors()
    none = np.empty(0, np.float32)
    if x.itemsize == 4:
        _quantize_blocks(x.view(np.uint32), scale, key, codes, 1.0, none, lo, hi)
    else:
        _quantize_blocks(x.view(np.uint64), scale, key, codes, 1.0, none, lo, hi)


def exp8_quantize(x: np.ndarray, scale: float, key: int) -> np.ndarray:
    """uint8 codes of :func:`exp8_quantize_range` over all of ``x`` (flattened; float32 or
    float64, other dtypes as float64): the host side of the dispatch kernel ``exp8_quantize``,
    whose GPU side (``kernels.gpu.quantize.exp8_quantize``) gives the same codes."""
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.dtype not in (np.float32, np.float64):
        flat = flat.astype(np.float64)
    codes = np.empty(flat.size, np.uint8)
    exp8_quantize_range(flat, float(scale), np.uint64(key), codes, 0, flat.size)
    return codes


@njit(cache=True, nogil=True)
def exp8_dequantize_range(codes: np.ndarray, d_scale: float, out: np.ndarray,
                          lo: int, hi: int) -> None:
    """out[i] = sign 2^-e d_scale for 8-bit codes ``lo <= i < hi``: the floats of
    :func:`exp_dequantize8_range`, bit for bit. For a float32 ``out`` and
    2 <= fl32(d_scale) < inf (every gradient whose norm 2^c / P is at least 2, i.e.
    norm >= 2^-17 P at 8 bits), 2^-e d_scale rounded to float32 is fl32(d_scale) with its
    exponent lowered by e, so the loop only subtracts e << 23 from a bit pattern (16
    lanes per AVX-512 vector); otherwise the float64 product."""
    dbits = _fast_dequant_bits(d_scale) if out.itemsize == 4 else np.int64(-1)
    if dbits >= 0:
        _dequant8_bits(codes, dbits, out.view(np.uint32), lo, hi)
    else:
        exp_dequantize8_range(codes, d_scale, out, lo, hi)


@njit(cache=True, nogil=True)
def exp8_quantize_dequant_range(x: np.ndarray, scale: float, key: np.uint64, d_scale: float,
                                codes: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """:func:`exp8_quantize_range` and, block by block while the codes are in L1,
    :func:`exp8_dequantize_range` of them times ``d_scale`` into ``out`` (``local``, or the
    average itself on one rank)."""
    prefer_512bit_vectors()
    if x.itemsize == 4:
        _quantize_blocks(x.view(np.uint32), scale, key, codes, d_scale, out, lo, hi)
    else:
        _quantize_blocks(x.view(np.uint64), scale, key, codes, d_scale, out, lo, hi)
