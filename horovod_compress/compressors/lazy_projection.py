"""``lazy_projection`` -- GaLore-style lazy low-rank projection, no error feedback.

The "Lazy-SVD" framework of the GreedyLore paper
("Greedy Low-Rank Gradient Compression for Distributed Learning with Convergence Guarantees" (GreedyLore),
eqs. 6-7, Algorithm 1; GaLore made communication-efficient, Appendix E) and
its baseline "GaLore" in Tables II-V. Per tensor, viewed and transposed as in
:mod:`.greedylore` (``M_i`` is ``m x n``, ``m <= n``), ``r = min(rank, m)``:

* SVD step (the first compressed step and every ``period``-th after it):
  ``G = allreduce_avg(M_i)``; ``U, S, W = svd(G)``; ``Q = U[:, :r]`` (the top-r
  left singular vectors, eq. 7). The optimizer receives ``G``.
* other steps: ``C = allreduce_avg(Q^T M_i)`` (``r x n``); the optimizer
  receives ``Q C`` -- the same ``Q`` for the whole period.

No error feedback: with a fixed ``Q`` it would change nothing (Proposition 1:
``Q^T e = 0`` for ``e = (I - QQ^T)(...)``), and the compressor is not
contractive (Proposition 2: a gradient orthogonal to ``Q`` is lost entirely),
which is what GreedyLore fixes. Words per rank per step: ``r n``, plus ``m n``
on SVD steps. Small tensors and vectors go dense by the min-compression-rate
rule of :mod:`.lowrank_common`.

Per-tensor state (checkpointed): ``Q`` (m x r) and ``svd_step``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import Method, TensorState
from .state import SubspaceState
from .greedylore import left_singular_vectors, working_matrix
from .lowrank_common import (
    PeriodicSubspaceSchedule,
    check_min_rate,
    check_rank,
    compressed_matrix,
    effective_rank,
)
from ..params import check_int
from .registry import register


@register
class LazyProjection(PeriodicSubspaceSchedule, Method):
    """GaLore-style lazy SVD projection (no error feedback): the GreedyLore paper's baseline."""

    name = "lazy_projection"
    state_class = SubspaceState
    layout = "matrix"
    biased = True
    default_feedback = "none"

    def __init__(self, *, rank: int = 8, period: int = 200, min_compression_rate: float = 2.0,
                 warmup_steps: int = 0, seed: int = 0) -> None:
        self.rank = check_rank(self.name, rank)
        self.period = check_int(self.name, "period", period, 1)
        self.min_compression_rate = check_min_rate(self.name, min_compression_rate)
        super().__init__(feedback="none", warmup_steps=warmup_steps, seed=seed)

    def params(self) -> dict[str, Any]:
        return {"rank": self.rank, "period": self.period,
                "min_compression_rate": self.min_compression_rate}

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        mat = compressed_matrix(x, self.rank, self.min_compression_rate)
        if mat is None:
            return comm.allreduce(x, op="avg"), x
        m_mat, transposed = working_matrix(mat)
        m, n = m_mat.shape
        r = effective_rank(m, n, self.rank)
        q = state.Q
        if self.is_svd_step(state.t) or q is None or q.shape != (m, r) or q.dtype != m_mat.dtype:
            with comm.phase("lazy_projection.svd"):
                g = comm.allreduce(np.ascontiguousarray(m_mat), op="avg")
            state.Q = np.ascontiguousarray(left_singular_vectors(g)[:, :r])
            state.svd_step = state.t
            avg = g.T if transposed else g
            return np.ascontiguousarray(avg).reshape(x.shape), x
        c_local = q.T @ m_mat      # r x n; BLAS reads a transposed view as it is
        with comm.phase("lazy_projection.projection"):
            c = comm.allreduce(c_local, op="avg")
        # Q C in the tensor's own layout, (Q C)^T = C^T Q^T when the working matrix is the
        # transpose: the product writes it contiguous (copying a transposed view cost ~40 ms
        # per 4M-element matrix, most of the method's time on the e2e Transformer)
        avg = c.T @ q.T if transposed else q @ c
        local = None
        if self.feedback.uses_local:    # feedback is "none" (see the module docstring): unused
            local = (c_local.T @ q.T if transposed else q @ c_local).reshape(x.shape)
        return avg.reshape(x.shape), local

    def projection_words(self, m: int, n: int, r: int) -> int:
        """The r x n projection on the fixed subspace."""
        return r * n
