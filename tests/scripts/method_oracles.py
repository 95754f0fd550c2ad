"""What each method must deliver, rebuilt in NumPy from every rank's local gradients.

The Horovod scripts (horovod_methods_torch.py, horovod_methods_tf.py) run each
method inside Horovod's own optimizer, gather every rank's local gradient
(taken by a plain model at the same weights) and hand both to
:class:`MethodOracle`. Nothing here imports ``horovod_compress``: every
reference is the method's definition in its paper, written with NumPy (and
SciPy's normal quantile and SVD), so a bug shared by a method and our own
optimizer cannot pass.

Deterministic methods are compared entry by entry; for randomised ones the
oracle checks what holds for every draw (the structure of the result and the
papers' worst-case error bounds). :data:`ORACLE_PARAMS` fixes the parameters
the oracles assume: no error feedback (the residual is internal state, so the
reference would need it), thresholds recomputed every step for Ok-Topk, and
low-rank methods that compress every matrix (``min_compression_rate=0``).
"""
from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtri

DENSITY = 0.25
RANK = 2
RATIO = 0.25

#: The constructor parameters each oracle below assumes, by method name.
ORACLE_PARAMS = {
    "topk": dict(density=DENSITY, feedback="none"),
    "topk_dsa": dict(density=DENSITY, feedback="none"),
    "deepreduce": dict(density=DENSITY, feedback="none", index="huffman", value="raw"),
    "gtopk": dict(density=DENSITY, feedback="none"),
    "oktopk": dict(density=DENSITY, feedback="none", tau=1, tau_prime=1, warmup_steps=0),
    "randk": dict(density=DENSITY, feedback="none"),
    "gaussiank": dict(density=DENSITY, feedback="none"),
    "qsgd": dict(bits=8, norm="l2"),
    "global_qsgd": dict(dithering="linear", bits=8, norm="inf"),
    "powersgd": dict(rank=RANK, min_compression_rate=0, feedback="none"),
    "greedylore": dict(rank=RANK, min_compression_rate=0, feedback="none"),
    "lazy_projection": dict(rank=RANK, min_compression_rate=0),
    "arc_topk": dict(ratio=RATIO, feedback="none"),
    "randk_rows": dict(ratio=RATIO, feedback="none"),
    "topk_rows": dict(ratio=RATIO, feedback="none"),
}

#: Methods also checked with their default residual error feedback (EF14: acc = g + e, the
#: method compresses acc, e = acc - the rank's own Top-k of acc), which the oracle tracks itself.
RESIDUAL_PARAMS = {"topk": dict(density=DENSITY, feedback="residual"),
                   "topk_dsa": dict(density=DENSITY, feedback="residual")}

#: Methods whose gradients travel as one fused flat vector in a fused front-end.
FLAT = ("topk", "topk_dsa", "deepreduce", "gtopk", "oktopk", "randk", "gaussiank", "qsgd",
        "global_qsgd")


def k_of(n: int, density: float = DENSITY) -> int:
    """k = max(1, round(density n)), at most n (the methods' definition of k)."""
    return min(n, max(1, round(density * n)))


def topk(v: np.ndarray, k: int) -> np.ndarray:
    """v with all but its k largest |v| entries zeroed ("Sparse Communication for
    Distributed Gradient Descent", Aji and Heafield 2017, Section 2)."""
    out = np.zeros_like(v)
    top = np.argsort(-np.abs(v), kind="stable")[:k]
    out[top] = v[top]
    return out


def sum_of_topk(x: np.ndarray, k: int) -> np.ndarray:
    """sum_j Topk(x_j) over the rows of x (P, n): TopkA's and TopkDSA's sum (Ok-Topk paper,
    Li and Hoefler, PPoPP'22, Section 2 and Table 1)."""
    return sum(topk(row, k) for row in x)


def gtopk_tree(x: np.ndarray, k: int) -> np.ndarray:
    """gTopk's binomial reduction tree: every merge re-selects the k largest of the two
    partial sums (Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k
    Sparsification", ICDCS'19, Algorithm 2; Ok-Topk paper, Table 1). Rank order (0, 1),
    (2, 3), then the pairs, for P a power of two."""
    if x.shape[0] == 1:
        return topk(x[0], k)
    half = x.shape[0] // 2
    return topk(gtopk_tree(x[:half], k) + gtopk_tree(x[half:], k), k)


def gaussian_selection(v: np.ndarray, density: float = DENSITY) -> np.ndarray:
    """v where |v| >= th: th = |mu| + sigma Phi^-1(1 - density/2) from v's mean and unbiased
    standard deviation, divided by 1.012 until 3k/4 entries pass (at most 50 times), the loop
    of the Ok-Topk paper's experiments (Section 5.4; Gaussiank of Shi et al. 2019)."""
    th = abs(float(v.mean())) + float(v.std(ddof=1)) * float(ndtri(1.0 - density / 2.0))
    need, steps = (3 * k_of(v.size, density)) // 4, 0
    while steps < 50 and np.count_nonzero(np.abs(v) >= th) < need:
        th /= 1.012
        steps += 1
    return np.where(np.abs(v) >= th, v, 0.0)


def as_matrix(a: np.ndarray) -> np.ndarray:
    """A tensor seen as (shape[0], prod(shape[1:])) (PowerSGD, Vogels et al. 2019, Section 3)."""
    return a.reshape(a.shape[0], -1)


def small_side(m: np.ndarray) -> np.ndarray:
    """The m x n orientation with m <= n that GreedyLore projects on (GreedyLore, Appendix D)."""
    return m if m.shape[0] <= m.shape[1] else m.T


def left_singular(m: np.ndarray) -> np.ndarray:
    return np.linalg.svd(m, full_matrices=True)[0]


def assert_close(got: np.ndarray, want: np.ndarray, what: str, rtol: float = 1e-5) -> None:
    """Entry by entry, to float32 rounding of the average (scaled by the largest |want|)."""
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max())
    assert err <= rtol * scale, f"{what}: off by {err:.3g} (largest |want| {scale:.3g})"


def assert_same_support(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = set(np.flatnonzero(got)), set(np.flatnonzero(want))
    assert g == w, f"{what}: {len(g - w)} entries that must be 0 are not, {len(w - g)} missing"


class MethodOracle:
    """Checks one method's averaged gradients, step after step, against its definition.

    ``check(step, got, ranks, fused)``: ``got`` the front-end's result per tensor (the average
    over P ranks), ``ranks`` every rank's local gradient per tensor, each (P, *shape); with
    ``fused`` the flat methods see all tensors as one vector (the PyTorch optimizer's fused
    bucket), otherwise each tensor on its own (TensorFlow's tape). Steps count from 0.
    """

    def __init__(self, method: str, residual: bool = False) -> None:
        if method not in (RESIDUAL_PARAMS if residual else ORACLE_PARAMS):
            raise ValueError(f"no oracle for method {method!r} (residual={residual})")
        self.method = method
        self.projectors: dict[int, np.ndarray] = {}   # lazy_projection / greedylore, per tensor
        #: with ``residual``: each rank's error e_j per unit (fused vector or tensor)
        self.errors: dict[int, np.ndarray] | None = {} if residual else None

    def check(self, step: int, got: list, ranks: list, fused: bool) -> None:
        got = [np.asarray(g, np.float64) for g in got]
        ranks = [np.asarray(r, np.float64) for r in ranks]
        if self.method in FLAT:
            if fused:
                got = [np.concatenate([g.reshape(-1) for g in got])]
                ranks = [np.concatenate([r.reshape(r.shape[0], -1) for r in ranks], axis=1)]
            for j, (g, x) in enumerate(zip(got, ranks)):
                x = x.reshape(x.shape[0], -1)
                if self.errors is not None:
                    x = self._add_error(j, x)
                getattr(self, f"_flat_{self.method}")(g.reshape(-1), x,
                                                      f"{self.method} step {step} tensor {j}")
            return
        for j, (g, x) in enumerate(zip(got, ranks)):
            what = f"{self.method} step {step} tensor {j}"
            if g.ndim < 2:   # biases: every matrix method sends them dense
                assert_close(g, x.mean(0), what + " (dense vector)")
                continue
            getattr(self, f"_matrix_{self.method}")(step, j, as_matrix(g),
                                                    x.reshape(x.shape[0], g.shape[0], -1), what)

    def _add_error(self, j: int, x: np.ndarray) -> np.ndarray:
        """EF14 (Stich et al., "Sparsified SGD with Memory", 2018, Algorithm 1; Seide et al.
        2014): every rank compresses acc_j = g_j + e_j and keeps e_j = acc_j - Topk(acc_j)."""
        acc = x + self.errors.get(j, 0.0)
        k = k_of(x.shape[1])
        self.errors[j] = acc - np.stack([topk(row, k) for row in acc])
        return acc

    # ------------------------------------------------------------ flat methods
    def _sparse_sum(self, g, want, what):
        assert_same_support(g, want, what)
        assert_close(g, want, what)

    def _flat_topk(self, g, x, what):
        self._sparse_sum(g, sum_of_topk(x, k_of(x.shape[1])) / x.shape[0], what)

    _flat_topk_dsa = _flat_topk
    _flat_deepreduce = _flat_topk    # Huffman indices and raw values are lossless

    def _flat_gtopk(self, g, x, what):
        self._sparse_sum(g, gtopk_tree(x, k_of(x.shape[1])) / x.shape[0], what)

    def _flat_oktopk(self, g, x, what):
        """Ok-Topk with thresholds recomputed every step: u = Topk(sum_i Topk(x_i)), avg =
        u / P (Li and Hoefler, PPoPP'22, Algorithm 1 with exact thresholds, Section 3)."""
        k = k_of(x.shape[1])
        self._sparse_sum(g, topk(sum_of_topk(x, k), k) / x.shape[0], what)

    def _flat_randk(self, g, x, what):
        """Rand-K with shared indices: exactly k entries, each the exact average of the ranks'
        values there, zero elsewhere (Stich et al., "Sparsified SGD with Memory", 2018,
        Section 2; the indices come from a seed every rank shares)."""
        k = k_of(x.shape[1])
        support = np.flatnonzero(g)
        assert support.size == k, f"{what}: {support.size} non-zeros, k = {k}"
        assert_close(g[support], x.mean(0)[support], what)

    def _flat_gaussiank(self, g, x, what):
        self._sparse_sum(g, sum(gaussian_selection(row) for row in x) / x.shape[0], what)

    def _flat_qsgd(self, g, x, what):
        """QSGD (Alistarh et al. 2017, Section 3.1, eq. 1 with s = 127 levels): each rank's
        stochastic rounding moves an entry by less than one level, ||x_j||_2 / s, so the
        average of the P dequantized vectors is within (1/P) sum_j ||x_j||_2 / s of the mean."""
        bound = np.linalg.norm(x, axis=1).sum() / (127 * x.shape[0])
        err = float(np.abs(g - x.mean(0)).max())
        assert err <= bound * (1 + 1e-5), f"{what}: error {err:.3g} > bound {bound:.3g}"

    def _flat_global_qsgd(self, g, x, what):
        """Global-QSGD, linear dithering (Xin et al., Algorithm 1 and eq. 2): with the global
        norm ||x||_inf = max_j max |x_j| and s = floor(127 / P) levels (Section 4.2, so the sum
        of P levels fits 8 bits), every rank's rounding is below one level, norm / s, and so is
        the average's error."""
        s = 127 // x.shape[0]
        bound = float(np.abs(x).max()) / s
        err = float(np.abs(g - x.mean(0)).max())
        assert err <= bound * (1 + 1e-5), f"{what}: error {err:.3g} > bound {bound:.3g}"

    # ------------------------------------------------------------ matrix methods
    def _matrix_powersgd(self, step, j, g, x, what):
        """PowerSGD (Vogels et al. 2019, Algorithm 1): the result is P P^T M for the mean M and
        an orthonormal rank-r P, i.e. the orthogonal projection of M onto the column space of
        the result, which has rank <= r; hence (Eckart-Young) no closer to M than M's best
        rank-r approximation from the SVD computed here."""
        mean = x.mean(0)
        u, sv, _ = np.linalg.svd(g)
        assert sv[RANK:].max(initial=0.0) <= 1e-5 * sv[0], f"{what}: rank > {RANK}: {sv}"
        basis = u[:, :RANK]
        assert_close(g, basis @ (basis.T @ mean), what + " (projection of the mean)")
        mu, msv, mvt = np.linalg.svd(mean)
        best = np.linalg.norm(mean - (mu[:, :RANK] * msv[:RANK]) @ mvt[:RANK])
        assert np.linalg.norm(mean - g) >= best * (1 - 1e-5), f"{what}: beats the SVD"

    def _matrix_lazy_projection(self, step, j, g, x, what):
        """GaLore-style lazy projection (GreedyLore paper, eqs. 6-7, Algorithm 1): at the first
        step the exact mean G_0, then Q Q^T M_t with Q the top-r left singular vectors of G_0
        (on the matrix's smaller side), from the SVD computed here."""
        mean = small_side(x.mean(0))
        g = small_side(g)
        if step == 0:
            assert_close(g, mean, what + " (SVD step: the exact mean)")
            self.projectors[j] = left_singular(mean)[:, :RANK]
            return
        q = self.projectors[j]
        assert_close(g, q @ (q.T @ mean), what)

    def _matrix_greedylore(self, step, j, g, x, what):
        """GreedyLore (Algorithm 3, eqs. 9-10 and 15): the first step delivers the exact mean
        G_0 and keeps all left singular vectors U of G_0; later steps deliver U_I U_I^T M_t for
        some r columns I of U (chosen by the estimated scores). In U's coordinates the result
        has exactly r non-zero rows, equal to those of U^T M_t."""
        mean = small_side(x.mean(0))
        g = small_side(g)
        if step == 0:
            assert_close(g, mean, what + " (SVD step: the exact mean)")
            self.projectors[j] = left_singular(mean)
            return
        u = self.projectors[j]
        coords, want = u.T @ g, u.T @ mean
        norms = np.linalg.norm(coords, axis=1)
        rows = np.flatnonzero(norms > 1e-5 * norms.max())
        assert rows.size == min(RANK, g.shape[0]), f"{what}: {rows.size} directions, r = {RANK}"
        kept = np.zeros_like(want)
        kept[rows] = want[rows]
        assert_close(coords, kept, what)

    def _rows_of_the_mean(self, g, x, what):
        """K = ceil(ratio m) whole rows of the mean, zero elsewhere (same rows on every rank)."""
        k = math.ceil(RATIO * g.shape[0])
        rows = np.flatnonzero(np.abs(g).max(axis=1) > 0)
        assert rows.size == k, f"{what}: {rows.size} rows, K = {k}"
        want = np.zeros_like(g)
        want[rows] = x.mean(0)[rows]
        assert_close(g, want, what)

    def _matrix_arc_topk(self, step, j, g, x, what):
        """ARC-Top-K (Chen et al., Algorithm 1, eq. 5): the exact average of K rows."""
        self._rows_of_the_mean(g, x, what)

    def _matrix_randk_rows(self, step, j, g, x, what):
        """Rand-K on rows (ARC-Top-K paper, Table I): the exact average of K shared rows."""
        self._rows_of_the_mean(g, x, what)

    def _matrix_topk_rows(self, step, j, g, x, what):
        """Top-K rows (ARC-Top-K paper, Table I, Proposition 1): (1/N) sum_i [G_i]_{I_i,:}, I_i
        the K rows of largest norm of rank i's own G_i."""
        k = math.ceil(RATIO * g.shape[0])
        want = np.zeros_like(g)
        for gi in x:
            rows = np.argsort(-np.linalg.norm(gi, axis=1), kind="stable")[:k]
            want[rows] += gi[rows]
        want /= x.shape[0]
        assert_same_support(g, want, what)
        assert_close(g, want, what)
