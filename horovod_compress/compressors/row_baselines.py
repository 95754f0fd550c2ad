"""The ARC-Top-K paper's row baselines: ``randk_rows`` and ``topk_rows`` (Table I, Table II).

Both see a tensor as an m x n matrix (conv kernels as (out, in*kh*kw); 0-D and
1-D tensors are sent dense) and keep K = ceil(mu * m) rows, mu = ``ratio``,
as ARC-Top-K does, so the paper's comparison can be rerun at equal K.

``randk_rows`` -- Rand-K on rows: every rank draws the same K rows I_t from the
shared seed (base seed, tensor name, step), so one index-free allreduce of the
K x n block suffices:  C(g) = [(1/N) sum_i G_i]_{I_t,:}.
Volume 2Kn (P-1)/P words (Table I: 2Kn). Contractive with alpha = K/m in
expectation, exactly (every row is kept with probability K/m).

``topk_rows`` -- the paper's Top-K: each rank keeps the K rows of *its own*
G_i with the largest norms, I_i = argtop_K(diag(G_i G_i^T)), and the ranks
allgather (K indices, K x n values):  C(g) = (1/N) sum_i [G_i]_{I_i,:}.
Volume (P-1)(Kn + K) words received per rank (Table I). The supports differ
across ranks, so the averaged result is not contractive for the averaged
gradient (Proposition 1: it can return 0 for g != 0).

Both are biased; like ``arc_topk`` they default to ``feedback="ef21m"`` so the
three compare under the same error feedback (the paper's "with EF" rows).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import dispatch
from ..kernels.arrays import as_module_array, get_array_module, to_host
from ..kernels.rows import matrix_shape, top_rows
from ..kernels.scatter import is_power_of_two, row_local, scatter_add_rows
from .base import Method, TensorState
from .registry import register
from .row_common import check_ratio, rows_from_ratio
from ..mpi_collectives.accounting import allreduce_volume


class _RowMethod(Method):
    """Common constructor and 2-D view of the row baselines."""

    layout = "matrix"
    biased = True
    default_feedback = "ef21m"
    gpu_native = True

    def __init__(self, *, ratio: float = 0.2, feedback: str | None = None,
                 warmup_steps: int = 0, seed: int = 0, **feedback_params: Any) -> None:
        self.ratio = check_ratio(self.name, ratio)
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed,
                         **feedback_params)

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, **self.feedback.params()}

    def view(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(m, n, K) of a tensor's 2-D view, or ``None`` when it is sent dense (1-D, or K = m)."""
        mn = matrix_shape(tuple(shape))
        if mn is None or mn[0] * mn[1] == 0:
            return None
        m, n = mn
        k = rows_from_ratio(self.ratio, m)
        return None if k >= m else (m, n, k)

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        view = self.view(x.shape)
        if view is None:
            return comm.allreduce(x, op="avg"), x
        m, n, k = view
        g = get_array_module(x).ascontiguousarray(x).reshape(m, n)
        avg, local = self._reduce_rows(g, k, name, comm, state)
        return avg.reshape(x.shape), local.reshape(x.shape)

    def _reduce_rows(self, g: np.ndarray, k: int, name: str, comm: Any,
                     state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        """``(avg, local)`` as m x n matrices for the m x n view ``g`` of a tensor, keeping K = ``k`` rows."""
        raise NotImplementedError(f"{type(self).__name__} must implement _reduce_rows")

    def expected_bytes(self, shape: tuple[int, ...], world_size: int,
                       itemsize: int = 4) -> float:
        """The rows' volume (:meth:`_row_bytes`), or a dense ring allreduce 2 N (P-1)/P when sent dense."""
        view = self.view(tuple(shape))
        if view is None:
            return allreduce_volume(int(np.prod(shape, dtype=np.int64)) * itemsize, world_size)
        return self._row_bytes(*view, world_size, itemsize)   # each subclass defines its formula


@register
class RandKRows(_RowMethod):
    """Rand-K rows: K shared random rows, index-free allreduce (the paper's Rand-K)."""

    name = "randk_rows"

    def rows(self, name: str, step: int, m: int, k: int) -> np.ndarray:
        """The shared row set I_t of tensor ``name`` at ``step`` (ascending)."""
        return np.sort(self.rng(name, step, "randk_rows").choice(m, size=k, replace=False))

    def _reduce_rows(self, g: np.ndarray, k: int, name: str, comm: Any,
                     state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        m = g.shape[0]
        rows = as_module_array(self.rows(name, state.t, m, k), get_array_module(g))  # drawn on the host
        own = dispatch.call("gather_rows", g, rows)
        avg_rows = comm.allreduce(own, op="avg")
        local = (row_local(self, name, own, rows, m) if isinstance(own, np.ndarray)
                 else dispatch.call("scatter_rows", own, rows, m))
        return dispatch.call("scatter_rows", avg_rows, rows, m), local

    @staticmethod
    def _row_bytes(m: int, n: int, k: int, world_size: int, itemsize: int) -> float:
        """One ring allreduce of the K x n rows: 2 K n (P-1)/P words."""
        return allreduce_volume(k * n * itemsize, world_size)


@register
class TopKRows(_RowMethod):
    """Local Top-K rows + allgather of (indices, rows), averaged (the paper's Top-K)."""

    name = "topk_rows"

    def _reduce_rows(self, g: np.ndarray, k: int, name: str, comm: Any,
                     state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        m, n = g.shape
        xp = get_array_module(g)
        norms = to_host(dispatch.call("row_sq_norms", g))
        rows = as_module_array(top_rows(norms, k), xp)           # this rank's own choice
        msg = xp.empty(k + k * n, dtype=g.dtype)                 # [K indices | K x n rows]
        msg[k:] = dispatch.call("gather_rows", g, rows).reshape(-1)
        if g.dtype == np.float32:
            msg[:k] = rows.astype(np.int32).view(np.float32)
        else:                                                    # float64: indices as int64 bits
            msg[:k] = rows.astype(np.int64).view(np.float64)
        gathered = comm.allgather(msg)                           # (P, K + K n)
        idx_type = np.int32 if g.dtype == np.float32 else np.int64
        if xp is np:
            # compiled row scatter-add in g's dtype into one m x n buffer: 1/P per value when
            # exact (P a power of two), else once on the sum -- no float64 matrix and no cast
            exact = is_power_of_two(comm.size)
            avg = np.zeros((m, n), dtype=g.dtype)
            for j in range(gathered.shape[0]):
                part = gathered[j]
                scatter_add_rows(avg, part[:k].view(idx_type), part[k:],
                                 1.0 / comm.size if exact else 1.0)
            if not exact:
                avg /= g.dtype.type(comm.size)
            return avg, row_local(self, name, msg[k:].reshape(k, n), rows, m)
        total = xp.zeros((m, n), dtype=np.float64)
        for j in range(gathered.shape[0]):
            part = gathered[j]
            idx = xp.ascontiguousarray(part[:k]).view(idx_type)
            total[idx] += part[k:].reshape(k, n)
        avg = (total / comm.size).astype(g.dtype)
        return avg, dispatch.call("scatter_rows", xp.ascontiguousarray(msg[k:]).reshape(k, n), rows, m)

    @staticmethod
    def _row_bytes(m: int, n: int, k: int, world_size: int, itemsize: int) -> float:
        """An allgather of (K indices, K x n rows): (K n + K)(P-1) words."""
        return float((k * n + k) * itemsize * (world_size - 1))


__all__ = ["RandKRows", "TopKRows"]
