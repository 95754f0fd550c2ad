"""Ok-Topk's fused CPU hot path: kernels against NumPy, and the fused step against the unfused one.

"Near-Optimal Sparse Allreduce for Distributed Deep Learning" (Ok-Topk):
Algorithm 2, line 4 (``acc = e + g``) runs in the pass that selects by the
reused local threshold (Algorithm 1, line 4; Section 3.1.3); the reduction of
split-and-reduce (line 8) is a merge of sorted runs; line 14's intersection is
a merge; the output ``u / P`` is written in one pass. Every one of these must
give the same bits as the unfused computation, and the step the same bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import horovod_compress as hvdc
from horovod_compress.compressors.oktopk import OkTopk
from horovod_compress.kernels.oktopk_fused import (
    add_select_at_least,
    compact_at_least,
    densify,
    filter_at_least,
    intersect_sorted,
    merge_sum,
    select_at_least,
)
from horovod_compress.kernels.selection import coo_sum, select_by_threshold
from horovod_compress.tools.testing import run_cases, same_on_all_ranks

FLOATS = st.sampled_from([np.float32, np.float64])
VALUES = (st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, -2.0, 3.25, 1e-30])
          | st.floats(-1e6, 1e6, width=32))


# ------------------------------------------------------------------ kernels
@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=FLOATS)
def test_add_select_is_the_sum_and_one_compare(data, dtype):
    n = data.draw(st.integers(1, 300))
    x = data.draw(hnp.arrays(dtype, n, elements=VALUES))
    e = data.draw(hnp.arrays(dtype, n, elements=VALUES))
    th = data.draw(st.sampled_from([0.0, 0.5, 1.0, 1e6]) | st.floats(0, 10))
    cap = data.draw(st.integers(0, n + 2))
    acc = np.full(n, np.nan, dtype)
    bi, bv = np.empty(cap, np.int64), np.empty(cap, dtype)
    count = add_select_at_least(x, e, acc, th, bi, bv)
    want = x + e
    assert np.array_equal(acc.view(np.uint8), want.view(np.uint8))
    idx, val = select_by_threshold(want, th)
    assert count == idx.size
    w = min(cap, count)
    assert np.array_equal(bi[:w], idx[:w]) and np.array_equal(bv[:w], val[:w])
    bi2, bv2 = np.empty(cap, np.int64), np.empty(cap, dtype)
    assert select_at_least(want, th, bi2, bv2) == count
    assert np.array_equal(bi2[:w], idx[:w]) and np.array_equal(bv2[:w], val[:w])


def test_add_select_on_a_long_vector_with_blocks_and_a_tail():
    rng = np.random.default_rng(0)
    n = 64 * 1000 + 37
    x = rng.standard_normal(n).astype(np.float32)
    e = rng.standard_normal(n).astype(np.float32)
    x[::97] = -e[::97]                              # exact zeros are never selected
    acc = np.empty_like(x)
    bi, bv = np.empty(n, np.int64), np.empty(n, np.float32)
    count = add_select_at_least(x, e, acc, 1.5, bi, bv)
    idx, val = select_by_threshold(x + e, 1.5)
    assert count == idx.size and np.array_equal(bi[:count], idx) and np.array_equal(bv[:count], val)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=FLOATS)
def test_compact_and_filter_match_select_by_threshold(data, dtype):
    val = data.draw(hnp.arrays(dtype, st.integers(0, 200), elements=VALUES))
    idx = np.arange(val.size, dtype=np.int64) * 3
    th = data.draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 10))
    pos, want = select_by_threshold(val, th) if val.size else (np.empty(0, np.int64), val)
    fi, fv, top = filter_at_least(idx, val, th)
    assert np.array_equal(fi, idx[pos]) and np.array_equal(fv, want)
    assert top == (float(np.abs(want).max()) if want.size else 0.0)
    ci, cv = idx.copy(), val.copy()
    kept = compact_at_least(ci, cv, val.size, th)
    assert np.array_equal(ci[:kept], idx[pos]) and np.array_equal(cv[:kept], want)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_merge_sum_equals_coo_sum_of_the_concatenation(data):
    runs = data.draw(st.integers(0, 5))
    own = np.unique(data.draw(hnp.arrays(np.int64, st.integers(0, 40), elements=st.integers(0, 60))))
    parts = [np.unique(data.draw(hnp.arrays(np.int64, st.integers(0, 40),
                                            elements=st.integers(0, 60)))) for _ in range(runs)]
    rng = np.random.default_rng(own.size + 7 * runs)
    vals = [rng.standard_normal(p.size).astype(np.float32) * 10.0 ** rng.integers(-20, 20, p.size)
            for p in [own] + parts]
    b_idx = np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32)
    b_val = np.concatenate(vals[1:]) if parts else np.empty(0, np.float32)
    starts = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64)
    got_idx, got_val = merge_sum(own, vals[0], b_idx, b_val, starts)
    want_idx, want_val = coo_sum(np.concatenate([own] + parts),
                                 np.concatenate(vals).astype(np.float64))
    assert np.array_equal(got_idx, want_idx)
    assert np.array_equal(got_val.view(np.uint64), want_val.view(np.uint64))   # bit for bit


@settings(max_examples=100, deadline=None)
@given(a=hnp.arrays(np.int64, st.integers(0, 60), elements=st.integers(0, 100)),
       b=hnp.arrays(np.int64, st.integers(0, 60), elements=st.integers(0, 100)))
def test_intersect_sorted_is_intersect1d(a, b):
    a, b = np.unique(a), np.unique(b)
    got = intersect_sorted(a.astype(np.int32), b)
    assert got.dtype == np.int64 and np.array_equal(got, np.intersect1d(a, b, assume_unique=True))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [1, 2, 3, 7])
def test_densify_is_zeros_and_a_scatter_of_val_over_p(dtype, p):
    rng = np.random.default_rng(p)
    n = 10_007
    idx = np.sort(rng.choice(n, 300, replace=False))
    idx[-1] = n - 1
    val = (rng.standard_normal(300) * 1e3).astype(dtype)
    want = np.zeros(n, dtype)
    want[idx] = val / dtype(p)
    got = densify(n, idx, val, p, dtype)
    assert got.dtype == dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    shuffled = rng.permutation(idx.size)               # any order
    got = densify(n, idx[shuffled], val[shuffled], p, dtype)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert not densify(5, np.empty(0, np.int64), np.empty(0, dtype), p, dtype).any()


# -------------------------------------------- the fused step against the unfused one
class _Unfused(OkTopk):
    """Ok-Topk without the EF14 fusion: ``acc = g + e`` by NumPy, then ``_reduce(acc)``."""

    _reduce_residual = None


def _stream(rank: int, n: int, steps: int, jump_at: int | None = None):
    base = np.exp(np.random.default_rng(3).normal(0.0, 1.0, n))
    shared, own = np.random.default_rng(7), np.random.default_rng(100 + rank)
    z = shared.standard_normal(n)
    for step in range(1, steps + 1):
        z = 0.7 * z + np.sqrt(0.51) * shared.standard_normal(n)
        g = base * (z + 0.5 * own.standard_normal(n))
        yield (g * (20.0 if jump_at is not None and step >= jump_at else 1.0)).astype(np.float32)


def _same_steps(comm, kwargs: dict, n: int, steps: int, jump_at: int | None = None,
                dtype=np.float32, shape=None) -> dict:
    """Run fused and unfused Ok-Topk side by side; assert equal bits, states and bytes every step."""
    fused = hvdc.Compression.oktopk(**kwargs)
    plain = _Unfused(**kwargs)
    stats = {"local_guard": 0, "global_guard": 0}
    for g in _stream(comm.rank, n, steps, jump_at):
        g = g.astype(dtype).reshape(shape or g.shape)
        comm.reset_stats()
        a = fused.allreduce(g, "w", comm)
        bytes_a = (comm.bytes_sent, comm.bytes_received, comm.stats()["by_phase"])
        comm.reset_stats()
        b = plain.allreduce(g, "w", comm)
        bytes_b = (comm.bytes_sent, comm.bytes_received, comm.stats()["by_phase"])
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        assert bytes_a[:2] == bytes_b[:2]
        assert {k: (v["calls"], v["sent"], v["received"]) for k, v in bytes_a[2].items()} == \
               {k: (v["calls"], v["sent"], v["received"]) for k, v in bytes_b[2].items()}
        sa, sb = fused.state["w"], plain.state["w"]
        assert set(sa) == set(sb)
        for key in sa:
            if isinstance(sa[key], np.ndarray):
                assert np.array_equal(sa[key].view(np.uint8), sb[key].view(np.uint8)), key
            else:
                assert sa[key] == sb[key], (key, sa[key], sb[key])
        assert same_on_all_ranks(comm, a)
        k = fused.k_for(g.size)
        stats["local_guard"] += int(sa.get("local_count_reused", 0) > 2 * k)
        stats["global_guard"] += int(sa.get("global_count_reused", 0) > 2 * k)
    return stats


def case_fused_equals_unfused_default(comm):
    """Default parameters, warm-up 2, 40 steps of a gradient stream (float32)."""
    return _same_steps(comm, {"density": 0.01, "warmup_steps": 2}, 200_000, 40)


def case_fused_equals_unfused_guards(comm):
    """A 20x jump: the local guard re-selects among candidates that overflow the reused
    buffers (the selection falls back to the exact top-k over acc), the global guard trips."""
    return _same_steps(comm, {"density": 0.005, "warmup_steps": 0, "global_guard": 1.0},
                       100_000, 10, jump_at=5)


def case_fused_equals_unfused_no_guards(comm):
    """Guards off: a stale threshold selects more than the buffers hold; they grow."""
    return _same_steps(comm, {"k": 200, "warmup_steps": 0, "local_guard": None,
                              "global_guard": None, "tau_prime": 8}, 50_000, 10, jump_at=4)


def case_fused_equals_unfused_float64_matrix(comm):
    """float64 values, a 2-D gradient, small buckets (several split rounds), eager balancing."""
    return _same_steps(comm, {"density": 0.02, "warmup_steps": 0, "bucket_size": 1,
                              "balance_factor": 1.0, "tau_prime": 3}, 30_000, 8,
                       dtype=np.float64, shape=(150, 200))


def case_nonfinite_gradient_on_fused_steps(comm):
    """A NaN/Inf gradient on a reused-threshold step (the fused pass reports it) and on an
    exact step (the gate tests the gradient): skipped everywhere, the state left as it was,
    and the run continues exactly like one that never saw those steps."""
    n = 100_000
    seen = hvdc.Compression.oktopk(density=0.01, warmup_steps=0, tau_prime=4)
    seen.set_nonfinite("skip")
    clean = hvdc.Compression.oktopk(density=0.01, warmup_steps=0, tau_prime=4)
    skipped = 0
    for step, g in enumerate(_stream(comm.rank, n, 12), start=1):
        if step in (3, 5):                 # sparse steps 3 (reused) and 5 (exact, (5-1) % 4 == 0)
            before = {k: (v.copy() if isinstance(v, np.ndarray) else v)
                      for k, v in seen.state["w"].items()}
            bad = g.copy()
            if comm.rank == comm.size - 1:
                bad[12345] = np.nan if step == 3 else -np.inf
            out = seen.allreduce(bad, "w", comm)
            assert not out.any() and seen.last_step_skipped
            after = seen.state["w"]
            assert set(after) == set(before)
            for key, value in before.items():
                if isinstance(value, np.ndarray):
                    assert np.array_equal(after[key], value), key
                else:
                    assert after[key] == value, key
            skipped += 1
            continue
        a, b = seen.allreduce(g, "w", comm), clean.allreduce(g, "w", comm)
        assert np.array_equal(a, b)
        assert np.array_equal(seen.state["w"]["fb_residual"], clean.state["w"]["fb_residual"])
    raising = hvdc.Compression.oktopk(density=0.01, warmup_steps=0, tau_prime=4)
    for step, g in enumerate(_stream(comm.rank, n, 3), start=1):
        if step == 3:
            g[7] = np.inf
        try:
            raising.allreduce(g, "w", comm)
        except FloatingPointError:
            assert step == 3
            return {"skipped": skipped, "raised": True}
    return {"skipped": skipped, "raised": False}


@pytest.fixture(scope="module", params=[1, 2, 4])
def fused_results(request):
    return request.param, run_cases(request.param, __file__)


def test_fused_step_is_bit_identical_to_the_unfused_one(fused_results):
    p, res = fused_results
    guards = res[case_fused_equals_unfused_guards][0]
    assert guards["local_guard"] >= 1
    if p > 1:
        assert guards["global_guard"] >= 1
    for case in (case_fused_equals_unfused_default, case_fused_equals_unfused_no_guards,
                 case_fused_equals_unfused_float64_matrix):
        assert len(res[case]) == p


def test_nonfinite_gradients_are_caught_by_the_fused_pass(fused_results):
    p, res = fused_results
    assert all(r == {"skipped": 2, "raised": True}
               for r in res[case_nonfinite_gradient_on_fused_steps].values())
