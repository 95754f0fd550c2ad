"""Stochastic quantization kernels for QSGD and Global-QSGD (Numba, CPU).

Every kernel is pure: NumPy arrays and scalars in, arrays out (``*_into``
variants write into an ``out`` array the caller passes); all randomness comes
from an explicit 64-bit ``key`` through a counter-based generator, so a call is
reproducible and every element can be computed independently (the GPU port
computes element ``i`` from ``(key, i)`` exactly as here).

Random numbers -- SplitMix64 as a counter-based hash
----------------------------------------------------
The i-th random word of stream ``key`` is ``splitmix64(key + (i + 1) * G)``
with ``G = 0x9E3779B97F4A7C15`` (Steele, Lea, Flood, "Fast splittable
pseudorandom number generators", 2014): the finaliser of SplitMix64 applied to
the i-th state of its Weyl sequence. A uniform double in [0, 1) is the top 53
bits of the word times 2^-53. Callers derive ``key`` from (seed, tensor name,
step, rank, purpose) -- see :meth:`Method.local_rng` -- so streams of different
ranks, steps and tensors are independent.

Quantizers (Global-QSGD paper, Definition 1 and equation 2)
------------------------------------------------------------
Both map y = |x| * scale in [0, 1] to one of the two adjacent levels
l_low <= y <= l_high, choosing l_high with probability
(y - l_low) / (l_high - l_low), so E[xi(y)] = y (unbiased).

* linear:       levels j / s, j = 0..s. Output is the signed integer level
                sign(x) * j in int8 (|j| <= s <= 127).
* exponential:  levels {0} U {2^-e : e = 1..emax}. Output is a code
                ``e | (sign << sign_shift)`` in uint8, with e = 0 meaning 0
                (8-bit: sign_shift 7, emax 127; 4-bit: sign_shift 3, emax 7).
                The caller pre-scales so that y <= 1/2 (Global-QSGD divides
                by a power of two >= 2P, section 4.3); a value above 1/2 is
                saturated to e = 1 (documented bias for misuse only).

Non-finite inputs (NaN, +-Inf) quantize to 0: the kernels never raise and
never emit a code outside the representation. The methods detect non-finite
gradients before quantizing (their norm is non-finite) and apply their own
documented policy; the kernels' behaviour is only a safety net.

Speed: the element functions (:func:`linear_level`, :func:`exp_code`) are
branch-free and read the exponent and mantissa from the float64 bit pattern
(:func:`float64_bits`, no ``frexp``), and the loops advance the generator's
Weyl state by one addition per element (:func:`word_state`), so LLVM
vectorises them (4 lanes: LLVM's tuning for this CPU prefers 256-bit vectors even
with AVX-512, whose ``vpmullq`` does SplitMix64's two multiplies); the same decisions as the scalar definition, bit for bit (the
GPU kernels in ``gpu/quantize.py`` still use ``frexp`` and agree).

Packing: 4-bit codes go two per byte, element 2j in the low nibble and 2j+1 in
the high nibble (an odd tail leaves the last high nibble 0). Signed 4-bit
linear levels are stored in two's complement within the nibble.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from .llvm_casts import bits_float64, float64_bits

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TWO_POW_M53 = 1.0 / 9007199254740992.0  # 2^-53
_MANT_BITS = np.int64((1 << 52) - 1)


# ----------------------------------------------------------------- random words
@njit(cache=True, inline="always")
def splitmix64(state: np.uint64) -> np.uint64:
    """SplitMix64 finaliser (a bijective 64-bit mixing function)."""
    z = state
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def random_word(key: np.uint64, index: np.uint64) -> np.uint64:
    """The ``index``-th 64-bit word of stream ``key``: splitmix64(key + (index+1) G)."""
    return splitmix64(key + (index + np.uint64(1)) * GOLDEN)


@njit(cache=True, inline="always")
def random_uniform(key: np.uint64, index: np.uint64) -> float:
    """The ``index``-th uniform double in [0, 1) of stream ``key`` (53 random bits)."""
    return np.float64(random_word(key, index) >> np.uint64(11)) * _TWO_POW_M53


@njit(cache=True, inline="always")
def word_state(key: np.uint64, index: np.uint64) -> np.uint64:
    """The Weyl state ``key + (index + 1) G`` whose mix is word ``index`` of stream ``key``.

    Loops draw consecutive words as ``s = word_state(key, start) - G`` and then
    ``s += G; w = splitmix64(s)`` per element: an induction variable, so LLVM
    vectorises the loop without a 64-bit multiply for ``i * G``.
    """
    return key + (index + np.uint64(1)) * GOLDEN


@intrinsic
def prefer_512bit_vectors(typingctx):
    """Mark the calling Numba function for 512-bit vectorisation (no effect on its results).

    Adds the LLVM function attributes ``"prefer-vector-width"="512"`` and
    ``"min-legal-vector-width"="512"`` to the function being compiled. LLVM's
    tuning for this project's AVX-512 CPUs prefers 256-bit vectors process-wide
    (``prefer-256-bit``), so a loop over 64-bit lanes runs 4 lanes wide; these
    attributes let the loop vectoriser of *this* function use 8 lanes (``zmm``)
    without changing Numba's target for anything else.
    Only instruction selection changes, never a result; on a CPU without
    AVX-512 the attributes are ignored. Call it first thing in a kernel.
    Used where it measured faster (N = 2^20, one core): Algorithm 2's loops
    (``exp_reduce``: 1.3 -> 0.93 ms) and the norm's integer max; not in the
    quantizers (no change) nor in dequantization (about 10% slower).
    """
    sig = types.void()

    def codegen(context, builder, signature, args):
        attrs = builder.function.attributes
        # llvmlite accepts only keyword attributes; key="value" ones are written verbatim
        set.add(attrs, '"prefer-vector-width"="512"')
        set.add(attrs, '"min-legal-vector-width"="512"')
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def random_words(key: np.uint64, start: np.uint64, n: int) -> np.ndarray:
    """Words ``start .. start+n-1`` of stream ``key`` as a uint64 array."""
    out = np.empty(n, dtype=np.uint64)
    for i in range(n):
        out[i] = random_word(key, start + np.uint64(i))
    return out


@njit(cache=True)
def random_uniforms(key: np.uint64, start: np.uint64, n: int) -> np.ndarray:
    """Uniforms ``start .. start+n-1`` of stream ``key`` as a float64 array."""
    out = np.empty(n, dtype=np.float64)
    for i in range(n):
        out[i] = random_uniform(key, start + np.uint64(i))
    return out


# -------------------------------------------------------------- linear dithering
@njit(cache=True, inline="always")
def linear_level(v: float, scale: float, levels: int, word: np.uint64) -> int:
    """Signed level of one element with random word ``word`` (shared by the serial and parallel loops).

    Branch-free, so the element loops vectorise. y = |v| scale levels (in
    this order, as the NumPy reference); y = 0 gives level 0 by itself
    (floor 0, and u < 0 is false), y above ``levels`` is clipped before the
    rounding (same level as rounding then clipping), NaN and inf are masked by ``y < inf``;
    ``scale`` must be >= 0 (the wrappers map a negative or NaN scale to 0).
    """
    y = abs(v) * scale * levels
    yc = min(y, np.float64(levels))  # above the top level: level ``levels`` (u < 0 is false)
    lo = math.floor(yc)
    u = np.float64(np.int64(word >> np.uint64(11))) * _TWO_POW_M53
    q = np.int64(lo) + np.int64(u < (yc - lo))
    q = q if y < math.inf else 0
    return -q if v < 0.0 else q


@njit(cache=True)
def linear_quantize_into(x: np.ndarray, scale: float, levels: int, key: np.uint64,
                         out: np.ndarray) -> None:
    """out[i] = sign(x[i]) * xi(|x[i]| * scale * levels), levels j in [0, levels].

    ``scale`` is 1 / norm (0 for an all-zero input gives all zeros; a negative
    or NaN scale gives all zeros too); a value above the top level is clipped
    to ``levels``; NaN/Inf give 0. ``out`` is an integer array (int8 for
    levels <= 127). Element i uses uniform i of stream ``key``.
    """
    if not scale >= 0.0:
        scale = 0.0
    linear_quantize_range(x, scale, levels, key, out, 0, x.size)


@njit(cache=True)
def linear_quantize_range(x: np.ndarray, scale: float, levels: int, key: np.uint64,
                          out: np.ndarray, lo: int, hi: int) -> None:
    """Elements ``lo <= i < hi`` of :func:`linear_quantize_into` (``scale`` >= 0 already).

    The loop of the serial kernel and of each chunk of :mod:`.parallel`'s;
    unsigned bounds and the additive Weyl state let LLVM vectorise it.
    """
    s = word_state(key, np.uint64(lo)) - GOLDEN
    for i in range(np.uint64(lo), np.uint64(hi)):
        s += GOLDEN
        out[i] = linear_level(np.float64(x[i]), scale, levels, splitmix64(s))


def linear_quantize(x: np.ndarray, scale: float, levels: int, key: int) -> np.ndarray:
    """int8 signed levels of :func:`linear_quantize_into` (levels must be <= 127)."""
    return linear_quantize_by(linear_quantize_into, x, scale, levels, key)


def linear_quantize_by(into: Any, x: np.ndarray, scale: float, levels: int, key: int) -> np.ndarray:
    """Check ``levels``, allocate the int8 output and fill it with ``into`` (serial or parallel kernel)."""
    if not 1 <= levels <= 127:
        raise ValueError(f"levels must be in [1, 127] for int8 output, got {levels}")
    x = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(x.size, dtype=np.int8)
    into(x, float(scale), int(levels), np.uint64(key), out)
    return out


@njit(cache=True)
def linear_dequantize_into(q: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out[i] = q[i] * scale (integer levels or level sums back to floats)."""
    for i in range(q.size):
        out[i] = np.float64(q[i]) * scale


def linear_dequantize(q: np.ndarray, scale: float, dtype: np.dtype = np.float32) -> np.ndarray:
    """Floats ``q * scale`` in ``dtype``."""
    q = np.ascontiguousarray(q).reshape(-1)
    out = np.empty(q.size, dtype=dtype)
    linear_dequantize_into(q, float(scale), out)
    return out


# ---------------------------------------------------------- exponential dithering
@njit(cache=True, inline="always")
def exp_code(v: float, scale: float, emax: int, sign_bit: int, tiny_mul: float,
             word: np.uint64) -> int:
    """Code of one element with random word ``word`` (shared by the serial and parallel loops).

    Branch-free, no libm call: with a = |v| scale = (1 + f 2^-52) 2^(biased-1023)
    (normal), frexp's exponent is biased - 1022, so e_low = 1023 - biased,
    and rounding up (to 2^-e_low) happens with probability f 2^-52, i.e. iff
    W < 2 f for the top 53 bits W of the word (u = W 2^-53 < f 2^-52, exact).
    Below the smallest level (e_low > emax: tiny normals, subnormals and 0)
    the test is u < a 2^emax, i.e. W < a 2^(emax+53) = a ``tiny_mul`` (both
    sides exact; a = 0 gives code 0 here). NaN and inf fail ``a < inf``.
    ``sign_bit`` = 1 << sign_shift.
    """
    w = np.int64(word >> np.uint64(11))
    a = abs(v) * scale
    b = float64_bits(a)
    e_low = 1023 - (b >> 52)
    e_norm = max(e_low - np.int64(w < ((b & _MANT_BITS) << 1)), 1)
    e_tiny = emax if np.float64(w) < a * tiny_mul else 0
    e = e_tiny if e_low > emax else e_norm
    e = e if a < math.inf else 0
    return e | sign_bit if (v < 0.0) & (e > 0) else e


@njit(cache=True)
def exp_quantize_into(x: np.ndarray, scale: float, emax: int, sign_shift: int,
                      key: np.uint64, out: np.ndarray) -> None:
    """Exponential stochastic rounding of y = |x| * scale to {0} U {2^-e, 1 <= e <= emax}.

    For y in [2^-(e+1), 2^-e), i.e. y = (1 + f) 2^-(e+1) with f in [0, 1) the
    fraction of its float64 mantissa, the code is e (value 2^-e) with
    probability (y - 2^-(e+1)) / 2^-(e+1) = f and e+1 otherwise; below the
    smallest level, 2^-emax is chosen with probability y 2^emax and 0
    otherwise. Codes: ``e | (negative << sign_shift)``; zero is always code 0;
    a value above 1/2 saturates to e = 1; NaN/Inf (and a negative or NaN
    ``scale``) give 0. Element i uses word i of stream ``key``: up iff
    (word >> 11) < 2 * mantissa (u < f with u = (word >> 11) 2^-53,
    f = mantissa 2^-52), so no rounding. See :func:`exp_code`.
    """
    if not scale >= 0.0:
        scale = 0.0
    exp_quantize_range(x, scale, emax, np.int64(1) << sign_shift, math.ldexp(1.0, emax + 53), key,
                       out, 0, x.size)


@njit(cache=True)
def exp_quantize_range(x: np.ndarray, scale: float, emax: int, sign_bit: int, tiny_mul: float,
                       key: np.uint64, out: np.ndarray, lo: int, hi: int) -> None:
    """Elements ``lo <= i < hi`` of :func:`exp_quantize_into` (``scale`` >= 0 already;
    ``sign_bit`` = 1 << sign_shift, ``tiny_mul`` = 2^(emax+53), see :func:`exp_code`).

    The loop of the serial kernel and of each chunk of :mod:`.parallel`'s.
    """
    s = word_state(key, np.uint64(lo)) - GOLDEN
    for i in range(np.uint64(lo), np.uint64(hi)):
        s += GOLDEN
        out[i] = exp_code(np.float64(x[i]), scale, emax, sign_bit, tiny_mul, splitmix64(s))


def exp_quantize(x: np.ndarray, scale: float, bits: int, key: int) -> np.ndarray:
    """uint8 codes (one per element, unpacked) of :func:`exp_quantize_into` for ``bits`` 8 or 4."""
    return exp_quantize_by(exp_quantize_into, x, scale, bits, key)


def exp_quantize_by(into: Any, x: np.ndarray, scale: float, bits: int, key: int) -> np.ndarray:
    """Allocate the uint8 codes for ``bits`` and fill them with ``into`` (serial or parallel kernel)."""
    sign_shift, emax = exp_code_layout(bits)
    x = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(x.size, dtype=np.uint8)
    into(x, float(scale), emax, sign_shift, np.uint64(key), out)
    return out


@njit(cache=True)
def exp_dequantize_into(codes: np.ndarray, scale: float, sign_shift: int,
                        out: np.ndarray) -> None:
    """out[i] = sign * 2^-e * scale for code (sign, e); e = 0 gives (signed) 0.

    2^-e is built from its float64 bit pattern ``(1023 - e) << 52`` (exact for
    e <= 1022) and multiplied by ``scale``: one correctly rounded product,
    i.e. ``ldexp(scale, -e)`` bit for bit (the GPU kernel's table), but
    branch-free and without a per-element table gather, so LLVM vectorises
    the loop (4x faster than the 256-entry lookup on AVX-512).
    """
    cmask = (2 << sign_shift) - 1
    emask = (1 << sign_shift) - 1
    for i in range(codes.size):
        c = np.int64(codes[i]) & cmask
        e = c & emask
        val = bits_float64((1023 - e) << 52) * scale
        val = val if e > 0 else 0.0
        out[i] = -val if (c >> sign_shift) & 1 else val


def exp_dequantize(codes: np.ndarray, scale: float, bits: int,
                   dtype: np.dtype = np.float32) -> np.ndarray:
    """Floats of unpacked exponential codes, times ``scale``, in ``dtype``."""
    sign_shift, _ = exp_code_layout(bits)
    codes = np.ascontiguousarray(codes).reshape(-1)
    out = np.empty(codes.size, dtype=dtype)
    exp_dequantize_into(codes, float(scale), sign_shift, out)
    return out


def exp_code_layout(bits: int) -> tuple[int, int]:
    """(sign_shift, emax) of a ``bits``-bit exponential code: 8 -> (7, 127), 4 -> (3, 7)."""
    if bits == 8:
        return 7, 127
    if bits == 4:
        return 3, 7
    raise ValueError(f"bits must be 8 or 4, got {bits!r}")


# ---------------------------------------------------------------------- packing
@njit(cache=True)
def pack_nibbles_into(codes: np.ndarray, out: np.ndarray) -> None:
    """out[j] = (codes[2j] & 15) | (codes[2j+1] & 15) << 4; ``out`` has ceil(n/2) bytes."""
    n = codes.size
    for j in range(n // 2):
        out[j] = np.uint8((np.int64(codes[2 * j]) & 15) | ((np.int64(codes[2 * j + 1]) & 15) << 4))
    if n % 2:
        out[n // 2] = np.uint8(np.int64(codes[n - 1]) & 15)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte (low nibble first); signed int8 levels keep two's complement."""
    codes = np.ascontiguousarray(codes).reshape(-1)
    out = np.empty((codes.size + 1) // 2, dtype=np.uint8)
    pack_nibbles_into(codes, out)
    return out


@njit(cache=True)
def unpack_nibbles_into(packed: np.ndarray, signed: bool, out: np.ndarray) -> None:
    """Inverse of packing: out[2j] = low nibble, out[2j+1] = high nibble (n = out.size).

    With ``signed`` the nibble is read as a two's complement value in [-8, 7].
    """
    n = out.size
    for i in range(n):
        b = np.int64(packed[i // 2])
        v = (b >> (4 * (i % 2))) & 15
        if signed:
            v = (v ^ 8) - 8
        out[i] = v


def unpack_nibbles(packed: np.ndarray, n: int, signed: bool = False) -> np.ndarray:
    """``n`` codes from packed bytes: uint8 codes, or int8 levels with ``signed``."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    if n > 2 * packed.size:
        raise ValueError(f"n must be at most 2 * len(packed) = {2 * packed.size}, got {n}")
    out = np.empty(n, dtype=np.int8 if signed else np.uint8)
    unpack_nibbles_into(packed, bool(signed), out)
    return out


@njit(cache=True)
def nibble_add_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """Lane-wise sum of two signed 4-bit lanes per byte, modulo 16 per lane (SWAR).

    out = ((a & 0x77) + (b & 0x77)) ^ ((a ^ b) & 0x88): the low three bits of
    each lane are added with the carry stopped at the lane's top bit, whose
    value is then the XOR of both top bits and the carry. Exact whenever every
    true lane sum lies in [-8, 7], which linear dithering guarantees by
    choosing s <= 7 / P (so no partial sum of up to P ranks can overflow).
    """
    for i in range(a.size):
        x = np.int64(a[i])
        y = np.int64(b[i])
        out[i] = np.uint8((((x & 0x77) + (y & 0x77)) ^ ((x ^ y) & 0x88)) & 0xFF)


# ------------------------------------------- biased byte lanes in int64 words
LANES_PER_INT64 = 7  # 7 x 8 bits = 56 bits: sums of lanes never reach the sign bit


@njit(cache=True)
def pack_biased_lanes_into(q: np.ndarray, bias: int, out: np.ndarray) -> None:
    """out[j] = sum_l (q[7j+l] + bias) << 8l: seven non-negative byte lanes per int64 word.

    Signed levels |q| <= bias become lanes in [0, 2 bias]; a tail past q.size
    is padded with level 0 (lane = bias). Summing such words over P ranks with
    a plain integer allreduce adds every lane independently as long as
    2 bias P <= 255 (no carry between lanes, and bits 56..63 stay 0, so there
    is no signed overflow) -- how linear dithering's int8 levels travel through
    an allreduce that has no 8-bit integer type (Horovod's PyTorch ops).
    """
    n = q.size
    for j in range(out.size):
        w = np.int64(0)
        for lane in range(LANES_PER_INT64):
            i = j * LANES_PER_INT64 + lane
            v = np.int64(bias)
            if i < n:
                v += np.int64(q[i])
            w |= v << (8 * lane)
        out[j] = w


def pack_biased_lanes(q: np.ndarray, bias: int) -> np.ndarray:
    """int64 words of :func:`pack_biased_lanes_into` (ceil(n / 7) words)."""
    q = np.ascontiguousarray(q).reshape(-1)
    out = np.empty(-(-q.size // LANES_PER_INT64), dtype=np.int64)
    pack_biased_lanes_into(q, int(bias), out)
    return out


@njit(cache=True)
def unpack_biased_lanes_into(words: np.ndarray, total_bias: int, out: np.ndarray) -> None:
    """out[i] = lane i of the summed words minus ``total_bias`` (= P * bias): the level sums."""
    for i in range(out.size):
        w = np.int64(words[i // LANES_PER_INT64])
        out[i] = ((w >> (8 * (i % LANES_PER_INT64))) & 255) - total_bias


def unpack_biased_lanes(words: np.ndarray, n: int, total_bias: int) -> np.ndarray:
    """``n`` int64 level sums from summed lane words."""
    words = np.ascontiguousarray(words, dtype=np.int64).reshape(-1)
    if n > LANES_PER_INT64 * words.size:
        raise ValueError(f"n must be at most 7 * len(words) = {7 * words.size}, got {n}")
    out = np.empty(n, dtype=np.int64)
    unpack_biased_lanes_into(words, int(total_bias), out)
    return out


# ------------------------------------------------------------------ local norms
@njit(cache=True)
def _abs_max_generic(x: np.ndarray) -> float:
    m = 0.0
    for i in range(x.size):
        v = abs(np.float64(x[i]))
        if not v < math.inf:  # NaN or Inf
            return math.inf
        m = max(m, v)
    return m


@njit(cache=True)
def _max_abs_bits(b: np.ndarray, magnitude: Any) -> Any:
    """max_i (b_i & magnitude): the largest |x| of float bits, ``magnitude`` the mask of all
    bits but the sign (0x7FFFFFFF for float32, as uint32; 0x7FF...F for float64, as uint64);
    an integer max, so it vectorises."""
    prefer_512bit_vectors()
    m = magnitude ^ magnitude
    for i in range(b.size):
        m = max(m, b[i] & magnitude)
    return m


def abs_max(x: np.ndarray) -> float:
    """max_i |x_i| in float64 (the inf-norm); +inf if any entry is NaN or +-Inf, 0 for empty x.

    float32/float64: one integer max over the bit patterns with the sign bit
    cleared (non-negative IEEE floats order like their bits, and NaN/Inf are
    exactly the patterns >= the exponent-all-ones one), so the loop
    vectorises and needs no early exit; float16 is widened to float32 (exact);
    other dtypes: a float64 loop.
    """
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.float32:
        m = int(_max_abs_bits(x.view(np.uint32), np.uint32(0x7FFFFFFF)))
        return math.inf if m >= 0x7F800000 else float(np.uint32(m).view(np.float32))
    if x.dtype == np.float64:
        m = int(_max_abs_bits(x.view(np.uint64), np.uint64(0x7FFFFFFFFFFFFFFF)))
        return math.inf if m >= 0x7FF0000000000000 else float(np.uint64(m).view(np.float64))
    if x.dtype.kind == "f" and x.dtype.itemsize < 4:   # float16: widening to float32 is exact
        return abs_max(x.astype(np.float32))
    return float(_abs_max_generic(x))


@njit(cache=True)
def sum_squares(x: np.ndarray) -> float:
    """sum_i x_i^2 accumulated in float64 (the squared l2 norm); NaN/Inf propagate."""
    s = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        s += v * v
    return s
