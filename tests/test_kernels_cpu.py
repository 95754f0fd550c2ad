"""CPU kernels against NumPy / pure-Python references, where no other test file checks them.

Covered elsewhere and not repeated here: the selection kernels
(tests/test_oktopk_kernels.py), the quantizers, packing and the exponential
reduce (tests/test_global_qsgd_kernels.py), RLE/varint round trips and Bloom
false-negative rates (tests/test_codecs.py), row selection
(tests/test_arc_topk.py). Here: the Bloom hash family against its definition
computed with Python integers and the query against a NumPy scan, RLE and
varints against independent NumPy encoders, and the multi-threaded variants
(kernels/parallel.py) against the serial kernels, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from horovod_compress.tools.bench import kernels as refs
from horovod_compress.kernels import (
    bloom,
    exp_reduce,
    parallel,
    quantize,
    rle,
    selection,
)


def _grad(n: int, seed: int, dtype=np.float32) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n).astype(dtype)
    x[::11] = 0
    return x


# ---------------------------------------------------------------------- bloom
def _mix_py(z: int) -> int:
    mask = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_bloom_hashes_follow_their_definition() -> None:
    """h_j(i) = ((a mod m) + j (b mod m)) mod m with a = mix(i ^ seed), b = mix(a ^ GOLDEN)."""
    seed, m, h = 987654321, 1003, 5
    idx = np.array([0, 1, 2, 999, 123456789, 2**40 + 3], np.int64)
    pos = bloom.bloom_positions(idx, m, h, np.uint64(seed))
    for t, i in enumerate(idx.tolist()):
        a = _mix_py(i ^ seed)
        b = _mix_py(a ^ 0x9E3779B97F4A7C15)
        assert pos[t].tolist() == [((a % m) + j * (b % m)) % m for j in range(h)]
    filt = bloom.bloom_insert(idx, m, h, np.uint64(seed))
    bits = np.zeros(((m + 7) // 8) * 8, bool)
    bits[pos.ravel()] = True
    assert np.array_equal(filt, np.packbits(bits, bitorder="little"))


def test_bloom_query_is_the_set_of_all_positive_indices() -> None:
    rng = np.random.default_rng(6)
    n, m, h, seed = 20_000, 2_000, 3, np.uint64(11)
    idx = np.sort(rng.choice(n, 200, replace=False)).astype(np.int64)
    filt = bloom.bloom_insert(idx, m, h, seed)
    got = bloom.bloom_query_range(filt, m, h, seed, n)
    assert np.array_equal(got, refs.np_bloom_query(filt, m, h, seed, n))
    assert np.all(np.isin(idx, got))


# ------------------------------------------------------------------------ rle
def test_runs_and_varints_match_numpy_encoders() -> None:
    rng = np.random.default_rng(7)
    n = 50_000
    bitmap = np.repeat(rng.random(4000) < 0.4, rng.integers(1, 25, 4000))[:n]
    idx = np.flatnonzero(bitmap).astype(np.int64)
    runs = rle.runs_from_sorted_indices(idx, n)
    assert np.array_equal(runs, refs.np_runs(idx, n)) and runs.sum() == n
    back, status = rle.indices_from_runs(runs, n)
    assert status == rle.OK and np.array_equal(back, refs.np_indices_from_runs(runs))
    values = np.concatenate([runs, [0, 127, 128, 2**21, 2**56 - 1, 2**56, 2**63 - 1]]).astype(np.int64)
    enc = rle.varint_encode(values)
    assert np.array_equal(enc, refs.np_varint_encode(values))
    dec, used, status = rle.varint_decode(enc, values.size)
    assert status == rle.OK and used == enc.size
    assert np.array_equal(dec, refs.np_varint_decode(enc, values.size)) and np.array_equal(dec, values)


# --------------------------------------------------------- parallel variants
@pytest.mark.parametrize("n", [0, 1, 1000, 300_001])
def test_parallel_selection_is_identical(n: int) -> None:
    x = _grad(n, 8)
    thr = selection.kth_largest_abs(x, max(1, n // 100)) if n else 1.0
    a = selection.select_by_threshold(x, thr)
    b = parallel.select_by_threshold(x, thr)
    assert all(np.array_equal(u, v) and u.dtype == v.dtype for u, v in zip(a, b))
    assert parallel.count_at_least(x, thr) == selection.count_at_least(x, thr)


def test_parallel_quantizers_are_identical() -> None:
    x = _grad(200_003, 9)
    x[:8] = [np.nan, np.inf, -np.inf, 1e-38, -1e-45, 0.9, -0.9, 5e-324]
    norm = float(np.linalg.norm(x[8:].astype(np.float64)))
    for bits, scale in ((8, 1.0 / norm), (4, 1.0 / norm), (4, 1e-3 / norm), (8, 1e-300), (8, 1.0),
                        (8, 1e300)):
        a = quantize.exp_quantize(x, scale, bits, 123)
        b = parallel.exp_quantize(x, scale, bits, 123)
        assert np.array_equal(a, b), (bits, scale, int((a != b).sum()))
    for levels, scale in ((127, 1.0 / norm), (7, 1.0 / norm), (3, 100.0 / norm)):
        assert np.array_equal(quantize.linear_quantize(x, scale, levels, 5),
                              parallel.linear_quantize(x, scale, levels, 5))
    with pytest.raises(ValueError, match="levels"):
        parallel.linear_quantize(x, 1.0, 128, 5)


def test_parallel_exp_reduce_is_identical() -> None:
    rng = np.random.default_rng(10)
    a = rng.integers(0, 256, 100_001).astype(np.uint8)
    b = rng.integers(0, 256, 100_001).astype(np.uint8)
    a[:500], b[:500] = 1, 2  # saturating pairs
    for serial, par in ((exp_reduce.exp_reduce8_into, parallel.exp_reduce8_into),
                        (exp_reduce.exp_reduce4_into, parallel.exp_reduce4_into)):
        o1, o2 = np.empty_like(a), b.copy()
        s1 = serial(a, b, o1, np.uint64(42), np.uint64(7))
        s2 = par(a, o2, o2, np.uint64(42), np.uint64(7))  # in place, as MPI's inout buffer
        assert s1 == s2 > 0 and np.array_equal(o1, o2)


@pytest.mark.parametrize("n", [1, 65_535, 65_537, 300_001])
def test_parallel_bloom_query_is_identical(n: int) -> None:
    """Chunked multi-threaded query == serial query, across chunk boundaries (chunks of 2^16)."""
    from horovod_compress.kernels import bloom
    rng = np.random.default_rng(n)
    k = max(1, n // 50)
    idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    m, h, seed = 8 * k + 3, 3, np.uint64(99)
    bits = bloom.bloom_insert(idx, m, h, seed)
    serial = bloom.bloom_query_range(bits, m, h, seed, n)
    assert np.isin(idx, serial).all()                   # no false negatives
    assert np.array_equal(parallel.bloom_query_range(bits, m, h, seed, n), serial)
