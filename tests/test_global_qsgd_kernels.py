"""Global-QSGD kernels on one process: the exponential reduce (Algorithm 2) exhaustively,
the quantizers' rounding probabilities, packing, the SWAR nibble sum and the RNG."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors.global_qsgd import exp_shift, linear_levels
from horovod_compress.kernels.exp_reduce import LANE_FINE, exp_reduce_codes, exp_reduce_packed
from horovod_compress.kernels.quantize import (
    exp_dequantize,
    exp_quantize,
    linear_dequantize,
    linear_quantize,
    nibble_add_into,
    pack_biased_lanes,
    pack_nibbles,
    random_uniforms,
    random_words,
    unpack_biased_lanes,
    unpack_nibbles,
)


def _breakpoint_words() -> tuple[np.ndarray, np.ndarray]:
    """Both ends of r = 0 and of every dyadic interval [2^j, 2^(j+1)), j = 0..63.

    The kernel compares r with powers of two only, so its output is constant on
    each interval (checked); interval j has probability 2^j / 2^64, r = 0 has 2^-64.
    """
    lows = [0] + [1 << j for j in range(64)]
    highs = [0] + [(1 << (j + 1)) - 1 for j in range(64)]
    return np.array(lows, dtype=np.uint64), np.array(highs, dtype=np.uint64)


@pytest.mark.parametrize("bits", [8, 4])
def test_reduce_exhaustive_exact_expectation(bits):
    """Every pair of codes: E[reduce(a, b)] == a + b exactly, from the kernel's own outputs.

    Values are integers in units of 2^-emax and probabilities integers in units
    of 2^-64, so the expectation is computed without rounding. Exceptions,
    each checked exactly: a same-sign pair with a 1/2 whose sum may round up
    to 1 saturates at 1/2 (the code cannot hold 1), and a pair whose exponents
    differ by 64 or more keeps the larger operand (bias < 2^-64 of it).
    """
    sign_shift = 7 if bits == 8 else 3
    emax = (1 << sign_shift) - 1
    ncodes = 1 << bits
    codes = np.arange(ncodes, dtype=np.uint8)
    a = np.repeat(codes, ncodes)
    b = np.tile(codes, ncodes)
    lows, highs = _breakpoint_words()
    outs = np.empty((65, a.size), dtype=np.uint8)
    for j, (lo, hi) in enumerate(zip(lows, highs)):
        at_lo = exp_reduce_codes(a, b, np.full(a.size, lo, np.uint64), bits)
        at_hi = exp_reduce_codes(a, b, np.full(a.size, hi, np.uint64), bits)
        assert np.array_equal(at_lo, at_hi), f"output not constant on dyadic interval {j}"
        outs[j] = at_lo
    # Two outcomes at most: "low" = output at r = 0, "high" = output at r near 2^64.
    out_low, out_high = outs[0], outs[64]
    assert ((outs == out_low) | (outs == out_high)).all()
    # weight of the "high" outcome, in units of 2^-64: sum of 2^j over intervals j where it occurs
    is_high = (outs[1:] == out_high) & (out_high != out_low)
    mask = (is_high.astype(np.uint64) << np.arange(64, dtype=np.uint64)[:, None]).sum(0)
    emask = emax

    def value(code: int) -> int:  # in units of 2^-emax
        e = code & emask
        if e == 0:
            return 0
        return (-1 if (code >> sign_shift) & 1 else 1) << (emax - e)

    counts = {"exact": 0, "saturated": 0, "dropped": 0}
    for col in range(a.size):
        ca, cb = int(a[col]), int(b[col])
        lo_code, hi_code = int(out_low[col]), int(out_high[col])
        for o in (lo_code, hi_code):  # canonical, valid codes: zero carries no sign bit
            assert (o & emask) != 0 or o == 0
        w_high = int(mask[col])
        expect_2_64 = (2**64 - w_high) * value(lo_code) + w_high * value(hi_code)
        va, vb = value(ca), value(cb)
        ea, eb = ca & emask, cb & emask
        same_sign = va * vb > 0
        if same_sign and min(ea, eb) == 1:
            half = value(ca) if ea == 1 else value(cb)
            assert lo_code == hi_code and value(lo_code) == half, (ca, cb)
            counts["saturated"] += 1
        elif va and vb and abs(ea - eb) - (0 if same_sign else 1) >= 64:
            larger = va if ea < eb else vb
            assert expect_2_64 == 2**64 * larger, (ca, cb)
            counts["dropped"] += 1
        else:
            assert expect_2_64 == 2**64 * (va + vb), (ca, cb)
            counts["exact"] += 1
    assert sum(counts.values()) == ncodes ** 2
    assert counts["exact"] > 0.7 * ncodes ** 2, counts


@pytest.mark.parametrize("bits", [8, 4])
def test_reduce_zero_and_cancellation_are_deterministic(bits):
    sign_shift = 7 if bits == 8 else 3
    emax = (1 << sign_shift) - 1
    e = np.arange(1, emax + 1, dtype=np.uint8)
    r = random_words(np.uint64(11), np.uint64(0), e.size)
    for rr in (r, np.zeros_like(r), np.full_like(r, np.iinfo(np.uint64).max)):
        assert np.array_equal(exp_reduce_codes(e, np.zeros_like(e), rr, bits), e)          # x + 0
        assert np.array_equal(exp_reduce_codes(np.zeros_like(e), e, rr, bits), e)          # 0 + x
        neg = e | np.uint8(1 << sign_shift)
        assert np.array_equal(exp_reduce_codes(e, neg, rr, bits), np.zeros_like(e))        # x - x
        assert np.array_equal(exp_reduce_codes(neg, e, rr, bits), np.zeros_like(e))
        assert np.array_equal(exp_reduce_codes(neg, np.zeros_like(e), rr, bits), neg)      # -x + 0


def _paper_algorithm2(sign1, e1, sign2, e2, p, s):
    """Algorithm 2 transcribed line by line (float p, log2, floor) as the reference."""
    m = s + 1
    k = -math.floor(math.log2(2.0 ** -m + max(0.0, p - 2.0 ** -m)))
    gz1, gz2 = int(e1 > 0), int(e2 > 0)
    sign12 = sign1 * sign2 * gz1 * gz2
    diff = abs(e1 - e2) - (1 - sign12) // 2
    smaller = (int(e1 <= e2) + (1 - gz2)) * gz1
    non_zero = 1 - int(e1 == e2 and sign12 == -1)
    sign = sign1 * smaller + sign2 * (1 - smaller)
    e = (e1 * smaller + e2 * (1 - smaller)) * non_zero - sign12 * int(k > diff) * non_zero
    return sign, e


@pytest.mark.parametrize("bits", [8, 4])
def test_reduce_matches_paper_algorithm2_line_by_line(bits):
    """Random codes and p: the kernel (integer threshold on r = p 2^64) equals the paper's formula."""
    sign_shift = 7 if bits == 8 else 3
    emax = (1 << sign_shift) - 1
    rng = np.random.default_rng(2)
    n = 20000
    e1 = rng.integers(0, emax + 1, n)
    e2 = np.clip(e1 + rng.integers(-6, 7, n), 0, emax)  # mostly close exponents: both outcomes occur
    s1 = rng.integers(0, 2, n)
    s2 = rng.integers(0, 2, n)
    p = rng.random(n)
    r = np.array([int(v * 2.0 ** 64) for v in p], dtype=np.uint64)
    a = (e1 | (s1 << sign_shift)).astype(np.uint8)
    b = (e2 | (s2 << sign_shift)).astype(np.uint8)
    out = exp_reduce_codes(a, b, r, bits)
    mismatches = 0
    for i in range(n):
        sign, e = _paper_algorithm2(1 - 2 * int(s1[i]), int(e1[i]), 1 - 2 * int(s2[i]), int(e2[i]),
                                    float(p[i]), emax)
        if e == 0 and e1[i] > 0 and e2[i] > 0 and s1[i] == s2[i]:
            e = 1  # the paper's 2^0 = 1 is saturated at 1/2 (documented)
        expect = e | ((1 if (sign < 0 and e > 0) else 0) << sign_shift)
        mismatches += int(out[i]) != expect
    assert mismatches == 0


def _lane_words(key: np.uint64, counter: np.uint64, n: int) -> np.ndarray:
    """The documented 8-bit words lane_word(key, counter + i), i < n, from ``random_words``:
    R 2^57 + (word 2^62 + counter + i) >> 7, R = byte (counter + i) % 8 of word
    (counter + i) // 8, & 0x7F."""
    pos = np.uint64(counter) + np.arange(n, dtype=np.uint64)
    q0 = np.uint64(counter) >> np.uint64(3)
    coarse = random_words(key, q0, int((pos[-1] >> np.uint64(3)) - q0) + 1)
    r7 = (coarse[(pos >> np.uint64(3)) - q0] >> (np.uint64(8) * (pos & np.uint64(7)))) & np.uint64(0x7F)
    return (r7 << np.uint64(57)) | (random_words(key, LANE_FINE + np.uint64(counter), n) >> np.uint64(7))


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_reduce_uses_the_documented_words(bits):
    """The operator's inner loop = the pure kernel with words lane_word(key, counter + i)
    (8-bit) / counter + 2i (+1) (4-bit), at a counter that is not a multiple of 8."""
    rng = np.random.default_rng(3)
    ncodes = 1000
    a = rng.integers(0, 1 << bits, ncodes).astype(np.uint8)
    b = rng.integers(0, 1 << bits, ncodes).astype(np.uint8)
    key, counter = 987654321, 4242
    if bits == 8:
        words = _lane_words(np.uint64(key), np.uint64(counter), ncodes)
    else:
        words = random_words(np.uint64(key), np.uint64(counter), ncodes)
    expect = exp_reduce_codes(a, b, words, bits)
    if bits == 8:
        got, _ = exp_reduce_packed(a, b, 8, key, counter)
    else:
        packed, _ = exp_reduce_packed(pack_nibbles(a), pack_nibbles(b), 4, key, counter)
        got = unpack_nibbles(packed, ncodes)
    assert np.array_equal(got, expect)


@pytest.mark.parametrize("bits", [8, 4])
def test_exp_quantize_levels_and_probabilities(bits):
    """Adjacent power-of-two levels with P(up) = 2m - 1 (5-sigma), exact powers unchanged, specials 0."""
    emax = 127 if bits == 8 else 7
    n = 40000
    for y, low_e in [(0.3, 2), (0.126, 3), (0.0390625, 5), (0.6 * 2.0 ** -emax, None)]:
        x = np.full(n, -y, dtype=np.float64)
        codes = exp_quantize(x, 1.0, bits, key=17)
        vals = exp_dequantize(codes, 1.0, bits, np.float64)
        if low_e is None:        # below the smallest level: 0 or -2^-emax
            p_up = y * 2.0 ** emax
            up = vals == -(2.0 ** -emax)
            assert set(np.unique(vals)) <= {0.0, -(2.0 ** -emax)}
        else:
            lo = 2.0 ** -low_e
            p_up = (y - lo) / lo
            up = vals == -2 * lo
            assert set(np.unique(vals)) <= {-lo, -2 * lo}
        sigma = math.sqrt(p_up * (1 - p_up) / n)
        assert abs(up.mean() - p_up) < 5 * sigma, (y, up.mean(), p_up)
        assert abs(vals.mean() + y) < 5 * sigma * (2 * y)
    exact = np.array([0.5, 0.25, -2.0 ** -6, 0.0, -0.0])
    assert np.array_equal(exp_dequantize(exp_quantize(exact, 1.0, bits, 1), 1.0, bits, np.float64),
                          [0.5, 0.25, -2.0 ** -6, 0.0, 0.0])
    special = np.array([np.nan, np.inf, -np.inf], np.float32)
    assert (exp_quantize(special, 1.0, bits, 1) == 0).all()
    assert (exp_quantize(np.array([0.9]), 1.0, bits, 1) == 1).all()  # above 1/2: saturated to 1/2


def test_linear_quantize_levels_and_probabilities():
    n = 40000
    s = 7
    for y in (0.1, 0.55, 0.93):
        x = np.full(n, y, dtype=np.float32)
        q = linear_quantize(x, 1.0, s, key=5)
        lo = math.floor(y * s)
        assert set(np.unique(q).tolist()) <= {lo, lo + 1}
        p_up = y * s - lo
        sigma = math.sqrt(p_up * (1 - p_up) / n)
        assert abs((q == lo + 1).mean() - p_up) < 5 * sigma
    assert np.array_equal(linear_quantize(np.array([-1.0, 0.0, 1.0, 3 / 7]), 1.0, 7, 1), [-7, 0, 7, 3])
    assert (linear_quantize(np.array([np.nan, np.inf, -np.inf]), 1.0, 7, 1) == 0).all()
    assert np.array_equal(linear_dequantize(np.array([-7, 3], np.int8), 0.5), [-3.5, 1.5])
    with pytest.raises(ValueError, match="levels"):
        linear_quantize(np.ones(3), 1.0, 128, 1)


def test_pack_unpack_roundtrip_and_layout():
    codes = np.arange(16, dtype=np.uint8)
    packed = pack_nibbles(codes)
    assert packed.size == 8 and packed[0] == 0x10 and packed[7] == 0xFE
    assert np.array_equal(unpack_nibbles(packed, 16), codes)
    odd = np.array([3, 9, 12], np.uint8)
    assert np.array_equal(unpack_nibbles(pack_nibbles(odd), 3), odd)
    levels = np.array([-8, -7, -1, 0, 1, 7, 3], np.int8)
    assert np.array_equal(unpack_nibbles(pack_nibbles(levels), 7, signed=True), levels)
    with pytest.raises(ValueError, match=r"n must be at most 2 \* len\(packed\)"):
        unpack_nibbles(packed, 17)


def test_nibble_add_exhaustive():
    """All pairs of signed nibble values whose sum fits in [-8, 7], in both lanes at once."""
    vals = np.arange(-8, 8)
    a, b = np.meshgrid(vals, vals)
    ok = (a + b >= -8) & (a + b <= 7)
    a, b = a[ok], b[ok]
    pa = ((a & 15) | ((b & 15) << 4)).astype(np.uint8)   # lane0 = a, lane1 = b
    pb = ((b & 15) | ((a & 15) << 4)).astype(np.uint8)   # lane0 = b, lane1 = a
    out = np.empty_like(pa)
    nibble_add_into(pa, pb, out)
    lo = unpack_nibbles(out, 2 * out.size, signed=True)
    assert np.array_equal(lo[0::2], a + b) and np.array_equal(lo[1::2], a + b)


@pytest.mark.parametrize("p", [1, 2, 4, 127])
def test_biased_lanes_sum_without_carries(p):
    """Words of 7 biased byte lanes, summed as plain int64 over P 'ranks', give the level sums."""
    s = 127 // p
    rng = np.random.default_rng(p)
    n = 7 * 50 + 3  # a padded tail
    levels = rng.integers(-s, s + 1, (p, n)).astype(np.int8)
    levels[:, :4] = s       # extremes: every lane total at its bounds 0 and 2 s P
    levels[:, 4:8] = -s
    words = np.stack([pack_biased_lanes(q, s) for q in levels])
    assert words.shape == (p, 51) and (words >= 0).all() and (words < 2**56).all()
    total = words.sum(0)    # what an integer MPI_SUM / Horovod Sum computes
    assert np.array_equal(unpack_biased_lanes(total, n, p * s), levels.astype(np.int64).sum(0))


def test_counter_based_rng_reproducible_and_uniform():
    u1 = random_uniforms(np.uint64(42), np.uint64(0), 100000)
    u2 = random_uniforms(np.uint64(42), np.uint64(0), 100000)
    assert np.array_equal(u1, u2)
    # any window of the stream is reproducible on its own (what parallel/GPU code relies on)
    assert np.array_equal(random_uniforms(np.uint64(42), np.uint64(500), 10), u1[500:510])
    assert not np.array_equal(random_uniforms(np.uint64(43), np.uint64(0), 100000), u1)
    assert ((u1 >= 0) & (u1 < 1)).all()
    counts = np.histogram(u1, bins=20, range=(0, 1))[0]
    chi2 = ((counts - 5000) ** 2 / 5000).sum()
    assert chi2 < 50  # 19 degrees of freedom: P(chi2 > 50) < 2e-4
    w = random_words(np.uint64(7), np.uint64(0), 100000)
    bits = np.unpackbits(w.view(np.uint8)).mean()
    assert abs(bits - 0.5) < 0.005


def test_level_counts_follow_bits_and_world_size():
    assert [linear_levels(8, p) for p in (1, 2, 4, 127)] == [127, 63, 31, 1]
    assert [linear_levels(4, p) for p in (1, 2, 4, 7)] == [7, 3, 1, 1]
    assert linear_levels(4, 64, sparse=True) == 7
    with pytest.raises(ValueError, match="cannot sum 8 ranks"):
        linear_levels(4, 8)
    with pytest.raises(ValueError, match="cannot sum 128 ranks"):
        linear_levels(8, 128)
    assert exp_shift(8, 4, 0) == 3 and exp_shift(8, 4, 16) == 19 and exp_shift(8, 3, 0) == 3
    assert exp_shift(4, 4, 0) == 3 and exp_shift(4, 1, 0) == 1 and exp_shift(4, 64, 0, sparse=True) == 1
    with pytest.raises(ValueError, match="level"):
        exp_shift(4, 64, 0)  # 2^7 >= 2P leaves one level below 1


class _NoComm(SimpleNamespace):
    def allreduce(self, *args, **kwargs):
        raise AssertionError("an impossible configuration must fail before any communication")


def test_impossible_linear_configuration_raises_before_communication():
    method = hvdc.Compression.global_qsgd(dithering="linear", bits=4)
    with pytest.raises(ValueError, match="overflow"):
        method.allreduce(np.ones(10, np.float32), "g", _NoComm(size=8, rank=0))


def test_constructor_validation():
    # each message names the argument at fault
    for bad, name in (({"dithering": "log"}, "dithering"), ({"bits": 2}, "bits"), ({"bits": 6}, "bits"),
                      ({"bits": "8"}, "bits"), ({"norm": "l1"}, "norm"), ({"sparse": "yes"}, "sparse"),
                      ({"headroom": -1}, "headroom"), ({"headroom": 5, "bits": 4}, "headroom"),
                      ({"dithering": "linear", "headroom": 2}, "headroom"), ({"seed": -1}, "seed"),
                      ({"feedback": "nope"}, "feedback")):
        with pytest.raises(ValueError, match=f"global_qsgd: {name}"):
            hvdc.Compression.global_qsgd(**bad)
    for bad in ({"bits": 3}, {"norm": "l0"}):
        with pytest.raises(ValueError, match=f"qsgd: {next(iter(bad))}"):
            hvdc.Compression.qsgd(**bad)
    m = hvdc.Compression.global_qsgd()
    assert m.params()["dithering"] == "exponential" and m.bits == 8 and m.norm == "inf"
    assert m.headroom == 16 and not m.biased and m.feedback.name == "none"
    assert hvdc.Compression.global_qsgd(bits=4).headroom == 0
    assert hvdc.Compression.global_qsgd(dithering="linear").horovod_compatible
    assert not hvdc.Compression.global_qsgd().horovod_compatible
    assert not hvdc.Compression.global_qsgd(dithering="linear", bits=4).horovod_compatible
    assert hvdc.Compression.qsgd().levels == 127 and hvdc.Compression.qsgd(bits=4).levels == 7


def test_expected_bytes_formula():
    m8 = hvdc.Compression.global_qsgd()
    m4 = hvdc.Compression.global_qsgd(bits=4)
    for p in (2, 4, 16):
        n = 10**6
        assert m8.expected_bytes((n,), p) == 2 * (8 + n) * (p - 1) / p
        assert m4.expected_bytes((1000, 1001), p) == 2 * (8 + 500500) * (p - 1) / p
        assert hvdc.Compression.qsgd().expected_bytes((n,), p) == (p - 1) * (4 + n)
    assert hvdc.Compression.global_qsgd(sparse=True).expected_bytes((10,), 4) is None


def test_abs_max_bit_pattern_kernel_matches_numpy_and_flags_nonfinite():
    import math

    from horovod_compress.kernels.quantize import abs_max
    rng = np.random.default_rng(21)
    for dtype in (np.float32, np.float64, np.float16):
        x = (rng.standard_normal(10_001) * 3).astype(dtype)
        assert abs_max(x) == float(np.abs(x.astype(np.float64)).max())
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[1234] = bad
            assert abs_max(y) == math.inf
    assert abs_max(np.zeros(0, np.float32)) == 0.0
    assert abs_max(np.array([-0.0, -2.5e-45], np.float32)) == float(np.float32(2.5e-45))  # subnormal


def test_exp_dequantize_equals_ldexp_table_bit_for_bit():
    import math

    from horovod_compress.kernels.quantize import exp_dequantize_into
    for sign_shift in (7, 3):
        codes = np.arange(2 << sign_shift).astype(np.uint8)
        emask = (1 << sign_shift) - 1
        for scale in (1.3, 2.0 ** -30, 7.5e20, 3e-290):
            got = np.empty(codes.size, np.float64)
            exp_dequantize_into(codes, scale, sign_shift, got)
            ref = np.array([(-1.0 if (c >> sign_shift) & 1 else 1.0) *
                            (math.ldexp(scale, -(c & emask)) if c & emask else 0.0)
                            for c in codes.tolist()])
            assert np.array_equal(got.view(np.int64), ref.view(np.int64)), (sign_shift, scale)


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_quantize_dequantize_equals_the_two_pass_kernels(bits):
    """qsgd_fused: the one-pass codes and ``local`` equal exp_quantize (+ pack_nibbles) and
    exp_dequantize bit for bit, whole or by arbitrary ranges; the range dequantizers too."""
    from horovod_compress.kernels.qsgd_fused import (
        exp_dequantize4_range,
        exp_dequantize8_range,
        exp_quantize4_packed_range,
        exp_quantize_dequant,
        exp_quantize_dequant4_range,
        exp_quantize_dequant8_range,
    )
    from horovod_compress.kernels.quantize import exp_dequantize, exp_quantize, pack_nibbles
    rng = np.random.default_rng(5)
    emax = 127 if bits == 8 else 7
    tiny = math.ldexp(1.0, emax + 53)
    quant = exp_quantize_dequant8_range if bits == 8 else exp_quantize_dequant4_range
    deq = exp_dequantize8_range if bits == 8 else exp_dequantize4_range
    for n in (1, 2, 7, 1000, 1001, 65_537):
        for dtype in (np.float32, np.float64):
            x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 6)).astype(dtype)
            x[1::13] = 0.0
            norm = float(np.abs(x).max())
            scale, d_scale = 2.0 ** -4 / norm, norm * 2.0 ** 4
            local = np.empty(n, dtype)
            codes = exp_quantize_dequant(x, scale, bits, 99, d_scale, local)
            ref = exp_quantize(x, scale, bits, 99)
            assert np.array_equal(codes, ref if bits == 8 else pack_nibbles(ref)), (n, dtype)
            ref_local = exp_dequantize(ref, d_scale, bits, dtype)
            assert np.array_equal(local.view(np.uint8), ref_local.view(np.uint8)), (n, dtype)
            out = np.empty(n, dtype)
            deq(codes, d_scale, out, 0, codes.size)
            assert np.array_equal(out.view(np.uint8), ref_local.view(np.uint8))
            cuts = sorted({0, codes.size, *rng.integers(0, codes.size + 1, 4).tolist()})
            c2, l2, o2 = np.zeros_like(codes), np.empty(n, dtype), np.empty(n, dtype)
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                quant(x, scale, emax, tiny, np.uint64(99), d_scale, c2, l2, lo, hi)
                deq(codes, d_scale, o2, lo, hi)
            assert np.array_equal(c2, codes) and np.array_equal(l2, local) and np.array_equal(o2, out)
            if bits == 4:   # codes only, without ``local``
                c3 = np.zeros_like(codes)
                for lo, hi in zip(cuts[:-1], cuts[1:]):
                    exp_quantize4_packed_range(x, scale, emax, tiny, np.uint64(99), c3, lo, hi)
                assert np.array_equal(c3, codes)


def test_ring_segments_cover_blocks():
    from horovod_compress.mpi_collectives.reduce_ops import ring_segments
    for size, seg in ((0, 4), (1, 4), (10, 4), (1 << 20, 1 << 18), (1_000_003, 1 << 16)):
        parts = ring_segments(size, 17, seg)
        assert parts[0][0] == 17 and parts[-1][1] == 17 + size
        assert all(a[1] == b[0] for a, b in zip(parts[:-1], parts[1:]))
        assert all(hi - lo <= seg for lo, hi in parts)


# ------------------------------------------ 8-bit quantizer with 16-bit draws (issues 15, 21)
def _exp8_reference():
    """exp_code of every element with the documented word exp8_word(key, i): the definition
    of the 8-bit kernels of qsgd_fused, one element at a time."""
    from numba import njit

    from horovod_compress.kernels.qsgd_fused import exp8_word
    from horovod_compress.kernels.quantize import exp_code
    tiny = math.ldexp(1.0, 127 + 53)

    @njit(cache=False)
    def ref(x, scale, key, codes):
        for i in range(x.size):
            codes[i] = exp_code(np.float64(x[i]), scale, 127, 128, tiny, exp8_word(key, np.uint64(i)))
    return ref


def _hard_inputs(rng, n: int, kind: int) -> np.ndarray:
    """Inputs that stress every branch: all float32 bit patterns (NaN, Inf, subnormals),
    values a few ulps from powers of two, wide magnitudes, repeated magnitudes and zeros."""
    if kind == 0:
        return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    if kind == 1:
        base = np.ldexp(1.0, rng.integers(-140, 10, n)).astype(np.float32)
        off = rng.integers(-3, 4, n).astype(np.int32)
        return (base.view(np.int32) + off).view(np.float32) * rng.choice([-1, 1], n).astype(np.float32)
    if kind == 2:
        return (rng.standard_normal(n) * 10.0 ** rng.uniform(-40, 38)).astype(np.float32)
    return (np.full(n, rng.standard_normal(), np.float32)
            * rng.choice([-1, 1, 0.5, 0.25, 2.0 ** -20, 0], n).astype(np.float32))


def test_exp8_kernels_equal_exp_code_with_the_documented_words():
    """exp8_quantize_range (+ _dequant_range) = exp_code(x_i, exp8_word(key, i)) for every
    element, bit for bit: float32 and float64, NaN/Inf/subnormal/zero, values at and near
    powers of two (where the float32 product and the float64 one straddle a level), scales
    that saturate, that fall below the smallest level, or that float32 cannot hold, and
    arbitrary cuts of the range."""
    import warnings

    from horovod_compress.kernels.qsgd_fused import (
        exp8_quantize_dequant_range,
        exp8_quantize_range,
        exp_dequantize8_range,
    )
    ref = _exp8_reference()
    rng = np.random.default_rng(11)
    for trial in range(40):
        n = int(rng.integers(1, 20_000))
        x = _hard_inputs(rng, n, trial % 4)
        if trial % 8 >= 4:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                x = x.astype(np.float64)
        finite = np.abs(x[np.isfinite(x)])
        norm = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        norm = max(norm * float(rng.choice([1.0, 1.0, 0.3, 3.0, 1e-30, 1e20, 1e-300])), 1e-300)
        c = int(rng.integers(1, 30))
        scale, d_scale = 2.0 ** -c / norm, norm * 2.0 ** c
        key = np.uint64(rng.integers(0, 2**63))
        expect = np.empty(n, np.uint8)
        ref(x, scale, key, expect)
        got, codes, local = np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.empty(n, x.dtype)
        cuts = sorted({0, n, *rng.integers(0, n + 1, 3).tolist()})
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            exp8_quantize_range(x, scale, key, got, lo, hi)
            exp8_quantize_dequant_range(x, scale, key, d_scale, codes, local, lo, hi)
        assert np.array_equal(got, expect), (trial, x.dtype, norm, c)
        assert np.array_equal(codes, expect), (trial, x.dtype, norm, c)
        ref_local = np.empty(n, x.dtype)
        exp_dequantize8_range(expect, d_scale, ref_local, 0, n)
        assert np.array_equal(local.view(np.uint8), ref_local.view(np.uint8)), trial


def test_exp8_words_are_the_documented_draws():
    """exp8_word(key, i): top 16 bits 2^16 - 1 - (16-bit lane i % 4 of word i // 4), low 48
    bits word 2^62 + i >> 16, of the SplitMix64 stream (random_words)."""
    from horovod_compress.kernels.qsgd_fused import EXP8_FINE, exp8_word
    key = np.uint64(0xDEADBEEF12345)
    n = 103
    draws = random_words(key, np.uint64(0), (n + 3) // 4).view(np.uint16)[:n].astype(np.uint64)
    fine = random_words(key, EXP8_FINE, n)
    for i in range(n):
        expect = (np.uint64(0xFFFF - int(draws[i])) << np.uint64(48)) | (fine[i] >> np.uint64(16))
        assert exp8_word(key, np.uint64(i)) == expect, i


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp8_rounding_probabilities_and_unbiasedness(dtype):
    """P(round up) = y / 2^-e - 1 (5 sigma) and E[value] = y, for values whose mantissa
    needs more than the 16 drawn bits (the refinement decides a 2^-16 sliver exactly)."""
    from horovod_compress.kernels.qsgd_fused import exp8_quantize_range
    n = 200_000
    for y, low_e in [(0.3, 2), (0.126, 3), (0.0390625 * (1 + 2.0 ** -20), 5),
                     (2.0 ** -9 * (1 + 1 / 3), 9), (2.0 ** -40 * 1.999, 40)]:
        x = np.full(n, -y, dtype=dtype)
        codes = np.empty(n, np.uint8)
        exp8_quantize_range(x, 1.0, np.uint64(17), codes, 0, n)
        vals = exp_dequantize(codes, 1.0, 8, np.float64)
        lo = 2.0 ** -low_e
        assert set(np.unique(vals)) <= {-lo, -2 * lo}, y
        p_up = (float(dtype(y)) - lo) / lo
        sigma = math.sqrt(p_up * (1 - p_up) / n)
        assert abs((vals == -2 * lo).mean() - p_up) < 5 * sigma, (y, p_up)
        assert abs(vals.mean() + float(dtype(y))) < 5 * sigma * 2 * lo


def test_exp8_dequantize_equals_the_float64_product():
    """exp8_dequantize_range: the bits of exp_dequantize8_range for all 256 codes, for scales
    on the exponent-subtraction path (fl32(d) >= 2), below it, huge, and float64 outputs."""
    from horovod_compress.kernels.qsgd_fused import exp8_dequantize_range, exp_dequantize8_range
    codes = np.arange(256, dtype=np.uint8)
    for d in (2.0, 3.5, 1.9999999, 1.0, 1e-30, 1e30, 3.4e38, 1e39, 262144.0 * 0.731):
        for dtype in (np.float32, np.float64):
            ref, got = np.empty(256, dtype), np.empty(256, dtype)
            exp_dequantize8_range(codes, d, ref, 0, 256)
            exp8_dequantize_range(codes, d, got, 0, 256)
            assert np.array_equal(got.view(np.uint8), ref.view(np.uint8)), (d, dtype)


def test_exp_reduce8_range_equals_the_pair_kernel_with_lane_words():
    """exp_reduce8_range (the MPI operator's loop) = exp_reduce_pair with the word
    lane_word(key, counter + i) for every byte, at counters on and off a stream word
    (multiples of 8 and not), on random bytes (many lanes needing the whole word) and on
    quantized gradients, whole, by unaligned ranges and with ``out`` aliasing a or b;
    saturations counted as the pair kernel counts them. (Fails on the layout before
    issue 15's fourth pass, word counter + i per code.)"""
    from numba import njit

    from horovod_compress.kernels.exp_reduce import exp_reduce8_into, exp_reduce8_range, exp_reduce_pair

    @njit(cache=False)
    def saturations(a, b, words):
        s = 0
        for i in range(a.size):
            s += exp_reduce_pair(np.int64(a[i]), np.int64(b[i]), words[i], 7)[1]
        return s

    rng = np.random.default_rng(21)
    for trial in range(24):
        n = int(rng.integers(1, 9000))
        if trial % 3 == 0:
            a = rng.integers(0, 256, n).astype(np.uint8)
            b = rng.integers(0, 256, n).astype(np.uint8)
        else:   # near exponents and both signs, saturating pairs at e = 1..3 included
            top = 4 if trial % 3 == 1 else 30
            a = (rng.integers(1, top, n) | (rng.integers(0, 2, n) << 7)).astype(np.uint8)
            b = (rng.integers(1, top + 9, n) | (rng.integers(0, 2, n) << 7)).astype(np.uint8)
        key, counter = np.uint64(rng.integers(0, 2**63)), np.uint64(rng.integers(0, 2**40))
        if trial % 2 == 0:
            counter &= ~np.uint64(7)   # what reduce_stream hands out
        words = _lane_words(key, counter, n)
        expect = exp_reduce_codes(a, b, words, 8)
        out = np.zeros(n, np.uint8)
        lo = int(rng.integers(0, n + 1))
        hi = int(rng.integers(lo, n + 1))
        sat = sum(exp_reduce8_range(a, b, out, key, counter, u, v)
                  for u, v in ((0, lo), (lo, hi), (hi, n)))
        assert np.array_equal(out, expect), trial
        assert sat == saturations(a, b, words), trial
        for alias in ("a", "b"):
            aa, bb = a.copy(), b.copy()
            s_alias = exp_reduce8_into(aa, bb, aa if alias == "a" else bb, key, counter)
            assert np.array_equal(aa if alias == "a" else bb, expect), (trial, alias)
            assert s_alias == sat, (trial, alias)


def test_operator_calls_take_disjoint_lane_words_from_the_stream():
    """The 8-bit MPI operator's callback inside reduce_stream: call k equals exp_reduce_packed
    at the stream's counter c_k, c_0 = 0 and c_(k+1) = c_k + n_k rounded up to a multiple
    of 8, so calls of one collective never share a word (their positions are disjoint) and
    every call starts on a stream word; the stream reports the calls and the saturations."""
    from horovod_compress.mpi_collectives import reduce_ops

    rng = np.random.default_rng(15)
    key = 4321
    sizes = (13, 20, 8, 1, 300)
    calls = [(rng.integers(0, 256, n).astype(np.uint8), rng.integers(0, 256, n).astype(np.uint8))
             for n in sizes]
    calls[1][0][:4] = calls[1][1][:4] = 1                    # 1/2 + 1/2: saturates
    counter, sat, expect = 0, 0, []
    for a, b in calls:
        out, s = exp_reduce_packed(a, b, 8, key, counter)
        expect.append(out)
        sat += s
        counter += -(-a.size // 8) * 8
    assert counter == 16 + 24 + 8 + 8 + 304
    with reduce_ops.reduce_stream(key) as st:
        for (a, b), want in zip(calls, expect):
            inout = b.copy()
            reduce_ops._exp8(a, inout, None)
            assert np.array_equal(inout, want)
    assert (st.counter, st.calls, st.saturated) == (counter, len(sizes), sat) and sat >= 4
