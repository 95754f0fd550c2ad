"""GPU version of :mod:`horovod_compress.kernels.exp_reduce`: Global-QSGD's exponential reduce.

Algorithm 2 of the Global-QSGD paper (unbiased rounding of the sum of two
signed powers of two back to a power of two), branch-free integer arithmetic
on codes ``e | negative << sign_shift``, one thread per byte. Byte ``i``
decides with the CPU kernel's words -- :func:`lane_word` (key, counter + i) for
8-bit codes (the 7 top bits from byte (counter + i) mod 8 of word
(counter + i) div 8 of stream ``key``, the rest from word 2^62 + counter + i),
words ``counter + 2i`` / ``counter + 2i + 1`` for packed 4-bit codes (low / high
nibble) -- so both devices produce the same bytes. Saturations (a rounded sum of 1, clamped
to 1/2) are counted per block and added with one integer atomic per block,
so the count is exact and deterministic.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, int64

from ._common import (
    TPB,
    block_sum,
    empty,
    flat,
    guard_simulator_globals,
    launch,
    to_host,
    zeros,
)
from ..exp_reduce import LANE_FINE
from .rng import random_word


@cuda.jit(device=True)
def exp_reduce_pair(c1, c2, r, sign_shift):
    """Algorithm 2 on two codes with random word ``r``: (code, saturated 0/1)."""
    emask = (np.int64(1) << sign_shift) - 1
    e1 = np.int64(c1) & emask
    e2 = np.int64(c2) & emask
    sign1 = 1 - 2 * ((np.int64(c1) >> sign_shift) & 1)
    sign2 = 1 - 2 * ((np.int64(c2) >> sign_shift) & 1)
    gz1 = np.int64(e1 > 0)
    gz2 = np.int64(e2 > 0)
    sign12 = sign1 * sign2 * gz1 * gz2
    diff = abs(e1 - e2) - (1 - sign12) // 2
    smaller = (np.int64(e1 <= e2) + (1 - gz2)) * gz1
    non_zero = 1 - np.int64(e1 == e2) * np.int64(sign12 == -1)
    sign = sign1 * smaller + sign2 * (1 - smaller)
    dc = min(max(diff, np.int64(0)), np.int64(63))
    event = np.int64(((r >> np.uint64(63 - dc)) >> np.uint64(1)) == np.uint64(0)) * np.int64(diff < 64)
    e_sel = e1 * smaller + e2 * (1 - smaller)
    e = e_sel * non_zero - sign12 * event * non_zero
    saturated = np.int64(e == 0) * np.int64(e_sel * non_zero > 0)
    e = e + saturated
    negative = np.int64(sign < 0) * np.int64(e > 0)
    return e | (negative << sign_shift), saturated


@cuda.jit(device=True)
def lane_word(key, i):
    """The 8-bit operator's word at stream position ``i`` (uint64) of stream ``key``, as
    :func:`horovod_compress.kernels.exp_reduce.lane_word`: R 2^57 + (word 2^62 + i) >> 7,
    R = byte i mod 8 of word i div 8, & 0x7F."""
    w = random_word(key, i >> np.uint64(3))
    r7 = (w >> (np.uint64(8) * (i & np.uint64(7)))) & np.uint64(0x7F)
    return (r7 << np.uint64(57)) | (random_word(key, LANE_FINE + i) >> np.uint64(7))


@cuda.jit(device=True)
def _add_block_sum(sh, v, sat):
    """sat[0] += the block's sum of ``v``: one atomic add per block, none when the sum is 0.

    Every thread must call it (``sh``: shared int64 array of TPB). Kept in this
    module, beside the kernels that call it: the CUDA simulator swaps a device
    function's ``cuda`` global while one thread runs it, and restores it when
    that thread returns, so a function of another module must not touch
    ``cuda`` after its last ``syncthreads``.
    """
    total = block_sum(sh, cuda.threadIdx.x, v)
    if cuda.threadIdx.x == 0 and total != 0:
        cuda.atomic.add(sat, 0, total)


_STREAM8, _STREAM4, _GIVEN = 0, 1, 2   # words: lane_word(key, counter + i); words 2i, 2i + 1; r[i]


@cuda.jit
def _reduce_kernel(mode, a, b, r, sign_shift, key, counter, out, sat):
    """``out[i]`` = Algorithm 2 on bytes ``a[i]``, ``b[i]``; ``sat[0]`` += the saturations.

    ``mode`` ``_STREAM4``: both nibbles of packed 4-bit codes; otherwise one code
    of sign bit ``sign_shift``, with the word of ``_STREAM8`` or ``r[i]`` (``_GIVEN``).
    """
    sh = cuda.shared.array(TPB, int64)
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = np.int64(0)
    while i < a.size:
        x = np.int64(a[i])
        y = np.int64(b[i])
        if mode == _STREAM4:
            lo, s0 = exp_reduce_pair(x & 15, y & 15, random_word(key, counter + np.uint64(2 * i)),
                                     np.int64(3))
            hi, s1 = exp_reduce_pair(x >> 4, y >> 4, random_word(key, counter + np.uint64(2 * i + 1)),
                                     np.int64(3))
            out[i] = np.uint8(lo | (hi << 4))
            s += s0 + s1
        else:
            w = np.uint64(r[i]) if mode == _GIVEN else lane_word(key, counter + np.uint64(i))
            c, z = exp_reduce_pair(x, y, w, sign_shift)
            out[i] = np.uint8(c)
            s += z
        i += stride
    _add_block_sum(sh, s, sat)


def _launch(mode: int, a: Any, b: Any, r: Any, sign_shift: int, key: int, counter: int,
            out: Any) -> int:
    sat = zeros(a, 1, np.int64)
    launch(_reduce_kernel, int(a.size), np.int64(mode), a, b, r, np.int64(sign_shift),
           np.uint64(key), np.uint64(counter), out, sat)
    return int(to_host(sat)[0])


def exp_reduce8_into(a: Any, b: Any, out: Any, key: int, counter: int) -> int:
    """8-bit codes: out[i] = reduce(a[i], b[i]) with :func:`lane_word` (key, counter + i);
    returns saturations. ``out`` may alias ``b``."""
    return _launch(_STREAM8, a, b, a, 7, key, counter, out)


def exp_reduce4_into(a: Any, b: Any, out: Any, key: int, counter: int) -> int:
    """Packed 4-bit codes: both nibbles reduced with words counter+2i, counter+2i+1; returns saturations."""
    return _launch(_STREAM4, a, b, a, 3, key, counter, out)


def exp_reduce_codes_into(a: Any, b: Any, r: Any, sign_shift: int, out: Any) -> int:
    """Unpacked codes with explicit random words ``r``; returns saturations."""
    return _launch(_GIVEN, a, b, r, sign_shift, 0, 0, out)


def exp_reduce_codes(a: Any, b: Any, r: Any, bits: int) -> Any:
    """Pure form: reduced unpacked ``bits``-bit codes of ``a`` and ``b`` given words ``r``."""
    sign_shift = 7 if bits == 8 else 3 if bits == 4 else None
    if sign_shift is None:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    a, b, r = flat(a, "a"), flat(b, "b"), flat(r, "r")
    if not (a.size == b.size == r.size):
        raise ValueError(f"a, b and r must have the same length, got {a.size}, {b.size}, {r.size}")
    out = empty(a, a.size, np.uint8)
    exp_reduce_codes_into(a, b, r, sign_shift, out)
    return out


def exp_reduce_packed(a: Any, b: Any, bits: int, key: int, counter: int = 0) -> tuple[Any, int]:
    """Pure form of the operator's inner loop: (reduced bytes, saturations)."""
    a, b = flat(a, "a"), flat(b, "b")
    if a.size != b.size:
        raise ValueError(f"a and b must have the same length, got {a.size} and {b.size}")
    out = empty(b, b.size, np.uint8)
    if bits == 8:
        sat = exp_reduce8_into(a, b, out, key, counter)
    elif bits == 4:
        sat = exp_reduce4_into(a, b, out, key, counter)
    else:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return out, sat


__all__ = ["exp_reduce4_into", "exp_reduce8_into", "exp_reduce_codes", "exp_reduce_codes_into",
           "exp_reduce_packed", "exp_reduce_pair", "lane_word"]


guard_simulator_globals(globals())
