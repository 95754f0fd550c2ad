"""``greedylore`` -- greedy low-rank compression with error feedback (papers/greedylore.txt).

GreedyLore (Algorithm 3 of the paper; ALGORITHMS.md restates the formulas the
extracted text lost). Per tensor, viewed as a matrix ``(shape[0], prod(shape[1:]))``
and transposed when it has more rows than columns, so that ``M_i`` is
``m x n`` with ``m <= n`` and the projector is the small side (Appendix D,
Algorithm 4). Rank ``r = min(rank, m)``, subspace period ``tau = period``,
error ``e_i`` (``m x n``, starts at 0).

* SVD step -- the first compressed step and every ``tau``-th one after it
  (eq. 15 / 22): ``G = allreduce_avg(M_i)`` dense; ``U, S, W = svd(G)``, keep
  the full ``U`` (``m x m``, orthonormal). The optimizer receives ``G`` itself
  (the exact average), and ``e_i = 0`` (Section V-D: "we reset e when
  t mod tau = 0, as no communication compression is applied").
* other steps -- ``A_i = M_i + e_i`` (eq. 9a). Scores by the approximate
  global top-r projection (eqs. 23-24, Algorithm 2): probes ``xi ~ N(0, I_n)``
  from the shared seed; ``s = allreduce_avg([u_j^T A_i xi_j]_j)`` -- one
  m-vector, for which ``E[s_j^2] = ||u_j^T avg(A)||^2`` (Proposition 4).
  ``I`` = the ``r`` largest ``s_j^2`` (eq. 27 with eq. 19); ``Q = U[:, I]``;
  ``C = allreduce_avg(Q^T A_i)`` (``r x n``); the optimizer receives ``Q C``
  (eq. 10), transposed back; ``e_i = A_i - Q Q^T A_i`` (eq. 9b).

Words per rank per step: ``m + r n`` on ordinary steps and ``m n`` on SVD
steps (Section V-E); in bytes, each allreduce of N words of w bytes counts
``2 N w (P-1)/P``. Proposition 3: with exact scores the compressor is
contractive, ``||A - Q Q^T A||^2 <= (1 - r/m) ||A||^2``; with the estimated
scores it is in expectation (Lemma 2).

Decisions where the paper leaves room (checked against its prose):

* The SVD-step allreduce carries ``M_i``, not ``M_i + e_i``: the paper hands
  "the globally averaged gradient" to the optimizer and resets ``e``;
  ALGORITHMS.md says the same. The error accumulated since the last SVD step
  is therefore dropped, as in the paper.
* SVD steps are counted from the first compressed step (after
  ``warmup_steps`` dense steps): compressed step ``c = t - warmup_steps``
  (1-based) is an SVD step iff ``(c - 1) % period == 0``. The paper's
  ``t mod tau == 0`` with 0-based ``t`` is the same schedule.
* ``probes`` (default 1, the paper's choice) draws that many independent
  probe vectors per column and averages their squared scores, an m x probes
  allreduce; more probes lower the estimator's variance (tests use it to show
  the selection converges to the true top-r).
* **Shared probes (deviation, default ``probe_mode="shared"``).** The paper
  draws an independent ``xi_j`` for every column j (eq. 23): m n Gaussians
  per step, and the scores then need every ``u_j^T A_i`` -- the whole
  ``U^T A_i`` (m^2 n multiply-adds; 220 ms per step for 2000 x 2000 on one
  thread, more than the rest of the step). We draw one ``xi`` (n Gaussians
  per probe) for all columns and compute ``s = U^T (A_i xi)``: m n + m^2
  multiply-adds. Each score keeps exactly its distribution --
  ``s_j = u_j^T avg(A) xi ~ N(0, ||u_j^T avg(A)||^2)`` either way -- so
  Proposition 4 (unbiasedness) holds and every score's variance
  (``2 ||u_j^T avg(A)||^4`` per probe) is unchanged. What changes is that
  scores of different columns become correlated. The pairwise property the
  selection rests on survives: for two columns with true scores
  ``a_j >= a_k``, ``P(s_j^2 >= s_k^2) = 1/2 + arcsin(rho)/pi >= 1/2`` with
  ``rho`` the correlation of ``s_j - s_k`` and ``s_j + s_k`` (a bivariate
  normal orthant probability; ``Cov = a_j - a_k >= 0``), the same conclusion
  as with independent probes; but the paper's proof of Lemma 2 assumes
  independent probes, and we have not re-proved it for shared ones. The tests
  check unbiasedness, convergence to the true top-r with many probes, and the
  contraction in expectation on random data for both modes.
  ``probe_mode="independent"`` is the paper's estimator (and its cost).
  (Rademacher probes would keep E[s_j^2] with a variance at most the
  Gaussian's, but draw cost is no longer the issue at n numbers per step, and
  the Gaussian keeps the orthant argument above.)
* Error feedback is built in (``feedback="residual"``, default, or ``"none"``)
  rather than delegated to :mod:`horovod_compress.feedback`, because the SVD
  step must both bypass the error and reset it.
* The compute per ordinary step (shared probes) is ``A_i xi`` and ``U^T (A_i
  xi)`` (``probes (m n + m^2)``), the projection ``Q^T A_i`` (``r m n``) and
  ``Q C`` and ``Q Q^T A_i`` for the reconstruction and the error (``2 r m
  n``): about PowerSGD's ``3 r m n`` -- BLAS through NumPy, no compiled kernel
  and no orthogonalization. The SVD stays lazy (once per ``period``).

Tensors the min-compression-rate rule leaves dense, and vectors, are
averaged with one dense allreduce (:mod:`.lowrank_common`).

Per-tensor state (checkpointed): ``U`` (m x m), ``error`` (m x n, in the
transposed orientation when the tensor was transposed), ``columns`` (the last
selected ``I``) and ``svd_step`` (the step ``t`` of the last SVD).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import Method, TensorState
from .lowrank_common import (
    PeriodicSubspaceSchedule,
    check_min_rate,
    check_rank,
    compressed_matrix,
    effective_rank,
    top_indices,
)
from ..params import check_choice, check_int
from .registry import register


def working_matrix(mat: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(M, transposed)``: ``mat`` or its transpose, whichever has rows <= columns (Appendix D)."""
    if mat.shape[0] > mat.shape[1]:
        return mat.T, True
    return mat, False


def left_singular_vectors(g: np.ndarray) -> np.ndarray:
    """Full ``U`` (m x m) of the SVD of ``g`` (m <= n); float64 inside, g's dtype out."""
    u, _s, _vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    return np.ascontiguousarray(u.astype(g.dtype))


def probe_values(b: np.ndarray, xi: np.ndarray) -> np.ndarray:
    """``[u_j^T A xi_{j,k}]`` for ``b = U^T A`` (m x n) and probes ``xi`` (k x m x n): m x k."""
    return np.einsum("jn,kjn->jk", b, xi, optimize=True)


def shared_probe_values(u: np.ndarray, a: np.ndarray, xi: np.ndarray) -> np.ndarray:
    """``[u_j^T A xi_k]`` for probes ``xi`` (k x n) shared by all columns: ``U^T (A xi^T)``, m x k.

    ``m n k + m^2 k`` multiply-adds; ``U^T A`` is never formed.
    """
    return u.T @ (a @ xi.T)


@register
class GreedyLore(PeriodicSubspaceSchedule, Method):
    """GreedyLore: semi-lazy SVD, approximate global top-r projection, error feedback."""

    name = "greedylore"
    layout = "matrix"
    biased = True
    default_feedback = "none"  # error feedback is part of the algorithm (see module docstring)

    def __init__(self, *, rank: int = 8, period: int = 200, probes: int = 1,
                 probe_mode: str = "shared", feedback: str = "residual",
                 min_compression_rate: float = 2.0, warmup_steps: int = 0,
                 seed: int = 0) -> None:
        self.rank = check_rank(self.name, rank)
        self.period = check_int(self.name, "period", period, 1)
        self.probes = check_int(self.name, "probes", probes, 1)
        self.probe_mode = check_choice(self.name, "probe_mode", probe_mode,
                                       ["shared", "independent"])
        self.error_feedback = check_choice(self.name, "feedback", feedback,
                                           ["residual", "none"]) == "residual"
        self.min_compression_rate = check_min_rate(self.name, min_compression_rate)
        super().__init__(feedback="none", warmup_steps=warmup_steps, seed=seed)

    def params(self) -> dict[str, Any]:
        return {"rank": self.rank, "period": self.period, "probes": self.probes,
                "probe_mode": self.probe_mode,
                "feedback": "residual" if self.error_feedback else "none",
                "min_compression_rate": self.min_compression_rate}

    # ------------------------------------------------------------- pieces
    def probes_for(self, name: str, step: int, m: int, n: int, dtype: np.dtype) -> np.ndarray:
        """The shared probes of tensor ``name`` at ``step`` (eq. 23), drawn once per step.

        ``probe_mode="shared"``: ``xi`` of shape (probes, n), one per probe for
        all columns; ``"independent"`` (the paper): (probes, m, n), one per column.
        """
        shape = (self.probes, n) if self.probe_mode == "shared" else (self.probes, m, n)
        return self.rng(name, step, "greedylore-probes").standard_normal(shape, dtype=dtype)

    def scores(self, u: np.ndarray, a: np.ndarray, name: str, step: int,
               comm: Any) -> np.ndarray:
        """score_j = mean_k s_jk^2 with s = allreduce_avg(u_j^T A_i xi_(j)k) (eqs. 23-24).

        One allreduce of ``m * probes`` words; ``E[score_j] = ||u_j^T avg(A)||^2``
        (Proposition 4) in both probe modes. Shared probes: ``U^T (A_i xi)``;
        independent: the paper's ``u_j^T A_i xi_j`` through ``U^T A_i``.
        """
        xi = self.probes_for(name, step, a.shape[0], a.shape[1], a.dtype)
        if self.probe_mode == "shared":
            vals = shared_probe_values(u, a, xi)
        else:
            vals = probe_values(u.T @ a, xi)
        with comm.phase("greedylore.scores"):
            s = comm.allreduce(np.ascontiguousarray(vals), op="avg")
        return np.mean(np.square(s, dtype=np.float64), axis=1)

    # ------------------------------------------------------------ protocol
    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        mat = compressed_matrix(x, self.rank, self.min_compression_rate)
        if mat is None:
            return comm.allreduce(x, op="avg"), x
        m_mat, transposed = working_matrix(mat)
        m, n = m_mat.shape
        u = state.get("U")
        if self.is_svd_step(state.t) or u is None or u.shape != (m, m) or u.dtype != m_mat.dtype:
            with comm.phase("greedylore.svd"):
                g = comm.allreduce(np.ascontiguousarray(m_mat), op="avg")
            state["U"] = left_singular_vectors(g)
            state["error"] = np.zeros_like(g)
            state["columns"] = np.arange(0, dtype=np.int64)
            state["svd_step"] = state.t
            avg = g.T if transposed else g
            return np.ascontiguousarray(avg).reshape(x.shape), x
        e = state.get("error")
        if self.error_feedback and e is not None and e.shape == (m, n) and e.dtype == m_mat.dtype:
            # A_i = M_i + e_i in the error's own buffer, which then becomes the new error
            # (state_dict copies, so no checkpoint shares it): no 4-byte-per-entry allocations
            a = np.add(m_mat, e, out=e)
        elif self.error_feedback and e is not None and e.shape == (m, n):
            a = m_mat + e
        else:
            a = m_mat
        score = self.scores(u, a, name, state.t, comm)
        cols = top_indices(score, effective_rank(m, n, self.rank))
        q = np.ascontiguousarray(u[:, cols])
        c_local = q.T @ a                        # Q^T A_i (r x n)
        with comm.phase("greedylore.projection"):
            c = comm.allreduce(np.ascontiguousarray(c_local), op="avg")
        avg_m = q @ c
        local_m = q @ c_local
        if self.error_feedback:
            state["error"] = np.subtract(a, local_m, out=a if a is not m_mat else None)
        state["columns"] = cols.astype(np.int64)
        if transposed:
            avg_m, local_m = avg_m.T, local_m.T
        return (np.ascontiguousarray(avg_m).reshape(x.shape),
                np.ascontiguousarray(local_m).reshape(x.shape))

    # -------------------------------------------------------------- volume
    def projection_words(self, m: int, n: int, r: int) -> int:
        """m probe scores plus the r x n projection (ALGORITHMS.md: m + r n words)."""
        return m * self.probes + r * n
