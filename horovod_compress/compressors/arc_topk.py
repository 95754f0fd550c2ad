"""``arc_topk`` -- ARC-Top-K: all-reduce compatible top-K rows (Chen et al., Algorithm 1).

Each tensor is viewed as a matrix G_i in R^{m x n} (2-D weights as they are,
conv kernels (out, in, kh, kw) as (out, in*kh*kw); paper eq. (3), Sec. VI).
With K = ceil(mu * m) rows (mu = ``ratio``) and sketch rank r = ``rank``:

1. V in R^{n x r}, vec(V) ~ N(0, I_nr), drawn from the shared seed
   (base seed, tensor name, step) -- every rank gets the same V, no message;
2. P = (1/N) sum_i G_i V / sqrt(r)          one allreduce of m*r words;
3. Sigma = diag(P P^T); I = argtop_K(Sigma)  (eq. 4; E[Sigma_p] = ||avg row p||^2, eq. 6);
4. [G]_{I,:} = (1/N) sum_i [G_i]_{I,:}       one allreduce of K*n words (eq. 5),
   no index is sent because I is the same on every rank;
5. the result is zero outside the rows I.

``_reduce`` returns ``(C(g), C_local(g_i))``: the averaged rows and this
rank's own rows [G_i]_{I,:}, the two outputs of Algorithm 1.

Proposition 2: E ||C(g) - g||^2 <= (1 - K/m) ||g||^2 for the *averaged*
gradient g (contractive), unlike the average of local Top-K (Proposition 1).
Hence the default feedback is ``ef21m`` (eqs. 11a-c) with its momentum
``eta`` (see :mod:`horovod_compress.feedback.ef21`).

Volume per rank and step (ring allreduce, both allreduces):
    2 (m r + K n) (P-1)/P words  ~  the paper's 2Kn + 2mr (Table I).

Defined behaviour at the edges (the paper compresses "only two-dimensional
tensors" and leaves the rest open; we decide as follows):

* 0-D / 1-D tensors (biases, norms) are sent dense (one allreduce of N words);
* ``dense_fallback=True`` (default): a tensor is sent dense whenever ARC would
  move at least as many words as a dense allreduce, m*r + K*n >= m*n. This
  covers K = m (e.g. a 1 x n tensor, or ratio = 1) and a sketch rank r >= n
  (the sketch alone is as large as the tensor). With ``dense_fallback=False``
  the protocol above runs on every 2-D view regardless of cost (the paper's toy
  examples, experiments);
* m < 1/ratio gives K = ceil(ratio*m) = 1: one row is kept;
* ties in Sigma are broken by the lower row index
  (:func:`~horovod_compress.kernels.rows.top_rows`), so the selection is a
  function of the allreduced sketch alone and identical on every rank.

The paper starts compressing after 1000 dense iterations; pass
``warmup_steps=1000`` for that (default 0, as for every method here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels import dispatch
from ..kernels.arrays import as_module_array, get_array_module, to_host
from ..kernels.rows import matrix_shape, top_rows
from ..kernels.scatter import row_local
from .base import Method, TensorState
from ..params import check_int
from .registry import register
from .row_common import check_ratio, rows_from_ratio
from ..mpi_collectives.accounting import allreduce_volume


@dataclass(frozen=True)
class ArcPlan:
    """What ARC-Top-K does with one tensor shape: dense, or sketch + K rows of an m x n view."""

    size: int          # total number of elements
    m: int = 0         # rows of the 2-D view (0 if dense)
    n: int = 0         # columns of the 2-D view
    k: int = 0         # rows kept
    r: int = 0         # sketch rank

    @property
    def dense(self) -> bool:
        return self.k == 0

    @property
    def words(self) -> int:
        """Words this rank contributes to allreduces per step (sketch + rows, or the tensor)."""
        return self.size if self.dense else self.m * self.r + self.k * self.n


@register
class ArcTopK(Method):
    """ARC-Top-K: shared Gaussian sketch + allreduce of the top-K rows (no indices sent)."""

    name = "arc_topk"
    layout = "matrix"
    biased = True
    default_feedback = "ef21m"
    gpu_native = True

    def __init__(self, *, ratio: float = 0.2, rank: int = 4, dense_fallback: bool = True,
                 feedback: str | None = None, warmup_steps: int = 0, seed: int = 0,
                 **feedback_params: Any) -> None:
        self.ratio = check_ratio(self.name, ratio)
        self.rank = check_int(self.name, "rank", rank, 1, 2**20)
        if not isinstance(dense_fallback, (bool, np.bool_)):
            raise ValueError(f"{self.name}: dense_fallback must be True or False, "
                             f"got {dense_fallback!r}")
        self.dense_fallback = bool(dense_fallback)
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed,
                         **feedback_params)

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "rank": self.rank, "dense_fallback": self.dense_fallback,
                **self.feedback.params()}

    # ------------------------------------------------------------- the math
    def plan(self, shape: tuple[int, ...]) -> ArcPlan:
        """The 2-D view, K and r used for a tensor of ``shape`` (see the module docstring)."""
        size = int(np.prod(shape, dtype=np.int64))
        view = matrix_shape(tuple(shape))
        if view is None or size == 0:
            return ArcPlan(size)
        m, n = view
        k = rows_from_ratio(self.ratio, m)
        r = self.rank
        if self.dense_fallback and m * r + k * n >= m * n:
            return ArcPlan(size)
        return ArcPlan(size, m, n, k, r)

    def sketch_matrix(self, name: str, step: int, n: int, r: int,
                      dtype: np.dtype = np.dtype(np.float32)) -> np.ndarray:
        """V / sqrt(r): the n x r shared Gaussian of tensor ``name`` at ``step``, pre-scaled.

        Drawn from ``rng(seed, name, step, "arc_sketch")``: identical on every
        rank without a message (Algorithm 1, lines 1 and 3).
        """
        v = self.rng(name, step, "arc_sketch").standard_normal((n, r), dtype=np.float64)
        v *= 1.0 / math.sqrt(r)
        return v.astype(dtype, copy=False)

    @staticmethod
    def select_rows(sketch_avg: np.ndarray, k: int) -> np.ndarray:
        """I = argtop_K(diag(P P^T)) (eq. 4), ascending, ties to the lower index (a host array).

        The m row norms are computed where the sketch lives; the choice of K
        of them is made on the host (m values, not m x n).
        """
        return top_rows(to_host(dispatch.call("row_sq_norms", sketch_avg)), k)

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        plan = self.plan(x.shape)
        if plan.dense:
            state.pop("rows", None)
            with comm.phase("arc_dense"):
                return comm.allreduce(x, op="avg"), x
        xp = get_array_module(x)
        g = xp.ascontiguousarray(x).reshape(plan.m, plan.n)
        v = as_module_array(self.sketch_matrix(name, state.t, plan.n, plan.r, g.dtype), xp)
        with comm.phase("arc_sketch"):
            sketch = comm.allreduce(g @ v, op="avg")          # m x r words
        rows = self.select_rows(sketch, plan.k)
        rows_x = as_module_array(rows, xp)                    # on the gradient's device
        own = dispatch.call("gather_rows", g, rows_x)
        with comm.phase("arc_rows"):
            avg_rows = comm.allreduce(own, op="avg")          # K x n words, no indices
        state["rows"] = rows.astype(np.int32)                 # diagnostics (same on every rank)
        avg = dispatch.call("scatter_rows", avg_rows, rows_x, plan.m).reshape(x.shape)
        local = (row_local(self, name, own, rows, plan.m) if xp is np else
                 dispatch.call("scatter_rows", own, rows_x, plan.m)).reshape(x.shape)
        return avg, local

    def expected_bytes(self, shape: tuple[int, ...], world_size: int,
                       itemsize: int = 4) -> float:
        """2 (m r + K n) (P-1)/P words (two ring allreduces), or 2 N (P-1)/P when dense."""
        words = self.plan(tuple(shape)).words
        return allreduce_volume(words * itemsize, world_size)


__all__ = ["ArcPlan", "ArcTopK"]
