"""DeepReduce codecs: lossless round trips (Hypothesis), Bloom policies, fit bounds, QSGD.

Every expected value is computed here from the inputs (dense references, the
paper's formulas), never read back from the code under test.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from horovod_compress import codecs
from horovod_compress.codecs import bitio
from horovod_compress.codecs.index_bloom import bloom_size
from horovod_compress.codecs.index_huffman import canonical_codes, huffman_code_lengths
from horovod_compress.kernels import bloom as kbloom
from horovod_compress.kernels import rle

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
LOSSLESS_INDEX = ["raw", "bitmap", "rle", "huffman"]
DENSITIES = [0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0]


def make_support(n: int, density: float, pattern: str, seed: int) -> np.ndarray:
    """A sorted support of a length-n vector: scattered, in runs, or at the ends."""
    rng = np.random.default_rng(seed)
    if pattern == "scattered":
        mask = rng.random(n) < density
    elif pattern == "runs":
        mask = np.zeros(n, bool)
        pos = 0
        while pos < n:
            run = int(rng.geometric(0.05))
            mask[pos:pos + run] = rng.random() < density
            pos += run
    else:  # "ends": the first and last entries (runs touching both borders)
        m = int(round(density * n)) // 2
        mask = np.zeros(n, bool)
        mask[:m] = True
        mask[n - m:] = True
    return np.flatnonzero(mask).astype(np.int64)


supports = st.builds(make_support, n=st.integers(0, 3000), density=st.sampled_from(DENSITIES),
                     pattern=st.sampled_from(["scattered", "runs", "ends"]),
                     seed=st.integers(0, 2**32 - 1))


# ------------------------------------------------------------------ kernels
@SETTINGS
@given(supports, st.integers(0, 5))
def test_rle_runs_round_trip(support: np.ndarray, extra: int) -> None:
    n = (int(support[-1]) + 1 if support.size else 0) + extra
    runs = rle.runs_from_sorted_indices(support, n)
    assert runs.sum() == n and runs.size % 2 == 1
    assert runs[1::2].sum() == support.size                    # the one-runs cover S
    assert (runs[1:-1] >= 1).all()
    back, status = rle.indices_from_runs(runs, n)
    assert status == rle.OK
    np.testing.assert_array_equal(back, support)


def test_rle_rejects_inconsistent_runs() -> None:
    for runs, n in [([3, 2], 5), ([1, 0, 1], 2), ([1, 2, 1], 5), ([-1, 2, 4], 5), ([9], 5)]:
        _, status = rle.indices_from_runs(np.array(runs, np.int64), n)
        assert status == rle.INVALID, runs


@SETTINGS
@given(hnp.arrays(np.int64, st.integers(0, 50), elements=st.integers(0, 2**63 - 1)))
def test_varint_round_trip_and_truncation(values: np.ndarray) -> None:
    buf = rle.varint_encode(values)
    expected_len = sum(max(1, math.ceil(int(v).bit_length() / 7)) for v in values)
    assert buf.size == expected_len
    back, used, status = rle.varint_decode(buf, values.size)
    assert status == rle.OK and used == buf.size
    np.testing.assert_array_equal(back, values)
    if buf.size:
        _, _, status = rle.varint_decode(buf[:-1], values.size)
        assert status == rle.TRUNCATED


def test_varint_overflow_is_reported() -> None:
    _, _, status = rle.varint_decode(np.full(12, 0xFF, np.uint8), 1)
    assert status == rle.OVERFLOW


@SETTINGS
@given(st.integers(0, 64).flatmap(lambda w: st.tuples(st.just(w), hnp.arrays(
    np.uint64, st.integers(0, 40), elements=st.integers(0, 2**w - 1 if w else 0)))))
def test_fixed_width_bit_packing_round_trip(case: tuple[int, np.ndarray]) -> None:
    width, values = case
    buf = bitio.pack_fixed(values, width)
    assert buf.size == (values.size * width + 7) // 8
    back, status = bitio.unpack_fixed(buf, values.size, width)
    assert status == bitio.OK
    np.testing.assert_array_equal(back, values)


@SETTINGS
@given(st.integers(0, 3000), st.integers(0, 2**32 - 1))
def test_permutation_packing(r: int, seed: int) -> None:
    order = np.random.default_rng(seed).permutation(r)
    data = bitio.pack_permutation(order)
    assert len(data) == (r * max(r - 1, 0).bit_length() + 7) // 8   # ceil(log2 r) bits each
    np.testing.assert_array_equal(bitio.unpack_permutation(data, r), order)


def test_permutation_rejects_repeats() -> None:
    data = bitio.pack_fixed(np.array([0, 1, 1, 3], np.uint64), 2).tobytes()
    with pytest.raises(ValueError, match="not a permutation"):
        bitio.unpack_permutation(data, 4)


# ------------------------------------------------------- lossless index codecs
@SETTINGS
@given(supports, st.sampled_from(LOSSLESS_INDEX), st.integers(0, 3))
def test_lossless_index_codecs_round_trip(support: np.ndarray, name: str, extra: int) -> None:
    n = (int(support[-1]) + 1 if support.size else 0) + extra
    codec = codecs.make_index_codec(name)
    enc = codec.encode(support, n, seed=7)
    np.testing.assert_array_equal(enc.slots, support)
    np.testing.assert_array_equal(enc.sources, support)
    back = type(codec).decode(enc.payload, n, support.size, 7)
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, support)


def test_index_codec_sizes_match_their_formulas() -> None:
    rng = np.random.default_rng(3)
    n, r = 100_000, 1000
    support = np.sort(rng.choice(n, r, replace=False))
    size = {name: len(codecs.make_index_codec(name).encode(support, n, 0).payload)
            for name in LOSSLESS_INDEX}
    assert size["raw"] == 1 + 4 * r                                # u8 width + uint32 each
    assert size["bitmap"] == n // 8
    runs = rle.runs_from_sorted_indices(support, n)
    assert size["rle"] == sum(max(1, math.ceil(int(v).bit_length() / 7)) for v in runs) + 2
    # Huffman of the gap classes: within one bit per index of the class entropy, plus
    # the verbatim low bits, plus the table (2 bytes per class + count).
    gaps = np.diff(np.concatenate([[-1], support])) - 1
    classes = np.array([int(g).bit_length() for g in gaps])
    _, counts = np.unique(classes, return_counts=True)
    p = counts / r
    entropy_bits = -(p * np.log2(p)).sum() * r
    low_bits = np.maximum(classes - 1, 0).sum()
    table = 1 + 2 * counts.size
    assert size["huffman"] <= table + (entropy_bits + r + low_bits) / 8 + 1
    assert size["huffman"] >= table + (entropy_bits + low_bits) / 8
    assert size["huffman"] < 0.5 * size["raw"]


def test_canonical_huffman_codes_are_prefix_free() -> None:
    lengths = huffman_code_lengths({0: 100, 1: 50, 2: 25, 3: 12, 4: 6, 5: 3, 6: 1})
    assert sum(2.0 ** -l for l in lengths.values()) <= 1
    codes = canonical_codes(lengths)
    words = [format(codes[s], f"0{lengths[s]}b") for s in codes]
    for a in words:
        for b in words:
            assert a == b or not b.startswith(a)
    assert lengths[0] <= lengths[6]


def _huffman_reference_payload(support: np.ndarray) -> bytes:
    """The Huffman index section built field by field from the module docstring's format:
    classes counted in order of first occurrence, dahuffman's lengths, canonical codes, and
    the interleaved (code, low bits) fields packed by ``bitio.pack_fields``."""
    gaps = np.diff(np.concatenate([[-1], support])) - 1
    classes = [int(g).bit_length() for g in gaps]
    lengths = huffman_code_lengths(Counter(classes))
    codes = canonical_codes(lengths)
    head = bytes([len(lengths)]) + b"".join(bytes([s, lengths[s]]) for s in sorted(lengths))
    if not classes:
        return head
    values = np.array([v for c, g in zip(classes, gaps) for v in (codes[c], int(g))], np.uint64)
    widths = np.array([w for c in classes for w in (lengths[c], max(c - 1, 0))], np.int64)
    return head + bitio.pack_fields(values, widths).tobytes()


def _skewed_support(rng: np.random.Generator, classes: int) -> np.ndarray:
    """Gaps whose bit-length classes have Fibonacci counts: code lengths up to ``classes - 1``."""
    fib = [1, 1]
    while len(fib) < classes:
        fib.append(fib[-1] + fib[-2])
    gaps = np.concatenate([np.full(f, (1 << c) - 1 if c else 0, np.int64)
                           for c, f in enumerate(fib)])
    rng.shuffle(gaps)
    return np.cumsum(gaps + 1) - 1


def test_huffman_stream_matches_the_field_by_field_reference() -> None:
    """The compiled encoder writes the bytes of the reference; the table-driven decoder
    (with its bit-by-bit fallback for codes longer than TABLE_BITS) reads them back."""
    from horovod_compress.codecs.index_huffman import TABLE_BITS, HuffmanIndex
    rng = np.random.default_rng(11)
    cases = [np.sort(rng.choice(4_000_000, 40_000, replace=False)),      # Top-k 1 %
             np.sort(rng.choice(2**40, 300, replace=False)),            # gaps above 2**32
             np.arange(50), np.array([0]), np.array([2**40 - 1]), np.empty(0, np.int64),
             _skewed_support(rng, 24)]                                   # codes up to 23 bits
    for support in cases:
        support = support.astype(np.int64)
        n = int(support[-1]) + 1 if support.size else 1
        payload = HuffmanIndex().encode(support, n, 0).payload
        assert payload == _huffman_reference_payload(support)
        np.testing.assert_array_equal(HuffmanIndex.decode(payload, n, support.size, 0), support)
    skewed = cases[-1]
    classes = [int(g).bit_length() for g in np.diff(np.concatenate([[-1], skewed])) - 1]
    assert max(huffman_code_lengths(Counter(classes)).values()) > TABLE_BITS  # the fallback ran


def test_huffman_decoder_reports_errors_inside_a_long_stream() -> None:
    """Cuts and flips deep in a stream (where the fast path runs) raise, or decode to
    strictly increasing indices inside the tensor -- never a wrong count or a crash."""
    from horovod_compress.codecs.index_huffman import HuffmanIndex
    rng = np.random.default_rng(12)
    support = _skewed_support(rng, 16).astype(np.int64)
    n = int(support[-1]) + 1
    payload = HuffmanIndex().encode(support, n, 0).payload
    for cut in range(40, len(payload), 97):
        with pytest.raises(codecs.ContainerError, match="truncated"):
            HuffmanIndex.decode(payload[:cut], n, support.size, 0)
    for pos in range(40, len(payload), 89):
        bad = bytearray(payload)
        bad[pos] ^= 0x5A
        try:
            got = HuffmanIndex.decode(bytes(bad), n, support.size, 0)
        except codecs.ContainerError:
            continue
        assert got.size == support.size and np.all(np.diff(got) > 0) and got[-1] < n


# ------------------------------------------------------- lossless value codecs
float_arrays = st.sampled_from([np.float16, np.float32, np.float64]).flatmap(
    lambda dt: hnp.arrays(dt, st.integers(0, 600),
                          elements=hnp.from_dtype(np.dtype(dt), allow_nan=True, allow_infinity=True)))


@SETTINGS
@given(float_arrays, st.sampled_from(["raw", "deflate"]))
def test_lossless_value_codecs_round_trip_bitwise(values: np.ndarray, name: str) -> None:
    codec = codecs.make_value_codec(name)
    payload, order = codec.encode(values, seed=1)
    assert order is None
    back = type(codec).decode(payload, values.size, values.dtype)
    assert back.dtype == values.dtype
    np.testing.assert_array_equal(back.view(np.uint8), values.view(np.uint8))


def test_raw_values_cost_itemsize_per_value() -> None:
    v = np.arange(100, dtype=np.float32)
    assert len(codecs.make_value_codec("raw").encode(v, 0)[0]) == 400


# ------------------------------------------------------------------ container
@SETTINGS
@given(supports, st.sampled_from(LOSSLESS_INDEX), st.sampled_from(["raw", "deflate"]),
       st.sampled_from([np.float16, np.float32, np.float64]), st.integers(0, 2**64 - 1))
def test_container_lossless_round_trip(support: np.ndarray, index: str, value: str,
                                       dtype: type, seed: int) -> None:
    n = int(support[-1]) + 1 if support.size else 0
    rng = np.random.default_rng(seed % 2**32)
    shape = (n,) if n % 2 else (2, n // 2)
    dense = rng.standard_normal(n).astype(dtype)
    sparse = np.zeros(n, dtype)
    sparse[support] = dense[support]
    enc = codecs.encode(support, dense, shape, codecs.make_index_codec(index),
                        codecs.make_value_codec(value), seed)
    assert sum(enc.section_bytes.values()) == len(enc.data)
    dec = codecs.decode(enc.data, expected_shape=shape)
    assert dec.shape == shape and dec.selected == support.size
    out = dec.to_dense()
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    np.testing.assert_array_equal(out.reshape(-1), sparse)


def test_container_header_layout() -> None:
    support = np.array([1, 5, 7], np.int64)
    enc = codecs.encode(support, np.arange(10, dtype=np.float32), (10,),
                        codecs.make_index_codec("raw"), codecs.make_value_codec("raw"), 3)
    data = enc.data
    assert data[:4] == b"DRDC" and data[4] == 1
    assert data[5] == 1 and data[6] == 1        # raw index id, raw value id
    assert data[8] == 2 and data[9] == 1 and data[10] == 10   # float32, ndim 1, n = 10
    import zlib
    assert int.from_bytes(data[-4:], "little") == zlib.crc32(data[:-4])
    # 4 magic + 4 (version, ids, flags) + dtype + ndim + shape + n_slots + r + seed
    # + 3 length varints + 13 index bytes + 12 value bytes + CRC
    assert len(data) == 4 + 4 + 1 + 1 + 1 + 1 + 1 + 8 + 3 + 13 + 12 + 4


def test_sorting_codec_with_raw_indices_sends_no_permutation() -> None:
    rng = np.random.default_rng(0)
    n, r = 5000, 300
    support = np.sort(rng.choice(n, r, replace=False))
    dense = rng.standard_normal(n).astype(np.float32)
    fit = codecs.make_value_codec("polyfit")
    with_raw = codecs.encode(support, dense, (n,), codecs.make_index_codec("raw"), fit, 1)
    with_rle = codecs.encode(support, dense, (n,), codecs.make_index_codec("rle"), fit, 1)
    assert with_raw.section_bytes["permutation"] == 0
    assert with_rle.section_bytes["permutation"] == math.ceil(r * math.ceil(math.log2(r)) / 8)
    for enc in (with_raw, with_rle):
        dec = codecs.decode(enc.data, (n,))
        np.testing.assert_array_equal(np.sort(dec.slots), support)
        bound = 0.01 * np.abs(dense[support]).max()
        assert np.abs(dec.values - dense[dec.slots]).max() <= bound


def test_lossy_codec_falls_back_to_raw_on_non_finite_values() -> None:
    support = np.array([0, 3, 4], np.int64)
    dense = np.array([1.0, 0, 0, np.nan, -np.inf], np.float32)
    for value in ("qsgd", "polyfit", "dexp"):
        enc = codecs.encode(support, dense, (5,), codecs.make_index_codec("rle"),
                            codecs.make_value_codec(value), 0)
        assert enc.value_codec == "raw"
        out = codecs.decode(enc.data, (5,)).to_dense()
        np.testing.assert_array_equal(out, dense)


# ---------------------------------------------------------------------- Bloom
def test_bloom_size_follows_the_paper() -> None:
    for r, fpr in [(1000, 0.001), (369, 0.01), (10, 0.6), (0, 0.1)]:
        m, h = bloom_size(r, fpr)
        assert h == max(1, math.ceil(math.log2(1 / fpr)))
        optimal_bits = h * r / math.log(2)            # = -r ln(fpr) / ln(2)^2 with h rounded up
        assert optimal_bits <= m < optimal_bits + 8 + 1e-9 and m % 8 == 0 and m >= 8


def test_bloom_has_no_false_negatives_and_its_rate() -> None:
    rng = np.random.default_rng(11)
    n, r = 200_000, 2000
    support = np.sort(rng.choice(n, r, replace=False))
    for fpr in (0.1, 0.01, 0.001):
        m, h = bloom_size(r, fpr)
        bits = kbloom.bloom_insert(support, m, h, np.uint64(99))
        positives = kbloom.bloom_query_range(bits, m, h, np.uint64(99), n)
        assert np.isin(support, positives).all()
        rate = (positives.size - r) / (n - r)
        # (1 - e^{-hr/m})^h with m >= h r / ln 2 is at most 2^-h <= fpr
        assert 0.4 * 2.0 ** -h <= rate <= 1.25 * 2.0 ** -h, (fpr, rate)


def _bloom_case(seed: int, n: int = 20_000, density: float = 0.01, fpr: float = 0.01):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal(n).astype(np.float32)
    k = int(density * n)
    support = np.sort(np.argpartition(np.abs(dense), n - k)[n - k:])
    sparse = np.zeros_like(dense)
    sparse[support] = dense[support]
    return dense, sparse, support


@SETTINGS
@given(supports, st.sampled_from([0.3, 0.05, 0.001]), st.integers(0, 2**63))
def test_bloom_p0_reconstructs_the_sparse_input_exactly(support: np.ndarray, fpr: float,
                                                        seed: int) -> None:
    n = (int(support[-1]) + 1 if support.size else 0) + 50
    sparse = np.zeros(n, np.float32)
    sparse[support] = np.random.default_rng(seed % 97).standard_normal(support.size)
    enc = codecs.encode(support, sparse, (n,), codecs.make_index_codec("bloom", fpr=fpr, policy="p0"),
                        codecs.make_value_codec("raw"), seed)
    dec = codecs.decode(enc.data, (n,))
    assert np.isin(support, dec.slots).all()           # every true index is a positive
    np.testing.assert_array_equal(dec.to_dense(), sparse)


@SETTINGS
@given(supports, st.sampled_from(["p1", "p2", "naive"]), st.sampled_from([0.3, 0.01]),
       st.integers(0, 2**63))
def test_bloom_p1_p2_keep_exactly_r_entries(support: np.ndarray, policy: str, fpr: float,
                                            seed: int) -> None:
    n = (int(support[-1]) + 1 if support.size else 0) + 200
    dense = np.random.default_rng(seed % 89).standard_normal(n).astype(np.float32)
    enc = codecs.encode(support, dense, (n,), codecs.make_index_codec("bloom", fpr=fpr, policy=policy),
                        codecs.make_value_codec("raw"), seed)
    dec = codecs.decode(enc.data, (n,))
    assert dec.slots.size == support.size == np.unique(dec.slots).size
    m, h = bloom_size(support.size, fpr)
    if policy != "naive":
        np.testing.assert_array_equal(dec.values, dense[dec.slots])   # values of the chosen slots


@pytest.mark.parametrize("fpr,ratio", [(0.01, 0.6), (0.001, 0.25)])
def test_bloom_p2_error_is_below_p1_on_average(fpr: float, ratio: float) -> None:
    """Over 12 Top-1% gradients, P2's ||D(c) - g~||^2 averages well below P1's (Section 4, Fig. 6).

    Measured with these seeds: fpr 0.01 -> P2/P1 = 0.21/0.52; fpr 0.001 -> 0.013/0.14.
    """
    err = {"p1": [], "p2": []}
    true_hits = {"p1": [], "p2": []}
    for seed in range(12):
        dense, sparse, support = _bloom_case(seed, fpr=fpr)
        for policy in err:
            enc = codecs.encode(support, dense, sparse.shape,
                                codecs.make_index_codec("bloom", fpr=fpr, policy=policy),
                                codecs.make_value_codec("raw"), seed + 1000)
            out = codecs.decode(enc.data, sparse.shape)
            err[policy].append(float(np.sum((out.to_dense() - sparse) ** 2) / np.sum(sparse ** 2)))
            true_hits[policy].append(np.isin(out.slots, support).mean())
    assert np.mean(err["p2"]) < ratio * np.mean(err["p1"]), err
    assert np.mean(true_hits["p2"]) > np.mean(true_hits["p1"])


def test_bloom_naive_shifts_values_after_a_false_positive() -> None:
    dense, sparse, support = _bloom_case(3, fpr=0.05)
    enc = codecs.encode(support, dense, sparse.shape,
                        codecs.make_index_codec("bloom", fpr=0.05, policy="naive"),
                        codecs.make_value_codec("raw"), 5)
    dec = codecs.decode(enc.data, sparse.shape)
    # the receiver puts the t-th value (in index order) at the t-th positive
    np.testing.assert_array_equal(dec.values, dense[support])
    first_fp = int(np.flatnonzero(~np.isin(dec.slots, support))[0])
    np.testing.assert_array_equal(dec.slots[:first_fp], support[:first_fp])
    assert (dec.slots[first_fp + 1:] != support[first_fp + 1:]).mean() > 0.5
    naive_err = np.sum((dec.to_dense() - sparse) ** 2)
    assert naive_err > 0.5 * np.sum(sparse ** 2)       # the paper's negative example


def test_bloom_p0_sends_clearly_less_than_raw_pairs_at_one_percent() -> None:
    """Top-k 1 %, fpr 0.001: P0 is ~0.78 of the 8r bytes of (index, value) pairs, P2 ~0.73."""
    rng = np.random.default_rng(5)
    n = 200_000
    dense = rng.standard_normal(n).astype(np.float32)
    r = n // 100
    support = np.sort(np.argpartition(np.abs(dense), n - r)[n - r:])
    pairs = 8 * r
    sizes = {}
    for policy in ("p0", "p2"):
        enc = codecs.encode(support, dense, (n,), codecs.make_index_codec("bloom", fpr=0.001,
                                                                          policy=policy),
                            codecs.make_value_codec("raw"), 9)
        sizes[policy] = len(enc.data)
        h = 10
        m_bytes = math.ceil(h * r / math.log(2) / 8)
        # u8 policy, u8 h, varint m (3 bytes for m < 2**21), the filter
        assert enc.section_bytes["index"] == 1 + 1 + 3 + m_bytes
    expected_p0 = (10 * r / math.log(2) / 8 + 4 * (r + 0.001 * (n - r))) / pairs   # ~0.78
    assert sizes["p0"] / pairs < 0.85
    assert abs(sizes["p0"] / pairs - expected_p0) < 0.02
    assert sizes["p2"] / pairs < 0.75
    # the index part alone: ~1.8 bytes per index instead of 4 (the paper's "about half")
    assert (sizes["p2"] - 4 * r) / (4 * r) < 0.5


# ----------------------------------------------------------------- curve fits
def sorted_like_topk(seed: int, r: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "topk":
        g = rng.standard_normal(100 * max(r, 1)) * rng.uniform(1e-4, 10)
        return g[np.argsort(np.abs(g))[g.size - r:]]
    if kind == "laplace":
        return rng.laplace(size=r) * 1e-3
    if kind == "with_zeros":
        v = rng.standard_normal(r)
        v[rng.random(r) < 0.3] = 0.0
        return v
    if kind == "constant":
        return np.full(r, -2.5)
    return rng.uniform(-1, 1, r)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.integers(0, 400),
       st.sampled_from(["topk", "laplace", "with_zeros", "constant", "uniform"]),
       st.sampled_from([1e-3, 1e-2, 0.1]), st.integers(0, 7),
       st.sampled_from([np.float32, np.float64]))
def test_polyfit_respects_its_error_bound(seed: int, r: int, kind: str, tol: float, degree: int,
                                          dtype: type) -> None:
    v = sorted_like_topk(seed, r, kind).astype(dtype)
    codec = codecs.make_value_codec("polyfit", degree=degree, tol=tol)
    payload, order = codec.encode(v, 0)
    np.testing.assert_array_equal(np.sort(order), np.arange(r))
    assert np.all(np.diff(v[order].astype(np.float64)) <= 0)        # descending
    out = type(codec).decode(payload, r, np.dtype(dtype))
    assert out.dtype == np.dtype(dtype)
    if r:
        eps = tol * np.abs(v.astype(np.float64)).max()
        assert np.abs(out.astype(np.float64) - v[order]).max() <= eps


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.integers(0, 300),
       st.sampled_from(["topk", "laplace", "with_zeros", "uniform"]), st.sampled_from([1e-2, 0.1]))
def test_dexp_respects_its_error_bound(seed: int, r: int, kind: str, tol: float) -> None:
    v = sorted_like_topk(seed, r, kind).astype(np.float32)
    codec = codecs.make_value_codec("dexp", tol=tol)
    payload, order = codec.encode(v, 0)
    out = type(codec).decode(payload, r, np.dtype(np.float32))
    if r:
        assert np.abs(out.astype(np.float64) - v[order]).max() <= tol * np.abs(v).max()


def test_curve_fits_compress_topk_values() -> None:
    """On Top-k values the fits are far below 4 bytes a value (paper: Fit-Poly ~40 % total saving)."""
    v = sorted_like_topk(1, 2000, "topk").astype(np.float32)
    for name, limit in (("polyfit", 0.3), ("dexp", 0.3)):
        payload, _ = codecs.make_value_codec(name, tol=0.01).encode(v, 0)
        assert len(payload) < limit * 4 * v.size, (name, len(payload))


def test_polyfit_fits_a_polynomial_with_one_segment() -> None:
    x = np.linspace(-1, 1, 500)
    v = (3 - 2 * x + 0.5 * x ** 3)[::-1].copy()                        # ascending -> decreasing after sort
    v = np.sort(v)[::-1] + 10.0                                       # all positive, one part
    payload, order = codecs.make_value_codec("polyfit", degree=3, tol=1e-5).encode(v, 0)
    assert len(payload) == 1 + 2 + 1 + 4 * 4                          # one segment, 4 coefficients


# ----------------------------------------------------------------------- QSGD
def test_qsgd_bound_and_size() -> None:
    rng = np.random.default_rng(2)
    v = (rng.standard_normal(1300) * 1e-2).astype(np.float32)
    codec = codecs.make_value_codec("qsgd", levels=127, bucket=512)
    payload, _ = codec.encode(v, 4)
    nb = math.ceil(1300 / 512)
    assert len(payload) == 1 + 2 + 4 * nb + 1300                       # 8 bits per value
    out = type(codec).decode(payload, v.size, np.dtype(np.float32))
    norms = np.array([np.linalg.norm(v[i:i + 512].astype(np.float64)) for i in range(0, 1300, 512)])
    bound = np.repeat(norms, 512)[:1300] / 127
    assert np.all(np.abs(out - v) <= bound * (1 + 1e-5))
    assert np.all((np.sign(out) == np.sign(v)) | (out == 0))


def test_qsgd_is_unbiased() -> None:
    rng = np.random.default_rng(8)
    v = rng.standard_normal(64)
    codec = codecs.make_value_codec("qsgd", levels=3, bucket=16)
    trials = 3000
    acc = np.zeros(64)
    for s in range(trials):
        payload, _ = codec.encode(v, s)
        acc += type(codec).decode(payload, 64, np.dtype(np.float64))
    norms = np.repeat([np.linalg.norm(v[i:i + 16]) for i in range(0, 64, 16)], 16)
    sd = norms / 3 / 2                          # per-trial std <= (norm / s) / 2
    assert np.all(np.abs(acc / trials - v) <= 5 * sd / math.sqrt(trials))


# ------------------------------------------------------------------- registry
def test_registry_names_and_bad_parameters() -> None:
    assert codecs.index_codecs() == ["raw", "bitmap", "rle", "huffman", "bloom"]
    assert codecs.value_codecs() == ["raw", "deflate", "qsgd", "polyfit", "dexp"]
    for call, match in [(lambda: codecs.make_index_codec("zip"), "index must be one of"),
                        (lambda: codecs.make_index_codec("bloom", fpr=1.5), "fpr"),
                        (lambda: codecs.make_index_codec("bloom", policy="p9"), "policy"),
                        (lambda: codecs.make_index_codec("raw", fpr=0.1), "takes no parameter"),
                        (lambda: codecs.make_value_codec("polyfit", degree=-1), "poly_degree"),
                        (lambda: codecs.make_value_codec("qsgd", bucket=0), "qsgd_bucket"),
                        (lambda: codecs.make_value_codec("deflate", level=10), "deflate_level")]:
        with pytest.raises(ValueError, match=match):
            call()
