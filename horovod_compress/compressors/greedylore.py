"""``greedylore`` -- greedy low-rank compression with error feedback.

GreedyLore: "Greedy Low-Rank Gradient Compression for Distributed Learning with Convergence Guarantees"
(Algorithm 3; the project's algorithm notes restate the formulas the paper's
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
  the project's algorithm notes say the same. The error accumulated since the last SVD step
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
* **Sharded training.** Under FSDP2 a rank keeps only its chunk of each
  parameter's rows (:meth:`~.base.Method.keep_rows`); the estimate ``Q C``
  is then built for those rows only (``Q[lo:hi] C``, or the matching
  columns of a transposed tensor; the others are zero), (hi - lo)/m of that
  product. The error ``A_i - Q C_i`` uses the rank's own ``C_i`` and is
  computed as always, so the state and the error are the same bits as
  without it, and so are the kept rows where the reconstruct kernels build
  them (each entry computed alone); above their rank BLAS's GEMM on a row
  subset may round differently (it did not in the tests).
* **Per-step work** (implementation, same arithmetic; measured numbers in
  docs/methods/greedylore.md). An ordinary step streams the m x n matrices
  as few times as the data dependences allow: (1) one pass that adds
  ``M_i`` and the error into a second error buffer (which becomes ``A_i``;
  the error itself is left as it was until the step's NaN/Inf agreement
  has passed) and takes ``v = A_i xi``
  (:func:`..kernels.lowrank.add_and_probe`; the first probe's dot product
  in the same loop as the addition). The same ``v`` answers the NaN/Inf
  check (a NaN or Inf in ``M_i`` makes its row's product NaN/Inf;
  :func:`_probe_says_finite`), so the gradient is not read once more for it.
  The scores are ``U^T v`` (one GEMV, a read of the m x m ``U``); (2)
  ``C_i = Q^T A_i``, ``A_i`` read once (:func:`..kernels.lowrank.project`
  for ``r <= 4``, BLAS above); (3) ``Q C`` written
  (:func:`..kernels.lowrank.reconstruct` for ``r <= 5``, BLAS above). The
  new error ``e_i = A_i - Q C_i`` (eq. 9b) is *not written*: the state
  keeps ``A_i`` (``state.error``) and the factors ``Q``, ``C_i``
  (``state.error_q``, ``state.error_c``), and the next step's first
  pass computes ``A_{i+1} = M + A_i - Q C_i`` (:func:`..kernels.lowrank.add_lowrank_and_probe`,
  the same bytes as before plus ``r`` multiply-adds per entry from cache).
  That removes a read and a write of the m x n error per step.
  :func:`current_error` evaluates the error, :func:`materialize_error` writes
  it (the unfused path does so first); checkpoints keep all three arrays, so
  a resumed run continues bit for bit. The buffers then swap -- no m x n
  temporaries. (Without the fused first pass -- independent probes, other
  layouts -- the error is written as before:
  :func:`..kernels.lowrank.reconstruct_and_subtract` for ``r <= 5``, else
  an in-place GEMM with ``beta = 1``, :func:`subtract_low_rank`.) The
  dense ``local = Q C_i`` of the ``_reduce`` protocol is built only when a
  caller asks for it; the framework's path (``_BuiltInFeedback``) does not,
  since the error is kept here. Compute: ``probes (m n + m^2)`` for the
  scores and ``r m n`` each for ``C_i``, ``Q C`` and the error (applied in
  the next step's first pass), against
  PowerSGD's ``3 r m n`` plus its feedback's two element-wise passes; no
  orthogonalization. Float results: ``C_i`` from ``project`` sums each
  entry over the rows in groups of four (fused multiply-adds) instead of
  BLAS's blocking, so ``C_i``, ``Q C`` and the new error differ from the
  BLAS path in the last bits (relative 1e-6 in float32 on 2000 x 2000;
  same columns chosen).
* **Where the time goes, and the floor** (2000 x 2000 float32, r = 4, one
  thread, P = 1, in units of a memcpy of the gradient measured in the same
  process; before the second error buffer and the fused last sweep): the
  framework's NaN/Inf read of ``x`` 0.46; ``A = M + e`` with
  ``v`` 1.0; ``U^T v`` 0.47; draw, scores, top-r, ``Q`` 0.25; ``C_i`` 0.54;
  ``Q C`` into a new array 1.0; the error 0.55 -- 4.4 in all (PowerSGD r = 4
  3.2 in the same run). The second buffer removes the NaN/Inf read and the
  fused sweep one pass over the rows; the whole call then measured 11.0-11.7
  ms against 12.6-15.9 ms before (three interleaved runs each, 20th
  percentile of 80 calls, this 2-core VM on a slow evening: memcpy 2.2-3.1
  ms), 0.99-1.47x PowerSGD r = 4 in the same processes (1.40-1.52x before).
  The data dependences fix the memory traffic at
  about 3.5 memcpys: ``A_i`` must be read again after each of the two
  allreduces (``Q`` depends on all of ``A_i`` through the reduced scores,
  and the error on all of ``C_i``), the scores read all of ``U`` (m x m,
  as large as the gradient: the paper's greedy choice ranges over every
  column), and the estimate is a new array. The rest is the kernels'
  compute at 256-bit vectors and Python overhead. The SVD step (``U``
  every ``period`` steps, about 1.3 s here) adds about 6.5 ms per step
  averaged over the default period 200. Memory: one more m x n buffer per
  tensor (the spare error).
* **Rounds.** Two allreduces per ordinary step (scores, then projection),
  as in the paper; they cannot be fused, since ``Q`` is chosen from the
  reduced scores. Byte counts are unchanged.
* **SVD step.** ``U`` is computed as the eigenvectors of ``G G^T`` (float64),
  not by a full SVD: the same ``U`` up to column signs and rotations inside
  repeated singular values (neither changes ``Q Q^T``), 1.2 s instead of
  4.4 s for 2000 x 2000 on one thread (``W`` is never needed). The SVD stays
  lazy (once per ``period``).

Tensors the min-compression-rate rule leaves dense, and vectors, are
averaged with one dense allreduce (:mod:`.lowrank_common`).

Per-tensor state (checkpointed): ``U`` (m x m), ``error`` (m x n, in the
transposed orientation when the tensor was transposed, and then column-major,
i.e. in the gradient's own memory order; after a fused step
``A_i``, with ``error_q`` (m x r) and ``error_c`` (r x n) such that the error is
``error - error_q @ error_c``, see :func:`current_error`), ``columns`` (the
last selected ``I``) and ``svd_step`` (the step ``t`` of the last SVD).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from scipy.linalg import blas as _blas

from .base import Method, TensorState
from .state import GreedyLoreState
from .lowrank_common import (
    PeriodicSubspaceSchedule,
    check_min_rate,
    check_rank,
    compressed_matrix,
    effective_rank,
    top_indices,
)
from ..feedback import Feedback
from ..kernels.lowrank import (
    add_and_probe,
    add_and_probe_rows,
    add_lowrank_and_probe,
    add_lowrank_and_probe_rows,
    pad_rank,
    project,
    reconstruct,
    reconstruct_and_subtract,
)
from ..params import check_choice, check_int
from .registry import register

#: Up to this rank the estimate ``Q C`` is built by :func:`..kernels.lowrank.reconstruct`
#: (one write of the output); above it BLAS's GEMM is faster (measured, 2000 x 2000, one thread).
KERNEL_MAX_RANK = 5

#: Up to this rank a transposed (tall) tensor's estimate ``(Q C)^T`` is built by
#: :func:`..kernels.lowrank.reconstruct` (see :meth:`GreedyLore._low_rank`; measured up to r = 16).
TALL_KERNEL_MAX_RANK = 16

#: Up to this rank ``C_i = Q^T A_i`` comes from :func:`..kernels.lowrank.project`; above it
#: BLAS's GEMM is faster (2000 x 2000 float32, one thread: r = 4 1.01 ms against 1.16 ms,
#: r = 8 1.45 ms against 1.35 ms; a memcpy of the matrix 1.1 ms).
PROJECT_MAX_RANK = 4


def working_matrix(mat: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(M, transposed)``: ``mat`` or its transpose, whichever has rows <= columns (Appendix D)."""
    if mat.shape[0] > mat.shape[1]:
        return mat.T, True
    return mat, False


def left_singular_vectors(g: np.ndarray) -> np.ndarray:
    """Full ``U`` (m x m, orthonormal, columns by decreasing singular value) of ``G = U S W^T``.

    ``g`` is ``m x n`` with ``m <= n`` (Appendix D). Computed as the
    eigenvectors of the Gram matrix ``G G^T = U S^2 U^T`` (float64, LAPACK
    ``syevd``), which is the same ``U`` as the SVD of eq. 15 / 22 ("Greedy
    Low-Rank Gradient Compression for Distributed Learning with Convergence
    Guarantees", Section IV) up to the signs of its columns and rotations
    within repeated singular values -- neither changes ``Q Q^T``. Only ``U`` is
    needed, and for 2000 x 2000 this takes 1.2 s on one thread against 4.4 s
    for ``numpy.linalg.svd``, which also computes ``W``. Returns ``g``'s dtype.
    """
    g64 = np.asarray(g, dtype=np.float64)
    _lam, vecs = np.linalg.eigh(g64 @ g64.T)
    return np.ascontiguousarray(vecs[:, ::-1].astype(g.dtype))


def probe_values(b: np.ndarray, xi: np.ndarray) -> np.ndarray:
    """``[u_j^T A xi_{j,k}]`` for ``b = U^T A`` (m x n) and probes ``xi`` (k x m x n): m x k."""
    return np.einsum("jn,kjn->jk", b, xi, optimize=True)


def shared_probe_values(u: np.ndarray, a: np.ndarray, xi: np.ndarray) -> np.ndarray:
    """``[u_j^T A xi_k]`` for probes ``xi`` (k x n) shared by all columns: ``U^T (A xi^T)``, m x k.

    ``m n k + m^2 k`` multiply-adds; ``U^T A`` is never formed.
    """
    return u.T @ (a @ xi.T)


def subtract_low_rank(a: np.ndarray, q: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a -= q @ c`` in place (``a`` m x n C-contiguous float32/64, ``q`` m x r, ``c`` r x n).

    One BLAS GEMM with ``beta = 1`` on ``a``'s memory (read as the
    Fortran-ordered ``a^T = a^T - c^T q^T``): one read and one write of ``a``,
    no ``m x n`` temporary. Used for the error of eq. 9b, ``e = A - Q (Q^T A)``.
    """
    gemm = _blas.get_blas_funcs("gemm", (a,))
    res = gemm(-1.0, c.T, q.T, beta=1.0, c=a.T, overwrite_c=1)
    if not np.shares_memory(res, a):          # BLAS had to copy: write the result back
        a[...] = res.T
    return a


def _probe_says_finite(v: np.ndarray, mat: np.ndarray) -> bool:
    """Whether the gradient ``mat`` is finite, read from the first probe products ``v = A xi``.

    ``A = M + e`` with a finite error ``e``: a NaN or an Inf in row i of ``M``
    makes ``A``'s entry NaN or infinite, and its product with the probe
    entry NaN or infinite whatever that entry is (NaN x y and Inf x 0 are
    NaN; the kernels' fast-math flags allow re-association and contraction
    only, so NaN/Inf propagate), so a finite ``v[:, 0]`` proves ``M`` finite
    without reading it again. A non-finite ``v`` (which an overflow of
    finite numbers can also cause) has the gradient tested element by element.
    """
    if bool(np.isfinite(v[:, 0]).all()):
        return True
    return bool(np.isfinite(mat).all())


def _kernel_ready(*arrays: np.ndarray) -> bool:
    """Whether the Numba kernels take these arrays: one float dtype, C-contiguous, 2-D."""
    dt = arrays[0].dtype
    return dt in (np.float32, np.float64) and all(
        x.dtype == dt and x.ndim == 2 and x.flags.c_contiguous for x in arrays)


def _pending_ready(state: TensorState, base: np.ndarray) -> bool:
    """Whether a pending error ``base - Q C_i`` (if any) fits the fused first pass."""
    if state.error_q is None:
        return True
    q, c = state.error_q, state.error_c
    m, n = base.shape
    return (q.ndim == 2 and c.ndim == 2 and q.shape[0] == m and c.shape == (q.shape[1], n)
            and q.dtype == c.dtype == base.dtype)


def _drop_pending_error(state: TensorState) -> None:
    state.error_q = state.error_c = None


def current_error(state: TensorState) -> np.ndarray | None:
    """The error ``e_i`` (eq. 9b) of a tensor's state, as a new array; ``None`` if it has none.

    After a fused step the state keeps ``e_i = A_i - Q C_i`` unevaluated:
    ``state.error`` holds ``A_i`` and ``state.error_q``,
    ``state.error_c`` hold ``Q`` (m x r) and ``C_i = Q^T A_i`` (r x n);
    this evaluates it without changing the state. Both forms are exact
    checkpoints (``state_dict`` saves all three arrays).
    """
    e = state.error
    if e is None:
        return None
    if state.error_q is not None:
        return e - state.error_q @ state.error_c
    return np.array(e, copy=True)


def materialize_error(state: TensorState) -> np.ndarray:
    """Evaluate a pending ``e_i = A_i - Q C_i`` into ``state.error`` (in place when it can)."""
    e = state.error
    if state.error_q is not None:
        q, c = state.error_q, state.error_c
        if (e.flags.c_contiguous and e.flags.writeable and e.dtype in (np.float32, np.float64)
                and q.dtype == c.dtype == e.dtype):
            e = subtract_low_rank(e, q, c)
        elif (e.flags.f_contiguous and e.flags.writeable and e.dtype in (np.float32, np.float64)
                and q.dtype == c.dtype == e.dtype):       # a tall tensor's column-major error
            e = subtract_low_rank(e.T, c.T, q.T).T
        else:
            e = e - q @ c
        state.error = e
        _drop_pending_error(state)
    return e


class _BuiltInFeedback(Feedback):
    """What the framework sees as ``feedback="none"``: GreedyLore keeps its own error.

    The base class calls ``method._reduce`` and drops ``local``; this asks the
    method for ``avg`` alone, so the step never builds the m x n ``local``
    that nothing reads (GreedyLore's error, eq. 9b, is updated inside).
    """

    name = "none"

    def reduce(self, method: Any, x: np.ndarray, name: str, comm: Any, state: dict) -> np.ndarray:
        avg, _local = method._step(x, name, comm, state, want_local=False)
        return avg


@register
class GreedyLore(PeriodicSubspaceSchedule, Method):
    """GreedyLore: semi-lazy SVD, approximate global top-r projection, error feedback."""

    name = "greedylore"
    state_class = GreedyLoreState
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
        self.feedback = _BuiltInFeedback(self.name)

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
        return self._average_scores(vals, comm)

    @staticmethod
    def _average_scores(vals: np.ndarray, comm: Any) -> np.ndarray:
        """``mean_k allreduce_avg(vals)_jk^2`` (float64): the scores of eq. 24 from local probe values."""
        with comm.phase("greedylore.scores"):
            s = comm.allreduce(np.ascontiguousarray(vals), op="avg")
        return np.mean(np.square(s, dtype=np.float64), axis=1)

    # ------------------------------------------------------------ protocol
    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        return self._step(x, name, comm, state, want_local=True)

    def _step(self, x: np.ndarray, name: str, comm: Any, state: TensorState,
              want_local: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """One step of Algorithm 3: ``(avg, local)``; ``local`` is ``None`` unless ``want_local``."""
        mat = compressed_matrix(x, self.rank, self.min_compression_rate)
        if mat is None:
            self._pass_finite_gate()
            return comm.allreduce(x, op="avg"), x
        m_mat, transposed = working_matrix(mat)
        m, n = m_mat.shape
        u = state.U
        if self.is_svd_step(state.t) or u is None or u.shape != (m, m) or u.dtype != m_mat.dtype:
            self._pass_finite_gate()
            with comm.phase("greedylore.svd"):
                g = comm.allreduce(np.ascontiguousarray(m_mat), op="avg")
            state.U = left_singular_vectors(g)
            state.error = self._zeroed_error(name, state.error, g, transposed)
            _drop_pending_error(state)
            state.columns = np.arange(0, dtype=np.int64)
            state.svd_step = state.t
            avg = g.T if transposed else g
            return np.ascontiguousarray(avg).reshape(x.shape), x

        # A_i = M_i + e_i (eq. 9a). Fused path: into the spare error buffer (the error is left
        # as it was until the NaN/Inf agreement passes), with v = A_i xi in the same pass; an
        # error kept as base - Q C_i (see below) is applied in that same pass.
        e = state.error
        if transposed and e is not None and e.shape == (m, n) and not e.flags.f_contiguous:
            # a transposed tensor's error is column-major (see _zeroed_error); one restored from
            # a checkpoint (or an older one) is laid out so once, so a resumed run takes the same
            # arithmetic path -- and gives the same bits -- as the run that saved it
            e = state.error = np.asfortranarray(e)
        has_error = self.error_feedback and e is not None and e.shape == (m, n)
        xi = self.probes_for(name, state.t, m, n, m_mat.dtype)
        # a tall tensor's arrays are row-major in its own orientation (m_mat.T, e.T, a.T)
        fused = (has_error and self.probe_mode == "shared" and e.dtype == m_mat.dtype
                 and (_kernel_ready(m_mat.T, e.T, xi) if transposed else _kernel_ready(m_mat, e, xi))
                 and _pending_ready(state, e))
        if fused:
            a = self._spare_error(name, e, transposed)
            v = np.empty((m, self.probes), dtype=m_mat.dtype)
            if state.error_q is not None:
                q_p, c_p = pad_rank(state.error_q, state.error_c)
                if transposed:
                    add_lowrank_and_probe_rows(m_mat.T, e.T, np.ascontiguousarray(c_p.T),
                                               np.ascontiguousarray(q_p.T), xi, v, a.T)
                else:
                    add_lowrank_and_probe(m_mat, e, q_p, c_p, xi, v, a)
            elif transposed:
                add_and_probe_rows(m_mat.T, e.T, xi, v, a.T)
            else:
                add_and_probe(m_mat, e, xi, v, a)
            self._pass_finite_gate(_probe_says_finite(v, m_mat))
            owned, vals = True, u.T @ v
        else:
            self._pass_finite_gate()
            if has_error:
                e = materialize_error(state)
            # a transposed tensor's error is kept in the tensor's own memory order (column-major
            # as an m x n array, see _zeroed_error), so A_i = M_i + e_i is one contiguous pass
            in_place = has_error and e.dtype == m_mat.dtype and e.flags.writeable \
                and (e.flags.c_contiguous or (transposed and e.flags.f_contiguous))
            if in_place:
                a, owned = np.add(m_mat, e, out=e), True
            elif has_error:
                a, owned = m_mat + e, True
            else:
                a, owned = m_mat, False
            vals = (u.T @ (a @ xi.T) if self.probe_mode == "shared"
                    else probe_values(u.T @ a, xi))
        score = self._average_scores(vals, comm)

        cols = top_indices(score, effective_rank(m, n, self.rank))
        q = np.ascontiguousarray(u[:, cols])
        c_local = self._projection(a, q)                  # Q^T A_i (r x n), eq. 10
        with comm.phase("greedylore.projection"):
            c = np.ascontiguousarray(comm.allreduce(c_local, op="avg"))
        local = self._low_rank(q, c_local, transposed) if want_local else None
        rows = self.kept_rows(name)
        if fused:
            # e_i = A_i - Q C_i (eq. 9b) is not written: it is kept as A_i and the factors
            # (Q, C_i), and the next step's first pass applies them (add_lowrank_and_probe).
            avg = self._estimate(q, c, transposed, rows)  # Q C (eq. 10), in x's orientation
            self._spare_errors()[name] = e                # the old base is the next spare
            state.error_q, state.error_c = q, c_local
            new_error = a
        elif (self.error_feedback and owned and not transposed and q.shape[1] <= KERNEL_MAX_RANK
                and _kernel_ready(q, c, c_local, a)):
            # Q C (eq. 10) and e_i = A_i - Q C_i (eq. 9b) in one sweep of the rows (all of them,
            # kept or not: the sweep writes the error, and its bits must not depend on rows)
            avg = np.empty((m, n), dtype=a.dtype)
            reconstruct_and_subtract(q, c, c_local, avg, a)
            new_error = a
        else:
            avg = self._estimate(q, c, transposed, rows)  # Q C, in x's orientation
            new_error = None
            if self.error_feedback:                       # e_i = A_i - Q Q^T A_i (eq. 9b)
                if owned and a.flags.c_contiguous and a.dtype in (np.float32, np.float64):
                    new_error = subtract_low_rank(a, q, c_local)
                elif owned and a.flags.f_contiguous and a.dtype in (np.float32, np.float64):
                    new_error = subtract_low_rank(a.T, c_local.T, q.T).T   # A^T -= C^T Q^T in place
                else:
                    new_error = a - q @ c_local
        if new_error is not None:
            state.error = new_error
        state.columns = cols.astype(np.int64)
        return avg.reshape(x.shape), (None if local is None else local.reshape(x.shape))

    def _zeroed_error(self, name: str, old: np.ndarray | None, like: np.ndarray,
                      transposed: bool = False) -> np.ndarray:
        """The error reset of an SVD step (``e_i = 0``), in buffers whose pages are already mapped.

        Reuses the old error array when it fits, and writes zeros into it and
        into the spare buffer now: a fresh ``np.zeros`` is mapped lazily, so
        the first ordinary steps after every SVD step would each take the
        page faults of a new 16 MB array (2000 x 2000 float32) in their first
        pass; here the SVD step, which costs a second anyway, takes them.

        ``transposed``: the tensor is worked on as ``M = mat^T`` (more rows than
        columns), a column-major view of the gradient; its error is then
        column-major too (the transpose of a row-major ``n x m`` buffer), so
        ``A_i = M_i + e_i`` and ``e_i = A_i - Q C_i`` (an in-place GEMM) run
        through memory in order instead of striding across it. On the 11.6M-
        parameter Transformer of ``hvdc bench e2e`` 10.2M of the 11.5M
        compressed entries sit in such tall matrices (embedding, output head,
        the MLPs' first layers).
        """
        if (old is not None and old.shape == like.shape and old.dtype == like.dtype
                and old.flags.writeable
                and (old.flags.f_contiguous if transposed else old.flags.c_contiguous)):
            e = old
        elif transposed:
            e = np.empty(like.shape[::-1], dtype=like.dtype).T
        else:
            e = np.empty(like.shape, dtype=like.dtype)
        e.fill(0)
        if self.error_feedback and self.probe_mode == "shared":
            self._spare_error(name, e, transposed).fill(0)
        return e

    def _spare_errors(self) -> dict[str, np.ndarray]:
        """Tensor name -> its spare error buffer (:meth:`_spare_error`)."""
        return self.scratch.spare_error

    def _spare_error(self, name: str, like: np.ndarray, transposed: bool = False) -> np.ndarray:
        """The second error buffer of tensor ``name`` (shape and dtype of ``like``), reused.

        The fused pass writes ``A_i = M_i + e_i`` here instead of over
        ``e_i``, so a step the NaN/Inf agreement rejects leaves the error as it
        was; after the step the buffers swap. Not checkpointed (its content is
        dead between steps); one more m x n array per tensor, laid out as the
        error is (column-major for a ``transposed`` tensor, see
        :meth:`_zeroed_error`). A swapped-in error that cannot be written or
        is not laid out so is replaced by a fresh buffer.
        """
        bufs = self._spare_errors()
        buf = bufs.get(name)
        if (buf is None or buf.shape != like.shape or buf.dtype != like.dtype
                or not (buf.flags.writeable
                        and (buf.flags.f_contiguous if transposed else buf.flags.c_contiguous))
                or np.shares_memory(buf, like)):
            buf = (np.empty(like.shape[::-1], dtype=like.dtype).T if transposed
                   else np.empty_like(like, order="C"))
            bufs[name] = buf
        return buf

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """Yes for a NumPy float32/float64 gradient (:meth:`Method._defers_finite_check`).

        Every path of :meth:`_step` passes the gate once, before its first
        collective and before it changes the tensor's state: the fused
        ordinary step with the finiteness its first pass found
        (:func:`_probe_says_finite`), the others testing the gradient.
        """
        return (type(x) is np.ndarray and x.dtype in (np.float32, np.float64)
                and isinstance(self.feedback, _BuiltInFeedback))

    @staticmethod
    def _projection(a: np.ndarray, q: np.ndarray) -> np.ndarray:
        """``C_i = Q^T A_i`` (r x n, C-contiguous; eq. 10): :func:`..kernels.lowrank.project`
        up to rank :data:`PROJECT_MAX_RANK`, BLAS's GEMM above it or for other layouts."""
        if q.shape[1] <= PROJECT_MAX_RANK and _kernel_ready(a, q):
            c = np.empty((q.shape[1], a.shape[1]), dtype=a.dtype)
            project(a, q, c)
            return c
        return np.ascontiguousarray((a.T @ q).T)

    @classmethod
    def _estimate(cls, q: np.ndarray, c: np.ndarray, transposed: bool,
                  rows: tuple[int, int] | None) -> np.ndarray:
        """The optimizer's ``Q C`` (eq. 10) in x's orientation; with ``rows = (lo, hi)``
        (:meth:`~.base.Method.keep_rows`) only those rows, the others zero: ``Q[lo:hi] C``, or
        ``(Q C[:, lo:hi])^T`` for a transposed tensor -- (hi - lo) / m of the product's work.
        The error (eq. 9b) uses ``C_i``, not ``C``, so nothing else needs the other rows."""
        if rows is None:
            return cls._low_rank(q, c, transposed)
        lo, hi = rows
        shape = (c.shape[1], q.shape[0]) if transposed else (q.shape[0], c.shape[1])
        out = np.zeros(shape, dtype=c.dtype)
        lo, hi = max(0, lo), min(hi, shape[0])
        if hi > lo:
            out[lo:hi] = (cls._low_rank(q, np.ascontiguousarray(c[:, lo:hi]), True) if transposed
                          else cls._low_rank(np.ascontiguousarray(q[lo:hi]), c, False))
        return out

    @staticmethod
    def _low_rank(q: np.ndarray, c: np.ndarray, transposed: bool) -> np.ndarray:
        """``q @ c`` (m x n), or its transpose when the tensor was transposed; C-contiguous.

        A transposed (tall) tensor's ``(Q C)^T = C^T Q^T`` has short rows (m, the small side)
        and many of them: :func:`..kernels.lowrank.reconstruct` writes each row once with the
        r rank terms from cache, where BLAS's GEMM with an inner dimension of r is slow (one
        thread, r = 8: 16384 x 256 3.7 ms against 10.4 ms, 4000 x 2000 7.6 against 16.5 ms;
        a memcpy of the former 3.9 ms), up to :data:`TALL_KERNEL_MAX_RANK`."""
        if transposed:
            if q.shape[1] <= TALL_KERNEL_MAX_RANK:       # (the r x n, m x r copies only for the kernel)
                ct, qt = np.ascontiguousarray(c.T), np.ascontiguousarray(q.T)
                if _kernel_ready(ct, qt):
                    out = np.empty((ct.shape[0], qt.shape[1]), dtype=ct.dtype)
                    reconstruct(ct, qt, out)
                    return out
            return c.T @ q.T                              # (Q C)^T written in its own order
        if q.shape[1] <= KERNEL_MAX_RANK and _kernel_ready(q, c):
            out = np.empty((q.shape[0], c.shape[1]), dtype=q.dtype)
            reconstruct(q, c, out)
            return out
        return q @ c

    # -------------------------------------------------------------- volume
    def projection_words(self, m: int, n: int, r: int) -> int:
        """m probe scores plus the r x n projection (Section V-E: m + r n words)."""
        return m * self.probes + r * n
