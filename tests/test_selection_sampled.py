"""The one-read exact top-k (kernels/selection.py: sampled bound, candidates, exact k-th among them).

Whatever the data, the selection must be the one a full radix select makes:
every entry above the k-th largest magnitude, then the lowest-index ties
(TopkA), or every tie (Ok-Topk's ``|x| >= threshold``). The sample only
decides how fast: where it misses, the functions say so (``None``) and the
callers fall back. Vectors here are above ``SAMPLED_MIN_SIZE`` so the
sampled path runs; the adversarial ones put the top k where the sample
does not look, in sorted order, or on a few repeated magnitudes.
"""
from __future__ import annotations

import numpy as np
import pytest

from horovod_compress.compressors.sparse_common import exact_topk_coo
from horovod_compress.kernels.scatter import topk_coo_float32
from horovod_compress.kernels.selection import (
    SAMPLED_MIN_SIZE,
    kth_largest_abs,
    select_by_threshold,
    select_topk,
    topk_by_candidates,
    topk_candidates,
)

N = SAMPLED_MIN_SIZE * 2 + 12345


def _data(kind: str, n: int, rng: np.random.Generator, dtype) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n).astype(dtype)
    if kind == "heavy_tail":
        return (rng.standard_cauchy(n)).astype(dtype)
    if kind == "sorted":                       # magnitudes rise with the index
        return np.sort(np.abs(rng.standard_normal(n))).astype(dtype)
    if kind == "one_hot_region":               # the top entries all in one short run
        x = (rng.standard_normal(n) * 1e-3).astype(dtype)
        start = int(rng.integers(0, n - 5000))
        x[start:start + 5000] = rng.standard_normal(5000).astype(dtype) * 10
        return x
    if kind == "ties":                         # a handful of magnitudes: ties at the threshold
        return (rng.integers(-4, 5, n) * 0.25).astype(dtype)
    if kind == "sparse":                       # mostly zeros, fewer nonzeros than some k
        x = np.zeros(n, dtype)
        where = rng.choice(n, 3000, replace=False)
        x[where] = rng.standard_normal(3000).astype(dtype)
        return x
    if kind == "periodic":                     # period of a power of two, like stacked layers
        base = rng.standard_normal(4096).astype(dtype)
        return np.tile(base, n // 4096 + 1)[:n] * np.where(np.arange(n) % 7 == 0, 3, 1).astype(dtype)
    if kind == "constant":
        return np.full(n, 0.5, dtype)
    raise ValueError(kind)


KINDS = ["normal", "heavy_tail", "sorted", "one_hot_region", "ties", "sparse", "periodic", "constant"]


def _reference(x: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """Stable-sort reference: (sorted indices of the top k, nonzero only; the k-th largest |x|)."""
    order = np.argsort(-np.abs(x), kind="stable")[:k]
    return np.sort(order[x[order] != 0]), float(np.abs(x[order[-1]]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_topk_by_candidates_is_the_exact_topk(kind, dtype):
    rng = np.random.default_rng(11)
    x = _data(kind, N, rng, dtype)
    for k in (1, 37, N // 1000, N // 100, N // 10):
        out_idx = np.empty(k, np.int64)
        out_val = np.empty(k, dtype)
        got = topk_by_candidates(x, k, out_idx, out_val)
        ref, _ = _reference(x, k)
        if got is None:                  # the sample cannot bound it: the caller falls back
            assert np.count_nonzero(x) < k or kind in ("constant", "ties", "sparse", "sorted",
                                                        "one_hot_region", "periodic"), (kind, k)
            continue
        assert got == k == ref.size, (kind, k, got)
        assert np.all(np.diff(out_idx) > 0), "ascending index order"
        assert np.array_equal(out_idx, ref), (kind, k)
        assert np.array_equal(out_val, x[out_idx])


@pytest.mark.parametrize("kind", KINDS)
def test_exact_topk_coo_equals_the_two_pass_select(kind):
    """TopkA's message: the same (index, value) set as the fused radix select, padding included."""
    rng = np.random.default_rng(12)
    x = _data(kind, N, rng, np.float32)
    for k in (50, N // 100, 5000):
        idx, val, real = exact_topk_coo(x, k, np.int32, scratch={})
        ref_idx, ref_val = np.empty(k, np.int32), np.empty(k, np.float32)
        ref_real = topk_coo_float32(x, k, ref_idx, ref_val)
        assert real == ref_real
        a, b = np.argsort(idx[:real]), np.argsort(ref_idx[:real])
        assert np.array_equal(idx[:real][a], ref_idx[:real][b]), (kind, k)
        assert np.array_equal(val[:real][a], ref_val[:real][b])
        assert np.all(idx[real:] == 0) and np.all(val[real:] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_select_topk_equals_threshold_then_select(kind, dtype):
    """Ok-Topk's local step: every nonzero |x| >= |x|_(k) (all ties), and that threshold."""
    rng = np.random.default_rng(13)
    x = _data(kind, N, rng, dtype)
    for k in (1, N // 100, 4000):
        idx, val, th = select_topk(x, k)
        ref_th = kth_largest_abs(x, k)
        ref_idx, ref_val = select_by_threshold(x, ref_th)
        assert th == ref_th, (kind, k)
        assert np.array_equal(idx, ref_idx) and np.array_equal(val, ref_val), (kind, k)


def test_candidates_bound_holds_and_is_tight_on_smooth_data():
    """On Gaussian data the sampled bound keeps about 1.1-1.5 k candidates, and never fewer than k."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal(1 << 20).astype(np.float32)
    k = 10_000
    cand, cbits, c, t = topk_candidates(x, k)
    assert k <= c <= 1.5 * k
    assert np.all(np.abs(x[cand[:c]]) >= np.sort(np.abs(x))[-c])   # the c largest, in index order
    assert t == np.float32(np.sort(np.abs(x))[-k]).view(np.uint32)


def test_small_or_degenerate_inputs_fall_back():
    x = np.ones(SAMPLED_MIN_SIZE - 1, np.float32)
    assert topk_candidates(x, 10) is None                      # too small to sample
    y = np.zeros(N, np.float32)
    assert topk_candidates(y, 10) is None                       # all zeros: no key >= 1
    z = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    assert topk_candidates(z, 0) is None and topk_candidates(z, N) is None


@pytest.mark.parametrize("kind", KINDS)
def test_add_topk_writes_the_sum_and_its_exact_topk(kind):
    """EF14's acc = x + e fused with the selection: acc bit-identical to np.add, the top k exact.

    The fast path must take every one of these inputs (the residual's spread gives even the
    constant and tie-heavy ones a usable sampled bound): a fast path that always declined would
    fail here (checked once by making ``add_topk`` return None after writing ``acc``)."""
    from horovod_compress.kernels.selection import add_topk
    rng = np.random.default_rng(15)
    x = _data(kind, N, rng, np.float32)
    e = (_data("normal", N, rng, np.float32) * np.float32(0.01)).astype(np.float32)
    for k in (1, N // 100, 5000):
        acc = np.full(N, np.nan, np.float32)
        out_idx, out_val = np.empty(k, np.int32), np.empty(k, np.float32)
        got = add_topk(x, e, acc, k, out_idx, out_val, scratch={})
        assert np.array_equal(acc, x + e), (kind, k)            # written whole, whatever the bound
        assert got is not None, (kind, k, "the fast path declined")
        ref, _ = _reference(acc, k)
        assert got == k == ref.size and np.array_equal(out_idx, ref), (kind, k)
        assert np.array_equal(out_val, acc[out_idx])


def test_topk_with_residual_fused_equals_unfused():
    """TopkA's _reduce_residual (EF14 fused into the selection) gives the unfused outputs and residuals bit for bit."""
    import horovod_compress as hvdc
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()
    rng = np.random.default_rng(16)
    grads = [rng.standard_normal((300, 700)).astype(np.float32) for _ in range(5)]
    fused, plain = hvdc.Compression.topk(density=0.01), hvdc.Compression.topk(density=0.01)
    calls = []
    original = type(fused)._reduce_residual

    def spy(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    plain._reduce_residual = lambda *args: None
    type(fused)._reduce_residual = spy
    try:
        for g in grads:
            assert np.array_equal(fused.allreduce(g, "w", comm), plain.allreduce(g, "w", comm))
            assert np.array_equal(fused.state["w"]["fb_residual"], plain.state["w"]["fb_residual"])
    finally:
        type(fused)._reduce_residual = original
    assert calls and all(calls)          # every step after the first took the fused path
