"""16-bit float kernels: bit-identical to NumPy's float16 cast and to bfloat16's rounding rule."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from horovod_compress.kernels.halfprec import add16_into, decode16, encode16

ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def _random_float32_patterns(n: int, seed: int = 0) -> np.ndarray:
    bits = np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


def test_fp16_encode_matches_numpy_on_random_bit_patterns():
    x = _random_float32_patterns(2_000_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = x.astype(np.float16).view(np.uint16)
    got = encode16(x, "fp16")
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], ref[~nan])        # normals, subnormals, overflow, +-0, +-inf
    assert np.all(np.isnan(got[nan].view(np.float16)))


def test_fp16_round_trip_and_ties_to_even():
    f = ALL16.view(np.float16).astype(np.float32)
    ok = ~np.isnan(f)
    assert np.array_equal(encode16(f[ok], "fp16"), ALL16[ok])
    assert np.array_equal(decode16(ALL16[ok], "fp16"), f[ok])
    mid = ((f[:-1].astype(np.float64) + f[1:].astype(np.float64)) / 2).astype(np.float32)
    m = np.isfinite(mid)
    assert np.array_equal(encode16(mid[m], "fp16"), mid[m].astype(np.float16).view(np.uint16))


def test_bf16_rounding_rule():
    x = _random_float32_patterns(1_000_000, seed=1)
    bits = x.view(np.uint32).astype(np.uint64)
    ref = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    ref[np.isnan(x)] = 0x7FC0
    assert np.array_equal(encode16(x, "bf16"), ref)
    widened = decode16(ALL16, "bf16").view(np.uint32)
    assert np.array_equal(widened, ALL16.astype(np.uint32) << 16)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_scale_is_fused_and_sum_rounds_once(kind):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(10_001).astype(np.float32)
    assert np.array_equal(encode16(x, kind, scale=0.25), encode16(x * np.float32(0.25), kind))
    a, b = encode16(x, kind), encode16(x[::-1].copy(), kind)
    expect = encode16(decode16(a, kind) + decode16(b, kind), kind)
    add16_into(a, b, kind)
    assert np.array_equal(b, expect)
    assert np.array_equal(decode16(a, kind, scale=4.0), decode16(a, kind) * np.float32(4.0))
    with pytest.raises(ValueError, match="kind"):
        encode16(x, "fp8")
