"""GreedyLore (papers/greedylore.txt, Algorithm 3) and the lazy-projection baseline.

MPI cases live in tests/cases/lowrank_cases.py; one mpirun launch per world
size runs them all on real ranks. The single-process tests below check the
pieces that need no communication and the argument checks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors.greedylore import (
    GreedyLore,
    left_singular_vectors,
    probe_values,
    shared_probe_values,
    subtract_low_rank,
    working_matrix,
)
from horovod_compress.kernels.lowrank import add_and_probe, reconstruct
from horovod_compress.compressors.lowrank_common import should_compress, top_indices
from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "lowrank_cases.py"
ALL = ["case_greedylore_reference", "case_greedylore_reference_independent",
       "case_greedylore_fast_paths",
       "case_greedylore_unbiased", "case_greedylore_many_probes",
       "case_greedylore_error_feedback", "case_contractive", "case_bytes", "case_edge_shapes",
       "case_checkpoint"]


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def mpi(request):
    """All low-rank cases (except the torch comparison) on P real ranks, one launch."""
    return request.param, run_cases(request.param, CASES, ALL)


def test_matches_dense_reference_of_algorithm3(mpi):
    """Outputs equal a float64 re-implementation from all ranks' data (m<n, m>n, 4-D),
    the selected columns are the reference's, and SVD steps give the exact average."""
    _p, res = mpi
    for case in ("case_greedylore_reference", "case_greedylore_reference_independent"):
        for out in res[case].values():
            assert out["worst_rel"] < 1e-4
            assert out["cols_equal"] and out["svd_exact"]


def test_fast_paths_match_reference(mpi):
    """The fused kernels (r <= 5), the BLAS path (r = 7), float64 and transposed tensors
    give the reference's output and columns; ``_reduce``'s ``local`` is Q Q^T A_i."""
    _p, res = mpi
    for out in res["case_greedylore_fast_paths"].values():
        assert len(out) == 6
        for v in out.values():
            assert v["cols_equal"] and v["worst_rel"] < v["tol"] and v["local_worst"] < v["tol"]


def test_score_estimator_is_unbiased_proposition4(mpi):
    """Mean of s_j^2 over 3000 shared probes is ||u_j^T avg(A)||^2 within 12%
    (s_j is Gaussian: the mean's relative std is sqrt(2/3000) = 2.6%). A rank-local
    probe would be biased (here by factors 1.2 to 17): the shared seed matters."""
    _p, res = mpi
    for out in res["case_greedylore_unbiased"].values():
        ratio = np.array(out["ratio"])
        assert np.all(np.abs(ratio - 1.0) < 0.12), ratio
        ratio = np.array(out["ratio_independent"])       # the paper's per-column probes
        assert np.all(np.abs(ratio - 1.0) < 0.12), ratio
        assert np.max(np.abs(np.array(out["local_only_ratio"]) - 1.0)) > 0.2


def test_many_probes_select_true_top_r(mpi):
    """With 4000 probes per column the chosen columns are exactly the global top-r;
    with one probe the choice is noisy but beats a random choice of r columns."""
    _p, res = mpi
    for out in res["case_greedylore_many_probes"].values():
        assert out["chosen"] == out["true_top"]
        assert out["one_probe_captured"] > out["random_captured"] + 0.1


def test_error_feedback_identity_and_reset(mpi):
    """A_t = Q Q^T A_t + e_{t+1} to float rounding; e = 0 and output = exact average
    at SVD steps; every rank receives the average of what the ranks sent."""
    _p, res = mpi
    for out in res["case_greedylore_error_feedback"].values():
        assert out["worst_identity"] < 1e-6 and out["reset_ok"] and out["sent_ok"]


def test_contractive_where_lazy_projection_is_not(mpi):
    """Prop. 2: a gradient orthogonal to the lazy subspace is lost entirely (error 1);
    GreedyLore re-selects columns and recovers it exactly. Prop. 3 / Lemma 2: over
    80 seeds the mean relative error is below 1 - r/m = 0.75."""
    _p, res = mpi
    for out in res["case_contractive"].values():
        assert out["lazy_err"] == pytest.approx(1.0, abs=1e-6)
        assert out["greedy_err"] < 1e-10
        assert out["mean_err"] < out["bound"] - 0.05
        assert out["mean_err_independent"] < out["bound"] - 0.05
        assert out["worst_err"] <= 1.0 + 1e-6


def test_bytes_equal_formula(mpi):
    """Per step: m*probes + r*n words (two allreduces), m*n on SVD steps, dense when
    the rule says so; checked with == inside the case, spot-checked here."""
    p, res = mpi
    w = 2.0 * 4 * (p - 1) / p          # bytes per word of a ring allreduce, per rank
    for out in res["case_bytes"].values():
        g = out["greedylore"]["(24, 40)"]   # warm-up 1, period 3, rank 4, probes 2
        assert g[0] == 24 * 40 * w and g[1] == 24 * 40 * w
        assert g[2] == (24 * 2 + 4 * 40) * w and g[3] == (24 * 2 + 4 * 40) * w
        assert g[4] == 24 * 40 * w
        assert out["greedylore"]["(40, 24)"] == g                         # transposed
        assert out["greedylore_p1"]["(24, 40)"][1] == (24 + 5 * 40) * w
        assert out["lazy_projection"]["(24, 40)"][2] == 4 * 40 * w
        assert out["powersgd"]["(24, 40)"][1] == (24 + 40) * 4 * w
        assert out["greedylore"]["(6, 6)"] == [36 * w] * 7
        assert out["greedylore"]["(30,)"] == [30 * w] * 7


def test_edge_shapes(mpi):
    """rank >= min(m, n) (compressed with min_compression_rate=0) is exact for all three
    methods, m > n included; small matrices and vectors go dense bit-for-bit."""
    _p, res = mpi
    for out in res["case_edge_shapes"].values():
        assert out["tall_ok"]
        assert all(v < 1e-5 for k, v in out.items() if k != "tall_ok")


def test_checkpoint_roundtrip(mpi):
    _p, res = mpi
    for out in res["case_checkpoint"].values():
        assert all(out.values())


# ------------------------------------------------------ single process
def test_working_matrix_transposes_tall_matrices():
    a = np.zeros((7, 3))
    m, t = working_matrix(a)
    assert m.shape == (3, 7) and t
    m, t = working_matrix(a.T)
    assert m.shape == (3, 7) and not t


def test_left_singular_vectors_orthonormal_and_sorted():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((5, 9)).astype(np.float32)
    u = left_singular_vectors(g)
    assert u.shape == (5, 5) and u.dtype == np.float32
    assert np.allclose(u.T @ u, np.eye(5), atol=1e-5)
    energy = np.sum((u.T @ g) ** 2, axis=1)
    assert np.all(np.diff(energy) <= 1e-4)


def test_left_singular_vectors_span_the_svd_subspaces():
    """eigh of G G^T gives the SVD's U up to column signs: the projectors agree."""
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((30, 50)) * np.geomspace(5.0, 0.1, 30)[:, None]).astype(np.float64)
    u = left_singular_vectors(g)
    u_svd = np.linalg.svd(g)[0]
    assert np.allclose(np.abs(np.sum(u * u_svd, axis=0)), 1.0, atol=1e-8)
    for r in (1, 4, 17):
        assert np.allclose(u[:, :r] @ u[:, :r].T, u_svd[:, :r] @ u_svd[:, :r].T, atol=1e-8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("probes", [1, 3])
def test_add_and_probe_kernel(dtype, probes):
    rng = np.random.default_rng(4)
    m_mat = rng.standard_normal((7, 33)).astype(dtype)
    err = rng.standard_normal((7, 33)).astype(dtype)
    xi = rng.standard_normal((probes, 33)).astype(dtype)
    want_a = m_mat + err
    v = np.empty((7, probes), dtype=dtype)
    add_and_probe(m_mat, err, xi, v)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.array_equal(err, want_a)
    assert np.allclose(v, want_a @ xi.T, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 6, 9])
def test_reconstruct_and_subtract_low_rank(dtype, r):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((11, r)).astype(dtype)
    c = rng.standard_normal((r, 37)).astype(dtype)
    out = np.full((11, 37), np.nan, dtype=dtype)
    reconstruct(q, c, out)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.allclose(out, q @ c, rtol=tol, atol=tol)
    a = rng.standard_normal((11, 37)).astype(dtype)
    want = a - q @ c
    got = subtract_low_rank(a, q, c)
    assert got is a and np.allclose(a, want, rtol=tol, atol=tol)


def test_probe_values_are_u_j_a_xi_j():
    rng = np.random.default_rng(1)
    u = np.linalg.qr(rng.standard_normal((4, 4)))[0]
    a = rng.standard_normal((4, 6))
    xi = rng.standard_normal((3, 4, 6))
    got = probe_values(u.T @ a, xi)
    want = np.array([[u[:, j] @ a @ xi[k, j] for k in range(3)] for j in range(4)])
    assert np.allclose(got, want)


def test_shared_probe_values_are_u_j_a_xi_without_forming_u_t_a():
    rng = np.random.default_rng(2)
    u = np.linalg.qr(rng.standard_normal((5, 5)))[0]
    a = rng.standard_normal((5, 7))
    xi = rng.standard_normal((3, 7))
    got = shared_probe_values(u, a, xi)
    want = np.array([[u[:, j] @ a @ xi[k] for k in range(3)] for j in range(5)])
    assert np.allclose(got, want)
    # = the paper's formula with xi_j = xi for every column
    assert np.allclose(got, probe_values(u.T @ a, np.broadcast_to(xi[:, None, :], (3, 5, 7))))


def test_shared_probes_draw_n_numbers_per_probe():
    m = GreedyLore(rank=2, probes=3)
    assert m.probes_for("w", 5, 40, 60, np.float32).shape == (3, 60)
    ind = GreedyLore(rank=2, probes=3, probe_mode="independent")
    assert ind.probes_for("w", 5, 40, 60, np.float32).shape == (3, 40, 60)
    with pytest.raises(ValueError, match="probe_mode"):
        GreedyLore(probe_mode="rademacher")


def test_top_indices_is_deterministic_with_ties():
    assert top_indices(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), 2).tolist() == [1, 2]
    assert top_indices(np.array([0.0, 0.0, 0.0]), 2).tolist() == [0, 1]


def test_min_compression_rate_rule():
    assert should_compress(64, 64, 8, 2.0)              # 2*128*8 = 2048 < 4096
    assert not should_compress(16, 16, 8, 2.0)          # 2*32*8 = 512 > 256
    assert not should_compress(10, 128, 8, 2.0)         # 2*138*8 = 2208 > 1280
    assert should_compress(5, 12, 9, 0.0)               # rate 0 compresses everything


def test_schedule_counts_from_first_compressed_step():
    m = GreedyLore(period=3, warmup_steps=2)
    assert [s for s in range(1, 12) if m.is_svd_step(s)] == [3, 6, 9]


def test_expected_bytes_is_period_average():
    m = GreedyLore(rank=4, period=10)
    w = 2.0 * 4 * 3 / 4
    want = (9 * (32 + 4 * 64) + 32 * 64) / 10 * w
    assert m.expected_bytes((64, 32), 4) == pytest.approx(want)


@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 0}, ["rank", "[1, inf]"]),
    ({"period": 0}, ["period"]),
    ({"probes": 0}, ["probes"]),
    ({"feedback": "ef21"}, ["feedback", "residual"]),
    ({"min_compression_rate": -1}, ["min_compression_rate"]),
    ({"rank": 2.5}, ["rank", "integer"]),
    ({"warmup_steps": -3}, ["warmup_steps"]),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as info:
        hvdc.Compression.greedylore(**kwargs)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("kwargs", [{"rank": 0}, {"period": -1}, {"feedback": "residual"}])
def test_lazy_projection_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        hvdc.Compression.lazy_projection(**kwargs)


def test_registered_with_layout_matrix():
    for name in ("greedylore", "powersgd", "lazy_projection"):
        meth = hvdc.Compression.by_name(name)
        assert meth.layout == "matrix" and meth.biased
    assert hvdc.Compression.greedylore().config()["feedback"] == "residual"
