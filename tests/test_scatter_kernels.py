"""Exact top-k packing and scatter kernels (kernels/scatter.py) against NumPy references."""
from __future__ import annotations

import numpy as np
import pytest

from horovod_compress.compressors.sparse_common import exact_topk_coo, scatter_sum, topk_indices
from horovod_compress.kernels.scatter import SparseScratch, scatter_add


def _stable_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Reference: first k of a stable sort by -|x| (ties: lowest index first), zeros dropped."""
    ref = np.argsort(-np.abs(x), kind="stable")[:k]
    return ref[x[ref] != 0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_coo_exact_with_ties_zeros_and_padding(dtype):
    rng = np.random.default_rng(7)
    for _ in range(500):
        n = int(rng.integers(1, 400))
        # few distinct magnitudes: many ties at the threshold, and zeros
        x = (rng.integers(-3, 4, n) * rng.choice([1.0, 0.5], n)).astype(dtype)
        k = int(rng.integers(1, n + 1))
        idx, val, real = exact_topk_coo(x, k, np.int32)
        ref = _stable_topk(x, k)
        assert real == ref.size == min(k, np.count_nonzero(x))
        assert sorted(idx[:real].tolist()) == sorted(ref.tolist())
        assert np.array_equal(val[:real], x[idx[:real]])
        assert np.all(idx[real:] == 0) and np.all(val[real:] == 0)   # padding sends nothing


def test_topk_coo_ties_within_the_low_radix_digit():
    """float32 magnitudes sharing their top 16 bits: the fused select's second digit decides."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 300))
        ulps = rng.integers(0, 6, n).astype(np.float32) * np.float32(2.0 ** -23)
        x = ((np.float32(1.0) + ulps) * rng.choice([-1, 1, 0], n, p=[0.45, 0.45, 0.1])).astype(np.float32)
        x[rng.random(n) < 0.1] *= np.float32(4.0)          # a few above the shared digit
        k = int(rng.integers(1, n + 1))
        idx, val, real = exact_topk_coo(x, k, np.int32)
        ref = _stable_topk(x, k)
        assert real == ref.size
        assert sorted(idx[:real].tolist()) == sorted(ref.tolist())
        assert np.array_equal(val[:real], x[idx[:real]])
        assert np.all(idx[real:] == 0) and np.all(val[real:] == 0)


def test_topk_coo_continuous_matches_argpartition():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(100_000).astype(np.float32)
    k = 1000
    idx, _val, real = exact_topk_coo(x, k)
    assert real == k
    assert set(idx.tolist()) == set(np.argpartition(np.abs(x), x.size - k)[x.size - k:].tolist())
    assert np.array_equal(np.sort(topk_indices(x, k)), np.sort(idx))


def test_topk_indices_pads_like_before_when_few_nonzeros():
    x = np.zeros(50, np.float32)
    x[[3, 9]] = [1.0, -2.0]
    idx = topk_indices(x, 5)
    assert idx.size == 5 and np.unique(idx).size == 5 and {3, 9} <= set(idx.tolist())


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_scatter_sum_matches_float64_bincount(p):
    rng = np.random.default_rng(p)
    n, k = 10_000, 300
    idx = rng.integers(0, n, p * k).astype(np.int32)    # duplicates across "ranks"
    val = rng.standard_normal(p * k).astype(np.float32)
    got = scatter_sum(n, idx, val, np.float32, scale=1.0 / p)
    ref = np.bincount(idx, weights=val.astype(np.float64), minlength=n) / p
    assert got.dtype == np.float32
    assert np.allclose(got, ref, rtol=1e-6, atol=1e-7)
    if p in (1, 2):   # two float32 addends, exact 1/P: the correctly rounded sum
        assert np.array_equal(got, ref.astype(np.float32))


def test_scatter_add_accumulates_in_order():
    out = np.zeros(4, np.float32)
    scatter_add(out, np.array([1, 1, 3]), np.array([1.0, 2.0, 5.0], np.float32), 0.5)
    assert out.tolist() == [0.0, 1.5, 0.0, 2.5]


def test_sparse_scratch_erases_previous_entries():
    s = SparseScratch()
    src = np.arange(10, dtype=np.float32) + 1
    a = s.fill(10, np.float32, np.array([2, 5]), src)
    assert np.flatnonzero(a).tolist() == [2, 5]
    b = s.fill(10, np.float32, np.array([7, 1, 0]), src, count=2)
    assert b is a                                  # reused, no allocation
    assert np.flatnonzero(b).tolist() == [1, 7] and b[7] == 8 and b[1] == 2


def test_scatter_add_rows_matches_numpy():
    from horovod_compress.kernels.scatter import scatter_add_rows
    rng = np.random.default_rng(11)
    out = np.zeros((6, 5), np.float32)
    ref = np.zeros((6, 5), np.float64)
    for _ in range(3):
        rows = np.sort(rng.choice(6, 2, replace=False)).astype(np.int32)
        block = rng.standard_normal((2, 5)).astype(np.float32)
        scatter_add_rows(out, rows, block, 0.5)
        ref[rows] += 0.5 * block
    assert np.allclose(out, ref, rtol=1e-6)


def test_row_scratch_erases_previous_rows():
    from horovod_compress.kernels.scatter import RowScratch
    s = RowScratch()
    a = s.fill(np.ones((2, 3), np.float32), np.array([0, 4]), 5)
    assert a[[0, 4]].all() and not a[[1, 2, 3]].any()
    b = s.fill(np.full((1, 3), 2.0, np.float32), np.array([2]), 5)
    assert b is a and b[2].tolist() == [2.0, 2.0, 2.0] and not b[[0, 1, 3, 4]].any()


def test_support_of_names_the_last_fill_only_for_its_own_buffer():
    scratch = SparseScratch()
    src = np.arange(10, dtype=np.float32) + 1
    buf = scratch.fill(10, np.float32, np.array([7, 2, 2], np.int64), src, count=2)
    assert scratch.support_of(buf).tolist() == [7, 2]
    assert scratch.support_of(buf.reshape(2, 5)).tolist() == [7, 2]   # C-order view
    assert scratch.support_of(buf.copy()) is None                      # another buffer
    assert scratch.support_of(buf.reshape(2, 5).T) is None             # not C-order


@pytest.mark.parametrize("name", ["topk", "randk", "gaussiank", "topk_dsa", "gtopk", "oktopk"])
def test_sparse_residual_update_equals_the_dense_one(name, monkeypatch):
    """EF14 subtracts ``local`` only on its support; the residual is bit-identical to ``acc - local``."""
    import horovod_compress as hvdc
    from horovod_compress.compressors.base import Method
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()
    grads = [np.random.default_rng(s).standard_normal((60, 70)).astype(np.float32)
             for s in range(4)]
    residuals, used = {}, []
    sparse_support = Method.local_support

    def spy(self, n, local):
        support = sparse_support(self, n, local)
        used.append(support is not None)
        return support

    for mode in ("sparse", "dense"):
        monkeypatch.setattr(Method, "local_support",
                            spy if mode == "sparse" else (lambda self, n, local: None))
        extra = {"warmup_steps": 0} if name == "oktopk" else {}
        m = hvdc.Compression.by_name(name, density=0.05, **extra)
        outs = [m.allreduce(g, "g", comm).copy() for g in grads]
        residuals[mode] = (m.state["g"]["fb_residual"].copy(), outs)
    assert np.array_equal(residuals["sparse"][0], residuals["dense"][0])
    for a, b in zip(residuals["sparse"][1], residuals["dense"][1]):
        assert np.array_equal(a, b)
    assert np.count_nonzero(residuals["sparse"][0]) > 0
    assert used and all(used)        # the O(k) update ran on every step
