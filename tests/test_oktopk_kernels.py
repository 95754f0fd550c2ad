"""Selection kernels and the pure helpers of Ok-Topk and its baselines (no MPI ranks needed)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.special import ndtri

import horovod_compress as hvdc
from horovod_compress.compressors.gaussiank import adjusted_threshold
from horovod_compress.kernels.selection import (
    coo_sum,
    count_at_least,
    gaussian_threshold,
    kth_largest_abs,
    select_by_threshold,
    topk_of_coo,
)

FLOATS = st.sampled_from([np.float32, np.float64])


def _vectors(dtype):
    # small magnitudes with repeats (ties), zeros and negative zeros
    return hnp.arrays(dtype, st.integers(1, 200),
                      elements=st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, -2.0, 3.25, 1e-30])
                      | st.floats(-1e6, 1e6, width=32))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=FLOATS)
def test_kth_largest_abs_is_exact(data, dtype):
    x = data.draw(_vectors(dtype))
    k = data.draw(st.integers(1, x.size))
    assert kth_largest_abs(x, k) == np.sort(np.abs(x))[::-1][k - 1]


def test_kth_largest_abs_out_of_range_k():
    x = np.array([1.0, -2.0, 3.0], np.float32)
    assert kth_largest_abs(x, 0) == np.inf and kth_largest_abs(x, 4) == 0.0
    assert kth_largest_abs(np.zeros(0, np.float32), 1) == 0.0
    assert kth_largest_abs(np.array([np.inf, 1.0]), 1) == np.inf
    assert kth_largest_abs(np.array([5.0], np.float16), 1) == 5.0   # widened to float32


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=FLOATS)
def test_select_by_threshold_is_one_compare(data, dtype):
    x = data.draw(_vectors(dtype))
    th = data.draw(st.sampled_from([0.0, 0.5, 1.0, 1e6]) | st.floats(0, 10))
    idx, val = select_by_threshold(x, th)
    mask = (np.abs(x) >= x.dtype.type(th)) & (x != 0)
    assert np.array_equal(idx, np.flatnonzero(mask)) and np.array_equal(val, x[mask])
    assert val.dtype == x.dtype and idx.dtype == np.int64
    assert count_at_least(x, th) == mask.sum()


def test_threshold_of_kth_selects_k_without_ties():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    for k in (1, 100, 9_999, 10_000):
        idx, _ = select_by_threshold(x, kth_largest_abs(x, k))
        assert idx.size == k


@settings(max_examples=100, deadline=None)
@given(idx=hnp.arrays(np.int64, st.integers(0, 100), elements=st.integers(0, 30)))
def test_coo_sum_matches_dense_and_sorts(idx):
    val = np.arange(idx.size, dtype=np.float64) * 0.5 - 3
    u, s = coo_sum(idx, val)
    dense = np.bincount(idx, weights=val, minlength=31) if idx.size else np.zeros(31)
    present = np.unique(idx)
    assert np.array_equal(u, present) and np.allclose(s, dense[present])


def test_coo_sum_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        coo_sum(np.arange(3), np.zeros(2))


def test_topk_of_coo_keeps_k_largest_drops_zeros():
    idx = np.array([1, 4, 6, 9, 12])
    val = np.array([0.5, -3.0, 0.0, 2.0, -0.1], np.float32)
    i, v = topk_of_coo(idx, val, 2)
    assert i.tolist() == [4, 9] and v.tolist() == [-3.0, 2.0]
    i, v = topk_of_coo(idx, val, 10)
    assert i.tolist() == [1, 4, 9, 12]


def test_gaussian_threshold_is_the_percent_point_function():
    x = np.random.default_rng(1).normal(0.3, 2.0, 5000)
    want = abs(x.mean()) + x.std(ddof=1) * ndtri(1 - 0.01 / 2)
    assert np.isclose(gaussian_threshold(x, 0.01), want, rtol=1e-10)
    with pytest.raises(ValueError, match="density"):
        gaussian_threshold(x, 0.0)


def test_adjusted_threshold_matches_the_reference_loop_including_its_cap():
    rng = np.random.default_rng(3)
    for outlier, k in ((12.0, 60), (200.0, 60), (1.0, 60), (12.0, 1)):
        x = (0.1 * rng.standard_normal(6000)).astype(np.float32)
        x[rng.random(6000) < 0.005] *= outlier
        th0 = gaussian_threshold(x, k / 6000)
        t, loops = th0, 0
        while loops < 50 and count_at_least(x, t) < (3 * k) // 4:
            t /= 1.012
            loops += 1
        assert np.isclose(adjusted_threshold(x, th0, k), t, rtol=1e-12), (outlier, loops)
    assert adjusted_threshold(np.zeros(10, np.float32), 1.0, 8) == pytest.approx(1.012 ** -50)


# ------------------------------------------------------------ pure helpers
def test_local_region_boundaries_split_the_local_topk_evenly():
    from horovod_compress.mpi_collectives.oktopk import (
        local_region_boundaries,
        region_cuts,
    )

    idx = np.array([3, 10, 11, 40, 41, 42, 90, 95])
    b = local_region_boundaries(idx, 100, 4)
    assert b.tolist() == [0, 11, 41, 90, 100]
    assert np.diff(region_cuts(idx, b)).tolist() == [2, 2, 2, 2]
    assert local_region_boundaries(np.array([], np.int64), 10, 4).tolist() == [0, 2, 5, 7, 10]


def test_union_region_boundaries_split_local_and_global_together():
    """Each region holds an equal share of the local top-k and the last global top-k counted
    together: the merged multiset's quantiles, found without merging (random cases against a
    sort), and the paper's local split when there is no global top-k yet."""
    from horovod_compress.mpi_collectives.oktopk import local_region_boundaries, union_region_boundaries

    local = np.array([3, 10, 11, 40, 41, 42, 90, 95])
    glob = np.array([0, 1, 2, 4, 5, 6, 7, 8])          # the reduced sums' large entries all low
    b = union_region_boundaries(local, glob, 100, 4)
    assert b.tolist() == [0, 4, 8, 41, 100]            # 4 of the 16 indices in each region
    both = np.sort(np.concatenate([local, glob]))
    assert np.diff(np.searchsorted(both, b)).tolist() == [4, 4, 4, 4]
    assert union_region_boundaries(local, None, 100, 4).tolist() == local_region_boundaries(local, 100, 4).tolist()
    rng = np.random.default_rng(7)
    for _ in range(200):
        n, p = int(rng.integers(1, 5000)), int(rng.integers(1, 9))
        a = np.sort(rng.choice(n, int(rng.integers(0, min(n, 300) + 1)), replace=False))
        g = np.sort(rng.choice(n, int(rng.integers(1, min(n, 300) + 1)), replace=False))
        m = np.sort(np.concatenate([a, g]))
        j = np.arange(1, p)
        want = np.concatenate([[0], m[(j * m.size) // p], [n]])
        assert union_region_boundaries(a, g, n, p).tolist() == want.tolist()


@pytest.mark.parametrize("p,bucket", [(1, 4), (2, 1), (5, 2), (8, 4), (9, 4)])
def test_rotation_schedule_has_no_hot_spot_and_matching_buckets(p, bucket):
    from horovod_compress.mpi_collectives.oktopk import rotation_schedule

    plans = [rotation_schedule(r, p, bucket) for r in range(p)]
    assert all(len(plan) == -(-(p - 1) // bucket) for plan in plans)
    for b in range(len(plans[0])):
        for step in range(len(plans[0][b])):
            dests = [plans[r][b][step][0] for r in range(p)]
            assert sorted(dests) == list(range(p)) and all(d != r for r, d in enumerate(dests))
            for r in range(p):   # my destination receives from me in the same bucket and step
                dst, _ = plans[r][b][step]
                assert plans[dst][b][step][1] == r


def test_schedules():
    from horovod_compress.mpi_collectives.oktopk import (
        OkTopkSchedule,
        balanced_shares,
        repartition_due,
    )
    from horovod_compress.mpi_collectives.sparse_allreduce_baselines import (
        gtopk_tree_schedule,
        uniform_boundaries,
    )

    due = [s for s in range(1, 200) if repartition_due(s, OkTopkSchedule())]
    assert due == [1, 2, 3, 5, 9, 17, 33, 65, 129, 193]
    assert [s for s in range(1, 200) if repartition_due(s, OkTopkSchedule(early_repartition=False))] \
        == [1, 65, 129, 193]
    assert balanced_shares(10, 4).tolist() == [3, 3, 2, 2]
    assert gtopk_tree_schedule(5) == [[(0, 1), (2, 3)], [(0, 2)], [(0, 4)]]
    assert gtopk_tree_schedule(1) == []
    assert uniform_boundaries(10, 3).tolist() == [0, 3, 6, 10]


# ------------------------------------------------------------- parameters
@pytest.mark.parametrize("name,kwargs,match", [
    ("oktopk", {"density": 0.0}, "density"),
    ("oktopk", {"density": 1.5}, "density"),
    ("oktopk", {"tau": 0}, "tau"),
    ("oktopk", {"tau_prime": -1}, "tau_prime"),
    ("oktopk", {"k": 0}, "k"),
    ("oktopk", {"bucket_size": 0}, "bucket_size"),
    ("oktopk", {"balance_factor": 0.5}, "balance_factor"),
    ("oktopk", {"local_guard": 0.9}, "local_guard"),
    ("oktopk", {"warmup_steps": -1}, "warmup_steps"),
    ("oktopk", {"thresholds": 3}, "thresholds"),
    ("topk_dsa", {"density": -0.1}, "density"),
    ("gtopk", {"density": 2}, "density"),
    ("gaussiank", {"adjust": "yes"}, "adjust"),
])
def test_bad_arguments_raise_value_errors_naming_them(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hvdc.Compression.by_name(name, **kwargs)


def test_defaults_follow_the_paper():
    m = hvdc.Compression.oktopk()
    assert (m.density, m.tau, m.tau_prime, m.balance_factor, m.warmup_steps) == (0.01, 64, 32, 4.0, 32)
    assert m.feedback.name == "residual" and m.k_for(1000) == 10
    assert hvdc.Compression.oktopk(k=5000).k_for(10) == 5000
    for name in ("topk_dsa", "gtopk", "gaussiank"):
        assert hvdc.Compression.by_name(name).feedback.name == "residual"


def test_importing_and_building_does_not_start_mpi():
    code = ("import sys, horovod_compress as h\n"
            "[h.Compression.by_name(n) for n in ('oktopk','topk_dsa','gtopk','gaussiank')]\n"
            "h.Compression.oktopk().schedule\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
