"""ARC-Top-K (papers/arc-topk.txt, Algorithm 1) and the paper's row baselines.

MPI cases live in tests/cases/arc_cases.py; each launch runs them all on 2 or
4 real ranks. The single-process tests below check the pieces that need no
communication (selection kernel, plans, argument checks).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.kernels.rows import (
    gather_rows,
    matrix_shape,
    row_sq_norms,
    scatter_rows,
    top_rows,
)
from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "arc_cases.py"
ALL = ["case_prop1", "case_contractive", "case_bytes", "case_selection",
       "case_training_identical"]


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def mpi(request):
    """All ARC cases on P real ranks, in one mpirun launch."""
    return request.param, run_cases(request.param, CASES, ALL)


def test_proposition1_local_topk_returns_zero_arc_does_not(mpi):
    """Prop. 1: averaged local Top-1 of [-1, .1], [1, .1] is 0 (error = ||g||^2); ARC's is 0."""
    _p, res = mpi
    for out in res["case_prop1"].values():
        assert out["topk_elem"] == pytest.approx(out["norm2"], rel=1e-6)   # non-contractive
        assert out["topk_rows"] == pytest.approx(1.0, rel=1e-6) and out["topk_rows_zero"]
        for key in ("arc_rows_r1", "arc_rows_r4"):
            assert out[key] < 1e-9                       # ARC keeps the row that matters
        assert out["arc_2x1"] < 1e-9 * out["norm2"]


def test_proposition2_contractive_in_expectation(mpi):
    """Mean over 200 sketches of ||C(g)-g||^2/||g||^2 <= 1 - K/m, for the averaged g.

    On matrices built so that local row norms mislead (a large part cancels
    across ranks): ARC-Top-K stays far below the bound and close to the best K
    rows (oracle); Rand-K rows sits at the bound (its exact expectation, 200
    draws: +-0.05); averaged local Top-K rows exceeds it (non-contractive).
    """
    _p, res = mpi
    out = res["case_contractive"][0]
    bound, oracle = out["bound"], out["oracle"]
    assert bound == pytest.approx(1 - 4 / 20)
    for key in ("arc_r1", "arc_r4"):
        assert oracle - 1e-9 <= out[key + "_min"] and out[key] <= bound
    assert out["arc_r1"] <= oracle + 0.5 * (bound - oracle)      # informative rows, r = 1
    assert out["arc_r4"] <= oracle + 0.25 * (bound - oracle)     # larger r: better estimate
    assert out["arc_r4"] < out["arc_r1"]
    assert abs(out["randk_rows"] - bound) < 0.05
    assert out["topk_rows"] > bound + 0.1
    # every rank computed the same numbers
    assert all(v == out for v in res["case_contractive"].values())


def test_exact_bytes_no_index_sent(mpi):
    """Bytes/rank/step = ring allreduce of m*r + K*n words (checked inside each rank)."""
    p, res = mpi
    out = res["case_bytes"][0]
    k = math.ceil(0.2 * 32)
    assert out["(32, 24)/4/True"] == 2 * (32 * 4 + k * 24) * 4 * (p - 1) / p
    assert out["(50,)/4/True"] == 2 * 50 * 4 * (p - 1) / p
    assert all(v == out for v in res["case_bytes"].values())


def test_same_rows_on_every_rank_and_exact_row_average(mpi):
    """Selection = reference top-K of the sketch, same on all ranks; edge shapes defined."""
    _p, res = mpi
    out = res["case_selection"][0]
    assert all(v == out for v in res["case_selection"].values())
    for step in (1, 2, 3):
        assert len(out[f"fc/{step}"]) == math.ceil(0.2 * 24)
        assert len(out[f"conv/{step}"]) == 3
        assert len(out[f"short/{step}"]) == 1            # m < 1/ratio: K = 1
        assert out[f"row/{step}"] is None                # 1 x n: dense
        assert out[f"row_forced/{step}"] == [0]
        assert out[f"wide_r/{step}"] is None             # rank > n: dense
        assert len(out[f"wide_r_forced/{step}"]) == 2
        assert out[f"bias/{step}"] is None               # 1-D: dense


def test_training_ends_with_identical_parameters(mpi):
    _p, res = mpi
    out = res["case_training_identical"][0]
    assert out["end_loss"] < 0.7 * out["start_loss"]


# ------------------------------------------------------------ no MPI needed
def test_top_rows_ties_and_nan():
    s = np.array([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])
    assert top_rows(s, 2).tolist() == [1, 2]                 # ties -> lower index
    assert top_rows(s, 4).tolist() == [1, 2, 3, 4]
    assert top_rows(np.zeros(5), 3).tolist() == [0, 1, 2]
    assert top_rows(s, 0).size == 0 and top_rows(s, 9).tolist() == list(range(6))
    assert top_rows(np.array([0.0, np.nan, 5.0]), 1).tolist() == [1]
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.integers(0, 4, size=30).astype(float)        # many ties
        k = int(rng.integers(1, 30))
        ref = np.sort(np.lexsort((np.arange(30), -x))[:k])   # sort by (-score, index)
        assert top_rows(x, k).tolist() == ref.tolist()
    with pytest.raises(ValueError, match="k must be"):
        top_rows(s, -1)


def test_row_kernels_round_trip():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((9, 5)).astype(np.float32)
    rows = np.array([1, 4, 8])
    block = gather_rows(g, rows)
    assert block.flags.c_contiguous and np.array_equal(block, g[rows])
    full = scatter_rows(block, rows, 9)
    assert np.array_equal(full[rows], g[rows]) and np.count_nonzero(full[[0, 2, 3, 5, 6, 7]]) == 0
    assert np.allclose(row_sq_norms(g), (g.astype(np.float64) ** 2).sum(axis=1), rtol=1e-5)
    assert matrix_shape((64, 3, 3, 3)) == (64, 27) and matrix_shape((5,)) is None
    assert matrix_shape(()) is None


def test_plan_and_expected_bytes():
    arc = hvdc.Compression.arc_topk()                        # ratio 0.2, rank 4
    plan = arc.plan((64, 3, 3, 3))
    assert (plan.m, plan.n, plan.k, plan.r) == (64, 27, 13, 4)
    assert arc.expected_bytes((64, 3, 3, 3), 8) == 2 * (64 * 4 + 13 * 27) * 4 * 7 / 8
    assert arc.expected_bytes((128, 256), 1) == 0.0
    assert arc.plan((10,)).dense and arc.plan((1, 100)).dense and arc.plan((8, 4)).dense
    assert arc.plan((10, 5)).dense                           # 10*4 + 2*5 >= 50: no saving
    assert not arc.plan((10, 6)).dense                       # 40 + 12 < 60
    forced = hvdc.Compression.arc_topk(dense_fallback=False)
    assert not forced.plan((8, 4)).dense and forced.plan((1, 100)).k == 1
    assert forced.plan((10,)).dense                          # 1-D is always dense
    assert hvdc.Compression.arc_topk(ratio=0.2).plan((10, 100)).k == 2   # ceil(0.2*10) = 2


def test_sketch_is_shared_and_fresh_per_step():
    a = hvdc.Compression.arc_topk(seed=5)
    b = hvdc.Compression.arc_topk(seed=5)
    v1 = a.sketch_matrix("w", 1, 50, 4)
    assert np.array_equal(v1, b.sketch_matrix("w", 1, 50, 4))          # no message needed
    assert not np.array_equal(v1, a.sketch_matrix("w", 2, 50, 4))      # new V every step
    assert not np.array_equal(v1, a.sketch_matrix("u", 1, 50, 4))      # per tensor
    big = a.sketch_matrix("w", 1, 4000, 4, np.dtype(np.float64)) * 2.0  # sqrt(r) = 2
    assert abs(big.mean()) < 0.05 and abs(big.std() - 1.0) < 0.05      # N(0, 1) entries


@pytest.mark.parametrize("bad, match", [
    (dict(ratio=0.0), "ratio"), (dict(ratio=1.5), "ratio"), (dict(rank=0), "rank"),
    (dict(rank=2.5), "rank"), (dict(eta=0.0), "eta"), (dict(eta=2.0), "eta"),
    (dict(dense_fallback="yes"), "dense_fallback"), (dict(feedback="ef22"), "feedback"),
    (dict(warmup_steps=-1), "warmup_steps"), (dict(bogus=1), "bogus"),
])
def test_bad_arguments_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        hvdc.Compression.arc_topk(**bad)


@pytest.mark.parametrize("name", ["randk_rows", "topk_rows"])
def test_row_baselines_arguments(name):
    m = hvdc.Compression.by_name(name, ratio=0.3, eta=0.2)
    assert m.params() == {"ratio": 0.3, "eta": 0.2} and m.layout == "matrix"
    with pytest.raises(ValueError, match="ratio"):
        hvdc.Compression.by_name(name, ratio=0)


def test_registered_with_paper_defaults():
    arc = hvdc.Compression.arc_topk()
    assert arc.config() == {"name": "arc_topk", "seed": 0, "warmup_steps": 0,
                            "feedback": "ef21m", "ratio": 0.2, "rank": 4,
                            "dense_fallback": True, "eta": 0.1}
    assert arc.layout == "matrix" and arc.biased and not arc.horovod_compatible
    assert {"arc_topk", "randk_rows", "topk_rows"} <= set(hvdc.Compression.available())
