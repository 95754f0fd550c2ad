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
  global top-r projection (eqs. 23-24, Algorithm 2): for each column ``u_j`` of
  ``U`` an independent ``xi_j ~ N(0, I_n)`` from the shared seed;
  ``s = allreduce_avg([u_j^T A_i xi_j]_j)`` -- one m-vector, for which
  ``E[s_j^2] = ||u_j^T avg(A)||^2`` (Proposition 4). ``I`` = the ``r`` largest
  ``s_j^2`` (eq. 27 with eq. 19); ``Q = U[:, I]``;
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
* Error feedback is built in (``feedback="residual"``, default, or ``"none"``)
  rather than delegated to :mod:`horovod_compress.feedback`, because the SVD
  step must both bypass the error and reset it.
* The compute per ordinary step is one ``U^T A_i`` (``m^2 n`` multiply-adds;
  it yields every score and, as its rows ``I``, the projection ``Q^T A_i``),
  plus ``2 r m n`` for the reconstruction and the error -- BLAS through NumPy,
  no compiled kernel needed. Unlike PowerSGD there is no orthogonalization at
  all: the cost does not grow with ``r`` beyond the ``r m n`` products.

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
from .params import check_choice, check_int
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


@register
class GreedyLore(PeriodicSubspaceSchedule, Method):
    """GreedyLore: semi-lazy SVD, approximate global top-r projection, error feedback."""

    name = "greedylore"
    layout = "matrix"
    biased = True
    default_feedback = "none"  # error feedback is part of the algorithm (see module docstring)

    def __init__(self, *, rank: int = 8, period: int = 200, probes: int = 1,
                 feedback: str = "residual", min_compression_rate: float = 2.0,
                 warmup_steps: int = 0, seed: int = 0) -> None:
        self.rank = check_rank(self.name, rank)
        self.period = check_int(self.name, "period", period, 1)
        self.probes = check_int(self.name, "probes", probes, 1)
        self.error_feedback = check_choice(self.name, "feedback", feedback,
                                           ["residual", "none"]) == "residual"
        self.min_compression_rate = check_min_rate(self.name, min_compression_rate)
        super().__init__(feedback="none", warmup_steps=warmup_steps, seed=seed)

    def params(self) -> dict[str, Any]:
        return {"rank": self.rank, "period": self.period, "probes": self.probes,
                "feedback": "residual" if self.error_feedback else "none",
                "min_compression_rate": self.min_compression_rate}

    # ------------------------------------------------------------- pieces
    def probes_for(self, name: str, step: int, m: int, n: int, dtype: np.dtype) -> np.ndarray:
        """The shared probes ``xi`` (probes x m x n) of tensor ``name`` at ``step`` (eq. 23)."""
        return self.rng(name, step, "greedylore-probes").standard_normal(
            (self.probes, m, n), dtype=dtype)

    def scores(self, u: np.ndarray, a: np.ndarray, name: str, step: int,
               comm: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(score, U^T A_i)``: score_j = mean_k s_jk^2 with s = allreduce_avg(u_j^T A_i xi_jk).

        One allreduce of ``m * probes`` words (eq. 24); ``E[score_j] =
        ||u_j^T avg(A)||^2`` (Proposition 4).
        """
        b = u.T @ a
        xi = self.probes_for(name, step, a.shape[0], a.shape[1], a.dtype)
        with comm.phase("greedylore.scores"):
            s = comm.allreduce(np.ascontiguousarray(probe_values(b, xi)), op="avg")
        return np.mean(np.square(s, dtype=np.float64), axis=1), b

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
        a = m_mat + e if self.error_feedback and e is not None and e.shape == (m, n) else m_mat
        score, b = self.scores(u, a, name, state.t, comm)
        cols = top_indices(score, effective_rank(m, n, self.rank))
        q = u[:, cols]
        c_local = np.ascontiguousarray(b[cols])
        with comm.phase("greedylore.projection"):
            c = comm.allreduce(c_local, op="avg")
        avg_m = q @ c
        local_m = q @ c_local
        if self.error_feedback:
            state["error"] = a - local_m
        state["columns"] = cols.astype(np.int64)
        if transposed:
            avg_m, local_m = avg_m.T, local_m.T
        return (np.ascontiguousarray(avg_m).reshape(x.shape),
                np.ascontiguousarray(local_m).reshape(x.shape))

    # -------------------------------------------------------------- volume
    def projection_words(self, m: int, n: int, r: int) -> int:
        """m probe scores plus the r x n projection (ALGORITHMS.md: m + r n words)."""
        return m * self.probes + r * n
